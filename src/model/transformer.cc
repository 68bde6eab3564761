// The decoder's buffers: construction, the activation layout (one allocation,
// the same function sizes the ledger), parameters and gradients of the held
// units, hooks and initialisation. The math is in transformer_steps.cc, the
// cached generation path in transformer_decode.cc, a fine-tune's frozen base
// in transformer_base.cc.
#include "model/transformer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/device.h"
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

// Ranks the norm and residual regions are split over (sequence parallel).
int64_t seq_shards_of(const TransformerConfig& config, int64_t tp) {
  return config.sequence_parallel ? tp : 1;
}

// What a model over `range` (a pipeline stage) holds of n_layer blocks: its
// blocks, and whether the head unit is in it.
struct StageSpan {
  int64_t blocks;
  bool head;
};
StageSpan span_of(int64_t n_layer, UnitRange range) {
  const int head = static_cast<int>(n_layer) + 1;
  const int last = range.last < 0 ? head : range.last;
  return {std::min(last, head - 1) - (std::max(range.first, 1) - 1), last == head};
}

}  // namespace

int64_t Transformer::head_chunk_rows(int64_t B, int64_t T) {
  return std::min<int64_t>(kHeadChunkRows, B * T);
}

Transformer::Transformer(const TransformerConfig& config, int64_t B, int64_t T, UnitRange range,
                         TensorSplit split, bool head_logits)
    : global_config_(config.resolved()),
      config_(global_config_.shard(split.size)),
      layout_(global_config_, split),
      B_(B),
      T_(T) {
  PO_CHECK(B >= 1, "micro-batch size must be >= 1, got ", B);
  PO_CHECK(T >= 1 && T <= config_.seq_len, "sequence length ", T, " must be in [1, model.seq_len = ",
           config_.seq_len, "]");
  first_ = range.first;
  last_ = range.last < 0 ? layout_.head_unit() : range.last;
  PO_CHECK(first_ >= 0 && first_ <= last_ && last_ <= layout_.head_unit(), "unit range [", first_,
           ", ", last_, "] is not inside the model's units [0, ", layout_.head_unit(), "]");
  num_params_ = layout_.unit_offset(last_ + 1) - layout_.unit_offset(first_);
  head_chunk_ = head_chunk_rows(B_, T_);
  if (split.size == 1) {
    pieces_ = vocab::pieces_of(config_.vocab_size);
    piece_stats_.resize(pieces_.count(), head_chunk_);
    if (last_ == layout_.head_unit())
      tree_scratch_.resize(static_cast<size_t>(vocab::tree_height(pieces_.count()) * head_chunk_ *
                                               config_.n_embd));
  }
  if (split.size > 1) {
    row_max_.resize(static_cast<size_t>(head_chunk_));
    row_sums_.resize(2 * static_cast<size_t>(head_chunk_));
  }
  sp_ = seq_shards_of(global_config_, split.size);
  PO_CHECK(B * T % sp_ == 0, "parallel.sequence_parallel splits the micro-batch's ", B * T,
           " tokens (train.micro_batch_size × model.seq_len = ", B, " × ", T,
           ") over parallel.tp = ", sp_, " ranks, which must divide them");
  ActivationLayout v;
  const int64_t n_blocks = end_block() - first_block();
  // At least 4096-aligned (2 MiB from 2 MiB up), so the pages lent out of
  // it are where predicted_activation_regions says (an O_DIRECT frame starts
  // on a 4096 boundary).
  head_logits_ = head_logits;
  const size_t act_bytes =
      layout_activations(config_, B_, T_, sp_, n_blocks, has_head(), nullptr, v, head_logits) * sizeof(float);
  acts_ = tensor::Storage(act_bytes, tensor::Pool::kCompute, act_bytes >= (size_t{2} << 20) ? 0 : 4096);
  layout_activations(config_, B_, T_, sp_, n_blocks, has_head(), acts_.f32(), v, head_logits);
  for (const auto& [b, e] : v.regions)
    regions_.push_back({reinterpret_cast<char*>(acts_.f32() + b),
                        static_cast<size_t>(e - b) * sizeof(float)});
  lent_.assign(regions_.size(), false);
  encoded_ = v.encoded;
  layers_ = std::move(v.layers);
  layers16_ = std::move(v.layers16);
  stream_[0] = v.stream[0];
  stream_[1] = v.stream[1];
  in_buf_ = v.in_buf;
  scratch_ = v.scratch;
  rope_cos_ = v.rope_cos;
  rope_sin_ = v.rope_sin;
  lnf_ = v.lnf;
  lnf_mean_ = v.lnf_mean;
  lnf_rstd_ = v.lnf_rstd;
  logits_ = v.logits;
  lnf16_ = v.lnf16;
  logits16_ = v.logits16;
  losses_ = v.losses;
  dres_ = v.dres;
  dlnf_ = v.dlnf;
  dbuf_c_ = v.dbuf_c;
  dqkv_ = v.dqkv;
  dfch_ = v.dfch;
  moe_work_ = v.moe_work;
  full_ = v.full;
  gathered_ = v.gathered;
  dchunk_ = v.dchunk;
  emb_dout_ = dres_;
  build_rope_tables();
}

