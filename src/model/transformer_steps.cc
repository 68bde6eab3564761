// The decoder's per-unit steps, forward and backward, and the schedules made
// of them: the one-stage forward_backward, evaluate, and a pipeline stage's
// stage_forward / stage_backward. Backward reads as forward reversed.
#include <algorithm>
#include <cstring>

#include "backend/device.h"
#include "backend/ops.h"
#include "core/error.h"
#include "model/transformer.h"

namespace po::model {

namespace {
// A training pass: adapters drop out (set_dropout) in here only. A
// pipeline stage's forward is one when it trains (grad_scale != 0, as
// stage_forward's callers pass it), its backward always.
struct TrainingPass {
  bool& on;
  TrainingPass(bool& flag, bool training) : on(flag) { on = training; }
  ~TrainingPass() { on = false; }
  TrainingPass(const TrainingPass&) = delete;
  TrainingPass& operator=(const TrainingPass&) = delete;
};
}  // namespace

namespace ops = po::backend::cpu;

const float* Transformer::gather_rows(const float* chunk, float* full, int64_t rows) {
  if (sp_ == 1) return chunk;
  pops_->tp_all_gather(chunk, full, rows / sp_ * config_.n_embd);
  return full;
}

void Transformer::reduce_rows(float* partial, float* out, int64_t rows) {
  if (sp_ == 1)
    pops_->tp_all_reduce(out, rows * config_.n_embd);
  else
    pops_->tp_reduce_scatter(partial, out, rows / sp_ * config_.n_embd);
}

// Megatron's block: column-parallel q|k|v and fc, row-parallel o_proj and
// down_proj, each pair closed by a reduction over the tensor group. With
// sequence parallel the norms and residual adds run on this rank's rows and
// the reductions are split in two around them (model/parallel_ops.h).
void Transformer::block_forward(const BlockWeights& P, const float* in, const LayerActs& a,
                                int64_t b, int64_t t, const LayerActs16* h) {
  const parts::Block& k = layout_.block();
  const int64_t C = config_.n_embd, BT = b * t, R = BT / sp_;
  const int64_t AO = k.attn.out.in;
  PO_ASSERT(sp_ == 1 || BT == B_ * T_, "sequence parallel runs whole micro-batches");
  PO_ASSERT(h == nullptr || sp_ == 1, "bf16 GEMM inputs are written directly at one sequence shard");
  // Row-parallel biases: added by tp rank 0 alone, so the group's sum holds them once.
  const bool bias_here = pops_->tp_rank() == 0;
  float* partial2 = sp_ > 1 ? full_ : a.residual2;
  float* partial3 = sp_ > 1 ? full_ : a.residual3;
  // With h, the norms' and the activation's outputs exist only in bf16.
  ops::Operand ln1, ln2, act;
  if (h != nullptr) {
    k.norm1.forward(h->ln1, a.ln1_mean, a.ln1_rstd, in, P.norm1, R);
    ln1 = ops::Operand(h->ln1);
  } else {
    k.norm1.forward(a.ln1, a.ln1_mean, a.ln1_rstd, in, P.norm1, R);
    ln1 = gather_rows(a.ln1, gathered_, BT);
  }
  k.attn.qkv.forward(a.qkv, ln1, P.qkv, BT);
  attention_forward(a, b, t);
  if (h != nullptr) ops::f32_to_bf16(h->atty, a.atty, BT * AO);  // saved, and the GEMM's operand
  k.attn.out.forward(partial2, {a.atty, h != nullptr ? h->atty : nullptr}, P.out, BT, bias_here);
  reduce_rows(partial2, a.residual2, BT);  // g: the row-parallel o_proj's partial sums
  ops::residual_forward(a.residual2, a.residual2, in, R * C);
  if (h != nullptr) {
    k.norm2.forward(h->ln2, a.ln2_mean, a.ln2_rstd, a.residual2, P.norm2, R);
    ln2 = ops::Operand(h->ln2);
  } else {
    k.norm2.forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.residual2, P.norm2, R);
    ln2 = gather_rows(a.ln2, gathered_, BT);
  }
  if (k.moe.on()) {  // (one sequence shard, f32: TransformerConfig::validate, shard)
    moe::forward(k.moe.shape, a.residual3, a.ln2, P.moe, BT, moe_saved(a), moe_work(), moe_losses());
    ops::residual_forward(a.residual3, a.residual3, a.residual2, R * C);
    return;
  }
  k.mlp.up.forward(a.fch, ln2, P.up, BT);
  if (h != nullptr) {
    k.mlp.act_forward(h->fch_gelu, a.fch, BT);
    act = ops::Operand(h->fch_gelu);
  } else {
    k.mlp.act_forward(a.fch_gelu, a.fch, BT);
    act = a.fch_gelu;
  }
  k.mlp.down.forward(partial3, act, P.down, BT, bias_here);
  reduce_rows(partial3, a.residual3, BT);  // g: the row-parallel down_proj's partial sums
  ops::residual_forward(a.residual3, a.residual3, a.residual2, R * C);
}

