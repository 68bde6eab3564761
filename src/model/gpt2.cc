#include "model/gpt2.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "backend/ops.h"
#include "core/error.h"
#include "core/rng.h"

namespace po::model {
namespace ops = po::backend::cpu;
namespace {

constexpr int64_t kAlign = 16;  // floats: 64-byte aligned views
int64_t align_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Rows of logits per LM-head chunk: large enough for efficient GEMM, small
// enough that [chunk, V] stays a fraction of the activations.
constexpr int64_t kHeadChunkRows = 256;
int64_t head_chunk_rows(int64_t B, int64_t T) { return std::min<int64_t>(kHeadChunkRows, B * T); }

}  // namespace

GPT2::GPT2(const GPT2Config& config, int64_t B, int64_t T) : config_(config), B_(B), T_(T) {
  config_.validate();
  PO_CHECK(B >= 1, "micro-batch size must be >= 1, got ", B);
  PO_CHECK(T >= 1 && T <= config_.seq_len, "sequence length ", T, " must be in [1, model.seq_len = ",
           config_.seq_len, "]");
  build_layout();
  head_chunk_ = head_chunk_rows(B_, T_);
  ActivationLayout v;
  acts_ = tensor::Storage(layout_activations(config_, B_, T_, nullptr, v) * sizeof(float));
  layout_activations(config_, B_, T_, acts_.f32(), v);
  encoded_ = v.encoded;
  layers_ = std::move(v.layers);
  layers16_ = std::move(v.layers16);
  stream_[0] = v.stream[0];
  stream_[1] = v.stream[1];
  in_buf_ = v.in_buf;
  scratch_ = v.scratch;
  lnf_ = v.lnf;
  lnf_mean_ = v.lnf_mean;
  lnf_rstd_ = v.lnf_rstd;
  logits_ = v.logits;
  losses_ = v.losses;
  dres_ = v.dres;
  dlnf_ = v.dlnf;
  dbuf_c_ = v.dbuf_c;
  dqkv_ = v.dqkv;
  dfch_ = v.dfch;
}

void GPT2::build_layout() {
  const int64_t C = config_.n_embd, V = config_.vocab_size, L = config_.n_layer;
  int64_t offset = 0;
  auto add = [&](const std::string& name, tensor::Shape shape, int unit, bool conv1d) {
    ParamInfo p;
    p.name = name;
    p.shape = std::move(shape);
    p.offset = offset;
    p.unit = unit;
    p.decay = p.shape.size() >= 2;
    p.conv1d = conv1d;
    offset += p.numel();
    infos_.push_back(std::move(p));
  };
  unit_offsets_.push_back(0);
  add("wte.weight", {V, C}, 0, false);
  add("wpe.weight", {config_.seq_len, C}, 0, false);
  for (int64_t l = 0; l < L; ++l) {
    unit_offsets_.push_back(offset);
    const std::string h = "h." + std::to_string(l) + ".";
    const int u = static_cast<int>(l + 1);
    add(h + "ln_1.weight", {C}, u, false);
    add(h + "ln_1.bias", {C}, u, false);
    add(h + "attn.c_attn.weight", {3 * C, C}, u, true);
    add(h + "attn.c_attn.bias", {3 * C}, u, false);
    add(h + "attn.c_proj.weight", {C, C}, u, true);
    add(h + "attn.c_proj.bias", {C}, u, false);
    add(h + "ln_2.weight", {C}, u, false);
    add(h + "ln_2.bias", {C}, u, false);
    add(h + "mlp.c_fc.weight", {4 * C, C}, u, true);
    add(h + "mlp.c_fc.bias", {4 * C}, u, false);
    add(h + "mlp.c_proj.weight", {C, 4 * C}, u, true);
    add(h + "mlp.c_proj.bias", {C}, u, false);
  }
  unit_offsets_.push_back(offset);
  add("ln_f.weight", {C}, static_cast<int>(L + 1), false);
  add("ln_f.bias", {C}, static_cast<int>(L + 1), false);
  unit_offsets_.push_back(offset);
  num_params_ = offset;
  PO_ASSERT(num_params_ == config_.num_params(), "layout and formula disagree: ", num_params_,
            " vs ", config_.num_params());
  const std::vector<int64_t> units = config_.unit_numels();
  for (int u = 0; u < num_units(); ++u)
    PO_ASSERT(unit_numel(u) == units[static_cast<size_t>(u)], "unit ", u, ": layout ",
              unit_numel(u), " elements, GPT2Config::unit_numels ", units[static_cast<size_t>(u)]);
}

size_t GPT2::layout_activations(const GPT2Config& config, int64_t B, int64_t T, float* base,
                                ActivationLayout& out) {
  const int64_t C = config.n_embd, NH = config.n_head, V = config.vocab_size;
  const int64_t BT = B * T;
  int64_t used = 0;
  auto take = [&](int64_t n) -> float* {
    float* p = base ? base + used : nullptr;
    used += align_up(n);
    return p;
  };
  auto take16 = [&](int64_t n) -> uint16_t* {  // n bf16 values
    return reinterpret_cast<uint16_t*>(take((n + 1) / 2));
  };
  auto full_layer = [&](LayerActs& a, bool with_residual3) {
    a.ln1 = take(BT * C);
    a.ln1_mean = take(BT);
    a.ln1_rstd = take(BT);
    a.qkv = take(BT * 3 * C);
    a.atty = take(BT * C);
    a.lse = take(B * NH * T);
    a.residual2 = take(BT * C);
    a.ln2 = take(BT * C);
    a.ln2_mean = take(BT);
    a.ln2_rstd = take(BT);
    a.fch = take(BT * 4 * C);
    a.fch_gelu = take(BT * 4 * C);
    a.residual3 = with_residual3 ? take(BT * C) : nullptr;
  };
  out.encoded = take(BT * C);
  out.layers.assign(config.n_layer, LayerActs{});
  out.layers16.assign(config.bf16_activations ? config.n_layer : 0, LayerActs16{});
  out.scratch = LayerActs{};
  if (config.bf16_activations) {
    // Saved in bf16, computed in the f32 scratch layer; the block outputs
    // (the residual stream) run on in f32 through two alternating buffers.
    for (int64_t l = 0; l < config.n_layer; ++l) {
      LayerActs16& h = out.layers16[static_cast<size_t>(l)];
      LayerActs& a = out.layers[static_cast<size_t>(l)];
      h = LayerActs16{};
      h.residual3 = take16(BT * C);
      if (config.activation_checkpointing) continue;
      h.ln1 = take16(BT * C);
      h.qkv = take16(BT * 3 * C);
      h.atty = take16(BT * C);
      h.residual2 = take16(BT * C);
      h.ln2 = take16(BT * C);
      h.fch = take16(BT * 4 * C);
      h.fch_gelu = take16(BT * 4 * C);
      a.ln1_mean = take(BT);
      a.ln1_rstd = take(BT);
      a.lse = take(B * NH * T);
      a.ln2_mean = take(BT);
      a.ln2_rstd = take(BT);
    }
    full_layer(out.scratch, false);
    out.stream[0] = take(BT * C);
    out.stream[1] = take(BT * C);
    out.in_buf = take(BT * C);
  } else {
    for (auto& a : out.layers) {
      if (config.activation_checkpointing)
        a.residual3 = take(BT * C);  // only the block outputs (= next block's inputs) stay
      else
        full_layer(a, true);
    }
    if (config.activation_checkpointing) full_layer(out.scratch, false);
  }
  out.lnf = take(BT * C);
  out.lnf_mean = take(BT);
  out.lnf_rstd = take(BT);
  out.logits = take(head_chunk_rows(B, T) * V);
  out.losses = take(BT);
  out.dres = take(BT * C);
  out.dlnf = take(BT * C);
  out.dbuf_c = take(BT * C);
  out.dqkv = take(BT * 3 * C);
  out.dfch = take(BT * 4 * C);
  return static_cast<size_t>(used);
}

size_t GPT2::predicted_activation_bytes(const GPT2Config& config, int64_t B, int64_t T) {
  config.validate();
  ActivationLayout counted;
  return layout_activations(config, B, T, nullptr, counted) * sizeof(float);
}

size_t GPT2::predicted_logits_bytes(const GPT2Config& config, int64_t B, int64_t T) {
  return static_cast<size_t>(head_chunk_rows(B, T) * config.vocab_size + B * T) * sizeof(float);
}

size_t GPT2::predicted_bytes(const GPT2Config& config, int64_t B, int64_t T) {
  return predicted_activation_bytes(config, B, T) +
         2 * static_cast<size_t>(config.num_params()) * sizeof(float);
}

const ParamInfo& GPT2::param(const std::string& name) const {
  for (const auto& p : infos_)
    if (p.name == name) return p;
  PO_THROW(core::InvalidArgument, "no parameter named '", name, "'");
}

GPT2::BlockParams GPT2::block_params(float* unit_base, int64_t layer) const {
  // Block tensors are laid out in build_layout() order, 12 per block after the 2 embeddings.
  const ParamInfo* p = &infos_[2 + 12 * layer];
  auto at = [&](int i) { return unit_base + unit_relative(p[i]); };
  return {at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7), at(8), at(9), at(10), at(11)};
}

