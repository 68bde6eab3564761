// The decoder's embedding: token and position lookups forward, their
// gradients backward (the tied table's rows deferred where the trainer asks).
#include "backend/ops.h"
#include "core/error.h"
#include "model/transformer.h"

namespace po::model {
namespace ops = po::backend::cpu;

void Transformer::embed_forward(const int32_t* tokens, int64_t b, int64_t t) {
  PO_CHECK(pops_->tp_size() == tp_size() && pops_->tp_rank() == layout_.split().rank,
           "the model is tensor-parallel rank ", layout_.split().rank, " of ", tp_size(),
           " but its ParallelOps is rank ", pops_->tp_rank(), " of ", pops_->tp_size());
  UnitView v = unit_params_lean(0);
  if (layout_.adapters()) v = {base_of(0, nullptr), nullptr, false};  // the frozen table
  const float* w = v.f32;
  const TensorSpec* wpe = layout_.position_embedding();
  const int64_t C = config_.n_embd, table = layout_.token_embedding().offset;
  const int64_t rows = b * t;
  float* partial = tp_size() > 1 && sp_ > 1 ? full_ : encoded_;
  // tp = 1: the whole lookup; else each rank looks up the tokens of its
  // vocabulary slice and the sum is the lookup. Lean: the table's f32 values
  // were not widened and the lookup reads its bits.
  auto lookup = [&](const auto* wte) {
    if (tp_size() == 1)
      ops::embedding_forward(encoded_, tokens, wte,
                             wpe != nullptr && cp_.size == 1 && !packed() ? w + wpe->offset : nullptr,
                             b, t, C);
    else
      ops::embedding_forward_slice(partial, tokens, wte, layout_.vocab_begin(),
                                   layout_.vocab_real(), rows, C);
  };
  if (v.lean)
    lookup(v.bf16 + table);
  else
    lookup(w + table);
  if (tp_size() > 1) reduce_rows(partial, encoded_, rows);
  if (wpe != nullptr && (tp_size() > 1 || cp_.size > 1 || packed())) add_positions(encoded_, w + wpe->offset, b, t);
  unit_done(0);
}

// Every rank adds the whole lookup gradient of its vocabulary slice and of
// the positions, from every row: the position table's gradient needs no
// reduction over the group even under sequence parallel.
// A tied table's lookup rows go to the hooks' lookup_rows
// or, without one, to their own accumulator (tied_lookup_grads) unless hooks
// hold the gradient (they take each micro-batch's whole unit 0).
void Transformer::embed_backward(const int32_t* tokens, bool deferred) {
  if (layout_.adapters()) return;  // the tables are frozen
  emb_dout_ = gather_rows(dres_, full_, B_ * T_);
  const bool sink = layout_.tied() && hooks_.lookup_rows;
  if (sink) hooks_.lookup_rows(emb_dout_, tokens, B_ * T_);
  if (deferred) return hooks_.deferred_lookup(emb_dout_, tokens, B_ * T_);
  float* g0 = unit_grads(0);
  const TensorSpec* wpe = layout_.position_embedding();
  const bool apart = layout_.tied() && !hooks_.grads;
  float* wte = sink ? nullptr : apart ? tied_lookup_grads() : g0 + layout_.token_embedding().offset;
  const bool plain_positions = cp_.size == 1 && !packed();
  ops::embedding_backward_slice(wte, wpe != nullptr && plain_positions ? g0 + wpe->offset : nullptr,
                                emb_dout_, tokens, B_, T_, config_.n_embd, layout_.vocab_begin(),
                                sink ? 0 : layout_.vocab_real());  // (no row of a sunk table is held)
  if (wpe != nullptr && !plain_positions) position_grads(g0 + wpe->offset, emb_dout_);
}

void Transformer::add_positions(float* out, const float* wpe, int64_t b, int64_t t) const {
  const int64_t C = config_.n_embd, rows = b * t, row0 = chunk_begin(rows), n = rows / sp_;
  if (packed()) {  // this rank's rows (sequence parallel: its chunk of them), each at its example's position
    const int64_t first = sp_ > 1 ? row0 : 0;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
      const float* w = wpe + static_cast<int64_t>(positions_[static_cast<size_t>(first + i)]) * C;
      float* o = out + i * C;
#pragma omp simd
      for (int64_t c = 0; c < C; c++) o[c] += w[c];
    }
    return;
  }
  if (cp_.size == 1) return ops::position_embedding_add(out, wpe, row0, n, t, C);
  // This rank's rows of the micro-batch (all of them without sequence
  // parallel), each at its position in the sequence.
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const float* w = wpe + cp_.position((row0 + i) % t, t) * C;
    float* o = out + i * C;
#pragma omp simd
    for (int64_t c = 0; c < C; c++) o[c] += w[c];
  }
}

void Transformer::position_grads(float* dwpe, const float* dout) const {
  const int64_t C = config_.n_embd;
  if (packed()) {  // rows in order, each into its position's row (one thread: rows share positions)
    for (int64_t i = 0; i < B_ * T_; i++) {
      float* d = dwpe + static_cast<int64_t>(positions_[static_cast<size_t>(i)]) * C;
      const float* g = dout + i * C;
#pragma omp simd
      for (int64_t c = 0; c < C; c++) d[c] += g[c];
    }
    return;
  }
  const int64_t n = cp_.local_chunks(), S = T_ / n;
  for (int64_t i = 0; i < n; i++) {
    float* d = dwpe + cp_.chunk(static_cast<int>(i)) * S * C;
    for (int64_t s = 0; s < B_; s++) {  // sequences in order, as embedding_backward adds them
      const float* g = dout + (s * T_ + i * S) * C;
#pragma omp parallel for schedule(static)
      for (int64_t x = 0; x < S * C; x++) d[x] += g[x];
    }
  }
}

}  // namespace po::model
