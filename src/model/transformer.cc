// The decoder's buffers: construction, the activation layout (one allocation,
// the same function sizes the ledger), parameters and gradients of the held
// units, hooks and initialisation. The math is in transformer_steps.cc, the
// cached generation path in transformer_decode.cc.
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
  full_ = v.full;
  gathered_ = v.gathered;
  dchunk_ = v.dchunk;
  norm_dw_ = v.norm_dw;
  emb_dout_ = dres_;
  if (norm_dw_ != nullptr) backend::device_zero(norm_dw_, 4 * static_cast<size_t>(config_.n_embd) * sizeof(float));
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
  if (!lender_.lend || accumulating_ || r >= regions_.size() || lent_[r]) return;
  lent_[r] = true;
  lender_.lend(static_cast<int>(r), regions_[r].first, regions_[r].second);
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
    a.fch = take(BT * FC);
    a.fch_gelu = take(BT * F);
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
  if (seq_shards > 1) {
    out.full = take(BT * C);
    out.gathered = take(BT * C);
    out.dchunk = take(R * C);
    out.norm_dw = take(4 * C);
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
    out.push_back({C::kAllReduce, "norm weights' gradients", blocks + top,
                   4.0 * static_cast<double>((4 * blocks + 2 * top) * static_cast<uint64_t>(c.n_embd))});
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

float* Transformer::base_params() {
  if (!layout_.adapters()) return params();
  if (base_owner_ != nullptr) return base_owner_->base_params();
  const int64_t n = layout_.base_unit_offset(last_ + 1) - layout_.base_unit_offset(first_);
  if (config_.quant != WeightQuant::kNone) {
    if (base_sparse_.data() == nullptr) base_sparse_ = tensor::SparseStorage(static_cast<size_t>(n) * sizeof(float));
    return base_sparse_.f32();
  }
  if (base_.data() == nullptr) base_ = tensor::Storage(static_cast<size_t>(n) * sizeof(float));
  return base_.f32();
}

float* Transformer::base_of(int u, float* trainable) {
  if (!layout_.adapters()) return trainable;
  if (holds(u)) return base_params() + base_unit_offset(u);
  PO_ASSERT(u == 0 && base_unit0_ != nullptr, "unit ", u, "'s frozen base is not held by this model (units ",
            first_, "..", last_, ")");
  return base_unit0_;
}

void Transformer::share_base(Transformer& owner, float* unit0) {
  PO_CHECK(layout_.adapters() && owner.layout_.adapters() && owner.first_ == first_ && owner.last_ == last_ &&
               owner.config_.quant == config_.quant && owner.base_owner_ == nullptr,
           "share_base: the owner must be a model with adapters holding the same units (", first_, "..", last_,
           ") and its own base");
  PO_CHECK(base_.data() == nullptr && base_sparse_.data() == nullptr && !quantized_,
           "share_base: this model holds a base of its own already");
  base_owner_ = &owner;
  base_unit0_ = unit0;
}

void Transformer::quantize_base() {
  PO_CHECK(base_owner_ == nullptr, "quantize_base: the base is another model's (share_base)");
  PO_CHECK(config_.quant != WeightQuant::kNone, "quantize_base: model.quant is not set");
  PO_CHECK(!quantized_, "quantize_base: the base is quantized already");
  for (int u = std::max(first_, 1); u <= std::min(last_, layout_.head_unit() - 1); ++u) quantize_unit(u);
  quantized_ = true;
}

namespace {

// fn(linear index, base tensor index, the Linear) for each base tensor of
// block unit u that model.quant quantizes: the pieces of its Linears' weights.
template <class Fn>
void for_each_quantizable(const Layout& l, int u, const Fn& fn) {
  const std::vector<TensorSpec>& tensors = l.base_tensors();
  const int64_t unit0 = l.base_unit_offset(u);
  parts::Block k = l.block();
  const std::vector<parts::Linear*> linears = k.linears();
  for (size_t i = 0; i < linears.size(); ++i) {
    const parts::Linear& lin = *linears[i];
    const int64_t lo = unit0 + lin.weight, hi = lo + lin.out * lin.in;
    for (size_t t = 0; t < tensors.size(); ++t) {
      const TensorSpec& spec = tensors[t];
      if (spec.unit == u && spec.offset >= lo && spec.offset < hi) fn(i, t, lin);
    }
  }
}

}  // namespace

// Unit u's Linears: each base tensor inside a Linear's weight quantized from
// its f32 values, which are then given back.
void Transformer::quantize_unit(int u) {
  PO_ASSERT(layout_.split().size == 1, "model.quant under tensor parallel is not built");
  const std::vector<TensorSpec>& tensors = layout_.base_tensors();
  if (quant_.empty()) {
    quant_.resize(tensors.size());
    quant_linears_.resize(static_cast<size_t>(last_ - first_ + 1));
  }
  float* base = base_params();
  std::array<QuantWeight, 4>& lins = quant_linears_[static_cast<size_t>(u - first_)];
  for_each_quantizable(layout_, u, [&](size_t i, size_t t, const parts::Linear& lin) {
    const TensorSpec& spec = tensors[t];
    PO_ASSERT(spec.shape.size() == 2 && spec.shape[1] == lin.in, "quantize_unit: ", spec.name,
              " is not a [rows, ", lin.in, "] piece of its Linear");
    float* w = base + (spec.offset - layout_.base_unit_offset(first_));
    if (quant_[t].format == WeightQuant::kNone)  // (set_quantized may have given it)
      quant_[t] = quantize_weight(config_.quant, w, spec.shape[0], spec.shape[1], spec.name);
    lins[i].parts.push_back(&quant_[t]);
    base_sparse_.release(static_cast<size_t>(w - base) * sizeof(float),
                         static_cast<size_t>(spec.numel()) * sizeof(float));
  });
  parts::Block k = layout_.block();
  const std::vector<parts::Linear*> linears = k.linears();
  for (size_t i = 0; i < linears.size(); ++i)
    PO_ASSERT(lins[i].rows() == linears[i]->out, "quantize_unit: unit ", u, "'s Linear ", i, " has ",
              linears[i]->out, " rows, its tensors ", lins[i].rows());
}

size_t Transformer::predicted_frozen_bytes(const TransformerConfig& config, UnitRange units, TensorSplit split) {
  const Layout l(config.resolved(), split);
  if (!l.adapters()) return 0;
  const int last = units.last < 0 ? l.head_unit() : units.last;
  const std::vector<TensorSpec>& tensors = l.base_tensors();
  std::vector<bool> quantized(tensors.size(), false);
  if (config.quant != WeightQuant::kNone)
    for (int u = std::max(units.first, 1); u <= std::min(last, l.head_unit() - 1); ++u)
      for_each_quantizable(l, u, [&](size_t, size_t t, const parts::Linear&) { quantized[t] = true; });
  size_t n = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const TensorSpec& spec = tensors[t];
    if (spec.unit < units.first || spec.unit > last) continue;
    n += quantized[t] ? QuantTensor::predicted_bytes(config.quant, spec.shape[0], spec.shape[1])
                      : static_cast<size_t>(spec.numel()) * sizeof(float);
  }
  return n;
}

