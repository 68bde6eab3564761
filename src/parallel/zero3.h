// ZeRO stage 3: the parameters are sharded like the optimizer state. Each rank
// keeps only its fp32 shard of every unit (ShardLayout, padded to the unit's
// stride); a unit's full parameters exist only while the model computes with
// it, gathered from every rank's shard into a pooled buffer, and a unit's
// gradient exists only from its first contribution in a micro-batch until it
// is reduce-scattered into this rank's gradient shard.
//
// Zero3Units implements the model's UnitHooks (model/gpt2.h):
//   params(u)  hands out unit u's gathered buffer. The model's requests follow
//     a known order (one forward_backward: 0, 1..L, 0, L+1, L..1; an
//     evaluation is a prefix of it), so the gathers of the next `prefetch`
//     positions are issued as soon as a request is served and run while the
//     unit computes. A request off that order drains what was prefetched
//     (speculative, discarded) and is served by a synchronous gather; a
//     request for unit 0 off the order starts the order again.
//   done(u)    returns the buffer to the pool.
//   grads(u)   hands out a zeroed accumulator of ranks x stride(u) floats
//     (the padded layout a reduce-scatter sends), the same one until
//   grads_ready(u), which reduce-scatters it (non-blocking) into a temporary
//     block at its end; once complete, that block is added into the gradient
//     shard (so micro-batches accumulate) and the accumulator is recycled.
//     Completions are taken strictly in issue order, so the sums are the same
//     on every run.
// Every rank must make the same sequence of hook calls (they issue
// collectives); the decisions here depend only on that sequence, never on
// timing, so the collectives match across ranks.
//
// Pools: a request takes the smallest free buffer of its size class (up to
// twice the size asked for) or allocates one, so the pool grows to the
// largest number of buffers in use at once and no further: for gathers at
// most prefetch + 2 (the head holds units 0 and L+1) plus one during
// issue; for accumulators one per unit in the backward (unit 0 stays from
// the head to the embedding backward) plus at most kMaxReductionsInFlight
// reductions. Buffers are recycled, not freed, between uses (no allocation
// per step); their bytes are what memory() reports as gathered and grads.
//
// Without a communicator (one rank) a gather is a copy of the one shard and
// a reduce-scatter the accumulator itself.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "comm/communicator.h"
#include "model/gpt2.h"
#include "parallel/shard_layout.h"
#include "tensor/tensor.h"

namespace po::parallel {

class Zero3Units {
 public:
  struct Options {
    int prefetch = 1;     // parallel.prefetch: gathers issued ahead, in units
    bool overlap = true;  // false: each reduce-scatter is waited at once
  };
  // Installs the hooks into `model` and releases the model's flat gradients.
  // `grad_shard` [layout.local_numel()] receives the reduced gradients (+=).
  // The model keeps its full parameters until shard_params(). `group` may be
  // null when layout.ranks() == 1. All must outlive this object.
  Zero3Units(model::GPT2& model, const ShardLayout& layout, comm::Communicator* group,
             float* grad_shard, const Options& options);
  // Uninstalls the hooks and waits for communication in flight. With more
  // than one rank the model is left without parameters.
  ~Zero3Units();
  Zero3Units(const Zero3Units&) = delete;
  Zero3Units& operator=(const Zero3Units&) = delete;

  // Takes this rank's shard out of the model's full parameters and frees them
  // (ranks > 1; with one rank the model's buffer is laid out as the one shard
  // and stays, aliased). Call once the model holds its initial parameters;
  // the first params() request does it otherwise. Idempotent.
  void shard_params();
  bool sharded() const { return shard_ != nullptr; }
  // This rank's parameters of unit u: layout.owned(u) floats at element
  // layout.begin(u) of the unit (before shard_params(): in the model's full
  // buffer, where a loader may still write them).
  float* param_shard(int u);
  const float* param_shard(int u) const;
  // The local parameter shard [layout.local_numel()] (after shard_params()).
  float* param_shard_base() { return shard_; }

  // Waits for every reduce-scatter and adds it into the gradient shard.
  void finish_grads();
  // Waits for the prefetched gathers and recycles their buffers (before the
  // shard changes: the gathers read it).
  void drain_gathers();
  // Seconds spent waiting for communication since the last call.
  double take_wait_seconds();

  size_t param_shard_bytes() const { return own_shard_.size(); }
  size_t gathered_bytes() const { return gather_pool_.bytes(); }
  size_t accumulator_bytes() const { return acc_pool_.bytes(); }

  // Reduce-scatters pending at once beyond which grads_ready() waits for the
  // oldest (bounds the accumulators held).
  static constexpr size_t kMaxReductionsInFlight = 2;

 private:
  // Recycled float buffers (see the file comment).
  class Pool {
   public:
    float* acquire(int64_t n);
    void release(float* p);
    size_t bytes() const;

   private:
    struct Buffer {
      tensor::Storage storage;
      int64_t floats = 0;
      bool used = false;
    };
    std::deque<Buffer> buffers_;  // deque: Buffer addresses stay put
  };
  struct Gather {
    int pos = 0;  // position in order_
    float* buf = nullptr;
    comm::Work work;
  };
  struct Reduction {
    int unit = 0;
    float* acc = nullptr;
    comm::Work work;
  };

  float* params(int u);
  void done(int u);
  float* grads(int u);
  void grads_ready(int u);

  void issue_gather(int pos);  // the gather of order_[pos] into a pool buffer
  void wait(comm::Work& w);    // timed
  void progress();             // polls everything in flight; takes completed reductions
  void complete_front();       // waits for the oldest reduction and adds it in
  void add_reduced(int u, const float* block);

  model::GPT2& model_;
  const ShardLayout& layout_;
  comm::Communicator* group_;
  float* grad_shard_;
  Options options_;
  std::vector<int> order_;  // unit of each request position of one pass
  tensor::Storage own_shard_;
  float* shard_ = nullptr;  // [local_numel]: own_shard_, or the model's buffer (one rank)
  Pool gather_pool_, acc_pool_;  // declared before the Work holders: outlive them
  std::vector<float*> active_;   // per unit: the gathered buffer handed out, or null
  std::vector<float*> acc_;      // per unit: the accumulator of this micro-batch, or null
  std::deque<Gather> inflight_;  // positions [next_, issued_) of order_, in order
  std::deque<Reduction> pending_;
  int next_ = 0;    // position of the next expected request
  int issued_ = 0;  // first position not yet issued
  double wait_s_ = 0;
};

}  // namespace po::parallel
