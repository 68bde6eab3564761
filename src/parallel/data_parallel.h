// Data parallel with ZeRO stages 0-3 on the flat per-unit buffers: what the
// trainer does between "the backward of a step's last micro-batch starts" and
// "the parameters are updated on every rank" (and, at stage 3, where the
// parameters live in between).
//
//   stage 0 (DDP): gradients are summed over the group in buckets of
//     consecutive units (parallel.bucket_size), each all-reduced as soon as
//     the backward has finished its lowest unit; every rank then takes the
//     same AdamW step over the whole model.
//   stage 1: the same all-reduce, but Adam m and v exist only for this rank's
//     shard (ShardLayout): each rank updates its shard of the parameters and
//     the updated shards are all-gathered, unit by unit.
//   stage 2: each unit's gradient is reduce-scattered into this rank's
//     gradient shard as soon as the unit is final, on every micro-batch, from
//     a per-unit accumulator (UnitBuffers, parallel/units.h): the full
//     gradient is never held. Then as stage 1.
//   stage 3: the parameters are sharded too (UnitBuffers): the model reaches
//     them through UnitHooks that all-gather each unit just before use
//     (prefetching along the model's known order); the update touches only
//     the local shards and nothing is gathered after it (the next forward
//     gathers).
//
// Precision (DataParallelOptions::param_dtype). fp32: the parameters are
// their own master weights. bf16: parameters and gradients are stored in bf16
// (whole, or the shards the stage keeps), widened per unit for compute, and
// the update runs on fp32 master weights and Adam moments that exist for this
// rank's shard only (stage 0: all of them); the updated master is rounded
// into the bf16 parameters. Per rank that is DESIGN.md's ledger: 16Ψ at stage
// 0, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N at stages 1-3. Gradients are reduced in
// reduce_dtype: fp32 (bf16 gradients widened into f32 staging buffers, at most
// kMaxStaged buckets at once) or bf16 (2 bytes per element on the wire).

// Clipping uses the global norm: at stage 0 from the full reduced gradient,
// at stages 1-2 from every rank's shard, the per-rank sums of squares
// all-gathered as doubles and added in rank order (the same value on every
// rank, equal to the unsharded norm up to the order of the f32 sums).
//
// The embedding (stages 0 and 1, with overlap on): unit 0's other parts are
// final at the START of the backward, so it is reduced from there on, and
// the last micro-batch's embedding-lookup rows (its [B*T, C] gradient and
// its tokens) are all-gathered at the end and added into the position table
// (and an untied token table) on every rank in rank order (the model's
// deferred embedding). A tied token table takes its lookup part E once, at
// the step, from every micro-batch's rows of every rank, added into the
// reduced head part H: wte = H + E (bf16: rounded once), at every stage and
// on every layout the same sum (parallel/tied_pair.h, add_tied_rows).
//
// With no communicator (a single process) stages 0-2 are the plain step;
// stage 3 runs its hooks over the one shard (a gather is a copy).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "comm/communicator.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "parallel/grad_norm.h"
#include "parallel/memory_report.h"
#include "parallel/shard_layout.h"
#include "parallel/tied_pair.h"