size_t Transformer::frozen_bytes() const {
  if (!layout_.adapters() || base_owner_ != nullptr) return 0;
  size_t n = 0;
  for (const TensorSpec& t : layout_.base_tensors()) {
    if (!holds(t.unit)) continue;
    const QuantTensor* q = quantized(t);
    n += q != nullptr ? q->bytes() : static_cast<size_t>(t.numel()) * sizeof(float);
  }
  return n;
}

void Transformer::set_quantized(const TensorSpec& t, QuantTensor q) {
  PO_CHECK(config_.quant == q.format, "set_quantized: ", t.name, " is ", weight_quant_name(q.format),
           ", the model's model.quant is ", weight_quant_name(config_.quant));
  PO_CHECK(!quantized_, "set_quantized: ", t.name, ": the base is quantized already");
  PO_CHECK(q.rows == t.shape[0] && q.cols == t.shape[1], "set_quantized: ", t.name, " is [", t.shape[0], ", ",
           t.shape[1], "], the quantized tensor [", q.rows, ", ", q.cols, "]");
  PO_CHECK(t.unit >= 1 && t.unit < layout_.head_unit() && holds(t.unit), "set_quantized: ", t.name,
           " is not a block's weight of this model");
  const std::vector<TensorSpec>& tensors = layout_.base_tensors();
  if (quant_.empty()) {
    quant_.resize(tensors.size());
    quant_linears_.resize(static_cast<size_t>(last_ - first_ + 1));
  }
  for (size_t k = 0; k < tensors.size(); ++k)
    if (tensors[k].name == t.name) {
      quant_[k] = std::move(q);
      return;
    }
  PO_THROW(core::InvalidArgument, "set_quantized: the base has no tensor ", t.name);
}

void Transformer::attach_quant(BlockWeights& P, int u) const {
  if (base_owner_ != nullptr) return base_owner_->attach_quant(P, u);
  if (!quantized_) return;
  const std::array<QuantWeight, 4>& lins = quant_linears_[static_cast<size_t>(u - first_)];
  parts::Linear::Weights* ws[] = {&P.qkv, &P.out, &P.up, &P.down};
  for (size_t i = 0; i < 4; ++i) {
    ws[i]->q = &lins[i];
    ws[i]->w = nullptr;
    ws[i]->w16 = nullptr;
  }
}

const QuantTensor* Transformer::quantized(const TensorSpec& base_tensor) const {
  if (base_owner_ != nullptr) return base_owner_->quantized(base_tensor);
  if (!quantized_) return nullptr;
  const std::vector<TensorSpec>& tensors = layout_.base_tensors();
  for (size_t t = 0; t < tensors.size(); ++t)
    if (tensors[t].name == base_tensor.name)
      return quant_[t].format == WeightQuant::kNone ? nullptr : &quant_[t];
  return nullptr;
}

size_t Transformer::quantized_bytes() const {
  size_t n = 0;
  for (const QuantTensor& q : quant_) n += q.format == WeightQuant::kNone ? 0 : q.bytes();
  return n;
}

void Transformer::base_values(float* out) {
  if (base_owner_ != nullptr) return base_owner_->base_values(out);
  const int64_t first = layout_.base_unit_offset(first_);
  const int64_t n = layout_.base_unit_offset(last_ + 1) - first;
  if (!quantized_) {
    std::memcpy(out, base_params(), static_cast<size_t>(n) * sizeof(float));
    return;
  }
  const float* base = base_params();
  const std::vector<TensorSpec>& tensors = layout_.base_tensors();
  for (size_t t = 0; t < tensors.size(); ++t) {
    const TensorSpec& spec = tensors[t];
    if (!holds(spec.unit)) continue;
    float* dst = out + (spec.offset - first);
    if (quant_[t].format != WeightQuant::kNone)
      quant_[t].decode(0, quant_[t].rows, dst);
    else
      std::memcpy(dst, base + (spec.offset - first), static_cast<size_t>(spec.numel()) * sizeof(float));
  }
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
