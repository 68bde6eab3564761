// Generation with a KV cache, the one decode path of training's `generate`
// and of serving: each new token runs the blocks once (decode_blocks, the
// block's parts over few rows), its keys and values written into the cache's
// blocks, and attends to the cached positions, so no prefix is recomputed. A
// contiguous cache (forward_cached) is a paged cache of one block. Uses the
// first block's activation buffers as scratch (a generating model is not
// training).
#include <algorithm>
#include <cstring>
#include <functional>
#include <utility>

#include "backend/ops.h"
#include "core/error.h"
#include "model/transformer.h"

namespace po::model {
namespace ops = po::backend::cpu;

KvCache Transformer::make_kv_cache(int64_t capacity) const {
  PO_CHECK(capacity >= 1 && capacity <= T_, "KV cache of ", capacity,
           " positions: the model was built for at most ", T_);
  KvCache c;
  c.capacity = capacity;
  const auto bytes = static_cast<size_t>(capacity * config_.n_kv_head * config_.head_dim()) *
                     sizeof(float);
  for (int64_t l = 0; l < config_.n_layer; ++l) {
    c.k.emplace_back(bytes);
    c.v.emplace_back(bytes);
  }
  return c;
}

void Transformer::embed_rows(const int32_t* tokens, int64_t n, int64_t pos0, float* x) {
  const int64_t C = config_.n_embd, V = config_.vocab_size;
  const float* w = base_of(0, unit_params(0));
  const float* wte = w + layout_.token_embedding().offset;
  const TensorSpec* wpe = layout_.position_embedding();
  for (int64_t i = 0; i < n; ++i) {
    PO_CHECK(tokens[i] >= 0 && tokens[i] < V, "token ", tokens[i], " is outside the vocabulary (", V, ")");
    const float* e = wte + static_cast<int64_t>(tokens[i]) * C;
    const float* p = wpe ? w + wpe->offset + (pos0 + i) * C : nullptr;
    for (int64_t c = 0; c < C; ++c) x[i * C + c] = e[c] + (p ? p[c] : 0.0f);
  }
  unit_done(0);
}

const float* Transformer::decode_blocks(
    int64_t n, const std::function<void(int64_t l, float* qkv, float* atty)>& attend) {
  const parts::Block& k = layout_.block();
  const int64_t C = config_.n_embd;
  // Scratch: a full layer's views (the recompute layer, or block 0's).
  claim_regions();
  LayerActs a = config_.activation_checkpointing || config_.bf16_activations || config_.inference ? scratch_
                                                                                                   : layers_[0];
  const bool bias_here = pops_->tp_rank() == 0;  // row-parallel biases: once in the group's sum
  float* x = encoded_;
  float* y = dres_;  // the next block's input
  for (int64_t l = 0; l < config_.n_layer; ++l) {
    const int u = static_cast<int>(l + 1);
    float* unit = unit_params(u);
    BlockWeights P = k.weights(base_of(u, unit), nullptr, false, unit);
    attach_quant(P, u);
    k.norm1.forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, P.norm1, n);
    k.attn.qkv.forward_decode(a.qkv, a.ln1, P.qkv, n);
    add_row_adapters(0, u, a.qkv, a.ln1, P, true);
    attend(l, a.qkv, a.atty);
    k.attn.out.forward_decode(a.residual2, a.atty, P.out, n, bias_here);
    add_row_adapters(1, u, a.residual2, a.atty, P, bias_here);
    pops_->tp_all_reduce(a.residual2, n * C);
    ops::residual_forward(a.residual2, a.residual2, x, n * C);
    k.norm2.forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.residual2, P.norm2, n);
    k.mlp.up.forward_decode(a.fch, a.ln2, P.up, n);
    add_row_adapters(2, u, a.fch, a.ln2, P, true);
    k.mlp.act_forward(a.fch_gelu, a.fch, n);
    k.mlp.down.forward_decode(y, a.fch_gelu, P.down, n, bias_here);
    add_row_adapters(3, u, y, a.fch_gelu, P, bias_here);
    pops_->tp_all_reduce(y, n * C);
    ops::residual_forward(y, y, a.residual2, n * C);
    unit_done(u);
    std::swap(x, y);
  }
  return x;
}

void Transformer::add_row_adapters(int which, int u, float* y, const float* x, const BlockWeights& P,
                                   bool with_bias) const {
  const parts::Linear& base = *layout_.block().linears_const()[static_cast<size_t>(which)];
  const parts::Linear::Weights* ws[] = {&P.qkv, &P.out, &P.up, &P.down};
  for (const RowAdapter& ra : row_adapters_) {
    const Transformer& m = *ra.adapter;
    const parts::Linear& lin = *m.layout().block().linears_const()[static_cast<size_t>(which)];
    if (!lin.lora.on()) continue;  // the adapter leaves this Linear alone
    parts::Linear::Weights w = *ws[which];
    w.adapter = m.params() + m.unit_offset(u);
    w.drop = {};
    lin.adapter_forward(y + ra.row0 * base.out, x + ra.row0 * base.in, w, ra.rows, with_bias);
  }
}