void Transformer::build_rope_tables() {
  if (rope_cos_ == nullptr) return;
  ops::RopeScaling rs;
  rs.theta = config_.rope_theta;
  rs.factor = config_.rope_scaling.factor;
  rs.low_freq_factor = config_.rope_scaling.low_freq_factor;
  rs.high_freq_factor = config_.rope_scaling.high_freq_factor;
  rs.original_max_position = config_.rope_scaling.original_max_position;
  const int64_t half = config_.head_dim() / 2, n = cp_.local_chunks(), S = T_ / n;
  for (int64_t i = 0; i < n; i++)
    ops::rope_table(rope_cos_ + i * S * half, rope_sin_ + i * S * half, S, config_.head_dim(), rs,
                    cp_.chunk(static_cast<int>(i)) * S);
}

void Transformer::set_parallel_ops(ParallelOps& ops) {
  pops_ = &ops;
  const ContextSplit cp = ops.cp_split();
  if (cp.size == cp_.size && cp.rank == cp_.rank && cp.zigzag == cp_.zigzag) return;
  PO_CHECK(T_ % cp.local_chunks() == 0 && T_ * cp.size <= global_config_.seq_len, "context parallel: ",
           cp.size, " ranks hold ", T_, " rows each of a sequence of model.seq_len = ",
           global_config_.seq_len, ", which must split into ", cp.total_chunks(), " equal chunks");
  cp_ = cp;
  build_rope_tables();
}

void Transformer::set_activation_lender(ActivationLender lender) {
  claim_regions();
  lender_ = std::move(lender);
}

std::vector<std::pair<size_t, size_t>> Transformer::predicted_activation_regions(
    const TransformerConfig& config, int64_t B, int64_t T, int64_t tp) {
  const TransformerConfig local = config.shard(tp);
  ActivationLayout counted;
  layout_activations(local, B, T, seq_shards_of(config, tp), local.n_layer, true, nullptr, counted);
  std::vector<std::pair<size_t, size_t>> out;
  for (const auto& [b, e] : counted.regions)
    out.push_back({static_cast<size_t>(b) * sizeof(float), static_cast<size_t>(e - b) * sizeof(float)});
  return out;
}

void Transformer::lend_region(size_t r) {
  if (!lender_.lend || r >= regions_.size() || lent_[r]) return;
  lent_[r] = lender_.lend(static_cast<int>(r), regions_[r].first, regions_[r].second);
}

void Transformer::claim_region(size_t r) {
  if (r >= lent_.size() || !lent_[r]) return;
  lent_[r] = false;
  lender_.claim(static_cast<int>(r));
}

void Transformer::claim_regions() {
  for (size_t r = 0; r < lent_.size(); ++r) claim_region(r);
}