namespace po::parallel {

class UnitBuffers;

struct DataParallelOptions {
  int zero_stage = 0;
  bool overlap = true;               // parallel.overlap_comm
  uint64_t bucket_bytes = 25u << 20; // parallel.bucket_size (stage 0-1)
  int prefetch = 1;                  // parallel.prefetch (stage 3): units gathered ahead
  tensor::DType param_dtype = tensor::DType::kF32;   // train.precision: kF32 or kBF16 storage
  tensor::DType reduce_dtype = tensor::DType::kF32;  // parallel.reduce_dtype
  // Paged, without clipping: update each page as soon as its gradients are
  // final, during the backward (memory.update_in_backward; off by default:
  // on this machine the sweep after the backward is faster).
  bool update_in_backward = false;
  // Paged: the model's dead activations are lent to the state pages' pager
  // as compute frames (memory.lend_activations; model::ActivationLender).
  bool lend_activations = true;
  // Micro-batches a step: a tied table's lookup rows of a step are held in
  // one buffer of that size from the start (0: it grows in the first step).
  int64_t micro_batches = 0;
  // Packed rows (data.pack, Transformer::set_positions): each token's
  // position gradient goes to its own position's row, which the deferred
  // lookup rows (defer_embedding) do not know: the embedding's gradient is then not deferred.
  bool packed_rows = false;
};

class DataParallel {
 public:
  // `group` may be null (one process). The model must outlive this object.
  // Stage 3 installs its hooks into `model` and releases the model's
  // gradients now, its parameters at shard_params().
  DataParallel(model::Transformer& model, const optim::AdamWConfig& adam, comm::Communicator* group,
               const DataParallelOptions& options);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // Call once the model holds its initial (or loaded) fp32 parameters. Stage
  // 3: from then on this rank keeps only its shard and the model's full
  // buffer is freed (with one rank in fp32 it stays: it is the shard). bf16:
  // the fp32 master weights are taken from them and the model's buffer is
  // replaced by bf16 storage. The first forward does it otherwise (stage 3
  // fp32 only; bf16 needs the call). Other cases: nothing.
  void shard_params();
  // Stage 3: the same from a per-unit initialiser (init(u, dst) writes unit
  // u's unit_numel(u) fp32 values), so the whole fp32 model never exists.
  void shard_params_from(const std::function<void(int u, float* dst)>& init);

  // A step, as pp = 1 runs it: begin_step(lr) (the gradients zeroed; the
  // learning rate known before the backward, so that paged pages without
  // clipping update as their gradients become final), then micro_batch()
  // for each micro-batch (the model's forward and backward; the `last`
  // one's units are reduced as they become final, its lookup rows deferred
  // where the stage defers them), then step(lr). Returns the micro-batch's
  // loss, scaled by grad_scale per token as the gradients are.
  void begin_step(double lr);
  float micro_batch(const int32_t* inputs, const int32_t* targets, float grad_scale, bool last);
  // Waits for the reductions, clips by the global norm, updates, and (stages
  // 1-2) all-gathers the parameters. Returns the pre-clip global norm.
  double step(double lr);

  // Each unit's counted sum of squares of the whole reduced gradient (stages
  // 0-1; units the model does not hold: 0), summed over the tensor group:
  // grad_norm.h's per-unit sums, for a pipeline stage to add to the others'.
  template <typename T>
  std::vector<double> unit_squares(const T* grads);

  // Tensor parallel: the group of ranks that hold the other shards of this
  // rank's units (null: tp = 1). The gradient norm then covers the whole
  // mesh: the split tensors of every tp rank, the replicated ones once (tp
  // rank 0's; the others hold bit-identical copies).
  void set_tensor_group(comm::Communicator* group);

  // Seconds the last step() waited for communication (the exposed part).
  double comm_wait_seconds() const { return comm_wait_s_; }
  // steady_clock times (ns) of the last backward_done() and of the end of the
  // last step()'s communication wait. The clock is shared by the processes of
  // one node, so comparing them across ranks separates communication that
  // outlasts every rank's backward (exposed) from waiting for a slower rank.
  int64_t backward_end_ns() const { return backward_end_ns_; }
  int64_t wait_end_ns() const { return wait_end_ns_; }
  static int64_t now_ns();
  optim::AdamW& adam() { return *adam_; }
  const ShardLayout& layout() const { return layout_; }
  int zero_stage() const { return options_.zero_stage; }
  const DataParallelOptions& options() const { return options_; }
  MemoryReport memory() const;
  // What this rank's model states should take by DESIGN.md's ledger, from
  // the stage, the precision and the shard layout alone (padding included):
  // fp32 4 + 4 + 8 bytes per element, bf16 2 + 2 + 4 + 8, each sharded as
  // the stage says. memory() must agree (tests/parallel/zero_bf16_launch_test).
  size_t predicted_model_state_bytes() const;
  // The gradients' part of that ledger, as memory().grads counts them once
  // the first step has allocated them: 4 (fp32) or 2 (bf16) bytes per element
  // of the whole model (stages 0-1) or of this rank's shard (stages 2-3),
  // plus fp32 stage 1's copy of its shard of the reduced gradient; none for
  // ZeRO-3's paged shards (their gradients are pages).
  size_t predicted_grad_bytes() const;
  // Stages 0-1: the all-reduce buckets over units of `unit_numel` elements
  // (esz bytes each) as {lowest unit, highest unit}, in the order the
  // backward finishes them (the highest units first). With the embedding
  // deferred (`defer`), units 0 and 1 go alone (see the constructor).
  static std::vector<std::pair<int, int>> bucket_units(const std::vector<int64_t>& unit_numel,
                                                       size_t esz, uint64_t bucket_bytes,
                                                       bool defer);
  // At most this many bf16 buckets are staged in f32 at once (reduce_dtype fp32).
  static constexpr size_t kMaxStaged = 2;