moe::Losses Transformer::moe_losses() const {
  const TransformerConfig::Moe& m = config_.moe;
  const double S = static_cast<double>(m.step_sequences > 0 ? m.step_sequences : B_);
  return {m.aux_loss, m.z_loss, 1.0 / S, 1.0 / (S * static_cast<double>(T_)), T_};
}

void Transformer::attention_forward(const LayerActs& a, int64_t b, int64_t t) {
  const parts::Attention& at = layout_.block().attn;
  const int64_t NH = at.n_head, NKV = at.n_kv_head, hs = at.head_dim;
  if (packed()) {
    PO_ASSERT(b == B_ && t == T_, "packed rows run whole micro-batches");
    return packed_attention_forward(a.atty, a.lse, a.qkv);
  }
  if (rope_cos_ != nullptr)  // q and k heads are the first NH + NKV of the row
    ops::rope_forward(a.qkv, b, t, at.qkv.out, at.rotated_heads(), hs, rope_cos_, rope_sin_);
  if (cp_.size > 1) {
    PO_ASSERT(b == B_ && t == T_, "context parallel runs whole micro-batches");
    pops_->cp_attention_forward(a.atty, a.lse, a.qkv, b, t, NH, NKV, hs);
  } else {
    ops::attention_forward(a.atty, a.lse, a.qkv, b, t, NH, NKV, hs);
  }
}