size_t Transformer::layout_activations(const TransformerConfig& unresolved, int64_t B, int64_t T,
                                       int64_t seq_shards, int64_t n_blocks, bool with_head,
                                       float* base, ActivationLayout& out_layout, bool head_logits) {
  const TransformerConfig config = unresolved.resolved();
  ActivationLayout& out = out_layout;
  const int64_t C = config.n_embd, NH = config.n_head, V = config.vocab_size;
  const int64_t QKV = config.qkv_width(), AO = NH * config.head_dim();
  const int64_t FC = config.fc_width(), F = config.ffn_hidden;
  const bool ln = config.norm == Norm::kLayerNorm;
  const int64_t BT = B * T;
  const int64_t R = BT / seq_shards;  // rows of the norm and residual regions
  int64_t used = 0;
  auto take = [&](int64_t n) -> float* {
    float* p = base ? base + used : nullptr;
    used += align_up(n);
    return p;
  };
  auto take16 = [&](int64_t n) -> uint16_t* {  // n bf16 values
    return reinterpret_cast<uint16_t*>(take((n + 1) / 2));
  };
  auto stats = [&](LayerActs& a) {
    a.ln1_mean = ln ? take(R) : nullptr;
    a.ln1_rstd = take(R);
  };
  auto stats2 = [&](LayerActs& a) {
    a.ln2_mean = ln ? take(R) : nullptr;
    a.ln2_rstd = take(R);
  };
  auto full_layer = [&](LayerActs& a, bool with_residual3) {
    a.ln1 = take(R * C);
    stats(a);
    a.qkv = take(BT * QKV);
    a.atty = take(BT * AO);
    a.lse = take(B * NH * T);
    a.residual2 = take(R * C);
    a.ln2 = take(R * C);
    stats2(a);
    if (config.moe.on()) {  // the mixture's saved tensors and chosen experts in fch and fch_gelu (moe_saved)
      const moe::Shape s = moe_shape(config);
      a.fch = take(moe::Saved::floats(s, BT));
      a.fch_gelu = take(moe::Saved::ints(s, BT));
    } else {
      a.fch = take(BT * FC);
      a.fch_gelu = take(BT * F);
    }
    a.residual3 = with_residual3 ? take(R * C) : nullptr;
  };
  auto rope_tables = [&] {
    if (config.positions != Positions::kRope) return;
    out.rope_cos = take(T * config.head_dim() / 2);
    out.rope_sin = take(T * config.head_dim() / 2);
  };
  auto head_norm = [&] {  // opens the head's region
    out.regions.push_back({used, 0});
    out.lnf = take(R * C);
    out.lnf_mean = ln ? take(R) : nullptr;
    out.lnf_rstd = take(R);
  };
  out.encoded = take(R * C);
  out.layers.assign(static_cast<size_t>(n_blocks), LayerActs{});
  if (config.inference) {  // decode_blocks: one block's tensors, two residual buffers, the head's norm
    out.layers16.clear();
    out.scratch = LayerActs{};
    out.regions.clear();
    full_layer(out.scratch, false);
    rope_tables();
    if (with_head) {
      head_norm();
      out.regions.back().second = used;
    }
    out.dres = take(R * C);
    return static_cast<size_t>(used);
  }
  out.layers16.assign(config.bf16_activations ? static_cast<size_t>(n_blocks) : 0, LayerActs16{});
  out.scratch = LayerActs{};
  out.regions.clear();
  if (config.bf16_activations) {
    // Saved in bf16, computed in the f32 scratch layer; the block outputs
    // (the residual stream) run on in f32 through two alternating buffers.
    for (int64_t l = 0; l < n_blocks; ++l) {
      LayerActs16& h = out.layers16[static_cast<size_t>(l)];
      LayerActs& a = out.layers[static_cast<size_t>(l)];
      h = LayerActs16{};
      out.regions.push_back({used, 0});
      h.residual3 = take16(R * C);
      out.regions.back().second = used;
      if (config.activation_checkpointing) continue;
      h.ln1 = take16(R * C);
      h.qkv = take16(BT * QKV);
      h.atty = take16(BT * AO);
      h.residual2 = take16(R * C);
      h.ln2 = take16(R * C);
      h.fch = take16(BT * FC);
      h.fch_gelu = take16(BT * F);
      stats(a);
      a.lse = take(B * NH * T);
      stats2(a);
      out.regions.back().second = used;
    }
    full_layer(out.scratch, false);
    out.stream[0] = take(R * C);
    out.stream[1] = take(R * C);
    out.in_buf = take(R * C);
  } else {
    for (auto& a : out.layers) {
      out.regions.push_back({used, 0});
      if (config.activation_checkpointing)
        a.residual3 = take(R * C);  // only the block outputs (= next block's inputs) stay
      else
        full_layer(a, true);
      out.regions.back().second = used;
    }
    if (config.activation_checkpointing) full_layer(out.scratch, false);
  }
  rope_tables();
  if (with_head) {
    head_norm();
    if (head_logits) {
      out.logits = take(head_chunk_rows(B, T) * V);
      out.losses = take(BT);
    }
    out.dlnf = take(BT * C);
    if (config.bf16_activations) {
      out.lnf16 = take16(BT * C);
      if (head_logits) out.logits16 = take16(head_chunk_rows(B, T) * V);
    }
    out.regions.back().second = used;
  }
  out.dres = take(R * C);
  out.dbuf_c = take(BT * std::max(C, AO));
  out.dqkv = take(BT * QKV);
  // SwiGLU: d(activation output) [BT,F] beside d(fc) [BT,2F]; GELU runs in place.
  out.dfch = take(BT * FC + (config.mlp == Mlp::kSwiGLU ? BT * F : 0));
  if (config.moe.on()) out.moe_work = take(moe::Work::floats(moe_shape(config), BT));
  if (seq_shards > 1) {
    out.full = take(BT * C);
    out.gathered = take(BT * C);
    out.dchunk = take(R * C);
  }
  return static_cast<size_t>(used);
}

