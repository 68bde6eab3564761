// GPT-2 with explicit forward and backward, llm.c style.
//
// Shape legend: B micro-batch, T sequence, C channels, V vocab, L layers, NH heads.
//
// Parameters live in flat per-unit buffers: unit 0 = embeddings (wte, wpe),
// units 1..L = transformer blocks, unit L+1 = final LayerNorm. All units are
// consecutive in one allocation, gradients likewise with the same offsets, so
// a ZeRO shard or a page is a contiguous slice of one unit.
//
// Rules: parameter gradients accumulate (+=) across micro-batches until
// zero_grads(); activation gradients are written. Every read of parameters and
// every write of parameter gradients goes through one unit's base pointer
// (UnitHooks), with offsets relative to unit_offset(unit), so a unit's
// parameters need to exist only while that unit computes (ZeRO-3). The LM head (tied to wte) and
// the loss run fused in row chunks so that the [BT, V] logits are never held
// whole: each chunk's logits are turned into their gradient in place at once.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/gpt2_config.h"
#include "tensor/tensor.h"

namespace po::model {

// One named parameter tensor inside the flat buffer.
struct ParamInfo {
  std::string name;     // Hugging Face GPT-2 name, e.g. "h.0.attn.c_attn.weight"
  tensor::Shape shape;  // engine layout ([out, in] for linear weights)
  int64_t offset = 0;   // elements from the start of the flat buffer
  int unit = 0;         // 0 embeddings, 1..L blocks, L+1 final LayerNorm
  bool decay = false;   // weight decay applies (tensors with >= 2 dims)
  bool conv1d = false;  // stored transposed ([in, out]) in Hugging Face files
  int64_t numel() const { return tensor::shape_numel(shape); }
};

// How the model reaches each unit's parameters and gradients. Empty (the
// default): its own flat buffers. ZeRO-3 installs hooks that all-gather a
// unit's parameters just before use and reduce its gradient once final. One
// forward_backward asks, in this order (L = n_layer):
//   params(0)  embedding forward           done(0)
//   params(l)  block l forward             done(l)        l = 1..L
//   params(0), params(L+1), grads(0), grads(L+1)  head + loss + head backward
//              done(L+1), done(0), grads_ready(L+1)
//   params(l), grads(l)  block l [recompute and] backward
//              done(l), grads_ready(l)                     l = L..1
//   grads(0)   embedding backward          grads_ready(0)
// evaluate() asks for the forward part of the same order (up to the head's
// params(0), params(L+1)), and so does next_token_logits(). params(u) is
// called once per use and its pointer is not kept past done(u).
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
  bool empty() const { return !params && !done && !grads && !grads_ready; }
};

class GPT2 {
 public:
  // Allocates parameters, gradients and activations for micro-batch B at sequence T.
  GPT2(const GPT2Config& config, int64_t B, int64_t T);

  const GPT2Config& config() const { return config_; }
  int64_t batch() const { return B_; }
  int64_t seq_len() const { return T_; }
  int64_t seq() const { return T_; }

  // The flat parameter and gradient buffers [num_params()]: only while the
  // model holds them (throws after release_params() / release_grads()).
  float* params();
  const float* params() const;
  float* grads();
  int64_t num_params() const { return num_params_; }
  const std::vector<ParamInfo>& param_infos() const { return infos_; }
  const ParamInfo& param(const std::string& name) const;
  int num_units() const { return static_cast<int>(unit_offsets_.size()) - 1; }
  int64_t unit_offset(int u) const { return unit_offsets_[u]; }
  int64_t unit_numel(int u) const { return unit_offsets_[u + 1] - unit_offsets_[u]; }

  // GPT-2 initialisation from a counter-based RNG: N(0, 0.02), residual
  // projections N(0, 0.02/sqrt(2L)), biases 0, LayerNorm weights 1.
  // Element i of tensor k is a function of (seed, k, i) only.
  void init_random(uint64_t seed);
  // The same values for unit u alone, into `unit` (unit_numel(u) floats).
  void init_random_unit(uint64_t seed, int u, float* unit) const;
  // Zeroes grads(); does nothing once they are released (the hooks' owner
  // then keeps the gradients).
  void zero_grads();