// dres holds dL/d(block output) on entry and dL/d(block input) on return
// (this rank's rows under sequence parallel). With `work`, the GEMMs' weight
// and bias gradients are left out and what they need is copied into it
// (block_backward_weight adds them). With tp_overlap, each column-parallel
// GEMM's input-gradient reduction runs under its weight-gradient GEMM, and
// under sequence parallel the re-gather of its input under the GEMMs before
// (Megatron's order); the bits are the same either way.
void Transformer::block_backward(const BlockWeights& P, const BlockGrads& G, ops::Operand in,
                                 const LayerActs& a, float* dres, WeightGradWork* work,
                                 const LayerActs16* h) {
  const parts::Block& k = layout_.block();
  const parts::Attention& at = k.attn;
  const int64_t C = config_.n_embd, NH = at.n_head, NKV = at.n_kv_head, hs = at.head_dim;
  const int64_t QKV = at.qkv.out, AO = at.out.in, FC = k.mlp.up.out, F = k.mlp.hidden;
  const int64_t BT = B_ * T_, R = BT / sp_;
  const bool split = work != nullptr;
  const bool overlap = tp_overlap_ && !split && tp_size() > 1;
  PO_ASSERT(h == nullptr || (sp_ == 1 && !split), "bf16 GEMM inputs are read directly at one ",
            "sequence shard in a fused backward");
  // With adapters the base is frozen and the adapters' gradients come with
  // the input gradient (Linear::backward computes both): the weight half
  // has nothing left to do.
  const bool defer = split && !layout_.adapters();
  auto keep = [&](float* dst, const float* src, int64_t n) {
    if (defer) backend::device_copy(dst, src, static_cast<size_t>(n) * sizeof(float));
  };
  // The weight gradients, unless the weight half computes them.
  auto w = [&](const parts::Linear::Grads& g) { return defer ? parts::Linear::Grads{} : g; };
  // d(activation output) [BT,F]: in place for GELU, beside d(fc) for SwiGLU
  float* dact = k.mlp.act == Mlp::kSwiGLU ? dfch_ + BT * FC : dfch_;
  // a norm's output gradient: the column-parallel GEMM's input gradient, reduced
  float* dnorm = sp_ > 1 ? dchunk_ : dbuf_c_;
  // A column-parallel GEMM's input for its weight gradient: this rank's norm
  // output, all-gathered again under sequence parallel (with overlap: issued
  // now, there by the tp_wait in column_backward).
  auto gemm_input = [&](const float* norm_out, const uint16_t* norm_out16) -> ops::Operand {
    if (norm_out16 != nullptr) return norm_out16;
    if (sp_ == 1 || !overlap) return gather_rows(norm_out, gathered_, BT);
    pops_->tp_all_gather_async(norm_out, gathered_, R * C);
    return gathered_;
  };
  // The column-parallel linear's input gradient, reduced over the group into
  // dnorm (f's conjugate), and its weight and bias gradients.
  auto column_backward = [&](const parts::Linear& lin, const float* dout, ops::Operand x,
                             const parts::Linear::Weights& p, const parts::Linear::Grads& g) {
    if (!overlap) {
      lin.backward(dbuf_c_, w(g), dout, x, p, BT);
      reduce_rows(dbuf_c_, dnorm, BT);
      return;
    }
    lin.backward(dbuf_c_, {}, dout, nullptr, p, BT);
    pops_->tp_wait();  // x, when gathered
    if (sp_ > 1)
      pops_->tp_reduce_scatter_async(dbuf_c_, dnorm, R * C);
    else
      pops_->tp_all_reduce_async(dbuf_c_, BT * C);
    lin.backward(nullptr, g, dout, x, {}, BT);
    pops_->tp_wait();
  };
  const float* dy = gather_rows(dres, full_, BT);  // g's conjugate: d(down_proj output)
  if (k.moe.on()) {
    PO_ASSERT(!split && h == nullptr && sp_ == 1, "moe: a fused f32 backward at one sequence shard");
    moe::backward(k.moe.shape, dnorm, G.moe, dy, a.ln2, P.moe, BT, moe_saved(a), moe_work(), moe_losses());
  } else {
    const ops::Operand ln2 = gemm_input(a.ln2, h != nullptr ? h->ln2 : nullptr);
    const ops::Operand act = h != nullptr ? ops::Operand(h->fch_gelu) : ops::Operand(a.fch_gelu);
    keep(split ? work->d_proj : nullptr, dy, BT * C);
    keep(split ? work->in_proj : nullptr, a.fch_gelu, BT * F);
    k.mlp.down.backward(dact, w(G.down), dy, act, P.down, BT);
    k.mlp.act_backward(dfch_, h != nullptr ? ops::Operand(h->fch) : ops::Operand(a.fch), dact, BT);
    keep(split ? work->d_fc : nullptr, dfch_, BT * FC);
    keep(split ? work->in_fc : nullptr, ln2.f32, BT * C);
    column_backward(k.mlp.up, dfch_, ln2, P.up, G.up);
  }
  k.norm2.backward(dres, G.norm2, dnorm,
                   h != nullptr ? ops::Operand(h->residual2) : ops::Operand(a.residual2), P.norm2,
                   a.ln2_mean, a.ln2_rstd, R);
  dy = gather_rows(dres, full_, BT);  // g's conjugate: d(o_proj output)
  const ops::Operand ln1 = gemm_input(a.ln1, h != nullptr ? h->ln1 : nullptr);
  keep(split ? work->d_out : nullptr, dy, BT * C);
  keep(split ? work->in_out : nullptr, a.atty, BT * AO);
  at.out.backward(dbuf_c_, w(G.out), dy, h != nullptr ? ops::Operand(h->atty) : ops::Operand(a.atty),
                  P.out, BT);
  const bool read16 = h != nullptr && attention_reads16();  // the saved bf16 q, k, v and output as they are
  if (packed() && read16)  // (RoPE's backward included)
    packed_attention_backward(dqkv_, dbuf_c_, h->qkv, h->atty, a.lse);
  else if (packed())
    packed_attention_backward(dqkv_, dbuf_c_, a.qkv, a.atty, a.lse);
  else if (read16)
    ops::attention_backward(dqkv_, dbuf_c_, h->qkv, h->atty, a.lse, B_, T_, NH, NKV, hs);
  else if (cp_.size > 1)
    pops_->cp_attention_backward(dqkv_, dbuf_c_, a.qkv, a.atty, a.lse, B_, T_, NH, NKV, hs);
  else
    ops::attention_backward(dqkv_, dbuf_c_, a.qkv, a.atty, a.lse, B_, T_, NH, NKV, hs);
  if (rope_cos_ != nullptr && !packed())
    ops::rope_backward(dqkv_, B_, T_, QKV, at.rotated_heads(), hs, rope_cos_, rope_sin_);
  keep(split ? work->d_qkv : nullptr, dqkv_, BT * QKV);
  keep(split ? work->in_qkv : nullptr, ln1.f32, BT * C);
  column_backward(at.qkv, dqkv_, ln1, P.qkv, G.qkv);
  k.norm1.backward(dres, G.norm1, dnorm, in, P.norm1, a.ln1_mean, a.ln1_rstd, R);
}

namespace {
// A block's deferred weight half: the output gradients and inputs of its four
// GEMMs, in WeightGradWork's order (floats).
std::array<int64_t, 8> weight_work_sizes(const TransformerConfig& c, int64_t BT) {
  const int64_t C = c.n_embd, AO = c.n_head * c.head_dim(), F = c.ffn_hidden;
  return {BT * C, BT * F, BT * c.fc_width(), BT * C, BT * C, BT * AO, BT * c.qkv_width(), BT * C};
}
}  // namespace

size_t Transformer::predicted_weight_grad_work_bytes(const TransformerConfig& config, int64_t B,
                                                     int64_t T, int64_t tp) {
  int64_t total = 0;
  for (int64_t n : weight_work_sizes(config.resolved().shard(tp), B * T)) total += n;
  return static_cast<size_t>(total) * sizeof(float);
}

