// The pipeline executor: one rank's part of a pipelined training step, run
// from its list of actions (parallel/pipeline_schedule.h), the same list the
// planner times and the trace draws.
//
// What a rank holds, per chunk (a stage of the schedule on this rank): the
// chunk's units' fp32 parameters and gradients in one flat buffer, its AdamW
// state, and a pool of activation slots. A slot is a Transformer for the
// chunk's units whose every parameter and gradient access goes to the chunk's
// buffers (UnitHooks): it holds one micro-batch's activations from its
// forward until its input backward. The pool grows to the most micro-batches
// in flight at once, which the schedule bounds (Schedule::in_flight_cap: p on
// 1F1B's first stage); the engine counts its slots, so that bound is
// measured, not assumed. Split-backward schedules (zb-h1, zbv) keep each
// deferred weight backward's GEMM inputs and output gradients (the W queue).
//
// Exactness. Every stage runs its forwards, backwards and weight backwards in
// micro-batch order, so every parameter's gradient accumulates as it does in
// one stage; the gradient norm is grad_norm.h's per-unit order; the tied
// token table's gradient is the head's part H plus the lookup's part E
// (tied_pair.h): the head's chunk adds into a replica of unit 0 (or, under
// zbv, into the embedding chunk on the same rank), the embedding's stage
// keeps the lookup rows, and at the step the embedding's rank adds E into
// the head's H and sends H + E back: the same bits as pp = 1, and the two
// copies of the table take the same update, so they never drift apart.
//
// Point-to-point: each receive is posted ahead (a window of the next ones in
// the list) and waited where its compute needs it; sends go out as their
// tensors are made. Every message carries a shape header (StageLink): a
// mismatch is an error naming both ranks and shapes.
//
// ZeRO-1 (PipelineSetup::zero_stage = 1): each chunk's Adam state exists for
// this rank's shard of its units only (ShardLayout over the data group), the
// full reduced gradient's shard feeds the
// update and the updated shards are all-gathered unit by unit. The tied
// head's replica of unit 0 is cut by the same layout as the embedding's, so
// both copies update the same elements on the same rank. The update is
// element-wise, so the bits do not depend on the stage: ZeRO-1 gives ZeRO-0's.
//
// Paging (enable_paging): each chunk's Adam state (its shard under ZeRO 1-3)
// lives in pages of its own pager (memory/pager.h), moving between the compute
// tier, host RAM and an NVMe swap file per chunk; the update is the same
// element-wise computation cut at page boundaries, so the bits do not change.
// Under ZeRO-3 (over dp > 1, and on one data rank) the stored parameter
// and gradient shards live in the same pages (ZeRO-Infinity, pipeline_shards.cc): a gather copies the
// shard out of its pages, a reduction adds into them, and the step's last
// reduction of a unit sums its squares for the norm as it lands.
//
// bf16 (PipelineSetup::bf16): parameters and gradients are stored in bf16
// and the fp32 master lives with Adam (over the ZeRO shard, paged with it).
// A slot's hooks widen each unit's parameters for its use, and give each
// (micro-batch, unit) an f32 accumulator that is rounded into the stored
// gradient once the micro-batch's part is complete, as pp = 1 rounds each
// micro-batch's; the tied table is wte = bf16(H + E) on both copies.
//
// Vocabulary parallel (Schedule::vocab, parallel.vocab_parallel): the head's
// fixed vocabulary pieces (model/vocab_head.h) are spread over every
// pipeline rank. The last stage's forward ends at the final norm, whose
// output goes to every rank; each rank's S computes its pieces' logits and
// statistics and sends the statistics to every rank; its T combines all of
// them (in piece order, the same on every rank), computes its pieces' logit
// gradients, their weight gradients and the head's input gradient's parts
// summed over the tree nodes its pieces fill (vocab::tree_nodes), sent to
// the last stage's rank, whose backward adds all nodes up in the same tree
// and starts from that. The
// head's rank (the owner of the head weight: the tied replica, or the head
// unit) receives the other ranks' rows of the weight gradient before the
// update and sends the updated rows back to ranks that keep a copy (the
// embedding's rank reads its own table, which takes the same update). The
// same GEMMs and sums as one stage (vocab_head.h): the bits of pp = 1.
// (fp32 and tp = 1; the trainer refuses the rest.)
//
// ZeRO-2 (PipelineSetup::zero_stage = 2, pipeline_finalize.cc): each chunk
// keeps only its shard of the gradient. Every unit's per-micro-batch f32
// accumulator (the bf16 path's, for fp32 too) is reduce-scattered over the
// data group into the shard as soon as that micro-batch's part is complete,
// with add_block's arithmetic (unit_blocks.h). Every rank of a stage's data
// group runs the same action list, so the reduce-scatters of a unit come in
// the same order on each, and in pp = 1's micro-batch order: the shards hold
// pp = 1's ZeRO-2 bits, and the norm takes grad_norm.h's order.
//
// The tied table (tied_pair.h), at every ZeRO stage: the head's part H goes
// along the gradient path on the head's copy; the embedding's rank keeps the
// step's lookup rows, gathers its data group's at the step, adds E once into
// the H the head's rank sends it, and sends the sum back (on one rank, zbv:
// in place), the same sum at every pp.
//
// ZeRO-3 (zero_stage = 3, dp > 1): each chunk (and a tied head's replica)
// also stores only this rank's shard of its parameters (bf16 stages: the
// bf16 shard beside the fp32 master's). A slot's hooks gather a unit over
// the data group for each use, as stored (bf16 stays 2 bytes on the wire),
// into one buffer for unit 0 and one for the others (the model holds at
// most one of each), and the update writes the shard with no gather after
// it. Every data rank of a stage runs the same action list, so the gathers
// match as the reduce-scatters do; the gathered values are the stored ones,
// so ZeRO-3 gives ZeRO-2's bits. 2 × micro-batches gathers of a unit per
// step under 1F1B (forward and input backward; a deferred W reads no
// parameters), issued parallel.prefetch ahead of their use along the first
// step's order (param_gathers.h).
//
// Adapters (lora.r > 0): the chunk's parameters are its units' adapters;
// the frozen base of its units is held once per chunk (Chunk::frozen, its
// quantized tensors included) and every slot reads it (share_base). A
// frozen tied table trains nothing, so the tied pair's replica, lookup rows
// and sums are not made (Layout::tied_trains); a tied head on a rank
// without the embedding reads a copy of the base token table. set_base
// takes the base from a whole model loaded as a one-stage run loads it.
//
// What it does not do (refused by the trainer): ZeRO 2-3 with the
// vocabulary-parallel head; adapters with the vocabulary-parallel head.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "comm/communicator.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "memory/pager.h"
#include "parallel/bucket_sums.h"
#include "parallel/memory_report.h"
#include "parallel/param_gathers.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/shard_layout.h"
#include "parallel/shard_reductions.h"
#include "parallel/stage_link.h"
#include "parallel/stage_messages.h"
#include "parallel/tied_pair.h"
#include "parallel/unit_accumulators.h"
#include "tensor/tensor.h"