  // What a sharded checkpoint reads and writes: this rank's elements
  // [layout().begin(u), layout().end(u)) of unit u (layout().owned(u) floats),
  // wherever the stage keeps them. Parameters: stages 0-2 in the model's
  // flat buffer, stage 3 in the local shard (before shard_params(): still in
  // the model's buffer). Adam m, v: stage 0 in the full state, stages 1-3 in
  // the local state at layout().local_offset(u).
  float* param_shard(int u);
  const float* param_shard(int u) const;
  float* adam_m_shard(int u);
  float* adam_v_shard(int u);

  // Optimizer state in pages (memory/pager.h): Adam m, v and, with bf16
  // storage, the fp32 master. Call before shard_params() and the first step.
  // The pointers above then do not exist for what is paged: read_shard /
  // write_shard copy unit u's shard (layout().owned(u) floats) out and in,
  // wherever it lives.
  // At stage 3 the parameter and gradient shards go into the same pages
  // (ZeRO-Infinity): the gathers read each unit's shard out of them, the
  // reduce-scatters add into them, the update finds everything in one page.
  void enable_paging(const memory::PagerOptions& options);
  // What each paged element holds: m, v [, fp32 master] [, stage 3: the
  // parameter and gradient shards].
  optim::PagedState::Layout paging_layout() const;
  // Pages updated during the last step's backward (early updates).
  int64_t pages_updated_in_backward() const { return early_last_; }
  // Paged with memory.lend_activations: the compute frames the model's dead
  // activations lend the state pages' pager every step (0: none lent).
  size_t lent_frames() const;
  bool paged() const { return adam_->paged(); }
  // The pages (state and, at ZeRO-3, shard pages), or null.
  optim::PagedState* paged_state() { return paged() ? adam_->paged_state() : nullptr; }
  using Shard = optim::StateKind;
  // Copies of this rank's shard of unit u (fp32; quantized Adam moments
  // decoded, and recovered or quantized on the way in: optim/adamw.h).
  void read_shard(Shard kind, int u, float* dst);
  void write_shard(Shard kind, int u, const float* src);
  // Stage 0, where every rank holds all of Adam's state: unit u's whole
  // moment `kind` (unit_numel(u) floats), as a checkpoint load gives it.
  void write_whole_moment(Shard kind, int u, const float* src);
  // Quantized Adam blocks write_shard could not recover and quantized (a
  // 32-bit checkpoint's moments), since the start.
  int64_t quantized_on_load() const { return quantized_on_load_; }

 private:
  // The model's forward_backward of a step's LAST micro-batch takes the
  // per-unit callback (empty when nothing overlaps; at stage 3 the hooks
  // reduce every micro-batch themselves); backward_done() follows it
  // (`tokens`: its inputs [B*T]).
  std::function<void(int unit)> unit_ready();
  void backward_done(const int32_t* tokens);
  void on_unit_ready(int unit);
  void issue_allreduce(int unit);
  void gather_params();
  bool gathers_in_place(int u) const;
  double sharded_grad_norm();
  // The group's total of each rank's counted sums (every rank the same value).
  double tensor_total(double squares);
  // The norm of the whole reduced gradient (stages 0-1) in grad_norm.h's order.
  template <typename T>
  double full_grad_norm(const T* grads);
  double step_sharded_grads(double lr);
  void take_master();
  void add_tied_rows();
  void allocate_unpaged();
  bool bf16() const { return options_.param_dtype == tensor::DType::kBF16; }
  size_t param_esz() const { return bf16() ? 2 : 4; }
  void* stored_params();  // the parameters as the update writes them (see step())