WeightGradWork Transformer::make_weight_grad_work() const {
  const std::array<int64_t, 8> sizes = weight_work_sizes(config_, B_ * T_);
  int64_t total = 0;
  for (int64_t n : sizes) total += n;
  WeightGradWork w;
  w.storage = tensor::Storage(static_cast<size_t>(total) * sizeof(float));
  float* p = w.storage.f32();
  float** views[8] = {&w.d_proj, &w.in_proj, &w.d_fc, &w.in_fc,
                      &w.d_out,  &w.in_out,  &w.d_qkv, &w.in_qkv};
  for (int i = 0; i < 8; ++i) {
    *views[i] = p;
    p += sizes[static_cast<size_t>(i)];
  }
  return w;
}

void Transformer::block_backward_input(int layer, float* dres, WeightGradWork& work) {
  const int u = layer + 1;
  const BlockWeights P = block_weights(u);
  const BlockGrads G = block_grads(u);
  ops::Operand in;
  const LayerActs a = backward_acts(layer, P, in);
  block_backward(P, G, in, a, dres, &work);
  work.layer = layer;
  unit_done(u);
}

void Transformer::block_backward_weight(WeightGradWork& work) {
  PO_CHECK(work.layer >= 0, "block_backward_weight: no input half ran into this work");
  if (layout_.adapters()) {  // (the input half added the adapters' gradients)
    work.layer = -1;
    return;
  }
  const parts::Block& k = layout_.block();
  const int64_t BT = B_ * T_;
  const BlockGrads G = block_grads(work.layer + 1);
  k.mlp.down.backward(nullptr, G.down, work.d_proj, work.in_proj, {}, BT);
  k.mlp.up.backward(nullptr, G.up, work.d_fc, work.in_fc, {}, BT);
  k.attn.out.backward(nullptr, G.out, work.d_out, work.in_out, {}, BT);
  k.attn.qkv.backward(nullptr, G.qkv, work.d_qkv, work.in_qkv, {}, BT);
  work.layer = -1;
}

const float* Transformer::forward_blocks(const float* x0, int64_t b, int64_t t, bool save) {
  PO_CHECK(!config_.inference, "a model built for inference (TransformerConfig::inference) runs ",
           "forward_cached and forward_paged only, not a training or evaluation forward");
  const int64_t C = config_.n_embd, rows = b * t / sp_;
  const float* in = x0;
  for (int l = first_block(); l < end_block(); ++l) {
    const size_t i = static_cast<size_t>(l - first_block());
    LayerActs a = layers_[i];
    if (config_.bf16_activations) {
      a = config_.activation_checkpointing ? scratch_ : scratch_with_stats(l);
      a.residual3 = stream_[i % 2];
    } else if (config_.activation_checkpointing) {
      a = scratch_;
      a.residual3 = layers_[i].residual3;
    }
    const int u = l + 1;
    const LayerActs16* direct = direct16(l, save);
    claim_region(i);
    block_forward(block_weights(u), in, a, b, t, direct);
    unit_done(u);
    if (config_.bf16_activations && save) {
      const LayerActs16& h = layers16_[i];
      ops::f32_to_bf16(h.residual3, a.residual3, rows * C);
      if (!config_.activation_checkpointing)
        for (const SavedPair& s : saved_pairs(a, h))
          if (direct == nullptr || !written_direct(s, h)) ops::f32_to_bf16(s.h, s.f, s.numel);
    }
    in = a.residual3;
  }
  return in;
}

// The seven large tensors a block saves besides its output, f32 view and
// bf16 copy side by side, with their sizes (the norm and residual regions
// hold this rank's rows under sequence parallel, the rest every row).
std::array<Transformer::SavedPair, 7> Transformer::saved_pairs(const LayerActs& a,
                                                               const LayerActs16& h) const {
  const int64_t C = config_.n_embd, AO = config_.n_head * config_.head_dim();
  const int64_t BT = B_ * T_, R = BT / sp_;
  return {{{a.ln1, h.ln1, R * C},
           {a.qkv, h.qkv, BT * config_.qkv_width()},
           {a.atty, h.atty, BT * AO},
           {a.residual2, h.residual2, R * C},
           {a.ln2, h.ln2, R * C},
           {a.fch, h.fch, BT * config_.fc_width()},
           {a.fch_gelu, h.fch_gelu, BT * config_.ffn_hidden}}};
}

const Transformer::LayerActs16* Transformer::direct16(int64_t l, bool save) const {
  // Only where the GEMMs round their inputs anyway (an f32 GEMM reads the
  // forward's unrounded f32 values).
  if (!save || !config_.bf16_activations || config_.activation_checkpointing || sp_ > 1 ||
      ops::gemm_precision() != ops::GemmPrecision::kBF16)
    return nullptr;
  return &layers16_[static_cast<size_t>(l - first_block())];
}

