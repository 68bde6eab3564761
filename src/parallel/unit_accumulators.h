// The f32 gradient accumulators of bf16 stages and ZeRO 2-3, one per
// (micro-batch, stage, unit) in hand (the executor's: pipeline_executor.h).
//
// A slot's grads hook writes a unit's gradient for one micro-batch into an
// accumulator; once the micro-batch's part is complete the owner rounds it
// into the stored bf16 gradient, or (ZeRO 2-3) reduce-scatters it into the
// shard, and gives it back. Accumulators of unit 0's kind (0) and of the
// others' (1) come from a ring each, taken in turn, one accumulating at a
// time; a block whose weight half is deferred keeps its own until the W
// (pooled: a pool of such buffers, grown to the W queue's need). A ring's
// slot whose reduction is still in flight is completed (the owner's wait)
// before it is taken again, so what is held at every point does not depend
// on timing.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <tuple>
#include <vector>

#include "tensor/tensor.h"

namespace po::parallel {

class UnitAccumulators {
 public:
  using Key = std::tuple<int, int, int>;  // (micro-batch, stage, unit)
  struct Acc {
    float* buf = nullptr;
    int ring = -1, slot = 0;  // its ring's slot, or (ring -1) a pooled buffer
  };
  // bytes[k]: one accumulator of kind k, its reduce-scatter blocks included;
  // slots[k]: its ring's.
  UnitAccumulators(std::array<size_t, 2> bytes, std::array<int, 2> slots);
  // Accumulators still held by reductions in flight (a step that threw)
  // are leaked with their buffers rather than freed under a collective.
  ~UnitAccumulators();
  UnitAccumulators(const UnitAccumulators&) = delete;
  UnitAccumulators& operator=(const UnitAccumulators&) = delete;

  // key's accumulator if it is taken, else null.
  float* find(const Key& key) const;
  // A new accumulator for key (not taken), its first zero_bytes zeroed: a
  // pooled buffer of pool_bytes, or its kind's ring's next slot (unit 0's
  // kind: unit 0); a slot still held by reduction seq is first completed
  // by wait(seq).
  float* take(const Key& key, bool pooled, size_t pool_bytes, size_t zero_bytes,
              const std::function<void(int64_t)>& wait);
  // The keys taken, in key order.
  std::vector<Key> taken() const;
  bool pooled(const Key& key) const { return accs_.at(key).ring < 0; }
  // key's accumulator, no longer taken (its ring can take the next); held
  // until release().
  Acc remove(const Key& key);
  // A removed accumulator read by reduction seq until release().
  void hold(const Acc& a, int64_t seq);
  void release(const Acc& a);

  size_t ring_bytes() const;  // both rings
  size_t pool_bytes() const;  // the pooled buffers made so far

 private:
  struct Ring {
    std::vector<tensor::Storage> bufs;
    std::vector<int64_t> reduction;  // per slot: the reduction holding it (-1: none)
    size_t next = 0;
    bool busy = false;  // one accumulates at a time
  };
  Ring rings_[2];
  std::map<Key, Acc> accs_;
  std::vector<tensor::Storage> pool_;
  std::vector<float*> free_;
  int out_ = 0;  // removed and not yet released
};

}  // namespace po::parallel