size_t Transformer::predicted_activation_bytes(const TransformerConfig& config, int64_t B,
                                               int64_t T, int64_t tp) {
  const TransformerConfig local = config.shard(tp);
  ActivationLayout counted;
  return layout_activations(local, B, T, seq_shards_of(config, tp), local.n_layer, true, nullptr,
                            counted) *
         sizeof(float);
}

size_t Transformer::predicted_stage_activation_bytes(const TransformerConfig& config, int64_t B,
                                                     int64_t T, int64_t tp, UnitRange range,
                                                     bool head_logits) {
  const TransformerConfig local = config.shard(tp);
  const StageSpan span = span_of(local.n_layer, range);
  ActivationLayout counted;
  return layout_activations(local, B, T, seq_shards_of(config, tp), span.blocks, span.head, nullptr,
                            counted, head_logits) *
         sizeof(float);
}

std::vector<Transformer::CollectiveItem> Transformer::predicted_tp_collectives(
    const TransformerConfig& config, int64_t B, int64_t T, int64_t tp, UnitRange range) {
  if (tp == 1) return {};
  const TransformerConfig c = config.resolved();
  const StageSpan span = span_of(c.n_layer, range);
  const auto blocks = static_cast<uint64_t>(span.blocks);
  const uint64_t emb = range.first == 0 ? 1 : 0, top = span.head ? 1 : 0;
  const uint64_t recompute = c.activation_checkpointing ? 2 * blocks : 0;
  const int64_t rows = B * T;
  const double act = 4.0 * static_cast<double>(rows * c.n_embd);  // one [B·T, C] f32
  using C = Collective;
  std::vector<CollectiveItem> out;
  const uint64_t reductions = 4 * blocks + emb + top + recompute;
  if (seq_shards_of(c, tp) > 1) {
    const uint64_t gathers = 6 * blocks + emb + top + recompute;
    out.push_back({C::kReduceScatter, "row-parallel outputs, column-parallel input gradients", reductions,
                   static_cast<double>(reductions) * act});
    out.push_back({C::kAllGather, "norm outputs, output gradients", gathers, static_cast<double>(gathers) * act});
  } else {
    out.push_back({C::kAllReduce, "row-parallel outputs, column-parallel input gradients", reductions,
                   static_cast<double>(reductions) * act});
  }
  if (top == 1) {
    const int64_t chunk = head_chunk_rows(B, T);
    const auto chunks = static_cast<uint64_t>((rows + chunk - 1) / chunk);
    out.push_back({C::kAllReduce, "vocabulary-parallel loss: row maxima", chunks, 4.0 * static_cast<double>(rows)});
    out.push_back({C::kAllGather, "vocabulary-parallel loss: sums of exponentials, target logits", chunks,
                   16.0 * static_cast<double>(rows * tp)});
  }
  return out;
}