// The saved tensors block_forward writes in bf16 itself under direct16: the
// norms' and the activation's outputs and the attention output.
bool Transformer::written_direct(const SavedPair& s, const LayerActs16& h) {
  return s.h == h.ln1 || s.h == h.ln2 || s.h == h.fch_gelu || s.h == h.atty;
}

const float* Transformer::block_input(int64_t l) {
  if (l == first_block() && holds(0)) return encoded_;
  if (l == first_block()) {  // a pipeline stage's input: block l - 1's output, kept in bf16 at pp = 1
    ops::bf16_round_f32(in_buf_, encoded_, B_ * T_ / sp_ * config_.n_embd);
    return in_buf_;
  }
  ops::bf16_to_f32(in_buf_, layers16_[static_cast<size_t>(l - 1 - first_block())].residual3,
                   B_ * T_ / sp_ * config_.n_embd);
  return in_buf_;
}

Transformer::LayerActs Transformer::scratch_with_stats(int64_t l) const {
  LayerActs a = scratch_;
  const LayerActs& stats = layer(l);
  a.ln1_mean = stats.ln1_mean;
  a.ln1_rstd = stats.ln1_rstd;
  a.lse = stats.lse;
  a.ln2_mean = stats.ln2_mean;
  a.ln2_rstd = stats.ln2_rstd;
  return a;
}

// Widens block l's saved bf16 tensors into the f32 scratch layer. Unless
// `widen_all`, the ones the backward reads in bf16 stay there: the norms' and
// the activation's outputs (bf16 GEMMs' operands), the second norm's input,
// the activation's input, and the attention's q, k, v and output (their
// backwards read bf16), but for context parallel's attention, which widens.
Transformer::LayerActs Transformer::load_saved(int64_t l, bool widen_all) {
  const LayerActs a = scratch_with_stats(l);
  const LayerActs16& h = layers16_[static_cast<size_t>(l - first_block())];
  for (const SavedPair& s : saved_pairs(a, h)) {
    const bool attention = s.h == h.qkv || s.h == h.atty;
    const bool read16 = s.h == h.ln1 || s.h == h.ln2 || s.h == h.fch_gelu || s.h == h.residual2 ||
                        s.h == h.fch || (attention && attention_reads16());
    if (widen_all || !read16) ops::bf16_to_f32(s.f, s.h, s.numel);
  }
  return a;
}

Transformer::LayerActs Transformer::backward_acts(int64_t l, const BlockWeights& P,
                                                  ops::Operand& in, const LayerActs16* h) {
  if (config_.bf16_activations) {
    // With h, the first norm's backward reads the previous block's saved
    // bf16 output as it is.
    if (h != nullptr && l > first_block())
      in = layers16_[static_cast<size_t>(l - 1 - first_block())].residual3;
    else
      in = block_input(l);
    if (!config_.activation_checkpointing) return load_saved(l, h == nullptr);
    LayerActs a = scratch_;
    a.residual3 = stream_[0];  // recomputed, unused by the backward
    block_forward(P, in.f32, a, B_, T_);
    return a;
  }
  in = l == first_block() ? encoded_ : layer(l - 1).residual3;
  if (!config_.activation_checkpointing) return layer(l);
  LayerActs a = scratch_;
  a.residual3 = layer(l).residual3;  // recompute rewrites the same values
  block_forward(P, in.f32, a, B_, T_);
  return a;
}

// The head's tensors inside unit 0's and the head unit's buffers (parameters
// or gradients): the head weight (the token table when tied) and the final
// norm's weight and bias (null for RMSNorm).
Transformer::HeadViews Transformer::head_views(float* unit0, float* head_unit) const {
  const int64_t hu0 = layout_.base_unit_offset(layout_.head_unit());
  const parts::Norm& norm = layout_.final_norm();
  return {layout_.tied() ? unit0 + layout_.head().offset : head_unit + (layout_.head().offset - hu0),
          head_unit + norm.weight, norm.bias < 0 ? nullptr : head_unit + norm.bias};
}

// The head's parameters in its order (unit 0 first when tied, then the head unit).
Transformer::HeadViews Transformer::head_params() {
  const int hu = layout_.head_unit();
  float* w0 = layout_.tied() ? base_of(0, unit_params(0)) : nullptr;
  return head_views(w0, base_of(hu, unit_params(hu)));
}

Transformer::HeadViews Transformer::head_params_lean(const uint16_t*& weight16) {
  const int hu = layout_.head_unit();
  UnitView v0 = layout_.tied() ? unit_params_lean(0) : UnitView{};
  UnitView vh = unit_params_lean(hu);
  if (layout_.adapters()) {  // the frozen head, in f32
    if (layout_.tied()) v0 = {base_of(0, nullptr), nullptr, false};
    vh = {base_of(hu, nullptr), nullptr, false};
  }
  HeadViews P = head_views(v0.f32, vh.f32);
  const UnitView& wv = layout_.tied() ? v0 : vh;
  weight16 = wv.bf16 == nullptr
                 ? nullptr
                 : wv.bf16 + (layout_.head().offset - layout_.base_unit_offset(layout_.tied() ? 0 : hu));
  if (wv.lean) P.weight = nullptr;  // not widened: bits only
  return P;
}