// The flat buffers are allocated at first use: a model whose state lives
// elsewhere (ZeRO-3 initialised unit by unit, hooks) never holds them whole.
float* GPT2::params() {
  PO_ASSERT(!params_released_, "GPT2::params(): the flat parameters were released ",
            "(ZeRO-3 keeps only shards)");
  if (params_.data() == nullptr)
    params_ = tensor::Storage(static_cast<size_t>(num_params_) * sizeof(float));
  return params_.f32();
}

const float* GPT2::params() const { return const_cast<GPT2*>(this)->params(); }

float* GPT2::grads() {
  PO_ASSERT(!grads_released_, "GPT2::grads(): the flat gradients were released ",
            "(ZeRO-3 keeps only shards)");
  if (grads_.data() == nullptr)
    grads_ = tensor::Storage(static_cast<size_t>(num_params_) * sizeof(float));
  return grads_.f32();
}

void GPT2::set_unit_hooks(UnitHooks hooks) {
  PO_ASSERT(hooks.empty() || (hooks.params && hooks.done && hooks.grads && hooks.grads_ready),
           "GPT2::set_unit_hooks: give all four hooks (params, done, grads, grads_ready) or none");
  hooks_ = std::move(hooks);
}

void GPT2::release_params() {
  params_ = tensor::Storage();
  params_released_ = true;
}