namespace po::parallel {

struct PipelineSetup {
  pipeline::Schedule schedule;
  std::vector<model::UnitRange> stage_units;  // per global stage, contiguous, covering the model
  int64_t micro = 1, T = 1;                   // micro-batch shape
  comm::Communicator* pipe = nullptr;         // the pipeline group (stage ranks), null at pp = 1
  comm::Communicator* data = nullptr;         // this rank's data-parallel group (null: dp = 1)
  comm::Communicator* tensor = nullptr;       // its tensor group (null: tp = 1)
  model::ParallelOps* tp_ops = nullptr;       // the tensor group's collectives (null: tp = 1)
  model::TensorSplit split;
  bool tp_overlap = false;
  // ZeRO: 0 (whole Adam state per chunk), 1 (this rank's shard over the
  // data group), 2 (also the gradient: each micro-batch's part of a unit is
  // reduce-scattered into this rank's shard as soon as it is complete, from
  // an f32 accumulator) or 3 (also the
  // stored parameters, gathered per use). `dp` is the data group's size
  // (predict() reads it when `data` is null).
  int zero_stage = 0;
  int dp = 1;
  // bf16 stages (train.precision = "bf16"): parameters and gradients stored
  // in bf16, the fp32 master and Adam over the ZeRO shard; reduce_bf16: the
  // data group sums the gradients in bf16 (parallel.reduce_dtype).
  bool bf16 = false;
  bool reduce_bf16 = false;
  // The deferred embedding (dp > 1 with parallel.overlap_comm, cp 1,
  // ZeRO 0-1: defers_lookup): the last micro-batch's lookup rows
  // are not added on the embedding's stage but gathered over the data group
  // at the step and added after the reduction, in rank order, into the
  // position table (and an untied token table) (defers_lookup).
  bool defer_lookup = false;
  // ZeRO 0-1 over dp > 1: the data group sums each chunk's gradient in
  // buckets of consecutive units of about bucket_bytes (grad_buckets);
  // overlap_comm: each bucket's sum starts, non-blocking, as soon as the
  // last micro-batch's backward has finished its units (parallel.overlap_comm,
  // parallel.bucket_size), else all at the step.
  bool overlap_comm = false;
  uint64_t bucket_bytes = 25u << 20;
  // ZeRO-3 over dp > 1: the parameter gathers issued ahead of their use,
  // along the step's order of requests (parallel.prefetch; 0: at each use).
  int prefetch = 1;
  // Paged state of one whole chunk (pp = 1): its slot's activations, dead
  // after the step's last micro-batch until the next forward, lent to the
  // pager as compute frames (memory.lend_activations).
  bool lend_activations = false;
  // The optimizer state is paged (memory.host_budget or memory.nvme_dir;
  // enable_paging): Adam's moments and the fp32 master, and under ZeRO-3
  // over dp > 1 the stored parameter and gradient shards too
  // (ZeRO-Infinity). predict() then counts none of
  // them (the caller adds the compute tier's frames), and ZeRO-3's gather
  // buffers each hold a send block the shard is copied into out of its pages.
  bool paged = false;
  // Paged, with no clipping (adam.grad_clip <= 0) and overlap_comm: each
  // page of an AdamW is updated as soon as the gradients of every unit it
  // holds are final, during the backward (memory.update_in_backward; the
  // learning rate comes before the step: begin_step). Unit 0 and a
  // vocabulary-parallel head wait for the step (their rows come then).
  bool update_in_backward = false;
  // Adam's configuration (the executor's constructor sets it from its own
  // argument; predict() reads it): with optim.state_bits < 32 the moments are
  // stored quantized in blocks, and the data group's ZeRO cut lies on the
  // blocks' grid (shard_align).
  optim::AdamWConfig adam;
  int64_t shard_align() const { return adam.state_bits < 32 ? adam.block_size : 1; }
};

// One compute, receive wait or send of a step as run (steady-clock ns from
// the step's start).
struct PipelineSpan {
  pipeline::Action action;
  bool wait = false;  // a receive's wait (action is the kRecv)
  int64_t start_ns = 0, end_ns = 0;
};

struct PipelineStepStats {
  double loss_sum = 0;  // Σ over micro-batches of their mean loss (last stage; 0 elsewhere)
  double seconds = 0;   // this rank's forward-backward
  double busy_s = 0;    // of which compute
  double wait_s = 0;    // of which waiting for messages
  int peak_in_flight = 0;  // micro-batches held at once on this rank (all chunks)
  int peak_w_queue = 0;    // deferred weight backwards waiting at once
  int64_t sends = 0;       // p2p messages sent
  int64_t sent_bytes = 0;  // p2p payload sent
  // ZeRO-3 over dp > 1: the parameter gathers of the step, and of them
  // those issued ahead of their use (parallel.prefetch).
  int param_gathers = 0, prefetched = 0;
};

class PipelineExecutor {
 public:
  PipelineExecutor(const model::TransformerConfig& config, const optim::AdamWConfig& adam,
                   PipelineSetup setup);
  ~PipelineExecutor();
  PipelineExecutor(const PipelineExecutor&) = delete;
  PipelineExecutor& operator=(const PipelineExecutor&) = delete;