void Transformer::head_done() {
  unit_done(layout_.head_unit());
  if (layout_.tied()) unit_done(0);
}

// Final norm + head + loss over row chunks; with grad_scale != 0 also
// backward through head and final norm into dres_.
double Transformer::head_forward(const float* residual, const int32_t* targets, int64_t rows,
                                 float grad_scale) {
  const int64_t C = config_.n_embd, V = config_.vocab_size;
  const bool backward = grad_scale != 0.0f;
  const uint16_t* stored16 = nullptr;  // the head weight's stored bits (bf16 units)
  const HeadViews P = head_params_lean(stored16);
  HeadViews G{};
  if (backward && !layout_.adapters()) {  // (a frozen head has none)
    float* g0 = layout_.tied() ? unit_grads(0) : nullptr;
    G = head_views(g0, unit_grads(layout_.head_unit()));
  }
  const int64_t R = rows / sp_;  // the final norm's rows (this rank's under sequence parallel)
  claim_region(regions_.size() - 1);
  layout_.final_norm().forward(lnf_, lnf_mean_, lnf_rstd_, residual, {P.norm_w, P.norm_b}, R);
  const float* x = gather_rows(lnf_, gathered_, rows);
  // bf16: the head's operands are rounded once, not in every chunk's three
  // GEMMs (the same bits: a GEMM at kBF16 rounds them the same way), and the
  // loss writes its gradient in bf16.
  const bool bf16 = logits16_ != nullptr && ops::gemm_precision() == ops::GemmPrecision::kBF16;
  const uint16_t* w16 = stored16 != nullptr ? stored16 : bf16 ? head_weight16(P.weight) : nullptr;
  if (bf16) ops::f32_to_bf16(lnf16_, x, rows * C);
  const bool grad16 = bf16 && backward && tp_size() == 1;
  const ops::Operand w(P.weight, w16);
  for (int64_t r0 = 0; r0 < rows; r0 += head_chunk_) {
    const int64_t n = std::min(head_chunk_, rows - r0);
    const ops::Operand xin(x + r0 * C, bf16 ? lnf16_ + r0 * C : nullptr);
    if (tp_size() > 1) {
      ops::matmul_forward(logits_, xin, w, nullptr, n, C, V);
      vocab_parallel_loss(losses_ + r0, logits_, targets + r0, n, grad_scale);
      if (backward) ops::matmul_backward(dlnf_ + r0 * C, G.weight, nullptr, logits_, xin, w, n, C, V);
      continue;
    }
    // One stage: the vocabulary pieces one after another (vocab_head.h),
    // each piece's logits at n·begin(k) of the chunk's buffer.
    const int P = pieces_.count();
    for (int k = 0; k < P; ++k)
      vocab::piece_forward(pieces_, k, xin, w, targets + r0, n, C, logits_ + n * pieces_.begin(k),
                           piece_stats_, backward);
    vocab::combine(P, n, losses_ + r0, piece_stats_, targets + r0, grad_scale);
    if (!backward) continue;
    // The pieces' input-gradient parts added in the fixed tree.
    std::vector<float*> scratch;
    for (int h = 0; h < vocab::tree_height(P); ++h)
      scratch.push_back(tree_scratch_.data() + h * head_chunk_ * C);
    vocab::tree_sum(
        0, P, dlnf_ + r0 * C, n, C,
        [&](int k, float* dst) {
          vocab::piece_backward(pieces_, k, logits_ + n * pieces_.begin(k),
                                grad16 ? logits16_ + n * pieces_.begin(k) : nullptr, piece_stats_,
                                targets + r0, xin, w, G.weight, dst, false, n, C, grad_scale);
        },
        {}, scratch.data());
  }
  if (backward) {
    // f's conjugate for the vocabulary-parallel head: each rank's slice gave a part of dlnf.
    float* dnorm = sp_ > 1 ? dchunk_ : dlnf_;
    reduce_rows(dlnf_, dnorm, rows);
    backend::device_zero(dres_, static_cast<size_t>(R * C) * sizeof(float));
    layout_.final_norm().backward(
        dres_, {G.norm_w, G.norm_b}, dnorm, residual, {P.norm_w, P.norm_b}, lnf_mean_, lnf_rstd_, R);
  }
  head_done();
  double sum = 0;
  for (int64_t i = 0; i < rows; ++i) sum += losses_[i];
  return sum;
}

