// Where each unit's parameters and gradients live between uses, behind the
// model's UnitHooks (model/transformer.h). DataParallel installs a UnitBuffers when
// the model's own flat fp32 buffers are not what a step needs:
//
//   ZeRO-3 (shard_params): each rank keeps only its shard of every unit
//     (ShardLayout, padded to the unit's stride); a unit's full parameters
//     exist only while the model computes with it, gathered from every
//     rank's shard into a pooled buffer.
//   ZeRO-2 (kReduceScatter without shard_params): the parameters stay whole
//     on every rank, but a unit's gradient exists only from its first
//     contribution in a micro-batch until it is reduce-scattered into this
//     rank's gradient shard: the full gradient is never held.
//   bf16 storage (param_dtype kBF16): parameters are kept in bf16 (whole, or
//     the shard) and widened into a pooled f32 buffer for each use (the
//     kernels compute in f32; the GEMMs round their operands to bf16 again,
//     which is exact for bf16 values). Gradients are accumulated per unit in
//     f32 and stored in bf16: the gradient shard (kReduceScatter) or, for
//     ZeRO 0-1 (kFull), the whole gradient, which DataParallel all-reduces.
//
// The hooks:
//   params(u)  hands out unit u's parameters as f32. Sharded, the model's
//     requests follow a known order (one forward_backward: 0, 1..L, 0, L+1,
//     L..1; an evaluation is a prefix of it), so the gathers of the next
//     `prefetch` positions are issued as soon as a request is served and run
//     while the unit computes. A request off that order drains what was
//     prefetched (speculative, discarded) and is served by a synchronous
//     gather; a request for unit 0 off the order starts the order again.
//     bf16 shards are gathered as bf16 (2 bytes per element on the wire) and
//     widened when served.
//   done(u)    returns the buffer to the pool.
//   grads(u)   hands out a zeroed f32 accumulator (ranks x stride(u) floats,
//     the padded layout a reduce-scatter sends), the same one until
//   grads_ready(u), which (kReduceScatter) reduce-scatters it, non-blocking,
//     in `reduce_dtype` into a block at its end; once complete, that block is
//     added into the gradient shard (so micro-batches accumulate) and the
//     accumulator is recycled. Completions are taken strictly in issue
//     order, so the sums are the same on every run. kFull: the accumulator
//     is added into the whole bf16 gradient at once.
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
// per step); their bytes are what memory() reports as gathered and buckets.
//
// Without a communicator (one rank) a gather is a copy of the one shard and
// a reduce-scatter the accumulator itself.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <vector>

#include "comm/communicator.h"
#include "model/transformer.h"
#include "parallel/shard_layout.h"
#include "tensor/tensor.h"

namespace po::parallel {

// A reduced gradient block (n elements, f32 or bf16 on the wire) added into
// a gradient stored as f32 or bf16: the one arithmetic of a ZeRO 2-3
// gradient shard's accumulation, wherever the reduce-scatter ran.
void add_block(void* dst, tensor::DType dst_dtype, const void* block, tensor::DType block_dtype,
               int64_t n);

// Unit u's stored bf16 parameters `src` widened into `dst` (unit_numel(u)
// floats): every value, or (lean) only `layout`'s f32_read_ranges(u), the
// rest left as they were.
void widen_unit(const model::Layout& layout, int u, const uint16_t* src, float* dst, bool lean);

class UnitBuffers {
 public:
  enum class Grads {
    kReduceScatter,  // into this rank's gradient shard (ZeRO 2-3)
    kFull,           // into the whole bf16 gradient (ZeRO 0-1 with bf16 storage)
  };
  struct Options {
    int prefetch = 1;     // parallel.prefetch: gathers issued ahead, in units
    bool overlap = true;  // false: each reduce-scatter is waited at once
    bool shard_params = true;                           // ZeRO-3
    tensor::DType param_dtype = tensor::DType::kF32;    // kF32 or kBF16 storage
    Grads grads = Grads::kReduceScatter;
    tensor::DType grad_dtype = tensor::DType::kF32;     // of the gradient shard / whole gradient
    tensor::DType reduce_dtype = tensor::DType::kF32;   // on the reduce-scatter's wire
    // Called at the start of shard_params(), while the model still holds its
    // full fp32 parameters (DataParallel takes the fp32 master weights there).
    std::function<void()> before_shard;
  };
  // Installs the hooks into `model` and releases the model's flat gradients.
  // kReduceScatter: `grad_shard` [layout.local_numel()] elements of
  // grad_dtype receive the reduced gradients (+=). The model keeps its full
  // fp32 parameters until shard_params(). `group` may be null when
  // layout.ranks() == 1. All must outlive this object.
  UnitBuffers(model::Transformer& model, const ShardLayout& layout, comm::Communicator* group,
              void* grad_shard, const Options& options);
  // Uninstalls the hooks and waits for communication in flight. With more
  // than one rank the model is left without parameters.
  ~UnitBuffers();
  UnitBuffers(const UnitBuffers&) = delete;
  UnitBuffers& operator=(const UnitBuffers&) = delete;

