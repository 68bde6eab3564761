// The decoder-only transformer, with explicit forward and backward, llm.c
// style. GPT-2 and Llama are configurations of it (model/config.h); its
// tensors are the declared layout (model/layout.h).
//
// Shape legend: B micro-batch, T sequence, C channels, V vocab, L layers, NH
// query heads, NKV kv heads, hs = C/NH head size, F MLP width, QKV =
// (NH+2·NKV)·hs, FC = F (GELU) or 2F (SwiGLU).
//
// The model is made of per-unit steps (Layout::training_steps): embedding
// forward, block forward, head + loss (+ its backward), block backward (split
// into its input-gradient and weight-gradient halves where a schedule wants
// them apart), embedding backward. forward_backward is the one-stage schedule
// of those steps. A model can be built for a contiguous range of units (a
// pipeline stage): it then holds only those units' parameters and
// activations, takes activations in and hands them out (stage_forward,
// stage_backward).
//
// Rules: parameter gradients accumulate (+=) across micro-batches until
// zero_grads(); activation gradients are written. Every read of parameters and
// every write of parameter gradients goes through one unit's base pointer
// (UnitHooks), with offsets relative to the unit's start, so a unit's
// parameters need to exist only while that unit computes (ZeRO-3). The LM head
// and the loss run fused in row chunks so that the [BT, V] logits are never
// held whole. The model knows nothing of comm.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/layout.h"
#include "model/parallel_ops.h"
#include "model/quant_weight.h"
#include "model/vocab_head.h"
#include "tensor/tensor.h"

namespace po::model {

// How the model reaches each unit's parameters and gradients. Empty (the
// default): its own flat buffers. ZeRO-3 installs hooks that all-gather a
// unit's parameters just before use and reduce its gradient once final. The
// order of params(u) calls of a training micro-batch is the step_units of
// Layout::training_steps() in turn (tied GPT-2: 0, 1..L, 0, L+1, L..1; untied:
// 0, 1..L, L+1, L..1); the head asks grads(u) for the units it reads, then
// done(L+1), done(0) (tied), grads_ready(L+1); each block backward asks
// params(l), grads(l), then done(l), grads_ready(l); the embedding backward
// asks grads(0) then grads_ready(0). evaluate() and next_token_logits() ask for
// the forward part of the same order. params(u) is called once per use and its
// pointer is not kept past done(u).
struct UnitHooks {
  // Unit u's parameters: unit_numel(u) floats in the unit's layout, valid
  // until done(u).
  std::function<float*(int u)> params;
  // The model is finished with the pointer params(u) returned.
  std::function<void(int u)> done;
  // Unit u's gradient accumulator (unit_numel(u) floats; the model adds into
  // it): the same buffer from the first grads(u) of a micro-batch until
  // grads_ready(u).
  std::function<float*(int u)> grads;
  // Unit u's gradient of this micro-batch is complete. Called on every
  // micro-batch, at the points forward_backward's on_unit_ready is called.
  std::function<void(int u)> grads_ready;
  // Optional: unit u's parameters as stored in bf16 (the values params(u)
  // holds widened), valid until done(u), or null where they are not held in
  // bf16. Asked after params(u); a bf16 GEMM reads its weights from here
  // instead of rounding the widened copy again.
  std::function<const uint16_t*(int u)> params_bf16;
  // Optional, with params_bf16: params(u) for a model that reads the
  // Layout::read_as_bf16 tensors (GEMM weights, the token table) through
  // their bits: where params_bf16(u) then gives bits, those tensors' f32
  // values are not written (no widening pass over them); where it gives null,
  // every value is. Training steps ask for it when GEMMs run at kBF16;
  // generation asks params(u).
  std::function<float*(int u)> params_lean;
  // Optional, a tied table's training: the lookup rows of unit 0's token
  // table (rows [n, C] and their tokens) go here, deferred micro-batches'
  // too, and the model adds none of them (the caller adds E once at the
  // step: parallel/tied_pair.h). The position table's rows are added as ever.
  std::function<void(const float* rows, const int32_t* tokens, int64_t n)> lookup_rows;
  // Optional, data parallel's deferred lookup (parallel/tied_pair.h,
  // defers_lookup): asked once per backward of a model holding unit 0.
  // Where it answers true, this micro-batch's lookup gradient rows [n, C]
  // and their tokens go to deferred_lookup and none of them is added into
  // unit 0 (the caller adds them after the data group's sum), and a model
  // holding the head too reports unit 0 ready right after the head: all
  // unit 0 will hold of this micro-batch is there then.
  std::function<bool()> defers_lookup;
  std::function<void(const float* rows, const int32_t* tokens, int64_t n)> deferred_lookup;
  bool empty() const {
    return !params && !done && !grads && !grads_ready && !params_bf16 && !params_lean && !lookup_rows &&
           !defers_lookup && !deferred_lookup;
  }
};

// Where a whole model's activation memory goes while nothing in it will be
// read: after the backward of a step's last micro-batch through block l,
// block l's saved activations are dead until its next forward, and after
// the head's backward the head's until the next head.
// Region ids: the held blocks in order (0 = the first), then the head. The
// model offers lend(region, base, bytes) once a region is dead, which
// returns whether it took it (the caller lends only after the step's last
// micro-batch), and calls claim(region) for a region taken before it writes
// there again; claim must have taken everything back when it returns. The
// memory stays the model's allocation (the compute pool does not move).
// A split backward's blocks (stage_backward with deferred weight halves)
// are not offered.
struct ActivationLender {
  std::function<bool(int region, char* base, size_t bytes)> lend;
  std::function<void(int region)> claim;
};

// Global unit ids [first, last] a model holds; last = -1: through the head.
struct UnitRange {
  int first = 0;
  int last = -1;
};

// What a block's weight-gradient half needs, kept by its input-gradient half
// (the output gradients and inputs of the block's four GEMMs). Owning.
struct WeightGradWork {
  int layer = -1;
  tensor::Storage storage;
  float *d_proj = nullptr, *in_proj = nullptr;  // [BT,C], [BT,F]
  float *d_fc = nullptr, *in_fc = nullptr;      // [BT,FC], [BT,C]
  float *d_out = nullptr, *in_out = nullptr;    // [BT,C], [BT,NH·hs]
  float *d_qkv = nullptr, *in_qkv = nullptr;    // [BT,QKV], [BT,C]
};

// Serving's paged KV cache (serve/kv_cache.h owns it): per layer a pool of
// blocks of block_size positions, [blocks · block_size, NKV·hs] for keys and
// the same for values.
struct PagedKv {
  int64_t block_size = 16;
  std::vector<float*> k, v;  // per layer
};

// One sequence's rows in a batched serving step: tokens[n] at positions
// pos0 .. pos0 + n - 1, its keys and values at those positions written through
// block_table (which covers pos0 + n positions); its logits wanted or not.
struct PagedSeq {
  const int32_t* tokens = nullptr;
  int64_t n = 0, pos0 = 0;
  const int32_t* block_table = nullptr;
  bool logits = false;
  int64_t row_logits = 0;  // rows 0 .. row_logits-1 also give their logits (forward_paged's `each`)
  // Serving with adapters: a model of the same base shapes with adapters
  // (Layout::adapters(), its params() the adapters' tensors, e.g. a PEFT
  // adapter read by checkpoint::read_peft_adapter) whose adapters this
  // sequence's rows add to the base's linears; null: the base alone.
  const class Transformer* adapter = nullptr;
};

// The keys and values of past positions, per block, for generation.
struct KvCache {
  int64_t capacity = 0;  // positions
  int64_t length = 0;    // positions filled
  std::vector<tensor::Storage> k, v;  // per block [capacity, NKV·hs]
};

class Transformer {
 public:
  // Allocates activations for micro-batch B at sequence T (parameters and
  // gradients at first use) for the units in `range`. With split.size > 1 the
  // model is one tensor-parallel rank's: it holds that rank's shards
  // (Layout's held shapes) and computes its heads, MLP columns and vocabulary
  // slice; the reductions between ranks go through set_parallel_ops(), whose
  // tp_size() and tp_rank() must match `split`.
  // head_logits = false: the head's logits and loss rows are not allocated:
  // the model runs only the final norm of its head (HeadPart::kNormOnly), as a
  // pipeline's last stage does when the head's pieces are spread over the
  // ranks.
  Transformer(const TransformerConfig& config, int64_t B, int64_t T, UnitRange range = {},
              TensorSplit split = {}, bool head_logits = true);