size_t Transformer::predicted_layer_bytes(const TransformerConfig& config, int64_t B, int64_t T,
                                          int64_t tp) {
  const TransformerConfig local = config.shard(tp);
  const int64_t S = seq_shards_of(config, tp);
  ActivationLayout counted;
  return (layout_activations(local, B, T, S, 1, false, nullptr, counted) -
          layout_activations(local, B, T, S, 0, false, nullptr, counted)) *
         sizeof(float);
}

size_t Transformer::predicted_logits_bytes(const TransformerConfig& config, int64_t B, int64_t T,
                                           int64_t tp) {
  return static_cast<size_t>(head_chunk_rows(B, T) * config.shard(tp).vocab_size + B * T) *
         sizeof(float);
}

size_t Transformer::predicted_lookup_bytes(const TransformerConfig& config, int64_t tp) {
  const Layout held(config, {static_cast<int>(tp), 0});
  return held.tied() ? static_cast<size_t>(held.token_embedding().numel()) * sizeof(float) : 0;
}

size_t Transformer::predicted_bytes(const TransformerConfig& config, int64_t B, int64_t T,
                                    int64_t tp) {
  const Layout held(config, {static_cast<int>(tp), 0});
  return predicted_activation_bytes(config, B, T, tp) +
         2 * static_cast<size_t>(held.num_params()) * sizeof(float) +
         predicted_lookup_bytes(config, tp);
}

void Transformer::set_dropout(uint64_t seed, int64_t step, int64_t first_sequence) {
  dropout_.on = config_.lora.dropout > 0.0;
  dropout_.seed = seed;
  dropout_.step = static_cast<uint32_t>(step);
  dropout_.row0 = first_sequence * T_;
}

Transformer::BlockWeights Transformer::block_weights(int u) {
  const UnitView v = unit_params_lean(u);
  if (layout_.adapters()) {  // the frozen base in f32, the adapters in the unit
    BlockWeights P = layout_.block().weights(base_of(u, nullptr), nullptr, false, v.f32);
    attach_quant(P, u);
    if (training_pass_ && dropout_.on) {
      parts::AdapterDropout d = dropout_;
      d.unit = static_cast<uint32_t>(u);
      for (parts::Linear::Weights* w : {&P.qkv, &P.out, &P.up, &P.down}) w->drop = d;
    }
    return P;
  }
  return layout_.block().weights(v.f32, v.bf16, v.bf16 != nullptr && v.lean);
}

// The flat buffers are allocated at first use: a model whose state lives
// elsewhere (ZeRO-3 initialised unit by unit, hooks) never holds them whole.
float* Transformer::params() {
  PO_ASSERT(!params_released_, "Transformer::params(): the flat parameters were released ",
            "(ZeRO-3 keeps only shards)");
  if (params_.data() == nullptr)
    params_ = tensor::Storage(static_cast<size_t>(num_params_) * sizeof(float));
  return params_.f32();
}

const float* Transformer::params() const { return const_cast<Transformer*>(this)->params(); }

float* Transformer::grads() {
  PO_ASSERT(!grads_released_, "Transformer::grads(): the flat gradients were released ",
            "(ZeRO-3 keeps only shards)");
  if (grads_.data() == nullptr)
    grads_ = tensor::Storage(static_cast<size_t>(num_params_) * sizeof(float));
  return grads_.f32();
}

void Transformer::set_unit_hooks(UnitHooks hooks) {
  PO_ASSERT(hooks.empty() || (hooks.params && hooks.done && hooks.grads && hooks.grads_ready),
           "Transformer::set_unit_hooks: give all four hooks (params, done, grads, grads_ready) or none");
  PO_ASSERT(!hooks.defers_lookup == !hooks.deferred_lookup,
            "Transformer::set_unit_hooks: defers_lookup and deferred_lookup go together");
  hooks_ = std::move(hooks);
}

void Transformer::release_params() {
  params_ = tensor::Storage();
  params_released_ = true;
}