void GPT2::release_grads() {
  grads_ = tensor::Storage();
  grads_released_ = true;
}

float* GPT2::unit_params(int u) {
  return hooks_.params ? hooks_.params(u) : params() + unit_offset(u);
}

void GPT2::unit_done(int u) {
  if (hooks_.done) hooks_.done(u);
}

float* GPT2::unit_grads(int u) { return hooks_.grads ? hooks_.grads(u) : grads() + unit_offset(u); }

void GPT2::init_random(uint64_t seed) {
  float* w = params();
  for (int u = 0; u < num_units(); ++u) init_random_unit(seed, u, w + unit_offset(u));
}

void GPT2::init_random_unit(uint64_t seed, int u, float* unit) const {
  const double proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config_.n_layer));
  for (size_t k = 0; k < infos_.size(); ++k) {
    const ParamInfo& p = infos_[k];
    if (p.unit != u) continue;
    float* dst = unit + unit_relative(p);
    const int64_t n = p.numel();
    const bool is_ln_weight = p.name.find("ln_") != std::string::npos &&
                              p.name.ends_with(".weight");
    if (p.shape.size() == 1) {
      std::fill(dst, dst + n, is_ln_weight ? 1.0f : 0.0f);
      continue;
    }
    const bool residual_proj = p.name.ends_with("c_proj.weight");
    const float std = static_cast<float>(residual_proj ? proj_std : 0.02);
    core::Philox rng(seed, k);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) dst[i] = std * rng.normal(static_cast<uint64_t>(i));
  }
}