  // The whole model's configuration (at tp > 1, not the shapes held).
  const TransformerConfig& config() const { return global_config_; }
  // The shapes this rank computes with (TransformerConfig::shard).
  const TransformerConfig& local_config() const { return config_; }
  int tp_size() const { return layout_.split().size; }
  const Layout& layout() const { return layout_; }
  int64_t batch() const { return B_; }
  int64_t seq_len() const { return T_; }
  int64_t seq() const { return T_; }
  int first_unit() const { return first_; }
  int last_unit() const { return last_; }
  bool whole() const { return first_ == 0 && last_ == layout_.head_unit(); }
  bool holds_unit(int u) const { return holds(u); }

  // The flat parameter and gradient buffers of the held units [num_params()]:
  // only while the model holds them (throws after release_params() /
  // release_grads()).
  float* params();
  const float* params() const;
  float* grads();
  // Elements of the held units.
  int64_t num_params() const { return num_params_; }
  // A model with adapters (Layout::adapters()): the frozen base of the held
  // units, in the base layout (Layout::base_tensors(); the same as params()
  // without adapters), allocated at first use. params() and grads() are then
  // the adapters'.
  // With model.quant the base lives in a reservation (tensor::SparseStorage):
  // quantize_base() then drops the f32 pages of the quantized tensors, which
  // must not be read through base_params() again (base_values() decodes them).
  float* base_params();
  // With adapters: this model reads the frozen base (its f32 values and its
  // quantized tensors) from `owner`, a model of the same config holding the
  // same units, instead of holding one of its own (a pipeline's activation
  // slots share their chunk's). A tied head without unit 0 reads the base
  // token table (unit 0's base, Layout::base_unit_offset order) at `unit0`.
  // Both must outlive this model.
  void share_base(Transformer& owner, float* unit0 = nullptr);
  // model.quant: quantizes the held blocks' linear weights of the base now in
  // base_params() (each Hugging Face module's weight on its own) and gives
  // their f32 pages back; once, after the base is loaded. init_random does it
  // unit by unit itself, so a random base never exists whole in f32.
  void quantize_base();
  // Before quantize_base: base tensor `t` (a piece of a block Linear) comes
  // already quantized (a "-bnb-4bit" checkpoint's codes); quantize_base keeps
  // it as it is. Its f32 values are never read.
  void set_quantized(const TensorSpec& t, QuantTensor q);
  bool base_quantized() const { return base_owner_ != nullptr ? base_owner_->quantized_ : quantized_; }
  // The quantized form of a base tensor; null where it is held in f32.
  const QuantTensor* quantized(const TensorSpec& base_tensor) const;
  // Bytes the quantized tensors hold, and the f32 bytes given back for them.
  size_t quantized_bytes() const;
  // The frozen base this model holds by accounting (0 without adapters, or
  // when share_base reads another's): each held base tensor's f32 bytes, or
  // its quantized bytes; predicted_frozen_bytes: the same from the config
  // alone, for the held units `units` (the pipeline's ledger).
  size_t frozen_bytes() const;
  static size_t predicted_frozen_bytes(const TransformerConfig& config, UnitRange units, TensorSplit split);
  size_t released_base_bytes() const { return base_sparse_.released(); }
  // The base of the held units in f32, in the base layout, the quantized
  // tensors decoded (what the GEMMs compute with).
  void base_values(float* out);
  int64_t base_unit_offset(int u) const {
    return layout_.base_unit_offset(u) - layout_.base_unit_offset(first_);
  }
  // The declared tensors (offsets global: from the start of unit 0).
  const std::vector<TensorSpec>& param_infos() const { return layout_.tensors(); }
  const TensorSpec& param(const std::string& name) const { return layout_.tensor(name); }
  int num_units() const { return layout_.num_units(); }
  // Offset of held unit u in params() / grads().
  int64_t unit_offset(int u) const { return layout_.unit_offset(u) - layout_.unit_offset(first_); }
  int64_t unit_numel(int u) const { return layout_.unit_numel(u); }