  int rank() const { return rank_; }  // in the pipeline group
  int ranks() const { return setup_.schedule.ranks; }
  const pipeline::Schedule& schedule() const { return setup_.schedule; }
  const model::Layout& layout() const { return layout_; }  // this tp rank's
  const model::TransformerConfig& config() const { return config_; }  // resolved, the whole model's
  // Whether this rank holds unit u (its owner's copy; a tied replica does not count).
  bool holds(int u) const;
  // Unit u's state on this rank (holds(u)) as unit_numel(u) floats in the
  // held layout: its parameters (bf16 stages: the fp32 master), Adam m or
  // Adam v. Reading a sharded kind under ZeRO-1 all-gathers the shards: a
  // collective over the data group (every data rank of this stage calls it
  // for the same unit and kind). Writing keeps this rank's shard (bf16
  // parameters: and the whole unit rounded into the stored bf16). Paged
  // state is copied out of and into its pages.
  using State = optim::StateKind;
  void read_unit(State kind, int u, float* dst);
  void write_unit(State kind, int u, const float* src);
  // Elements [lo, hi) of unit u's state (holds(u)) into dst, from this rank
  // alone: a part of a kind held whole, or of a sharded kind within this
  // rank's ZeRO cut (local_parts()). No collective.
  void read_unit_part(State kind, int u, int64_t lo, int64_t hi, float* dst);
  // Whether every data rank's ZeRO cut of each unit is the cut
  // ShardLayout::stage_units makes over the data group (blocks of
  // stride_of(n, dp)): ZeRO-0, one data rank, or unquantized Adam state (a
  // quantized state's cut lies on its blocks' grid). A checkpoint writer's
  // slice then is its own (read_unit_part).
  bool local_parts() const;
  // Unit u's fp32 parameters in place (holds(u); not for bf16 stages).
  float* unit_params(int u);
  // The head's replica of the tied token table on this rank as stored (fp32
  // or bf16; null: none here).
  const void* tied_replica() const;
  // Whether this rank has the last stage (the loss).
  bool has_loss() const;