void GPT2::zero_grads() {
  if (grads_.data() != nullptr) std::memset(grads_.data(), 0, grads_.size());
}

void GPT2::block_forward(const BlockParams& P, const float* in, const LayerActs& a, int64_t b,
                         int64_t t) {
  const int64_t C = config_.n_embd, NH = config_.n_head, BT = b * t;
  ops::layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, in, P.ln1w, P.ln1b, BT, C);
  ops::matmul_forward(a.qkv, a.ln1, P.qkvw, P.qkvb, BT, C, 3 * C);
  ops::attention_forward(a.atty, a.lse, a.qkv, b, t, C, NH);
  ops::matmul_forward(a.residual2, a.atty, P.attprojw, P.attprojb, BT, C, C);
  ops::residual_forward(a.residual2, a.residual2, in, BT * C);
  ops::layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.residual2, P.ln2w, P.ln2b, BT, C);
  ops::matmul_forward(a.fch, a.ln2, P.fcw, P.fcb, BT, C, 4 * C);
  ops::gelu_forward(a.fch_gelu, a.fch, BT * 4 * C);
  ops::matmul_forward(a.residual3, a.fch_gelu, P.fcprojw, P.fcprojb, BT, 4 * C, C);
  ops::residual_forward(a.residual3, a.residual3, a.residual2, BT * C);
}

// dres holds dL/d(block output) on entry and dL/d(block input) on return.
void GPT2::block_backward(const BlockParams& P, const BlockParams& G, const float* in,
                          const LayerActs& a, float* dres) {
  const int64_t C = config_.n_embd, NH = config_.n_head, BT = B_ * T_;
  ops::matmul_backward(dfch_, G.fcprojw, G.fcprojb, dres, a.fch_gelu, P.fcprojw, BT, 4 * C, C);
  ops::gelu_backward(dfch_, a.fch, dfch_, BT * 4 * C);
  ops::matmul_backward(dbuf_c_, G.fcw, G.fcb, dfch_, a.ln2, P.fcw, BT, C, 4 * C);
  ops::layernorm_backward(dres, G.ln2w, G.ln2b, dbuf_c_, a.residual2, P.ln2w, a.ln2_mean,
                          a.ln2_rstd, BT, C);
  ops::matmul_backward(dbuf_c_, G.attprojw, G.attprojb, dres, a.atty, P.attprojw, BT, C, C);
  ops::attention_backward(dqkv_, dbuf_c_, a.qkv, a.atty, a.lse, B_, T_, C, NH);
  ops::matmul_backward(dbuf_c_, G.qkvw, G.qkvb, dqkv_, a.ln1, P.qkvw, BT, C, 3 * C);
  ops::layernorm_backward(dres, G.ln1w, G.ln1b, dbuf_c_, in, P.ln1w, a.ln1_mean, a.ln1_rstd,
                          BT, C);
}

const float* GPT2::forward_blocks(const int32_t* inputs, int64_t b, int64_t t, bool save) {
  const int64_t C = config_.n_embd, bt = b * t;
  const float* w = unit_params(0);
  ops::embedding_forward(encoded_, inputs, w + unit_relative(infos_[0]),
                         w + unit_relative(infos_[1]), b, t, C);
  unit_done(0);
  const float* in = encoded_;
  for (int64_t l = 0; l < config_.n_layer; ++l) {
    LayerActs a = layers_[l];
    if (config_.bf16_activations) {
      a = config_.activation_checkpointing ? scratch_ : scratch_with_stats(l);
      a.residual3 = stream_[l % 2];
    } else if (config_.activation_checkpointing) {
      a = scratch_;
      a.residual3 = layers_[l].residual3;
    }
    const int u = static_cast<int>(l + 1);
    block_forward(block_params(unit_params(u), l), in, a, b, t);
    unit_done(u);
    if (config_.bf16_activations && save) {
      const LayerActs16& h = layers16_[l];
      ops::f32_to_bf16(h.residual3, a.residual3, bt * C);
      if (!config_.activation_checkpointing)
        for (const SavedPair& s : saved_pairs(a, h)) ops::f32_to_bf16(s.h, s.f, bt * C * s.width);
    }
    in = a.residual3;
  }
  return in;
}