  // Initialisation from a counter-based RNG by the declared rule of each
  // tensor (N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)), biases 0,
  // norm weights 1). Element i of tensor k is a function of (seed, k, i) only.
  void init_random(uint64_t seed);
  // The same values for unit u alone, into `unit` (unit_numel(u) floats).
  void init_random_unit(uint64_t seed, int u, float* unit) const;
  // With adapters: A Kaiming-uniform, B zero, DoRA's magnitude the row
  // norms of the base weight (so read after the base is in base_params()).
  void init_adapters(uint64_t seed);
  // With adapters: the base of the held units with every adapter folded in
  // (parts::Linear::merge), into `out` in the base layout: the parameters of
  // a model without adapters that computes what this one does.
  void merged_params(float* out);
  // The base weight an adapter tensor adapts (its module's .weight).
  const TensorSpec& adapted_weight(const TensorSpec& adapter) const;
  // Zeroes grads(); does nothing once they are released.
  void zero_grads();

  // The collectives of split layers (model/parallel_ops.h); null by default.
  // `ops` must outlive the model.
  // Context parallel: the model's T rows are the ops' cp_split() share of
  // the sequence (their positions, and attention through the ops).
  void set_parallel_ops(ParallelOps& ops);
  const ContextSplit& context_split() const { return cp_; }
  // Activation memory lent while dead (ActivationLender); an empty lender
  // takes back whatever is lent and stops lending.
  void set_activation_lender(ActivationLender lender);
  // The regions a lender is offered (memory, bytes): blocks in order, then
  // the head (ActivationLender); the same at every step.
  const std::vector<std::pair<char*, size_t>>& activation_regions() const { return regions_; }
  // The same as byte offsets from the start of the activations' allocation
  // (at least 4096-aligned), for the planner.
  static std::vector<std::pair<size_t, size_t>> predicted_activation_regions(
      const TransformerConfig& config, int64_t B, int64_t T, int64_t tp);
  // parallel.tp_overlap: each column-parallel GEMM's input-gradient
  // reduction runs under its weight-gradient GEMM (the same bits).
  void set_tp_overlap(bool on) { tp_overlap_ = on; }
  ParallelOps& parallel_ops() const { return *pops_; }

  // Packed rows (SFT's data.pack): positions[B*T] is each token's position
  // in its own example. A row holds examples one after another, each
  // starting at position 0; position embeddings and RoPE take these
  // positions, and no token attends outside its example (block-diagonal
  // causal attention: each example's attention runs alone, so its bits are
  // those of the example in a row of its own). Null, the default: positions
  // 0 .. T-1 in every row. The array is copied; it holds for every
  // forward/evaluate and backward until the next call. A whole model or a
  // pipeline stage, at tp = 1 and cp = 1 (plan/capabilities refuses packing elsewhere).
  void set_positions(const int32_t* positions);
  bool packed() const { return !segments_.empty(); }