void Transformer::release_grads() {
  grads_ = tensor::Storage();
  grads_released_ = true;
}

// A stage with the tied head but not the embedding reads the token table of
// unit 0 through its hooks (pipeline parallel's replica of it).
float* Transformer::unit_params(int u) {
  PO_ASSERT(holds(u) || (u == 0 && has_head() && layout_.tied()), "unit ", u,
            " is not held by this model (units ", first_, "..", last_, ")");
  PO_CHECK(holds(u) || hooks_.params, "a stage holding the tied head without the embedding ",
           "(units ", first_, "..", last_, ") reaches unit 0's token table through UnitHooks");
  return hooks_.params ? hooks_.params(u) : params() + unit_offset(u);
}

Transformer::UnitView Transformer::unit_params_lean(int u) {
  UnitView v;
  v.lean = hooks_.params_lean && hooks_.params_bf16 &&
           ops::gemm_precision() == ops::GemmPrecision::kBF16;
  v.f32 = v.lean ? hooks_.params_lean(u) : unit_params(u);
  v.bf16 = hooks_.params_bf16 ? hooks_.params_bf16(u) : nullptr;
  if (v.bf16 == nullptr) v.lean = false;  // the hooks widened every value
  return v;
}

void Transformer::unit_done(int u) {
  if (hooks_.done) hooks_.done(u);
}

float* Transformer::unit_grads(int u) {
  PO_ASSERT(holds(u) || (u == 0 && has_head() && layout_.tied()), "unit ", u,
            " is not held by this model (units ", first_, "..", last_, ")");
  PO_CHECK(holds(u) || hooks_.grads, "a stage holding the tied head without the embedding ",
           "(units ", first_, "..", last_, ") reaches unit 0's token table through UnitHooks");
  return hooks_.grads ? hooks_.grads(u) : grads() + unit_offset(u);
}

void Transformer::init_random(uint64_t seed) {
  if (layout_.adapters()) {  // the base as without adapters, then the adapters on it
    float* base = base_params();
    const bool quant = config_.quant != WeightQuant::kNone && !quantized_;
    for (int u = first_; u <= last_; ++u) {
      init_random_base(seed, u, base + base_unit_offset(u));
      if (quant && u >= 1 && u < layout_.head_unit()) quantize_unit(u);
    }
    quantized_ = quantized_ || quant;
    return init_adapters(seed);
  }
  float* w = params();
  for (int u = first_; u <= last_; ++u) init_random_unit(seed, u, w + unit_offset(u));
}

void Transformer::init_random_unit(uint64_t seed, int u, float* unit) const {
  PO_CHECK(!layout_.adapters(), "init_random_unit: a model with adapters initialises them on its ",
           "base (init_adapters)");
  init_random_base(seed, u, unit);
}

// The model's own tensors of unit u (the base, with adapters), by each one's
// rule: tensor k from Philox(seed, k), k its index among the model's tensors.
void Transformer::init_random_base(uint64_t seed, int u, float* unit) const {
  const double proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config_.n_layer));
  const std::vector<TensorSpec>& tensors = layout_.base_tensors();
  for (size_t k = 0; k < tensors.size(); ++k) {
    const TensorSpec& p = tensors[k];
    if (p.unit != u) continue;
    float* dst = unit + (p.offset - layout_.base_unit_offset(u));
    const int64_t n = p.numel();
    if (p.init == Init::kZeros || p.init == Init::kOnes) {
      std::fill(dst, dst + n, p.init == Init::kOnes ? 1.0f : 0.0f);
      continue;
    }
    const float std = static_cast<float>(p.init == Init::kResidualNormal ? proj_std : 0.02);
    const core::Philox rng(seed, k);
    if (layout_.split().size == 1) {
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) dst[i] = std * rng.normal(static_cast<uint64_t>(i));
      continue;
    }
    // A shard: each element from its index in the whole tensor (padding rows 0).
    layout_.global_runs(p, [&](int64_t local, int64_t global, int64_t len) {
      for (int64_t i = 0; i < len; ++i)
        dst[local + i] = global < 0 ? 0.0f : std * rng.normal(static_cast<uint64_t>(global + i));
    });
  }
}