// The seven large tensors a block saves besides its output, f32 view and
// bf16 copy side by side, with their width in units of [B·T, C].
std::array<GPT2::SavedPair, 7> GPT2::saved_pairs(const LayerActs& a, const LayerActs16& h) {
  return {{{a.ln1, h.ln1, 1}, {a.qkv, h.qkv, 3}, {a.atty, h.atty, 1}, {a.residual2, h.residual2, 1},
           {a.ln2, h.ln2, 1}, {a.fch, h.fch, 4}, {a.fch_gelu, h.fch_gelu, 4}}};
}

const float* GPT2::block_input(int64_t l) {
  if (l == 0) return encoded_;
  ops::bf16_to_f32(in_buf_, layers16_[l - 1].residual3, B_ * T_ * config_.n_embd);
  return in_buf_;
}

GPT2::LayerActs GPT2::scratch_with_stats(int64_t l) const {
  LayerActs a = scratch_;
  const LayerActs& stats = layers_[l];
  a.ln1_mean = stats.ln1_mean;
  a.ln1_rstd = stats.ln1_rstd;
  a.lse = stats.lse;
  a.ln2_mean = stats.ln2_mean;
  a.ln2_rstd = stats.ln2_rstd;
  return a;
}

GPT2::LayerActs GPT2::load_saved(int64_t l) {
  const int64_t C = config_.n_embd, BT = B_ * T_;
  const LayerActs a = scratch_with_stats(l);
  for (const SavedPair& s : saved_pairs(a, layers16_[l])) ops::bf16_to_f32(s.f, s.h, BT * C * s.width);
  return a;
}

double GPT2::head_forward(const float* residual, const int32_t* targets, int64_t rows,
                          float grad_scale) {
  const int64_t C = config_.n_embd, V = config_.vocab_size;
  const int uf = static_cast<int>(config_.n_layer + 1);  // final LayerNorm's unit
  const ParamInfo& lnfw = infos_[infos_.size() - 2];
  const ParamInfo& lnfb = infos_[infos_.size() - 1];
  const bool backward = grad_scale != 0.0f;
  const float* wte = unit_params(0) + unit_relative(infos_[0]);
  const float* pf = unit_params(uf);
  float* dwte = backward ? unit_grads(0) + unit_relative(infos_[0]) : nullptr;
  float* gf = backward ? unit_grads(uf) : nullptr;
  ops::layernorm_forward(lnf_, lnf_mean_, lnf_rstd_, residual, pf + unit_relative(lnfw),
                         pf + unit_relative(lnfb), rows, C);
  for (int64_t r0 = 0; r0 < rows; r0 += head_chunk_) {
    const int64_t n = std::min(head_chunk_, rows - r0);
    ops::matmul_forward(logits_, lnf_ + r0 * C, wte, nullptr, n, C, V);
    ops::crossentropy_forward(losses_ + r0, logits_, targets + r0, n, V, grad_scale);
    if (backward)
      ops::matmul_backward(dlnf_ + r0 * C, dwte, nullptr, logits_, lnf_ + r0 * C, wte, n, C, V);
  }
  if (backward) {
    std::memset(dres_, 0, static_cast<size_t>(rows * C) * sizeof(float));
    ops::layernorm_backward(dres_, gf + unit_relative(lnfw), gf + unit_relative(lnfb), dlnf_,
                            residual, pf + unit_relative(lnfw), lnf_mean_, lnf_rstd_, rows, C);
  }
  unit_done(uf);
  unit_done(0);
  double sum = 0;
  for (int64_t i = 0; i < rows; ++i) sum += losses_[i];
  return sum;
}