// The head weight rounded to bf16 once per head pass, where no stored bits
// are handed out (in a buffer of the calling thread, as the GEMM's own
// rounding would be).
const uint16_t* Transformer::head_weight16(const float* weight) {
  thread_local std::vector<uint16_t> w16;
  const int64_t n = layout_.head().numel();
  w16.resize(static_cast<size_t>(n));
  ops::f32_to_bf16(w16.data(), weight, n);
  return w16.data();
}

void Transformer::vocab_parallel_loss(float* losses, float* logits, const int32_t* targets,
                                      int64_t n, float grad_scale) {
  const int64_t V = config_.vocab_size, nv = layout_.vocab_real(), v0 = layout_.vocab_begin();
  ops::vocab_ce_max(row_max_.data(), logits, n, V, nv);
  pops_->tp_all_reduce_max(row_max_.data(), n);
  ops::vocab_ce_sums(row_sums_.data(), logits, targets, row_max_.data(), n, V, nv, v0,
                     grad_scale != 0.0f);
  pops_->tp_all_reduce(row_sums_.data(), 2 * n);
  ops::vocab_ce_finish(losses, logits, targets, row_max_.data(), row_sums_.data(), n, V, nv, v0,
                       grad_scale);
}

void Transformer::head_logits(const float* x, int64_t rows, float* logits) {
  PO_CHECK(tp_size() == 1, "generation runs one whole model (parallel.tp = 1), not a ",
           "tensor-parallel shard");
  const HeadViews P = head_params();
  claim_region(regions_.size() - 1);
  layout_.final_norm().forward(lnf_, lnf_mean_, lnf_rstd_, x, {P.norm_w, P.norm_b}, rows);
  ops::matmul_forward_decode(logits, lnf_, P.weight, nullptr, rows, config_.n_embd, config_.vocab_size);
  head_done();
}

float Transformer::forward_backward(const int32_t* inputs, const int32_t* targets,
                                    float grad_scale,
                                    const std::function<void(int unit)>& on_unit_ready) {
  PO_CHECK(whole(), "forward_backward runs a whole model; a stage (units ", first_, "..", last_,
           ") runs stage_forward / stage_backward");
  PO_CHECK(grad_scale != 0.0f, "forward_backward needs a non-zero grad_scale");
  const TrainingPass pass(training_pass_, true);
  auto ready = [&](int unit) {
    if (hooks_.grads_ready) hooks_.grads_ready(unit);
    if (on_unit_ready) on_unit_ready(unit);
  };
  const bool defer_lookup = defers_lookup();
  const int64_t BT = B_ * T_;
  double loss_sum = 0;
  const float* x = encoded_;
  for (const Step& s : layout_.training_steps()) {
    switch (s.kind) {
      case Step::kEmbedForward:
        embed_forward(inputs, B_, T_);
        break;
      case Step::kBlockForward:  // the consecutive block forwards run as one stretch
        if (s.layer == 0) x = forward_blocks(encoded_, B_, T_, true);
        break;
      case Step::kHead:
        loss_sum = head_forward(x, targets, BT, grad_scale);
        lend_region(regions_.size() - 1);  // (the last micro-batch's)
        ready(layout_.head_unit());
        if (defer_lookup) {  // all but this micro-batch's lookup rows
          fold_tied_lookup();
          ready(0);
        }
        break;
      case Step::kBlockBackward: {
        const int u = s.layer + 1;
        const BlockWeights P = block_weights(u);
        const BlockGrads G = block_grads(u);
        ops::Operand in;
        const LayerActs16* h = direct16(s.layer, true);
        const LayerActs a = backward_acts(s.layer, P, in, h);
        block_backward(P, G, in, a, dres_, nullptr, h);
        unit_done(u);
        lend_region(static_cast<size_t>(s.layer - first_block()));
        ready(u);
        break;
      }
      case Step::kEmbedBackward:
        embed_backward(inputs, defer_lookup);
        if (!defer_lookup) {  // a tied table also collected the head's gradient
          fold_tied_lookup();
          ready(0);
        }
        break;
    }
  }
  return static_cast<float>(loss_sum / static_cast<double>(BT));
}

float Transformer::evaluate(const int32_t* inputs, const int32_t* targets) {
  PO_CHECK(whole(), "evaluate runs a whole model");
  embed_forward(inputs, B_, T_);
  const float* out = forward_blocks(encoded_, B_, T_, false);
  const double loss_sum = head_forward(out, targets, B_ * T_, 0.0f);
  return static_cast<float>(loss_sum / static_cast<double>(B_ * T_));
}