  void add_paged_grad(int u, const void* block, tensor::DType dtype, bool final);
  std::optional<optim::PagedState::Field> paged_field(Shard kind) const;
  float* shard_pointer(Shard kind, int u);
  bool paged_shards_ = false;
  // Early updates (paged shards, no clipping): per page, the units whose
  // final gradients it still waits for, and whether it was updated.
  void update_final_pages(int u);
  void finish_early_step(double lr);
  std::pair<int64_t, int64_t> state_range(int u) const;  // {first, count} in state coordinates
  optim::OutsidePages outside_pages();
  void copy_grad_shard(int u);
  void unit_final(int u);
  void fire_reduced_buckets();
  bool early_ = false, lr_known_ = false, step_begun_ = false, in_step_ = false;
  double step_lr_ = 0;
  std::vector<int> page_units_, page_waiting_;
  std::vector<bool> page_done_;
  int64_t early_count_ = 0, early_last_ = 0;
  // During shard_params_from(): unit u's full fp32 values.
  std::function<const float*(int u)> unit_source_;
  const float* unit_values(int u);
  // Adds the squares of x[n], elements [first, first + n) of this rank's
  // shard of unit u, with the elements another tp rank counts (replicated
  // tensors on tp ranks > 0) as zeros: the same sum however the shard
  // arrives in pieces (paged shards land page by page).
  template <typename T>
  void add_counted(SumOfSquares& acc, int u, int64_t first, const T* x, int64_t n) const;
  std::vector<SumOfSquares> unit_sq_;  // paged shards: per unit, its final gradient's

  model::Transformer& model_;
  comm::Communicator* group_;
  comm::Communicator* tensor_group_ = nullptr;
  std::vector<std::pair<int64_t, int64_t>> uncounted_;  // flat [offset, n) (tp ranks > 0)
  DataParallelOptions options_;
  ShardLayout layout_;
  std::unique_ptr<optim::AdamW> adam_;
  bool defer_embedding_ = false;
  bool final_micro_ = true;  // the micro-batch in hand is the step's last (micro_batch)
  double comm_wait_s_ = 0, staged_wait_s_ = 0;
  int64_t backward_end_ns_ = 0, wait_end_ns_ = 0;

  // stage 0-1 buckets: bucket_of_[u] -> index; buckets_[i] = {lowest unit, offset, numel}
  struct Bucket {
    int lo = 0;
    int64_t offset = 0, numel = 0;
  };
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_;
  // An all-reduce in flight; `staged` (bf16 gradients reduced in fp32) holds
  // the bucket widened to f32, narrowed back into the gradient when done.
  struct Pending {
    comm::Work work;
    tensor::Storage staged;  // f32, the bucket's elements (compute pool: counted)
    int bucket = -1;
  };
  void finish(Pending& p);
  // Local shards as tensor::Storage (counted in the compute tier's budget).
  tensor::Storage grad_shard_f32_;   // fp32 stages 1-3: [layout.local_numel()] floats
  tensor::Storage grad_shard_bf16_;  // bf16 stages 2-3: bf16
  tensor::Storage master_;           // bf16, not paged: fp32 master (stage 0 whole, else the shard)
  float* grad_f32() { return grad_shard_f32_.f32(); }
  uint16_t* grad_bf16() { return static_cast<uint16_t*>(grad_shard_bf16_.data()); }
  // Offset of unit u's shard in the Adam state / master (stage 0: the model's offsets).
  int64_t state_offset(int u) const;
  int64_t quantized_on_load_ = 0;  // quantized Adam blocks write_shard had to quantize
  tensor::Storage gather_send_, gather_recv_;  // param_dtype elements
  // Deferred embedding rows of all ranks: their tokens (i32) and gradients
  // ([rows, C] f32), in the compute pool like every other buffer.
  size_t lookup_rows_ = 0;
  tensor::Storage lookup_tokens_, lookup_grads_;
  std::unique_ptr<LookupRows> rows_;  // the tied table's lookup rows of the step (tied_pair.h)
  std::deque<Pending> pending_;
  std::unique_ptr<UnitBuffers> units_;  // after the gradient shards: destroyed first
};

}  // namespace po::parallel