  // Every held unit from the counter-based initialiser (the bits of
  // Transformer::init_random for the whole model), replicas included.
  void init_random(uint64_t seed);
  // With adapters (lora.r > 0): the frozen base of the held units (and a
  // tied head's base token table) from `whole`, a model of the same config
  // holding every unit, its base loaded (and quantized, model.quant) as a
  // one-stage run loads it (train::load_base_and_adapters). Quantized
  // tensors are copied as they are, never quantized again. The adapters
  // themselves are parameters: write_unit.
  void set_base(model::Transformer& whole);
  // After parameters (and Adam state) were written into unit_params() etc.:
  // the tied replica takes the embedding's table, m and v (a copy over the
  // pipeline group; a collective of the pair).
  void sync_replica();

  // The step's forward and backward over m micro-batches: `batch(micro,
  // inputs, targets)` fills micro-batch `micro` ([micro × T] each; called on
  // the first and the last stage). Gradients of grad_scale × Σ token losses
  // accumulate.
  // `before_forward(micro, model)`, when given, is called on every stage
  // with the slot's model before micro-batch `micro`'s forward (the slot
  // keeps it until its backward): what a micro-batch sets on the model, such
  // as its adapter dropout's masks (Transformer::set_dropout).
  using BatchFn = std::function<void(int micro, int32_t* inputs, int32_t* targets)>;
  using MicroFn = std::function<void(int micro, model::Transformer& model)>;
  PipelineStepStats forward_backward(const BatchFn& batch, float grad_scale, const MicroFn& before_forward = {});
  // The update: the data group's sums, the tied pair's H + E, the
  // global norm (every stage's units, grad_norm.h's order), clipping, AdamW.
  // Returns the pre-clip norm (the same on every rank).
  double step(double lr);
  // Seconds the last step waited for the data group's gradient sums (what
  // the backward did not hide; ZeRO 0-1: at the step, ZeRO 2-3: for its
  // reduce-scatters, in the backward too).
  double comm_wait_seconds() const { return sum_wait_s_; }
  // Of the last step's data-group reductions (ZeRO 0-1: the bucket sums,
  // ZeRO 2-3: the reduce-scatters; dp > 1), how many ran beside the
  // backward and how many there were (parallel.overlap_comm).
  std::pair<int, int> overlapped_sums() const { return {early_sums_, all_sums_}; }
  int64_t adam_steps() const;
  void set_adam_steps(int64_t t);