  // Moves the model's full fp32 parameters into this object's storage: the
  // shard (shard_params) or the whole bf16 copy, and frees the model's
  // buffer. fp32 without sharding keeps the model's buffer; fp32 sharded
  // over one rank aliases it (it is the one shard). Call once the model holds
  // its initial parameters; the first params() request does it otherwise.
  // Idempotent.
  void shard_params();
  // The same, ZeRO-3, with unit u's full fp32 values from source(u) (valid
  // until the next call) instead of the model's flat buffer, which is then
  // never allocated: a model initialised unit by unit.
  void shard_params(const std::function<const float*(int u)>& source);
  bool sharded() const { return sharded_; }
  // The stored parameters (after shard_params()): param_dtype elements, the
  // local shard [layout.local_numel()] with shard_params, else the whole
  // model [num_params] at the model's unit offsets.
  void* stored_params() { return stored_; }
  // fp32 storage only: this rank's parameters of unit u, layout.owned(u)
  // floats at element layout.begin(u) of the unit (before shard_params():
  // in the model's full buffer, where a loader may still write them).
  float* param_shard(int u);
  const float* param_shard(int u) const;
  // The local fp32 parameter shard [layout.local_numel()] (shard_params, fp32).
  float* param_shard_base() { return static_cast<float*>(stored_); }
  // kFull: the whole bf16 gradient [num_params] at the model's unit offsets.
  uint16_t* full_grads() { return static_cast<uint16_t*>(full_grads_.data()); }
  void zero_full_grads();

  // ZeRO-Infinity: the parameter and gradient shards live elsewhere (pages,
  // memory/pager.h) and are reached through these; set before
  // shard_params(). read(u, dst): unit u's padded shard (stride(u) elements
  // of param_dtype) into dst; add(u, block, dtype): a reduced block of
  // stride(u) elements into unit u's gradient shard; prefetch(u): a hint
  // that unit u's shard is read next.
  struct PagedShards {
    std::function<void(int u, void* dst)> read;
    // `final`: the block is the step's last micro-batch's (the shard is final after it).
    std::function<void(int u, const void* block, tensor::DType dtype, bool final)> add;
    std::function<void(int u)> prefetch;
  };
  void use_paged_shards(PagedShards shards);
  // Where reduce-scattered gradients go (kReduceScatter without paged shards):
  // set once, before the first backward (DataParallel allocates it at the
  // end of set-up, so that a paged run never holds it).
  void set_grad_shard(void* grad_shard) { grad_shard_ = grad_shard; }
  // Called with u once unit u's gradient shard is final (its last
  // micro-batch's reduction added), for updates that start in the backward.
  void set_on_final(std::function<void(int u)> fn) { on_final_ = std::move(fn); }
  // Whether the gradients about to be produced are the step's last
  // micro-batch's (reductions carry it to PagedShards::add).
  void set_final_micro_batch(bool final) { final_micro_ = final; }

  // Waits for every reduce-scatter and adds it into the gradient shard.
  void finish_grads();
  // Waits for the prefetched gathers and recycles their buffers (before the
  // shard changes: the gathers read it).
  void drain_gathers();
  // Seconds spent waiting for communication since the last call.
  double take_wait_seconds();

  // Bytes held: stored parameters (shard or bf16 copy), the whole bf16
  // gradient (kFull), gather + f32 work buffers, gradient accumulators.
  size_t stored_bytes() const { return own_.size(); }
  size_t full_grad_bytes() const { return full_grads_.size(); }
  size_t gathered_bytes() const { return gather_pool_.bytes() + work_pool_.bytes(); }
  size_t accumulator_bytes() const { return acc_pool_.bytes(); }