  // Adapter dropout (lora.dropout > 0; parts.h AdapterDropout): the masks of
  // the next training pass (forward_backward, or a stage's stage_forward
  // with grad_scale != 0 and its stage_backward) are those of `step`, this
  // micro-batch's first sequence being `first_sequence` of the step's global
  // batch. Evaluation and generation never drop.
  void set_dropout(uint64_t seed, int64_t step, int64_t first_sequence);

  // Routes every parameter and gradient access through `hooks` (all four
  // set), or back to the model's own buffers (all empty).
  void set_unit_hooks(UnitHooks hooks);
  // Frees the flat parameter / gradient buffers, for a caller whose hooks keep
  // the state elsewhere (ZeRO-3 keeps only shards). Irreversible.
  void release_params();
  void release_grads();
  // Bytes of flat parameters / gradients the model holds now (0 once released).
  // (With adapters: params_bytes() the adapters', base_bytes() the frozen base's.)
  size_t params_bytes() const { return params_.size(); }
  size_t base_bytes() const { return base_.size(); }
  size_t grads_bytes() const { return grads_.size() + lookup_.size(); }

  // One micro-batch of a whole model: forward, loss, backward (the one-stage
  // schedule of Layout::training_steps). inputs/targets [B,T]. Gradients of
  // grad_scale * sum(per-token losses) accumulate into grads(). Returns the
  // mean loss over the B*T tokens. `on_unit_ready`, when given, is called with
  // each unit's index as soon as its gradients are final for this micro-batch
  // (head unit, blocks L..1, then the embedding; with the hooks'
  // defers_lookup, unit 0 right after the head).
  float forward_backward(const int32_t* inputs, const int32_t* targets, float grad_scale,
                         const std::function<void(int unit)>& on_unit_ready = {});
  // Mean loss over [B,T] without touching gradients.
  float evaluate(const int32_t* inputs, const int32_t* targets);

  // What a last stage runs of its head: all of it (logits, loss and their
  // backward), or, where the head's vocabulary pieces are spread over the
  // pipeline ranks (parallel/pipeline_executor.h), its final norm only:
  // stage_forward then returns 0 and hands out the norm's output [B*T, C]
  // (the head's input, for every rank's pieces), and stage_backward takes
  // the head's input gradient as d_out and runs the norm's backward before
  // the blocks'. (tp = 1.)
  enum class HeadPart { kWhole, kNormOnly };
  // A pipeline stage's forward: tokens (first stage) or activations x_in
  // [B*T, C] in; the held blocks run; the last stage also runs `head` and
  // (grad_scale != 0) its backward and returns the loss sum, others return 0
  // and hand out stage_output() [B*T, C].
  double stage_forward(const int32_t* tokens, const float* x_in, const int32_t* targets,
                       float grad_scale, HeadPart head = HeadPart::kWhole);
  const float* stage_output() const { return norm_only_ && has_head() ? lnf_ : out_; }
  // A stage's backward: d_out [B*T, C] (ignored on the last stage, which has
  // its head's gradient), then the held blocks; returns dL/d(stage input)
  // [B*T, C] (valid until the next call), and on the first stage adds the
  // embedding's gradient. on_unit_ready as in forward_backward.
  // With `deferred` (one work per held block, from make_weight_grad_work) only
  // the blocks' input halves run, keeping what stage_backward_weight needs.
  // The hooks' defers_lookup is asked as forward_backward asks it.
  const float* stage_backward(const int32_t* tokens, const float* d_out,
                              const std::function<void(int unit)>& on_unit_ready = {},
                              std::vector<WeightGradWork>* deferred = nullptr, HeadPart head = HeadPart::kWhole);
  // The weight halves of a stage_backward(..., deferred): the blocks from the
  // highest down, as the fused backward adds them.
  void stage_backward_weight(std::vector<WeightGradWork>& works);

  // The tied token table's gradient (GPT-2) is the head's part H plus the
  // lookup's part E. Training hands E's rows to its hooks
  // (UnitHooks::lookup_rows), which add E once at the step; a model used on
  // its own sums each micro-batch's E apart and adds it, wte += E, where
  // unit 0 is reported ready. With hooks holding the gradient and no
  // lookup_rows hook the rows go straight into grads(0).
  // Bytes of the model's own E accumulator (0 until the first lookup backward).
  size_t lookup_grads_bytes() const { return lookup_.size(); }
  // The bytes the model's own E takes for `config` at tp (0 untied).
  static size_t predicted_lookup_bytes(const TransformerConfig& config, int64_t tp = 1);

  // Block l's backward in two halves, after its stage_forward: the input
  // gradient (dres: dL/d(block output) in, dL/d(block input) out; norm
  // weights' gradients included), keeping what the weight half needs in
  // `work`; and the weight gradients of its four GEMMs. Together they give
  // the bits of the fused backward.
  void block_backward_input(int layer, float* dres, WeightGradWork& work);
  void block_backward_weight(WeightGradWork& work);
  WeightGradWork make_weight_grad_work() const;
  // The current backward gradient buffer [B*T, C] (the stage's running dres).
  float* backward_buffer() { return dres_; }

