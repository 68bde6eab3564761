// The f32 gradient accumulators per (micro-batch, stage, unit) (unit_accumulators.h).
#include "parallel/unit_accumulators.h"

#include <utility>

#include "backend/device.h"
#include "core/error.h"

namespace po::parallel {

UnitAccumulators::UnitAccumulators(std::array<size_t, 2> bytes, std::array<int, 2> slots) {
  for (size_t k = 0; k < 2; ++k) {
    for (int i = 0; i < slots[k]; ++i) rings_[k].bufs.emplace_back(bytes[k]);
    rings_[k].reduction.assign(rings_[k].bufs.size(), -1);
  }
}

UnitAccumulators::~UnitAccumulators() {
  if (out_ == 0) return;
  (void)new std::vector<tensor::Storage>(std::move(pool_));
  for (Ring& r : rings_) (void)new std::vector<tensor::Storage>(std::move(r.bufs));
}

float* UnitAccumulators::find(const Key& key) const {
  const auto it = accs_.find(key);
  return it == accs_.end() ? nullptr : it->second.buf;
}

float* UnitAccumulators::take(const Key& key, bool pooled, size_t pool_bytes, size_t zero_bytes,
                              const std::function<void(int64_t)>& wait) {
  PO_ASSERT(!accs_.contains(key), "pipeline: a second accumulator of micro-batch ", std::get<0>(key),
            ", stage ", std::get<1>(key), ", unit ", std::get<2>(key));
  Acc a;
  if (pooled) {
    if (free_.empty()) {
      pool_.emplace_back(pool_bytes);
      free_.push_back(pool_.back().f32());
    }
    a.buf = free_.back();
    free_.pop_back();
  } else {
    const int u = std::get<2>(key);
    a.ring = u == 0 ? 0 : 1;
    Ring& r = rings_[a.ring];
    PO_ASSERT(!r.busy, "pipeline: a second accumulator of unit ", u, "'s kind");
    PO_ASSERT(!r.bufs.empty(), "pipeline: no accumulator ring for unit ", u, "'s kind");
    a.slot = static_cast<int>(r.next);
    r.next = (r.next + 1) % r.bufs.size();
    if (const int64_t seq = r.reduction[static_cast<size_t>(a.slot)]; seq >= 0) wait(seq);
    PO_ASSERT(r.reduction[static_cast<size_t>(a.slot)] < 0, "pipeline: unit ", u,
              "'s accumulator still held by its reduction");
    r.busy = true;
    a.buf = r.bufs[static_cast<size_t>(a.slot)].f32();
  }
  backend::device_zero(a.buf, zero_bytes);
  return accs_.emplace(key, a).first->second.buf;
}

std::vector<UnitAccumulators::Key> UnitAccumulators::taken() const {
  std::vector<Key> keys;
  for (const auto& [key, a] : accs_) keys.push_back(key);
  return keys;
}

UnitAccumulators::Acc UnitAccumulators::remove(const Key& key) {
  const auto it = accs_.find(key);
  PO_ASSERT(it != accs_.end(), "pipeline: no accumulator of unit ", std::get<2>(key), " to give back");
  const Acc a = it->second;
  accs_.erase(it);
  if (a.ring >= 0) rings_[a.ring].busy = false;
  ++out_;
  return a;
}

void UnitAccumulators::hold(const Acc& a, int64_t seq) {
  if (a.ring >= 0) rings_[a.ring].reduction[static_cast<size_t>(a.slot)] = seq;
}

void UnitAccumulators::release(const Acc& a) {
  --out_;
  if (a.ring < 0)
    free_.push_back(a.buf);
  else
    rings_[a.ring].reduction[static_cast<size_t>(a.slot)] = -1;
}

size_t UnitAccumulators::ring_bytes() const {
  size_t b = 0;
  for (const Ring& r : rings_)
    for (const auto& buf : r.bufs) b += buf.size();
  return b;
}

size_t UnitAccumulators::pool_bytes() const {
  size_t b = 0;
  for (const auto& buf : pool_) b += buf.size();
  return b;
}

}  // namespace po::parallel