  // Routes every parameter and gradient access through `hooks` (all four
  // set), or back to the model's own buffers (all empty).
  void set_unit_hooks(UnitHooks hooks);
  // Frees the flat parameter / gradient buffers, for a caller whose hooks keep
  // the state elsewhere (ZeRO-3 keeps only shards). Irreversible.
  void release_params();
  void release_grads();
  // Bytes of flat parameters / gradients the model holds now (0 once released).
  size_t params_bytes() const { return params_.size(); }
  size_t grads_bytes() const { return grads_.size(); }

  // One micro-batch: forward, loss, backward. inputs/targets [B,T].
  // Gradients of grad_scale * sum(per-token losses) accumulate into grads().
  // Returns the mean loss over the B*T tokens.
  // `on_unit_ready`, when given, is called with each unit's index as soon as
  // that unit's gradients are final for this micro-batch (final LayerNorm,
  // blocks L..1, then embeddings), so their reduction can overlap the rest of
  // the backward.
  //
  // `defer_embedding` (for data parallel): the tied wte's gradient gets two
  // kinds of contributions, the dense LM-head one (final right after the head,
  // at the START of the backward) and the sparse embedding-lookup one (at the
  // end, only the B*T rows of the batch's tokens). With it set, unit 0 is
  // reported ready right after the head, holding everything but this
  // micro-batch's lookup rows, and the lookup gradient is left in
  // embedding_output_grad() ([B*T, C]) for the caller to add with
  // ops::embedding_backward once unit 0 is reduced: so the largest tensor's
  // reduction overlaps the whole backward instead of none of it. With
  // gradient hooks, grads_ready(0) comes right after the head and the lookup
  // rows never reach grads(0).
  float forward_backward(const int32_t* inputs, const int32_t* targets, float grad_scale,
                         const std::function<void(int unit)>& on_unit_ready = {},
                         bool defer_embedding = false);
  // The gradient w.r.t. the embedding output of the last forward_backward with
  // defer_embedding ([B*T, C]); valid until the next forward.
  const float* embedding_output_grad() const { return dres_; }
  // Mean loss over [B,T] without touching gradients.
  float evaluate(const int32_t* inputs, const int32_t* targets);
  // Logits [V] at position t_len-1 of a single sequence tokens[t_len], t_len <= T.
  void next_token_logits(const int32_t* tokens, int64_t t_len, float* logits);

  // Bytes of activations and scratch this model holds (for the memory ledger).
  size_t activation_bytes() const { return acts_.size(); }
  // Bytes the model would hold: params + grads + activations (no optimizer).
  static size_t predicted_bytes(const GPT2Config& config, int64_t B, int64_t T);
  // Bytes of activations and scratch alone (what activation_bytes() will be).
  static size_t predicted_activation_bytes(const GPT2Config& config, int64_t B, int64_t T);
  // The part of those that is the head's: one chunk of logits [rows, V] and
  // the per-token losses [B·T].
  static size_t predicted_logits_bytes(const GPT2Config& config, int64_t B, int64_t T);

 private:
  struct LayerActs {
    float *ln1, *ln1_mean, *ln1_rstd, *qkv, *atty, *lse, *residual2;
    float *ln2, *ln2_mean, *ln2_rstd, *fch, *fch_gelu, *residual3;
  };
  // bf16_activations: the bf16 copies of a layer's large saved tensors (its
  // LayerActs keeps only the f32 statistics: means, rstds, lse). With
  // activation checkpointing only residual3 (the block output) is kept.
  struct LayerActs16 {
    uint16_t *ln1, *qkv, *atty, *residual2, *ln2, *fch, *fch_gelu, *residual3;
  };
  struct SavedPair {
    float* f;
    uint16_t* h;
    int64_t width;
  };
  static std::array<SavedPair, 7> saved_pairs(const LayerActs& a, const LayerActs16& h);
  struct BlockParams {
    float *ln1w, *ln1b, *qkvw, *qkvb, *attprojw, *attprojb;
    float *ln2w, *ln2b, *fcw, *fcb, *fcprojw, *fcprojb;
  };