  // Generation with a KV cache: runs tokens[n] at positions cache.length ..
  // cache.length + n - 1, appends their keys and values, and writes the logits
  // [V] of the last one. n <= B*T. The cache is a paged cache of one block:
  // this is forward_paged for one sequence.
  KvCache make_kv_cache(int64_t capacity) const;
  void forward_cached(const int32_t* tokens, int64_t n, KvCache& cache, float* logits);
  // Serving: every sequence's rows in one batch (rows concatenated, at most
  // B·T in all), so each weight is read once for the whole step; keys and
  // values go into `kv`, and the logits [V] of each sequence with `logits`
  // set, in order, into logits[count, V]. Per sequence the same arithmetic
  // as forward_cached but for the GEMMs' row count (their results may differ
  // in the last bits with the batch: docs/serving.md).
  // `each(seq, first, rows, logits[rows, V])` is called, after that, with the
  // logits of every row below each sequence's `row_logits` (a few rows at a
  // time, through a buffer of this model's: prompt log-probabilities).
  using RowLogits = std::function<void(size_t seq, int64_t first, int64_t rows, const float* logits)>;
  void forward_paged(const std::vector<PagedSeq>& seqs, const PagedKv& kv, float* logits,
                     const RowLogits& each = {});
  // Logits [V] at position t_len-1 of a single sequence tokens[t_len], t_len <= T
  // (recomputes the prefix; forward_cached is the fast path).
  void next_token_logits(const int32_t* tokens, int64_t t_len, float* logits);

  // Bytes of activations and scratch this model holds (for the memory ledger).
  size_t activation_bytes() const { return acts_.size(); }
  // Bytes the model would hold: params + grads + activations (no optimizer),
  // per rank of tp tensor-parallel ranks.
  static size_t predicted_bytes(const TransformerConfig& config, int64_t B, int64_t T,
                                int64_t tp = 1);
  // Bytes of activations and scratch alone (what activation_bytes() will be).
  static size_t predicted_activation_bytes(const TransformerConfig& config, int64_t B, int64_t T,
                                           int64_t tp = 1);
  // The part of those that is the head's: one chunk of logits [rows, V] and
  // the per-token losses [B·T].
  static size_t predicted_logits_bytes(const TransformerConfig& config, int64_t B, int64_t T,
                                       int64_t tp = 1);
  // The bytes one block keeps for its backward (its share of
  // activation_bytes()), per rank of tp; config.sequence_parallel splits the
  // norm and residual rows too.
  static size_t predicted_layer_bytes(const TransformerConfig& config, int64_t B, int64_t T,
                                      int64_t tp = 1);
  // The activations of a model over `range` (a pipeline stage), per rank of tp.
  static size_t predicted_stage_activation_bytes(const TransformerConfig& config, int64_t B,
                                                 int64_t T, int64_t tp, UnitRange range,
                                                 bool head_logits = true);
  // The tensor group's collectives of one micro-batch's forward and backward
  // over `range` (a pipeline stage; the whole model at pp = 1) at tp > 1, as
  // model/transformer_steps.cc issues them and comm::Traffic counts them
  // (allreduce: the buffer; reduce_scatter: the whole input; all_gather: the
  // whole output). Without sequence parallel: a [B·T, C] f32 sum for the
  // embedding's lookup (the stage of unit 0), two per block forward (again
  // in the recompute under activation checkpointing), two per block backward
  // and one for the head's input gradient. Under sequence parallel each of
  // those is a reduce-scatter, and the norms' outputs (two per block forward,
  // again for the weight gradients backward, and in the recompute; the final
  // norm's) and the output gradients (two per block backward, the
  // embedding's) are all-gathered. (Each rank's norm weights' gradients are
  // then its rows' part: the executor sums them over the group once a step,
  // Layout::norm_ranges.) Per chunk of head_chunk_rows
  // logits the loss's row maxima (n floats, summed as a max) and its n (sum
  // of exponentials, target logit) pairs of doubles, all-gathered as bits.
  enum class Collective { kAllReduce, kReduceScatter, kAllGather };
  struct CollectiveItem {
    Collective op;
    const char* what;
    uint64_t calls = 0;
    double bytes = 0;
  };
  static std::vector<CollectiveItem> predicted_tp_collectives(const TransformerConfig& config, int64_t B,
                                                              int64_t T, int64_t tp, UnitRange range);
  // One make_weight_grad_work()'s bytes (a block's deferred weight half), per rank of tp.
  static size_t predicted_weight_grad_work_bytes(const TransformerConfig& config, int64_t B,
                                                 int64_t T, int64_t tp);
  // Sequence-parallel ranks: tp when config.sequence_parallel, else 1.
  int64_t sequence_shards() const { return sp_; }
  // Rows of logits the head computes at once (the LM head and loss run in
  // chunks of this many of the B·T rows; at tp > 1 each chunk's loss is
  // reduced over the tensor group).
  static int64_t head_chunk_rows(int64_t B, int64_t T);