  // Mean loss of one micro-batch without gradients, through the stages in
  // turn (the value is the last stage's; others return 0). Packed rows
  // (data.pack): `positions` [micro × T], the same on every rank.
  double evaluate(const int32_t* inputs, const int32_t* targets, const int32_t* positions = nullptr);

  // The last forward_backward's spans on this rank.
  const std::vector<PipelineSpan>& spans() const { return spans_; }
  // Moves every chunk's Adam state (and the tied replica's) into pages, before
  // the first step. `options` holds this rank's totals: its compute frames
  // (0: every page resident) and host frames are split over the chunks in
  // proportion to their pages, each keeping its minimum; each chunk's swap
  // file is options.file_name with the stage appended.
  void enable_paging(const memory::PagerOptions& options);
  // The coming step's learning rate, before its forward_backward: with
  // update_in_backward the pages whose gradients are final are updated at
  // it during the backward (step(lr) then takes the same lr and updates the
  // rest). Pages updated so in the last step: pages_updated_in_backward().
  void begin_step(double lr);
  int64_t pages_updated_in_backward() const { return early_last_; }
  // Pages of every chunk at page_bytes (what enable_paging will make), and
  // the fewest compute frames they work with; from the configuration alone
  // for pipeline rank `rank` (the planner's).
  std::pair<size_t, size_t> paging_pages(size_t page_bytes, int prefetch) const;
  static std::pair<size_t, size_t> paging_pages(const model::TransformerConfig& config,
                                                const PipelineSetup& setup, int rank,
                                                size_t page_bytes, int prefetch);
  // All chunks' pagers: the traffic since the last call.
  memory::PagerStats take_paging_stats();
  // Every chunk's paged state (and a tied replica's), in chunk order; none unpaged.
  std::vector<const optim::PagedState*> paged_states() const;
  // Frames a step lends the pages from the activations (memory.lend_activations:
  // one stage holding the whole model), as predicted from the model's layout;
  // the static one for `config` (its activation layout) and `setup` alone,
  // as if it lends (the planner's).
  size_t lent_frames() const;
  static size_t lent_frames(const model::TransformerConfig& config, const PipelineSetup& setup, size_t page_bytes);
  // Quantized Adam blocks a checkpoint load could not recover and quantized
  // (a 32-bit checkpoint's moments), since the start.
  int64_t quantized_on_load() const { return quantized_on_load_; }
  const optim::AdamWConfig& adam_config() const { return setup_.adam; }

  // Chrome trace-event JSON of the last step, every rank (a collective over
  // the pipeline group: call on every rank; rank 0 gets the JSON, others "").
  std::string gather_trace();

  // Bytes this rank holds: parameters + gradients (+ replica, E, and under
  // ZeRO-1 the shard of the reduced gradient the update reads), Adam (in
  // memory), activation slots and W-queue works at their peak, message and
  // ZeRO-1 gather buffers, and the compute tier's page frames when paged.
  // (Vocabulary parallel: the pieces' rows a rank copies are in params and
  // grads, the logits and statistics held from S to T in activations.)
  // (Adapters: `frozen` is the frozen base, its quantized tensors at their
  // codes' and scales' bytes, and a tied head's copy of the base token table.)
  struct Memory {
    size_t params = 0, grads = 0, master = 0, adam = 0, activations = 0, w_queue = 0, buffers = 0,
           pages = 0, frozen = 0;
    size_t total() const {
      return params + grads + master + adam + activations + w_queue + buffers + pages + frozen;
    }
  };
  Memory memory() const;
  // The same bytes in the step records' kinds (memory_per_rank), and the pagers' state after the step.
  MemoryReport memory_report() const;
  PagingReport paging_report() const;
  // When this rank's last forward_backward ended, and when the step's wait
  // for the data group's sums did (steady clock, ns): the exposed
  // communication and the ranks' imbalance (train/train_step.h's comm_split).
  int64_t backward_end_ns() const { return backward_end_ns_; }
  int64_t wait_end_ns() const { return wait_end_ns_; }
  // What memory() will be on pipeline rank `rank` after a step, from the
  // configuration and the schedule alone (the slots, works and message
  // buffers its action list needs: the same bookkeeping, replayed). The
  // planner's pipeline layouts read it; tests hold memory() to it.
  static Memory predict(const model::TransformerConfig& config, const PipelineSetup& setup,
                        int rank);
  // The collectives this rank's step (forward_backward, then step) issues on
  // its data and tensor groups, as comm::Traffic counts them, from the
  // configuration and the schedule alone (pipeline_traffic.cc; the
  // planner's; tests hold the run's counters to it).
  struct Collectives {
    comm::Traffic data, tensor;
  };
  static Collectives predict_collectives(const model::TransformerConfig& config, const PipelineSetup& setup,
                                         int rank);
  // The ring collectives' scratch the step's data and tensor collectives hold
  // at most at once (comm/mpi/ring_sizes.h: those large enough to take the
  // ring; allocated by the communicator, in the compute tier, beside what
  // memory() counts).
  static size_t predict_ring_scratch(const model::TransformerConfig& config, const PipelineSetup& setup,
                                     int rank);
  // Activation bytes of one slot of each chunk (a Transformer for its units).
  std::vector<size_t> slot_bytes() const;