  void build_layout();
  // Every activation view, as laid out in one allocation.
  struct ActivationLayout {
    float* encoded = nullptr;
    std::vector<LayerActs> layers;
    std::vector<LayerActs16> layers16;
    float* stream[2] = {nullptr, nullptr};  // bf16_activations: f32 block outputs, alternating
    float* in_buf = nullptr;                // bf16_activations: a widened block input
    LayerActs scratch{};
    float *lnf = nullptr, *lnf_mean = nullptr, *lnf_rstd = nullptr, *logits = nullptr;
    float *losses = nullptr, *dres = nullptr, *dlnf = nullptr, *dbuf_c = nullptr;
    float *dqkv = nullptr, *dfch = nullptr;
  };
  // Lays out the activations of `config` at (B, T) from `base` (null: count
  // only, the views stay null) and returns the floats needed. The constructor
  // and predicted_bytes() both use it, so the ledger cannot drift.
  static size_t layout_activations(const GPT2Config& config, int64_t B, int64_t T, float* base,
                                   ActivationLayout& out);
  // Views into unit `layer`+1's buffer `unit_base` (parameters or gradients).
  BlockParams block_params(float* unit_base, int64_t layer) const;
  // Offset of tensor `p` inside its unit.
  int64_t unit_relative(const ParamInfo& p) const { return p.offset - unit_offset(p.unit); }
  // Unit u's parameters / gradient accumulator: through the hooks or the flat buffers.
  float* unit_params(int u);
  void unit_done(int u);
  float* unit_grads(int u);
  // Forward of one block at batch shape (b, t) with parameters P: reads `in`, writes a.
  void block_forward(const BlockParams& P, const float* in, const LayerActs& a, int64_t b,
                     int64_t t);
  void block_backward(const BlockParams& P, const BlockParams& G, const float* in,
                      const LayerActs& a, float* dres);
  // Forward through the blocks at (b, t); returns the last block's output.
  // `save`: keep what the backward needs (bf16_activations: round it into
  // layers16_; otherwise the f32 activations are kept anyway).
  const float* forward_blocks(const int32_t* inputs, int64_t b, int64_t t, bool save);
  // bf16_activations: block l's saved tensors widened into scratch_ (its
  // statistics from layers_[l]), and its f32 input.
  LayerActs load_saved(int64_t l);
  // bf16_activations: the f32 scratch layer with block l's saved statistics.
  LayerActs scratch_with_stats(int64_t l) const;
  const float* block_input(int64_t l);
  // Final LayerNorm + tied head + loss over row chunks; with grad_scale != 0
  // also backward through head and final LayerNorm into dres_.
  double head_forward(const float* residual, const int32_t* targets, int64_t rows,
                      float grad_scale);

  GPT2Config config_;
  int64_t B_, T_;
  int64_t num_params_ = 0;
  int64_t head_chunk_ = 0;  // rows of logits processed at once
  std::vector<ParamInfo> infos_;
  std::vector<int64_t> unit_offsets_;
  mutable tensor::Storage params_, grads_;  // allocated at first use
  tensor::Storage acts_;
  bool params_released_ = false, grads_released_ = false;
  UnitHooks hooks_;

  // Activation views (into acts_).
  float* encoded_ = nullptr;  // [BT,C]
  std::vector<LayerActs> layers_;
  std::vector<LayerActs16> layers16_;
  float* stream_[2] = {nullptr, nullptr};
  float* in_buf_ = nullptr;
  LayerActs scratch_{};  // recompute target with activation checkpointing
  float *lnf_ = nullptr, *lnf_mean_ = nullptr, *lnf_rstd_ = nullptr;  // [BT,C],[BT],[BT]
  float *logits_ = nullptr, *losses_ = nullptr;                       // [chunk,V], [BT]
  float *dres_ = nullptr, *dlnf_ = nullptr, *dbuf_c_ = nullptr;       // [BT,C] each
  float *dqkv_ = nullptr, *dfch_ = nullptr;                           // [BT,3C], [BT,4C]
};

}  // namespace po::model