// The contiguous cache is a paged cache of one block of `capacity` positions:
// the one decode path (forward_paged), the same kernel and the same bits.
void Transformer::forward_cached(const int32_t* tokens, int64_t n, KvCache& cache, float* logits) {
  PO_CHECK(whole(), "forward_cached runs a whole model");
  PO_CHECK(n >= 1 && n <= B_ * T_, "forward_cached: ", n, " tokens at once, at most ", B_ * T_);
  PO_CHECK(cache.length + n <= cache.capacity, "KV cache full: ", cache.length, " + ", n,
           " positions exceed its ", cache.capacity);
  PO_CHECK(static_cast<int64_t>(cache.k.size()) == config_.n_layer, "KV cache of ",
           cache.k.size(), " blocks for a model of ", config_.n_layer);
  PagedKv kv;
  kv.block_size = cache.capacity;
  for (int64_t l = 0; l < config_.n_layer; ++l) {
    kv.k.push_back(cache.k[static_cast<size_t>(l)].f32());
    kv.v.push_back(cache.v[static_cast<size_t>(l)].f32());
  }
  static constexpr int32_t kOneBlock[1] = {0};
  PagedSeq s;
  s.tokens = tokens;
  s.n = n;
  s.pos0 = cache.length;
  s.block_table = kOneBlock;
  s.logits = true;
  forward_paged({s}, kv, logits);
  cache.length += n;
}

void Transformer::forward_paged(const std::vector<PagedSeq>& seqs, const PagedKv& kv, float* logits,
                                const RowLogits& each) {
  PO_CHECK(whole(), "forward_paged runs a whole model");
  PO_CHECK(static_cast<int64_t>(kv.k.size()) == config_.n_layer, "paged KV cache of ", kv.k.size(),
           " layers for a model of ", config_.n_layer);
  const int64_t C = config_.n_embd, NH = config_.n_head, NKV = config_.n_kv_head;
  const int64_t hs = config_.head_dim(), QKV = config_.qkv_width(), AO = NH * hs;
  const int64_t kvw = NKV * hs, bs = kv.block_size;
  int64_t rows = 0;
  row_adapters_.clear();
  for (const PagedSeq& s : seqs) {
    PO_CHECK(s.n >= 1 && s.pos0 >= 0 && s.pos0 + s.n <= T_, "forward_paged: positions ", s.pos0, "..",
             s.pos0 + s.n - 1, " outside the model's ", T_);
    if (s.adapter != nullptr) {
      PO_CHECK(!layout_.adapters() && s.adapter->layout().adapters() &&
                   s.adapter->layout().base_num_params() == layout_.num_params(),
               "forward_paged: a sequence's adapter must be a model with adapters on this model's shapes");
      if (!row_adapters_.empty() && row_adapters_.back().adapter == s.adapter &&
          row_adapters_.back().row0 + row_adapters_.back().rows == rows)
        row_adapters_.back().rows += s.n;  // one span for consecutive rows of one adapter
      else
        row_adapters_.push_back({rows, s.n, s.adapter});
    }
    PO_CHECK(rows + s.n <= B_ * T_, "forward_paged: ", rows + s.n, "+ rows in one step, at most ",
             B_ * T_);
    PO_CHECK(s.row_logits >= 0 && s.row_logits <= s.n, "forward_paged: logits of ", s.row_logits,
             " rows of a sequence of ", s.n);
    embed_rows(s.tokens, s.n, s.pos0, encoded_ + rows * C);
    rows += s.n;
  }
  if (rows == 0) return;
  const float* x = decode_blocks(rows, [&](int64_t l, float* qkv, float* atty) {
    float* kp = kv.k[static_cast<size_t>(l)];
    float* vp = kv.v[static_cast<size_t>(l)];
    int64_t r0 = 0;
    for (const PagedSeq& s : seqs) {
      float* q = qkv + r0 * QKV;
      if (rope_cos_ != nullptr) ops::rope_forward(q, 1, s.n, QKV, NH + NKV, hs, rope_cos_, rope_sin_, s.pos0);
      for (int64_t i = 0; i < s.n; ++i) {
        const int64_t j = s.pos0 + i;
        const int64_t at = (s.block_table[j / bs] * bs + j % bs) * kvw;
        std::memcpy(kp + at, q + i * QKV + NH * hs, static_cast<size_t>(kvw) * sizeof(float));
        std::memcpy(vp + at, q + i * QKV + (NH + NKV) * hs, static_cast<size_t>(kvw) * sizeof(float));
      }
      ops::paged_attention_forward(atty + r0 * AO, q, QKV, kp, vp, s.block_table, bs, s.n, s.pos0, NH,
                                   NKV, hs);
      r0 += s.n;
    }
  });
  // The last row of each sequence that wants logits, gathered: one GEMM for all.
  int64_t out = 0, r0 = 0;
  float* last = dres_ == x ? encoded_ : dres_;  // the block buffer not holding x
  for (const PagedSeq& s : seqs) {
    r0 += s.n;
    if (s.logits) std::memcpy(last + (out++) * C, x + (r0 - 1) * C, static_cast<size_t>(C) * sizeof(float));
  }
  if (out > 0) head_logits(last, out, logits);
  // Every row's logits where asked, kRows at a time (x is still the last
  // block's output: head_logits reads it and writes only its own buffers).
  constexpr int64_t kRows = 8;
  r0 = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const PagedSeq& s = seqs[i];
    if (s.row_logits > 0 && each) {
      row_logits_.resize(static_cast<size_t>(kRows * config_.vocab_size));
      for (int64_t a = 0; a < s.row_logits; a += kRows) {
        const int64_t n = std::min(kRows, s.row_logits - a);
        head_logits(x + (r0 + a) * C, n, row_logits_.data());
        each(i, a, n, row_logits_.data());
      }
    }
    r0 += s.n;
  }
}

}  // namespace po::model