 private:
  struct Chunk;
  using Key = StageMessages::Key;  // (micro, stage, payload)
  Chunk& chunk_of_stage(int stage);
  // The constructor's parts (pipeline_executor.cc).
  bool sharded() const;
  std::unique_ptr<Chunk> make_chunk(int stage, const std::vector<bool>& quantized);
  void setup_unit0(Chunk& c, const std::vector<bool>& quantized);
  void setup_buffers();
  model::Transformer& acquire_slot(Chunk& c, int micro);
  void release_slot(Chunk& c, int micro);
  const float* incoming(const pipeline::Action& consumer, pipeline::Payload payload);
  float* incoming_key(const pipeline::Action& consumer, const Key& key);
  // Vocabulary parallel (pipeline_vocab.cc).
  struct VocabPart;
  void vocab_setup();
  void vocab_init(uint64_t seed);
  void vocab_forward_done(model::Transformer& m, int micro);
  void vocab_stats(const pipeline::Action& a, const BatchFn& batch);
  void vocab_grad(const pipeline::Action& a, float grad_scale, PipelineStepStats& stats);
  float* vocab_input_grad(const pipeline::Action& a);
  void vocab_gather_grads();
  void vocab_refresh();
  static size_t vocab_held_bytes(const model::TransformerConfig& config, const PipelineSetup& setup,
                                 int rank);
  static std::pair<bool, bool> vocab_copies(const model::Layout& layout, const PipelineSetup& setup,
                                            int rank);  // (a copy of its rows, its own gradient rows)
  void run_compute(const pipeline::Action& a, const BatchFn& batch, float grad_scale,
                   const MicroFn& before_forward, PipelineStepStats& stats);
  void sum_norm_rows();
  void sum_tied_pair();
  void tied_pair(void* emb_at, void* head_at, int64_t lo, int64_t hi);
  void keep_lookup_tail(const float* rows, const int32_t* tokens, int64_t n);
  void add_lookup_tail();
  void update(Chunk& c, bool replica, double lr, double clip);
  void* stored_unit(int u);
  void* stored_at(Chunk& c, bool replica, int u);
  void store_unit(Chunk& c, bool replica, int u, const float* src);
  size_t stored_esz() const { return bf16_ ? sizeof(uint16_t) : sizeof(float); }  // parameters, gradients
  void read_field(Chunk& c, bool replica, State kind, int64_t offset, int64_t n, float* dst);
  void write_field(Chunk& c, bool replica, State kind, int64_t offset, int64_t n, const float* src);
  float* field_in_memory(Chunk& c, bool replica, State kind);
  // ZeRO 0-1 over dp > 1 (pipeline_grad_sync.cc): the data group's sums in
  // buckets (bucket_sums.h), each started as the backward finishes its
  // units (overlap_comm), the rest and the tied replicas' at the step.
  std::unique_ptr<BucketSums> sums_;
  void setup_buckets();
  void unit_finished(Chunk& c, int u);
  void chunk_finished(Chunk& c);
  void finish_sums();
  int64_t largest_unit() const;
  bool cur_fused_ = false;  // the action running is a whole (unsplit) backward
  double sum_wait_s_ = 0;   // the last step's wait for the data group's sums
  int64_t backward_end_ns_ = 0, wait_end_ns_ = 0;  // (backward_end_ns(), wait_end_ns())
  int early_sums_ = 0, all_sums_ = 0;  // overlapped_sums()
  // ZeRO-2 (pipeline_executor.cc): where unit u's gradient shard lives for
  // chunk c (its own units; unit 0 of a tied head: the replica's, or the
  // embedding chunk's on the same rank), the reduce-scatter of one
  // micro-batch's accumulator into it, the tied pair's sum over the shards
  // and the shards' global norm in grad_norm.h's order.
  struct UnitShard {
    tensor::Storage* store;  // the gradient's shard, or (ZeRO-3) the stored parameters'
    const ShardLayout* layout;
    int index;  // of the unit in `layout`
    optim::AdamW* adam;  // over the shard (under paged_shards_ its pages hold it)
    bool params;
    int unit;      // the global unit
    bool counted;  // a chunk's own unit (the norm's), not a tied head's replica
    char* at(size_t esz) const {
      return static_cast<char*>(store->data()) + static_cast<size_t>(layout->local_offset(index)) * esz;
    }
  };
  UnitShard shard_of(Chunk& c, int u, bool params);
  // ZeRO-3 over dp > 1 with paged state (pipeline_shards.cc): the stored
  // parameter and gradient shards live in their AdamW's pages
  // (ZeRO-Infinity). Elements [lo, lo + n) of a
  // unit's shard as stored, out of or into device memory, wherever it lives;
  // a reduced block of the unit's gradient added into its shard (the last
  // micro-batch's add also sums the unit's squares, so the norm reads no
  // page again: paged_sq_).
  using Direction = backend::Device::Direction;
  void shard_out(const UnitShard& s, int64_t lo, int64_t n, void* dst, Direction d = Direction::kDeviceToDevice);
  void shard_in(const UnitShard& s, int64_t lo, int64_t n, const void* src,
                Direction d = Direction::kDeviceToDevice);
  void add_into_shard(const UnitShard& g, const void* block, tensor::DType dtype, bool final);
  void shard_squares(int u);  // unit u's squares (the tied pair changed unit 0 after its last add)
  // update_in_backward (pipeline_early_update.cc): unit u of chunk c (its
  // local index i in `sl`, its AdamW `a`) is final: the pages that wait for
  // no other unit are updated now; at the step, every page not yet updated.
  struct EarlyPages {
    std::vector<int> units, waiting;  // per state page: the units it holds, those not yet final
    std::vector<char> done;
    bool begun = false;  // the AdamW's step counted (begin_paged_step)
  };
  void setup_early();
  void early_unit_final(Chunk& c, int u);
  void early_finished(Chunk& c, int u);
  void unit_landed(int u);
  void early_sums_landed();
  void finish_early(Chunk& c, bool replica, double lr);
  optim::OutsidePages outside_pages(Chunk& c, bool replica);
  void copy_grad_shard(Chunk& c, bool replica, int i);
  bool early_ = false, lr_known_ = false;
  double step_lr_ = 0;
  int64_t early_count_ = 0, early_last_ = 0;
  std::map<std::pair<int, int>, int> early_micro_;  // (stage, unit): micro-batches finished (dp 1, ZeRO 0-1)
  bool paged_shards_ = false;
  std::vector<double> paged_sq_;  // per unit: the counted squares of this rank's gradient shard
  std::vector<std::pair<int64_t, int64_t>> uncounted_;  // tp ranks > 0: the replicated ranges (sorted)
  // ZeRO-3: unit u's stored parameters gathered over the data group for one
  // use (every data rank of the stage asks in the same order), until done(u).
  const void* gather_use(Chunk& c, int u);
  void release_use(int u);
  void sum_tied_shards();
  double unit_norm();
  double shard_norm();
  int64_t acc_numel(int u) const;  // an accumulator's floats (ZeRO-2 at dp > 1: padded)
  bool shard_grads_ = false;   // ZeRO 2-3: each chunk keeps its shard of the gradient
  bool shard_params_ = false;  // ZeRO-3 over dp > 1: and of the stored parameters
  bool accumulate_ = false;    // per-micro-batch f32 accumulators: bf16 or ZeRO 2-3
  // ZeRO 2-3 (pipeline_grad_sync.cc): one micro-batch's accumulator of a
  // unit reduce-scattered into this rank's shard, non-blocking, completed
  // in post order (shard_reductions.h).
  std::unique_ptr<ShardReductions> reductions_;
  void reduce_into_shard(Chunk& c, int u, const UnitAccumulators::Acc& a, bool final);
  void finish_reductions();
  // ZeRO-3 over dp > 1: the gathers of a unit's stored parameters for each
  // use (param_gathers.h); what one moves (pipeline_gathers.cc).
  std::unique_ptr<ParamGathers> gathers_;
  comm::Work start_param_gather(int stage, int u, void* buf);
  void progress();  // the collectives in flight moved on (at the model's hooks)
  // bf16 or ZeRO 2-3 (see pipeline_executor.cc): widened parameters and
  // the f32 accumulators (unit_accumulators.h), each followed by its
  // reduce-scatter's send and receive blocks (acc_layout).
  float* widen(Chunk& c, int u, bool lean = false);
  const uint16_t* stored_bf16(const Chunk& c, int u) const;
  float* accumulator(Chunk& c, int u);
  void flush(const UnitAccumulators::Key& key);
  void flush_micro(Chunk& c, int micro, bool keep_deferred, bool keep_unit0 = false);
  bool head_meets_embedding() const;
  bool keep_unit0_ = false;  // head_meets_embedding()
  std::vector<std::pair<optim::AdamW*, std::string>> adams() const;
  // The working buffers' bytes by what they hold (pipeline_memory.cc).
  struct Buffers {
    size_t messages = 0, gathered = 0, sums = 0, deferred = 0;
  };
  Buffers buffer_bytes() const;
  void gather_unit(const ShardLayout& sl, int i, const void* mine, void* dst, tensor::DType dtype);
  tensor::Shape message_shape() const;