 private:
  // (A mixture-of-experts block keeps moe::Saved in fch and, its chosen
  // experts, fch_gelu: moe_saved.)
  struct LayerActs {
    float *ln1, *ln1_mean, *ln1_rstd, *qkv, *atty, *lse, *residual2;
    float *ln2, *ln2_mean, *ln2_rstd, *fch, *fch_gelu, *residual3;
  };
  static moe::Shape moe_shape(const TransformerConfig& c) {
    return {c.n_embd, c.moe.hidden(c.ffn_hidden), c.moe.experts, c.moe.top_k, c.moe.router};
  }
  moe::Saved moe_saved(const LayerActs& a) const {
    return moe::Saved::carve(layout_.block().moe.shape, B_ * T_, a.fch, reinterpret_cast<int32_t*>(a.fch_gelu));
  }
  moe::Work moe_work() const { return moe::Work::carve(layout_.block().moe.shape, B_ * T_, moe_work_); }
  // The losses' coefficients and the step's scales (TransformerConfig::Moe).
  moe::Losses moe_losses() const;
  // bf16_activations: the bf16 copies of a layer's large saved tensors (its
  // LayerActs keeps only the f32 statistics). With activation checkpointing
  // only residual3 (the block output) is kept.
  struct LayerActs16 {
    uint16_t *ln1, *qkv, *atty, *residual2, *ln2, *fch, *fch_gelu, *residual3;
  };
  struct SavedPair {
    float* f;
    uint16_t* h;
    int64_t numel;  // values
  };
  std::array<SavedPair, 7> saved_pairs(const LayerActs& a, const LayerActs16& h) const;
  // A block unit's weights as a step reads them, and its gradient accumulators.
  using BlockWeights = parts::Block::Weights;
  using BlockGrads = parts::Block::Grads;
  // The saved bf16 copies that a block's GEMMs read and write directly
  // (bf16_activations with saved activations, one sequence shard, a fused
  // backward): the norms and the MLP activation write their outputs only in
  // bf16 (fused cast), the attention output is rounded into its slot once,
  // and the backward's weight gradients read them without widening. Null
  // elsewhere: the f32 activations, rounded by each GEMM (the same bits).
  const LayerActs16* direct16(int64_t l, bool save) const;
  static bool written_direct(const SavedPair& s, const LayerActs16& h);
  // Whether block_backward's attention reads the saved bf16 q, k, v and
  // output under direct16 (load_saved then leaves them unwidened): not under
  // context parallel, whose block kernels take f32.
  bool attention_reads16() const { return cp_.size == 1; }
  // Every activation view, as laid out in one allocation.
  struct ActivationLayout {
    float* encoded = nullptr;
    std::vector<LayerActs> layers;
    std::vector<LayerActs16> layers16;
    float* stream[2] = {nullptr, nullptr};
    float* in_buf = nullptr;
    LayerActs scratch{};
    float *rope_cos = nullptr, *rope_sin = nullptr;
    float *lnf = nullptr, *lnf_mean = nullptr, *lnf_rstd = nullptr, *logits = nullptr;
    float *losses = nullptr, *dres = nullptr, *dlnf = nullptr, *dbuf_c = nullptr;
    float *dqkv = nullptr, *dfch = nullptr;
    float *full = nullptr, *gathered = nullptr, *dchunk = nullptr;
    float* moe_work = nullptr;  // a mixture of experts' scratch (moe::Work)
    uint16_t *lnf16 = nullptr, *logits16 = nullptr;  // bf16_activations, with the head
    // Float offsets [begin, end) of each block's saved activations, then the
    // head's (ActivationLender's regions).
    std::vector<std::pair<int64_t, int64_t>> regions;
  };
  // Lays out the activations of `config` (a rank's shapes) at (B, T) for
  // `n_blocks` held blocks and (with_head) the head from `base` (null: count
  // only) and returns the floats needed; with seq_shards > 1 (sequence
  // parallel) the norm and residual regions hold B·T/seq_shards rows. The
  // constructor and predicted_bytes() both use it, so the ledger cannot drift.
  static size_t layout_activations(const TransformerConfig& config, int64_t B, int64_t T,
                                   int64_t seq_shards, int64_t n_blocks, bool with_head,
                                   float* base, ActivationLayout& out, bool head_logits = true);
  // Sequence parallel's moves of [rows, C] tensors (rows = B·T of the
  // micro-batch; a rank holds rows / sp_ of them). gather_rows: every rank's
  // chunk into `full` (returns it), or `chunk` itself at sp_ = 1.
  // reduce_rows: a row-parallel GEMM's partial sums into the reduced rows
  // this rank holds (reduce-scatter into `out`), or in place at sp_ = 1
  // (all-reduce; out == partial).
  const float* gather_rows(const float* chunk, float* full, int64_t rows);
  void reduce_rows(float* partial, float* out, int64_t rows);
  // The first row of this rank's chunk of `rows` rows.
  int64_t chunk_begin(int64_t rows) const { return rows / sp_ * pops_->tp_rank(); }
  // Block unit u's weights (through the hooks), with the bf16 weights where
  // the hooks hand them out; its gradient accumulators.
  BlockWeights block_weights(int u);
  void init_random_base(uint64_t seed, int u, float* unit) const;
  BlockGrads block_grads(int u) {
    if (layout_.adapters()) return layout_.block().grads(nullptr, unit_grads(u));
    return layout_.block().grads(unit_grads(u));
  }
  float* unit_params(int u);
  // Where unit u's base tensors are, given its trainable parameters: the
  // same pointer, or with adapters the frozen base's unit.
  float* base_of(int u, float* trainable);
  // unit_params for a training step: the f32 values, the stored bf16 bits
  // (null where the hooks hold none), and whether the f32 values of the
  // read_as_bf16 tensors are missing (params_lean hooks at kBF16 GEMMs): then
  // those tensors are read through `bf16` alone.
  struct UnitView {
    float* f32 = nullptr;
    const uint16_t* bf16 = nullptr;
    bool lean = false;
  };
  UnitView unit_params_lean(int u);
  void unit_done(int u);
  float* unit_grads(int u);
  bool holds(int u) const { return u >= first_ && u <= last_; }
  bool has_head() const { return last_ == layout_.head_unit(); }
  int first_block() const { return std::max(first_, 1) - 1; }  // layer ids
  int end_block() const { return std::min(last_, static_cast<int>(config_.n_layer)); }