// A: U(-1/sqrt(in), 1/sqrt(in)) (PEFT's Kaiming-uniform with a = sqrt(5)),
// from Philox(seed ^ kAdapterStream, k) at counter i, k the adapter's index;
// B: 0; DoRA's magnitude: the row norms of the base weight it adapts.
void Transformer::init_adapters(uint64_t seed) {
  constexpr uint64_t kAdapterStream = 0x4c6f5241ull;  // "LoRA"
  float* w = params();
  const float* base = base_params();
  const std::vector<TensorSpec>& tensors = layout_.tensors();
  for (size_t k = 0; k < tensors.size(); ++k) {
    const TensorSpec& t = tensors[k];
    if (!holds(t.unit)) continue;
    float* dst = w + (t.offset - layout_.unit_offset(first_));
    const int64_t n = t.numel();
    switch (t.init) {
      case Init::kKaimingUniform: {
        const float bound = 1.0f / std::sqrt(static_cast<float>(t.shape[1]));
        const core::Philox rng(seed ^ kAdapterStream, k);
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; ++i)
          dst[i] = bound * (2.0f * rng.uniform(static_cast<uint64_t>(i)) - 1.0f);
        break;
      }
      case Init::kRowNorm: {  // of the decoded rows where the base is quantized
        const TensorSpec& wt = adapted_weight(t);
        const QuantTensor* q = quantized(wt);
        const int64_t in = wt.shape[1];
        std::vector<float> decoded(q != nullptr ? static_cast<size_t>(in) : 0);
        for (int64_t j = 0; j < n; ++j) {
          const float* row = base + (wt.offset - layout_.base_unit_offset(first_)) + j * in;
          if (q != nullptr) {
            q->decode(j, 1, decoded.data());
            row = decoded.data();
          }
          double s = 0.0;
          for (int64_t i = 0; i < in; ++i) s += static_cast<double>(row[i]) * row[i];
          dst[j] = static_cast<float>(std::sqrt(s));
        }
        break;
      }
      default:
        std::fill(dst, dst + n, 0.0f);
    }
  }
}

void Transformer::merged_params(float* out) {
  PO_CHECK(layout_.adapters(), "merged_params: the model has no adapters");
  base_values(out);  // a quantized base merges into its decoded values (QLoRA's dequant(W4))
  const parts::Block& k = layout_.block();
  for (int u = std::max(first_, 1); u <= std::min(last_, layout_.head_unit() - 1); ++u) {
    float* unit = out + base_unit_offset(u);
    const float* adapters = params() + unit_offset(u);
    for (const parts::Linear* lin : {&k.attn.qkv, &k.attn.out, &k.mlp.up, &k.mlp.down})
      if (lin->lora.on()) lin->merge(unit, adapters);
  }
}

const TensorSpec& Transformer::adapted_weight(const TensorSpec& adapter) const {
  const std::string& n = adapter.name;
  const std::string module = n.substr(0, n.rfind(".lora_"));
  for (const TensorSpec& t : layout_.base_tensors())
    if (t.name == module + ".weight") return t;
  PO_THROW(core::InvalidArgument, "adapter ", n, ": the base has no ", module, ".weight");
}

void Transformer::zero_grads() {
  if (grads_.data() != nullptr) backend::device_zero(grads_.data(), grads_.size());
  if (lookup_.data() != nullptr) backend::device_zero(lookup_.data(), lookup_.size());
}

float* Transformer::tied_lookup_grads() {
  if (lookup_.data() == nullptr) {
    lookup_ = tensor::Storage(static_cast<size_t>(layout_.token_embedding().numel()) * sizeof(float));
    backend::device_zero(lookup_.data(), lookup_.size());
  }
  return lookup_.f32();
}

void Transformer::fold_tied_lookup() {
  if (!layout_.tied() || lookup_.data() == nullptr) return;
  float* wte = unit_grads(0) + layout_.token_embedding().offset;
  float* e = lookup_.f32();
  const int64_t n = layout_.token_embedding().numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    wte[i] += e[i];
    e[i] = 0.0f;
  }
}

}  // namespace po::model
