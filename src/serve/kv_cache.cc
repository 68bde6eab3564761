#include "serve/kv_cache.h"

#include <xxhash.h>

#include <cstring>

#include "core/error.h"

namespace po::serve {

KvBlockPool::KvBlockPool(const model::TransformerConfig& config, int64_t block_size, int64_t blocks)
    : block_size_(block_size) {
  PO_CHECK(block_size >= 1, "--kv-block-size must be >= 1, got ", block_size);
  PO_CHECK(blocks >= 1, "the KV cache needs at least one block, got ", blocks);
  const model::TransformerConfig c = config.resolved();
  block_floats_ = block_size * c.n_kv_head * c.head_dim();
  const auto bytes = static_cast<size_t>(block_floats_ * blocks) * sizeof(float);
  view_.block_size = block_size;
  for (int64_t l = 0; l < c.n_layer; ++l) {
    k_.emplace_back(bytes);
    v_.emplace_back(bytes);
    // Touched now, not by the first requests' steps (page faults are slow
    // here, and a budget that does not fit should fail at start).
    std::memset(k_.back().data(), 0, bytes);
    std::memset(v_.back().data(), 0, bytes);
    view_.k.push_back(k_.back().f32());
    view_.v.push_back(v_.back().f32());
  }
  refs_.assign(static_cast<size_t>(blocks), 0);
  lru_at_.resize(static_cast<size_t>(blocks));
  in_lru_.assign(static_cast<size_t>(blocks), false);
  hash_of_.resize(static_cast<size_t>(blocks));
  // Handed out lowest first.
  for (int64_t b = blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

size_t KvBlockPool::block_bytes(const model::TransformerConfig& config, int64_t block_size) {
  const model::TransformerConfig c = config.resolved();
  return static_cast<size_t>(2 * c.n_layer * block_size * c.n_kv_head * c.head_dim()) * sizeof(float);
}

std::optional<int32_t> KvBlockPool::allocate() {
  int32_t b = -1;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else if (!lru_.empty()) {  // evict the least recently released cached block
    b = lru_.front();
    lru_.pop_front();
    in_lru_[static_cast<size_t>(b)] = false;
    auto& h = hash_of_[static_cast<size_t>(b)];
    by_hash_.erase(*h);
    h.reset();
  } else {
    return std::nullopt;
  }
  refs_[static_cast<size_t>(b)] = 1;
  return b;
}

void KvBlockPool::ref(int32_t block) {
  const auto i = static_cast<size_t>(block);
  if (in_lru_[i]) {
    lru_.erase(lru_at_[i]);
    in_lru_[i] = false;
  }
  ++refs_[i];
}

void KvBlockPool::unref(int32_t block) {
  const auto i = static_cast<size_t>(block);
  PO_ASSERT(refs_[i] > 0, "KV block ", block, " released more often than taken");
  if (--refs_[i] > 0) return;
  if (hash_of_[i]) {
    lru_.push_back(block);
    lru_at_[i] = std::prev(lru_.end());
    in_lru_[i] = true;
  } else {
    free_.push_back(block);
  }
}

uint64_t KvBlockPool::chain_hash(uint64_t parent, std::span<const int32_t> tokens) {
  return XXH3_64bits_withSeed(tokens.data(), tokens.size_bytes(), parent);
}

std::optional<int32_t> KvBlockPool::lookup(uint64_t hash) {
  const auto it = by_hash_.find(hash);
  if (it == by_hash_.end()) return std::nullopt;
  ref(it->second);
  return it->second;
}

void KvBlockPool::publish(int32_t block, uint64_t hash) {
  auto& h = hash_of_[static_cast<size_t>(block)];
  if (h || by_hash_.count(hash) > 0) return;
  h = hash;
  by_hash_.emplace(hash, block);
}

void KvBlockPool::copy(int32_t dst, int32_t src) { copy_from(*this, src, dst); }

void KvBlockPool::copy_from(const KvBlockPool& other, int32_t src, int32_t dst) {
  PO_ASSERT(other.block_floats_ == block_floats_ && other.view_.k.size() == view_.k.size(),
            "KV block copy between pools of different shapes");
  const auto n = static_cast<size_t>(block_floats_) * sizeof(float);
  for (size_t l = 0; l < view_.k.size(); ++l) {
    std::memcpy(view_.k[l] + dst * block_floats_, other.view_.k[l] + src * block_floats_, n);
    std::memcpy(view_.v[l] + dst * block_floats_, other.view_.v[l] + src * block_floats_, n);
  }
}

}  // namespace po::serve