  // Reduce-scatters pending at once beyond which grads_ready() waits for the
  // oldest (bounds the accumulators held).
  static constexpr size_t kMaxReductionsInFlight = 2;

  // The units a forward_backward gathers, in order: the declared schedule's
  // (model::Layout::param_visit_order; tied 0, 1..L, 0, L+1, L..1).
  static std::vector<int> gather_order(const model::Layout& layout);
  // The pools' size class: a free buffer of `buffer` bytes serves a request
  // of `request` bytes (at least 4) when request <= buffer <= 2 * request.
  static size_t pool_request(size_t bytes) { return std::max<size_t>(bytes, 4); }
  static bool pool_serves(size_t buffer, size_t request) {
    return buffer >= request && buffer <= 2 * request;
  }

 private:
  // Recycled byte buffers (see the file comment).
  class Pool {
   public:
    void* acquire(size_t bytes);
    void release(void* p);
    size_t bytes() const;

   private:
    struct Buffer {
      tensor::Storage storage;
      size_t bytes = 0;
      bool used = false;
    };
    std::deque<Buffer> buffers_;  // deque: Buffer addresses stay put
  };
  struct Gather {
    int pos = 0;  // position in order_
    void* buf = nullptr;
    comm::Work work;
  };
  struct Reduction {
    int unit = 0;
    float* acc = nullptr;
    comm::Work work;
    bool final = true;
  };

  // lean: UnitHooks::params_lean (bf16 units widen only their
  // f32_read_ranges; params_bf16 then offers the stored or gathered bits).
  float* params(int u, bool lean = false);
  const uint16_t* params_bf16(int u) const;
  void done(int u);
  float* grads(int u);
  void grads_ready(int u);

  size_t param_esz() const { return tensor::dtype_size(options_.param_dtype); }
  // Bytes of a gather buffer for unit u (ranks x stride, + a send block when paged).
  size_t gather_bytes(int u) const;
  // Unit u's gathered block (ranks x stride, param_dtype) into `buf`.
  comm::Work start_gather(int u, void* buf);
  // f32 parameters of unit u from a gathered block (fp32: the block itself).
  // lean (bf16): only the f32-read tensors are widened and the gathered
  // bits stay until done(u), params_bf16's answer.
  float* serve(int u, void* gathered, bool lean);
  void issue_gather(int pos);  // the gather of order_[pos] into a pool buffer
  void wait(comm::Work& w);    // timed
  void progress();             // polls everything in flight; takes completed reductions
  void complete_front();       // waits for the oldest reduction and adds it in
  void add_reduced(int u, const void* block, bool final);
  // Byte offsets inside an accumulator of unit u: the reduce-scatter's send
  // (f32 accumulator, or its bf16 copy) and receive block.
  size_t acc_bytes(int u) const;
  const void* reduce_send(int u, float* acc) const;
  void* reduce_recv(int u, float* acc) const;

  model::Transformer& model_;
  const ShardLayout& layout_;
  comm::Communicator* group_;
  void* grad_shard_;
  Options options_;
  std::vector<int> order_;  // unit of each request position of one pass
  PagedShards paged_;        // set: the shards are not stored here
  std::function<void(int)> on_final_;
  bool final_micro_ = true;
  bool sharded_ = false;     // shard_params() has run
  tensor::Storage own_;      // stored parameters this object owns
  void* stored_ = nullptr;   // own_, or the model's buffer (fp32 shard of one rank)
  tensor::Storage full_grads_;   // kFull
  Pool gather_pool_, work_pool_, acc_pool_;  // declared before the Work holders: outlive them
  std::vector<float*> active_;   // per unit: the f32 parameters handed out, or null
  std::vector<void*> bits_;      // per unit: a gathered bf16 buffer kept for a lean use, or null
  std::vector<float*> acc_;      // per unit: the accumulator of this micro-batch, or null
  std::deque<Gather> inflight_;  // positions [next_, issued_) of order_, in order
  std::deque<Reduction> pending_;
  int next_ = 0;    // position of the next expected request
  int issued_ = 0;  // first position not yet issued
  double wait_s_ = 0;
};

}  // namespace po::parallel