  model::TransformerConfig config_;
  model::Layout layout_;
  PipelineSetup setup_;
  int rank_ = 0;
  int64_t quantized_on_load_ = 0;
  std::vector<std::unique_ptr<Chunk>> chunks_;
  int64_t rows_ = 0;  // rows of a message: micro × T / sequence shards
  std::unique_ptr<StageMessages> messages_;  // between the stages (stage_messages.h)
  tensor::Storage gather_;       // ZeRO 1-2: a send block and ranks × stride (the largest unit)
  bool bf16_ = false;
  tensor::Storage widen_[2];  // bf16: unit 0's, the largest other unit's
  bool widen_busy_[2] = {false, false};
  std::unique_ptr<UnitAccumulators> accs_;
  // defer_lookup: the last micro-batch's lookup rows [micro·T, C] and tokens
  // (the embedding's rank), every data rank's (there and on a tied head's).
  tensor::Storage tail_rows_, tail_tokens_, rows_all_, tokens_all_;
  // Sequence parallel: the norms' ranges, their held elements' f32 staging
  // for the step's sum over the tensor group (sum_norm_rows).
  std::vector<std::pair<int64_t, int64_t>> norms_;
  tensor::Storage norm_sums_;
  int cur_micro_ = -1;
  bool cur_deferred_ = false;
  std::vector<int32_t> inputs_, targets_;
  std::vector<PipelineSpan> spans_;
  int64_t step_start_ns_ = 0;
  int in_flight_ = 0, w_queue_ = 0;
  PipelineStepStats* stats_ = nullptr;
  // The tied table: the rank and chunk of unit 0, of the head.
  int emb_rank_ = 0, head_rank_ = 0;
  std::unique_ptr<VocabPart> vocab_;
  model::ActivationLender lender_;  // (lend_activations, once paged; empty: none)
};

}  // namespace po::parallel