  // The block's parts (layout_.block()) composed, with the tensor group's
  // collectives between them.
  void block_forward(const BlockWeights& P, const float* in, const LayerActs& a, int64_t b,
                     int64_t t, const LayerActs16* h = nullptr);
  // With `work`, the input gradient only, and into `work` what the weight
  // half needs.
  void block_backward(const BlockWeights& P, const BlockGrads& G, backend::cpu::Operand in,
                      const LayerActs& a, float* dres, WeightGradWork* work,
                      const LayerActs16* h = nullptr);
  // The attention kernel's forward and backward between the q|k|v and output
  // projections: RoPE, then this rank's heads (context parallel: through the
  // group's ring).
  void attention_forward(const LayerActs& a, int64_t b, int64_t t);
  // The saved (or, with checkpointing, recomputed) activations of block l
  // and its input, ready for its backward; with `h` (direct16) the tensors
  // the backward reads in bf16 stay in bf16 (load_saved), and so does the
  // block's input (`in`) after the first held block.
  LayerActs backward_acts(int64_t l, const BlockWeights& P, backend::cpu::Operand& in,
                          const LayerActs16* h = nullptr);
  const float* forward_blocks(const float* x0, int64_t b, int64_t t, bool save);
  void embed_forward(const int32_t* tokens, int64_t b, int64_t t);
  // Gathers dL/d(embedding output) of every row (sequence parallel); then
  // adds the lookup's gradient, or (`deferred`) hands the rows to the hooks'
  // deferred_lookup.
  void embed_backward(const int32_t* tokens, bool deferred = false);
  // Whether this backward's lookup rows are deferred (UnitHooks::defers_lookup).
  bool defers_lookup() const { return holds(0) && hooks_.defers_lookup && hooks_.defers_lookup(); }
  LayerActs load_saved(int64_t l, bool widen_all);
  LayerActs scratch_with_stats(int64_t l) const;
  // Generation's embedding of n tokens at positions pos0.. into x[n, C].
  void embed_rows(const int32_t* tokens, int64_t n, int64_t pos0, float* x);
  // Generation's blocks over n rows (x in, the result in the returned
  // buffer, x or the other one): per layer, `attend(l, qkv, atty)` applies
  // RoPE, stores the new keys and values and writes the attention output.
  const float* decode_blocks(int64_t n,
                             const std::function<void(int64_t l, float* qkv, float* atty)>& attend);
  // forward_paged's rows with an adapter: [row0, row0 + rows) add `adapter`'s.
  struct RowAdapter {
    int64_t row0 = 0, rows = 0;
    const Transformer* adapter = nullptr;
  };
  std::vector<RowAdapter> row_adapters_;
  // y [n, out] of Linear `which` (0 qkv, 1 out, 2 up, 3 down) of unit u, from
  // x [n, in] and the base weights P: each row span's adapter added.
  void add_row_adapters(int which, int u, float* y, const float* x, const BlockWeights& P, bool with_bias) const;
  const float* block_input(int64_t l);
  const LayerActs& layer(int64_t l) const { return layers_[static_cast<size_t>(l - first_block())]; }
  struct HeadViews {
    float *weight, *norm_w, *norm_b;
  };
  HeadViews head_views(float* unit0, float* head_unit) const;
  HeadViews head_params();
  // A training step's: through unit_params_lean, the head weight's stored
  // bits in weight16 (null where none are held: read P.weight).
  HeadViews head_params_lean(const uint16_t*& weight16);
  const uint16_t* head_weight16(const float* weight);
  void head_done();
  double head_forward(const float* residual, const int32_t* targets, int64_t rows,
                      float grad_scale);
  void head_logits(const float* x, int64_t rows, float* logits);
  // The vocabulary-parallel cross-entropy of one chunk of n rows of logits
  // (tp > 1): three reductions over the tensor group, never the logits.
  void vocab_parallel_loss(float* losses, float* logits, const int32_t* targets, int64_t n,
                           float grad_scale);