double Transformer::stage_forward(const int32_t* tokens, const float* x_in,
                                  const int32_t* targets, float grad_scale, HeadPart head) {
  PO_CHECK(head == HeadPart::kWhole || (tp_size() == 1 && sp_ == 1),
           "the head spread over pipeline ranks needs tp = 1");
  const TrainingPass pass(training_pass_, grad_scale != 0.0f);
  norm_only_ = head == HeadPart::kNormOnly;
  const int64_t BT = B_ * T_;
  if (holds(0)) {
    embed_forward(tokens, B_, T_);
  } else {
    PO_CHECK(x_in != nullptr, "stage_forward: a stage after the first needs its input activations");
    backend::device_copy(encoded_, x_in, static_cast<size_t>(BT / sp_ * config_.n_embd) * sizeof(float));
  }
  out_ = forward_blocks(encoded_, B_, T_, true);
  if (!has_head()) return 0.0;
  if (norm_only_) {
    final_norm_forward(out_);
    return 0.0;
  }
  PO_CHECK(head_logits_, "stage_forward: this model's head has no logits (made for an external head)");
  const double loss = head_forward(out_, targets, BT, grad_scale);
  if (grad_scale != 0.0f) lend_region(regions_.size() - 1);  // (the lender takes the last micro-batch's)
  return loss;
}

// The final norm's parameters or gradients: the head unit's (never the table's).
void Transformer::final_norm_forward(const float* residual) {
  const int hu = layout_.head_unit();
  const parts::Norm& norm = layout_.final_norm();
  const float* p = base_of(hu, unit_params(hu));
  claim_region(regions_.size() - 1);
  norm.forward(lnf_, lnf_mean_, lnf_rstd_, residual, norm.weights(p), B_ * T_);
  unit_done(hu);
}

void Transformer::final_norm_backward(const float* dlnf) {
  const int hu = layout_.head_unit();
  const parts::Norm& norm = layout_.final_norm();
  const float* p = base_of(hu, unit_params(hu));
  float* g = layout_.adapters() ? nullptr : unit_grads(hu);
  backend::device_zero(dres_, static_cast<size_t>(B_ * T_ * config_.n_embd) * sizeof(float));
  norm.backward(dres_, norm.grads(g), dlnf, out_, norm.weights(p), lnf_mean_, lnf_rstd_, B_ * T_);
  unit_done(hu);
}

const float* Transformer::stage_backward(const int32_t* tokens, const float* d_out,
                                         const std::function<void(int unit)>& on_unit_ready,
                                         std::vector<WeightGradWork>* deferred, HeadPart head) {
  const TrainingPass pass(training_pass_, true);
  auto ready = [&](int unit) {
    if (hooks_.grads_ready) hooks_.grads_ready(unit);
    if (on_unit_ready) on_unit_ready(unit);
  };
  const bool defer_lookup = defers_lookup();
  if (has_head()) {
    if (head == HeadPart::kNormOnly) {
      PO_CHECK(d_out != nullptr, "stage_backward: the head's input gradient is missing");
      final_norm_backward(d_out);
    }
    ready(layout_.head_unit());
    if (defer_lookup) {  // all but this micro-batch's lookup rows (as forward_backward)
      fold_tied_lookup();
      ready(0);
    }
  } else {
    PO_CHECK(d_out != nullptr, "stage_backward: a stage before the last needs its output gradient");
    backend::device_copy(dres_, d_out, static_cast<size_t>(B_ * T_ / sp_ * config_.n_embd) * sizeof(float));
  }
  if (deferred != nullptr) {
    PO_CHECK(deferred->size() == static_cast<size_t>(end_block() - first_block()),
             "stage_backward: ", deferred->size(), " weight-gradient works for ",
             end_block() - first_block(), " blocks");
  }
  for (int l = end_block() - 1; l >= first_block(); --l) {
    const int u = l + 1;
    if (deferred != nullptr) {  // the input half; ready once its weight half has run
      block_backward_input(l, dres_, (*deferred)[static_cast<size_t>(l - first_block())]);
      continue;
    }
    const BlockWeights P = block_weights(u);
    const BlockGrads G = block_grads(u);
    ops::Operand in;
    const LayerActs16* h = direct16(l, true);
    const LayerActs a = backward_acts(l, P, in, h);
    block_backward(P, G, in, a, dres_, nullptr, h);
    unit_done(u);
    lend_region(static_cast<size_t>(l - first_block()));
    ready(u);
  }
  if (holds(0)) {
    embed_backward(tokens, defer_lookup);
    if (!defer_lookup || !has_head()) {
      fold_tied_lookup();
      ready(0);
    }
  }
  return dres_;
}

void Transformer::stage_backward_weight(std::vector<WeightGradWork>& works) {
  for (size_t i = works.size(); i-- > 0;) block_backward_weight(works[i]);
}

void Transformer::next_token_logits(const int32_t* tokens, int64_t t_len, float* logits) {
  PO_CHECK(whole(), "next_token_logits runs a whole model");
  PO_CHECK(t_len >= 1 && t_len <= T_, "context of ", t_len, " tokens exceeds the model's ", T_);
  embed_forward(tokens, 1, t_len);
  const float* out = forward_blocks(encoded_, 1, t_len, false);
  head_logits(out + (t_len - 1) * config_.n_embd, 1, logits);
}

}  // namespace po::model