float GPT2::forward_backward(const int32_t* inputs, const int32_t* targets, float grad_scale,
                             const std::function<void(int unit)>& on_unit_ready,
                             bool defer_embedding) {
  auto ready = [&](int unit) {
    if (hooks_.grads_ready) hooks_.grads_ready(unit);
    if (on_unit_ready) on_unit_ready(unit);
  };
  PO_CHECK(grad_scale != 0.0f, "forward_backward needs a non-zero grad_scale");
  const int64_t BT = B_ * T_;
  const float* out = forward_blocks(inputs, B_, T_, true);
  const double loss_sum = head_forward(out, targets, BT, grad_scale);
  ready(static_cast<int>(config_.n_layer + 1));  // final LayerNorm
  if (defer_embedding) ready(0);  // all but this micro-batch's lookup rows
  for (int64_t l = config_.n_layer - 1; l >= 0; --l) {
    const int u = static_cast<int>(l + 1);
    const BlockParams P = block_params(unit_params(u), l);
    const BlockParams G = block_params(unit_grads(u), l);
    if (config_.bf16_activations) {
      const float* in = block_input(l);
      if (config_.activation_checkpointing) {
        LayerActs a = scratch_;
        a.residual3 = stream_[0];  // recomputed, unused by the backward
        block_forward(P, in, a, B_, T_);
        block_backward(P, G, in, a, dres_);
      } else {
        block_backward(P, G, in, load_saved(l), dres_);
      }
      unit_done(u);
      ready(u);
      continue;
    }
    const float* in = l == 0 ? encoded_ : layers_[l - 1].residual3;
    if (config_.activation_checkpointing) {
      LayerActs a = scratch_;
      a.residual3 = layers_[l].residual3;  // recompute rewrites the same values
      block_forward(P, in, a, B_, T_);
      block_backward(P, G, in, a, dres_);
    } else {
      block_backward(P, G, in, layers_[l], dres_);
    }
    unit_done(u);
    ready(u);
  }
  if (!defer_embedding) {
    float* g0 = unit_grads(0);
    ops::embedding_backward(g0 + unit_relative(infos_[0]), g0 + unit_relative(infos_[1]), dres_,
                            inputs, B_, T_, config_.n_embd);
    ready(0);  // wte also collected the tied head's gradient
  }
  return static_cast<float>(loss_sum / static_cast<double>(BT));
}

float GPT2::evaluate(const int32_t* inputs, const int32_t* targets) {
  const float* out = forward_blocks(inputs, B_, T_, false);
  const double loss_sum = head_forward(out, targets, B_ * T_, 0.0f);
  return static_cast<float>(loss_sum / static_cast<double>(B_ * T_));
}

void GPT2::next_token_logits(const int32_t* tokens, int64_t t_len, float* logits) {
  PO_CHECK(t_len >= 1 && t_len <= T_, "context of ", t_len, " tokens exceeds the model's ", T_);
  const int64_t C = config_.n_embd, V = config_.vocab_size;
  const float* out = forward_blocks(tokens, 1, t_len, false);
  const int uf = static_cast<int>(config_.n_layer + 1);
  const ParamInfo& lnfw = infos_[infos_.size() - 2];
  const ParamInfo& lnfb = infos_[infos_.size() - 1];
  const float* last = out + (t_len - 1) * C;
  const float* wte = unit_params(0) + unit_relative(infos_[0]);  // the head's order: 0, then L+1
  const float* pf = unit_params(uf);
  ops::layernorm_forward(lnf_, lnf_mean_, lnf_rstd_, last, pf + unit_relative(lnfw),
                         pf + unit_relative(lnfb), 1, C);
  ops::matmul_forward(logits, lnf_, wte, nullptr, 1, C, V);
  unit_done(uf);
  unit_done(0);
}

}  // namespace po::model
