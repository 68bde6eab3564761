// The serving KV cache: a fixed pool of blocks, each holding the keys and
// values of block_size positions in every layer (vLLM's PagedAttention
// layout). A sequence owns a block table (its logical blocks in order);
// blocks are reference-counted, so sequences can share them:
//   - prefix caching: a full block is published under a hash of its tokens
//     and of the hash of the blocks before it, so a prompt that starts the
//     same way finds the blocks another request computed. A block nobody
//     references stays cached (and findable) until the pool needs it; then
//     the least recently released goes first;
//   - copy-on-write: a sequence about to write into a block others also
//     reference gets its own copy first (forked sequences: n > 1, best_of).
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "model/config.h"
#include "model/transformer.h"
#include "tensor/tensor.h"

namespace po::serve {

class KvBlockPool {
 public:
  // `blocks` blocks of `block_size` positions for `config`'s layers (fp32).
  KvBlockPool(const model::TransformerConfig& config, int64_t block_size, int64_t blocks);

  // Bytes one block takes (keys and values, every layer).
  static size_t block_bytes(const model::TransformerConfig& config, int64_t block_size);

  int64_t block_size() const { return block_size_; }
  int64_t blocks() const { return static_cast<int64_t>(refs_.size()); }
  // Blocks a sequence could get now: free, or cached with no reference.
  int64_t available() const { return static_cast<int64_t>(free_.size() + lru_.size()); }
  // Blocks referenced by at least one sequence.
  int64_t used() const { return blocks() - available(); }
  // Unreferenced blocks kept for the prefix cache.
  int64_t cached() const { return static_cast<int64_t>(lru_.size()); }

  // A block with one reference (a free one, else the least recently
  // released cached one, unpublished); nullopt when every block is referenced.
  std::optional<int32_t> allocate();
  void ref(int32_t block);
  // Drops one reference; at none the block becomes free, or, when
  // published, cached.
  void unref(int32_t block);
  int32_t refs(int32_t block) const { return refs_[static_cast<size_t>(block)]; }

  // Prefix cache. The hash of a full block: of its tokens, chained from the
  // previous block's hash (0 for the first).
  static uint64_t chain_hash(uint64_t parent, std::span<const int32_t> tokens);
  // The block published under `hash`, with a reference taken for the caller.
  std::optional<int32_t> lookup(uint64_t hash);
  // Publishes a full block under `hash` (no-op when that hash already has a
  // block: the first stays the one found).
  void publish(int32_t block, uint64_t hash);

  // Copies every layer's keys and values of block `src` into `dst`.
  void copy(int32_t dst, int32_t src);
  // The same from block `src` of another pool of the same shapes (the host
  // tier and back).
  void copy_from(const KvBlockPool& other, int32_t src, int32_t dst);

  // The model's view of the pool (per-layer key and value bases).
  const model::PagedKv& view() const { return view_; }
  // Bytes of one layer's keys (or values) of one block; block b's start in
  // layer l is view().k[l] + b · block_floats().
  int64_t block_floats() const { return block_floats_; }

 private:
  int64_t block_size_ = 0, block_floats_ = 0;
  std::vector<tensor::Storage> k_, v_;
  model::PagedKv view_;
  std::vector<int32_t> refs_;
  std::vector<int32_t> free_;
  // Unreferenced published blocks, least recently released first, and where
  // each one sits in that list.
  std::list<int32_t> lru_;
  std::vector<std::list<int32_t>::iterator> lru_at_;
  std::vector<bool> in_lru_;
  std::unordered_map<uint64_t, int32_t> by_hash_;
  std::vector<std::optional<uint64_t>> hash_of_;
};

}  // namespace po::serve