  TransformerConfig global_config_;
  TransformerConfig config_;  // this rank's shapes
  Layout layout_;
  int64_t B_, T_;
  int first_ = 0, last_ = 0;
  int64_t num_params_ = 0;
  int64_t head_chunk_ = 0;  // rows of logits processed at once
  bool norm_only_ = false;  // the last stage_forward ran HeadPart::kNormOnly
  bool head_logits_ = true;  // the head's logits and losses allocated
  void final_norm_forward(const float* residual);
  void final_norm_backward(const float* dlnf);
  bool tp_overlap_ = false;
  int64_t sp_ = 1;          // sequence shards: the norm and residual regions hold B·T/sp_ rows
  mutable tensor::Storage params_, grads_;  // allocated at first use
  tensor::Storage base_;                    // with adapters: the frozen model
  tensor::SparseStorage base_sparse_;       // ... instead, with model.quant
  // model.quant: per base tensor its quantized form (format kNone: f32), and
  // per held unit (u - first_) its block's Linears (qkv, out, up, down) over them.
  std::vector<QuantTensor> quant_;
  std::vector<std::array<QuantWeight, 4>> quant_linears_;
  bool quantized_ = false;
  Transformer* base_owner_ = nullptr;  // share_base: the model whose base this one reads
  float* base_unit0_ = nullptr;        // share_base: unit 0's base for a tied head without it
  void quantize_unit(int u);
  // Points a block's Linear weights at their quantized forms (model.quant).
  void attach_quant(BlockWeights& P, int u) const;
  tensor::Storage acts_;
  bool params_released_ = false, grads_released_ = false;
  UnitHooks hooks_;
  // ActivationLender: the regions' memory, which are lent now.
  ActivationLender lender_;
  std::vector<std::pair<char*, size_t>> regions_;
  std::vector<bool> lent_;
  void lend_region(size_t r);
  void claim_region(size_t r);
  void claim_regions();
  tensor::Storage lookup_;           // the tied table's E (a model on its own), allocated at first use
  float* tied_lookup_grads();
  void fold_tied_lookup();
  ParallelOps* pops_ = &NullParallelOps::instance();

  // Activation views (into acts_).
  float* encoded_ = nullptr;  // [BT,C]: the first held block's input
  std::vector<LayerActs> layers_;
  std::vector<LayerActs16> layers16_;
  float* stream_[2] = {nullptr, nullptr};
  float* in_buf_ = nullptr;
  LayerActs scratch_{};
  float *rope_cos_ = nullptr, *rope_sin_ = nullptr;                   // [T, hs/2] each
  ContextSplit cp_;  // the rows' place in the sequence (context parallel)
  // The rope tables at the rows' positions (cp_).
  void build_rope_tables();
  // out[b, t, :] += wpe[position of row t] for B × T rows (whole sequences'
  // rows at context parallel; packed rows: each token's own position);
  // dwpe[position] += the rows' gradients.
  void add_positions(float* out, const float* wpe, int64_t b, int64_t t) const;
  void position_grads(float* dwpe, const float* dout) const;
  // Packed rows (set_positions): the examples, in row order, and the tokens'
  // positions; empty when not packed.
  struct Segment {
    int64_t row0, len;  // the example's first row of the [B*T] micro-batch, its tokens
  };
  std::vector<Segment> segments_;
  std::vector<int32_t> positions_;
  parts::AdapterDropout dropout_{};  // (its unit set per block)
  bool training_pass_ = false;       // inside forward_backward: adapters drop out
  // Attention over the packed rows, one example at a time (RoPE included);
  // Q is the saved q|k|v's and output's type (f32, or bf16 bits).
  void packed_attention_forward(float* out, float* lse, float* qkv);
  template <class Q>
  void packed_attention_backward(float* dqkv, const float* dout, const Q* qkv, const Q* out,
                                 const float* lse);
  float *lnf_ = nullptr, *lnf_mean_ = nullptr, *lnf_rstd_ = nullptr;  // [BT,C],[BT],[BT]
  float *logits_ = nullptr, *losses_ = nullptr;                       // [chunk,V], [BT]
  // bf16_activations: the head's GEMM operands rounded once: the final norm's
  // output (every row) [BT,C] and a chunk's logits gradient [chunk,V].
  uint16_t *lnf16_ = nullptr, *logits16_ = nullptr;
  float *dres_ = nullptr, *dlnf_ = nullptr, *dbuf_c_ = nullptr;       // [BT,C] each
  float *dqkv_ = nullptr, *dfch_ = nullptr;                           // [BT,QKV], [BT,FC]
  const float* out_ = nullptr;                                        // last stage_forward's output
  // Sequence parallel only (null otherwise): a whole [BT,C] tensor of the
  // group (partial sums before their reduce-scatter, an output gradient after
  // its all-gather), the all-gathered norm output [BT,C], an input
  // gradient's reduced rows [BT/sp,C].
  float *full_ = nullptr, *gathered_ = nullptr, *dchunk_ = nullptr;
  float* moe_work_ = nullptr;  // moe::Work of B·T rows (a mixture of experts)
  const float* emb_dout_ = nullptr;  // dL/d(embedding output) of every row [BT,C]
  // tp > 1: per row of a logits chunk, the maximum and (sum of exp, target logit).
  vocab::Pieces pieces_;       // the head's vocabulary pieces (one stage: tp = 1)
  vocab::Stats piece_stats_;   // their statistics over one chunk of rows
  std::vector<float> tree_scratch_;  // vocab::tree_sum's buffers, [height, chunk, C]
  std::vector<float> row_max_;
  std::vector<double> row_sums_;
  std::vector<float> row_logits_;  // forward_paged's `each`: a few rows' logits, at first use
};

}  // namespace po::model
