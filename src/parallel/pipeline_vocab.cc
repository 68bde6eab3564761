// Vocabulary parallel: the head's pieces on every rank (pipeline_executor.h).
#include <algorithm>
#include <cstring>

#include "backend/ops.h"
#include "backend/device.h"
#include "core/error.h"
#include "model/vocab_head.h"
#include "parallel/pipeline_executor.h"
#include "parallel/pipeline_executor_state.h"

namespace po::parallel {
namespace ops = po::backend::cpu;
using namespace executor_detail;  // its helpers and names (pipeline_executor_state.h)

namespace {
constexpr int kVocabGradTag = 32710, kVocabRowsTag = 32711;
}

// Whether pipeline rank `rank` keeps a copy of its pieces' rows (neither
// the owner nor, tied, the embedding's rank, which reads its own table),
// and whether it keeps its own rows' gradient (every rank but the owner).
std::pair<bool, bool> PipelineExecutor::vocab_copies(const model::Layout& layout,
                                                     const PipelineSetup& setup, int rank) {
  const pipeline::Schedule& s = setup.schedule;
  if (!s.vocab) return {false, false};
  const int head = s.rank_of(s.stages() - 1);
  if (rank == head) return {false, false};
  return {!(layout.tied() && rank == s.rank_of(0)), true};
}

size_t PipelineExecutor::vocab_held_bytes(const model::TransformerConfig& config,
                                          const PipelineSetup& setup, int rank) {
  const pipeline::Schedule& s = setup.schedule;
  const model::vocab::Pieces p = model::vocab::pieces_of(config.resolved().vocab_size);
  const auto [k0, k1] = s.pieces_of(rank, p.count());
  const int64_t rows = setup.micro * setup.T, vr = p.begin(k1) - p.begin(k0);
  // logits, targets, and per row and piece mx, sum, scale (4 + 8 + 4) and zt
  return static_cast<size_t>(rows * vr) * sizeof(float) + static_cast<size_t>(rows) * sizeof(int32_t) +
         static_cast<size_t>(rows * (16 * p.count() + 4));
}

void PipelineExecutor::vocab_setup() {
  const pipeline::Schedule& s = setup_.schedule;
  if (!s.vocab) return;
  PO_CHECK(!bf16_ && setup_.split.size == 1, "pipeline: the head spread over the ranks ",
           "(parallel.vocab_parallel) needs train.precision = \"fp32\" and parallel.tp = 1");
  auto v = std::make_unique<VocabPart>();
  const int64_t C = config_.n_embd;
  v->pieces = model::vocab::pieces_of(config_.vocab_size);
  std::tie(v->k0, v->k1) = s.pieces_of(rank_, v->pieces.count());
  v->row0 = v->pieces.begin(v->k0);
  v->rows = v->pieces.begin(v->k1) - v->row0;
  PO_CHECK(v->pieces.count() == model::vocab::kPieces, "pipeline: parallel.vocab_parallel needs ",
           "a vocabulary of at least ", model::vocab::kPieces, " tokens (model.vocab_size = ",
           config_.vocab_size, ")");
  const int64_t chunk = model::Transformer::head_chunk_rows(setup_.micro, setup_.T);
  v->scratch = zeroed(model::vocab::tree_height(v->pieces.count()) * chunk * C);
  PO_CHECK(3 * (v->k1 - v->k0) + 1 <= C, "pipeline: parallel.vocab_parallel sends ",
           3 * (v->k1 - v->k0) + 1, " statistics per row in a message of model.n_embd = ", C,
           " floats; use fewer pipeline ranks or a wider model");
  const int64_t head_off = layout_.head().offset;
  if (rank_ == head_rank_) {
    Chunk& c = chunk_of_stage(s.stages() - 1);
    v->table = layout_.tied() ? static_cast<float*>(c.unit0_params) + head_off
                              : c.params.f32() + (head_off - c.base);
    v->table_grad = layout_.tied() ? static_cast<float*>(c.unit0_grads) + head_off
                                   : c.grads.f32() + (head_off - c.base);
    v->w = v->table + v->row0 * C;
    v->dw = v->table_grad + v->row0 * C;
  } else {
    const auto [copy, own] = vocab_copies(layout_, setup_, rank_);
    if (copy) {
      v->w_copy = zeroed(v->rows * C);
      v->w = v->w_copy.f32();
    } else {  // the embedding's table, updated as the owner's is
      v->w = static_cast<float*>(stored_unit(0)) + head_off + v->row0 * C;
    }
    if (own) {
      v->dw_own = zeroed(v->rows * C);
      v->dw = v->dw_own.f32();
    }
  }
  vocab_ = std::move(v);
}

// A copy's rows from the initialiser: the head weight's values (tied: the
// token table's, unit 0).
void PipelineExecutor::vocab_init(uint64_t seed) {
  if (!vocab_ || vocab_->w_copy.size() == 0) return;
  model::Transformer init(config_.weights_only(), 1, 1, model::UnitRange{0, 0}, setup_.split);
  const int u = layout_.tied() ? 0 : layout_.head_unit();
  std::vector<float> unit(static_cast<size_t>(layout_.unit_numel(u)));
  init.init_random_unit(seed, u, unit.data());
  const int64_t C = config_.n_embd;
  backend::device_copy(vocab_->w_copy.data(),
              unit.data() + (layout_.head().offset - layout_.unit_offset(u)) + vocab_->row0 * C,
              vocab_->w_copy.size());
}

// The last stage's forward is done: its final norm's output to every other rank.
void PipelineExecutor::vocab_forward_done(model::Transformer& m, int micro) {
  const pipeline::Schedule& s = setup_.schedule;
  const size_t msg = static_cast<size_t>(rows_ * config_.n_embd) * sizeof(float);
  for (int q = 0; q < s.ranks; ++q) {
    if (q == rank_) continue;
    float* out = messages_->take();
    backend::device_copy(out, m.stage_output(), msg);
    messages_->made({micro, s.stages() + 1 + q, static_cast<int>(Payload::kHeadInput)}, out);
  }
}

// S: this rank's pieces' logits and statistics for one micro-batch, chunk by
// chunk of rows as one stage runs them; the statistics to every other rank.
void PipelineExecutor::vocab_stats(const Action& a, const BatchFn& batch) {
  const pipeline::Schedule& s = setup_.schedule;
  VocabPart& v = *vocab_;
  const int S = s.stages(), P = v.pieces.count();
  const int64_t C = config_.n_embd, chunk = model::Transformer::head_chunk_rows(setup_.micro, setup_.T);
  const float* x = nullptr;
  bool from_buffer = false;
  if (rank_ == head_rank_) {
    Chunk& c = chunk_of_stage(S - 1);
    for (size_t i = 0; i < c.slots.size(); ++i)
      if (c.slot_micro[i] == a.micro) x = c.slots[i]->stage_output();
    PO_ASSERT(x != nullptr, "pipeline: ", pipeline::describe(a), " before the last stage's forward");
  } else {
    x = incoming_key(a, {a.micro, S + 1 + rank_, static_cast<int>(Payload::kHeadInput)});
    from_buffer = true;
  }
  const int64_t t0 = now_ns();
  VocabPart::Held& h = v.take(a.micro, rows_, chunk, P);
  h.x = x;
  h.x_buffer = from_buffer;
  batch(a.micro, inputs_.data(), h.targets.data());
  float* logits = h.logits.f32();
  for (int64_t r0 = 0, ci = 0; r0 < rows_; r0 += chunk, ++ci) {
    const int64_t n = std::min(chunk, rows_ - r0);
    for (int k = v.k0; k < v.k1; ++k)
      model::vocab::piece_forward(v.pieces, k, ops::Operand(x + r0 * C), ops::Operand(v.w),
                                  h.targets.data() + r0, n, C,
                                  logits + r0 * v.rows + n * (v.pieces.begin(k) - v.row0),
                                  h.stats[static_cast<size_t>(ci)], true, v.row0);
  }
  // Packed per chunk: the pieces' maxima, sums (doubles) and the targets'
  // logits; one buffer sent to every other rank.
  {
    float* out = messages_->take();
    float* at = out;
    for (int64_t r0 = 0, ci = 0; r0 < rows_; r0 += chunk, ++ci) {
      const int64_t n = std::min(chunk, rows_ - r0);
      const model::vocab::Stats& st = h.stats[static_cast<size_t>(ci)];
      const auto mine = static_cast<size_t>((v.k1 - v.k0) * n);
      backend::device_copy(at, st.mx.data() + v.k0 * n, mine * sizeof(float));
      at += mine;
      backend::device_copy(at, st.sum.data() + v.k0 * n, mine * sizeof(double));
      at += 2 * mine;
      backend::device_copy(at, st.zt.data(), static_cast<size_t>(n) * sizeof(float));
      at += n;
    }
    const Key key{a.micro, S + 1 + s.ranks + rank_, static_cast<int>(Payload::kHeadStats)};
    messages_->made(key, out, s.ranks - 1);
  }
  spans_.push_back({a, false, t0 - step_start_ns_, now_ns() - step_start_ns_});
}

// T: every rank's statistics, the rows' losses, this rank's pieces' logit
// and weight gradients, and the head's input gradient continued from the
// previous holder (to the next one, or on the last stage's rank to its backward).
void PipelineExecutor::vocab_grad(const Action& a, float grad_scale, PipelineStepStats& stats) {
  const pipeline::Schedule& s = setup_.schedule;
  VocabPart& v = *vocab_;
  const int S = s.stages(), P = v.pieces.count();
  const int64_t C = config_.n_embd, chunk = model::Transformer::head_chunk_rows(setup_.micro, setup_.T);
  VocabPart::Held& h = v.find(a.micro);
  for (int q = 0; q < s.ranks; ++q) {
    if (q == rank_) continue;
    float* in = incoming_key(a, {a.micro, S + 1 + s.ranks + q, static_cast<int>(Payload::kHeadStats)});
    const auto [q0, q1] = s.pieces_of(q, P);
    const float* at = in;
    for (int64_t r0 = 0, ci = 0; r0 < rows_; r0 += chunk, ++ci) {
      const int64_t n = std::min(chunk, rows_ - r0);
      model::vocab::Stats& st = h.stats[static_cast<size_t>(ci)];
      const auto theirs = static_cast<size_t>((q1 - q0) * n);
      backend::device_copy(st.mx.data() + q0 * n, at, theirs * sizeof(float));
      at += theirs;
      backend::device_copy(st.sum.data() + q0 * n, at, theirs * sizeof(double));
      at += 2 * theirs;
      const int64_t lo = v.pieces.begin(q0), hi = v.pieces.begin(q1);
      for (int64_t r = 0; r < n; ++r) {
        const int64_t t = h.targets[static_cast<size_t>(r0 + r)];
        if (t >= lo && t < hi) st.zt[static_cast<size_t>(r)] = at[r];
      }
      at += n;
    }
    messages_->give(in);
  }
  const int64_t t0 = now_ns();
  std::vector<float> losses(static_cast<size_t>(chunk));
  double loss_sum = 0;
  float* logits = h.logits.f32();
  for (int64_t r0 = 0, ci = 0; r0 < rows_; r0 += chunk, ++ci) {
    const int64_t n = std::min(chunk, rows_ - r0);
    model::vocab::combine(P, n, losses.data(), h.stats[static_cast<size_t>(ci)],
                          h.targets.data() + r0, grad_scale);
    for (int64_t r = 0; r < n; ++r) loss_sum += losses[static_cast<size_t>(r)];
  }
  if (rank_ == head_rank_)
    stats.loss_sum += static_cast<float>(loss_sum / static_cast<double>(setup_.micro * setup_.T));
  // The input gradient's tree nodes of this rank's pieces (their leaves
  // also add the pieces' weight gradients), for the last stage's backward.
  const std::vector<float*> scratch = v.scratch_at(chunk, C);
  for (const auto& [lo, hi] : s.grad_nodes(rank_)) {
    float* node = messages_->take();
    for (int64_t r0 = 0, ci = 0; r0 < rows_; r0 += chunk, ++ci) {
      const int64_t n = std::min(chunk, rows_ - r0);
      const model::vocab::Stats& st = h.stats[static_cast<size_t>(ci)];
      model::vocab::tree_sum(
          lo, hi, node + r0 * C, n, C,
          [&](int k, float* dst) {
            model::vocab::piece_backward(v.pieces, k, logits + r0 * v.rows + n * (v.pieces.begin(k) - v.row0),
                                         nullptr, st, h.targets.data() + r0,
                                         ops::Operand(h.x + r0 * C), ops::Operand(v.w), v.dw, dst,
                                         false, n, C, grad_scale, v.row0);
          },
          {}, scratch.data());
    }
    messages_->made({a.micro, S + 1 + 2 * s.ranks + lo, static_cast<int>(Payload::kHeadGrad)}, node);
  }
  if (h.x_buffer) messages_->give(const_cast<float*>(h.x));
  h.micro = -1;
  spans_.push_back({a, false, t0 - step_start_ns_, now_ns() - step_start_ns_});
}

// The last stage's backward of a micro-batch: the head's input gradient,
// every rank's tree nodes (received, or this rank's own) added up in the
// tree as one stage adds its pieces' parts.
float* PipelineExecutor::vocab_input_grad(const Action& a) {
  const pipeline::Schedule& s = setup_.schedule;
  VocabPart& v = *vocab_;
  const int S = s.stages(), P = v.pieces.count();
  const int64_t C = config_.n_embd, chunk = model::Transformer::head_chunk_rows(setup_.micro, setup_.T);
  std::map<std::pair<int, int>, float*> parts;
  for (int q = 0; q < s.ranks; ++q)
    for (const auto& node : s.grad_nodes(q))
      parts[node] = incoming_key(a, {a.micro, S + 1 + 2 * s.ranks + node.first,
                                     static_cast<int>(Payload::kHeadGrad)});
  float* d = messages_->take();
  const std::vector<float*> scratch = v.scratch_at(chunk, C);
  for (int64_t r0 = 0; r0 < rows_; r0 += chunk) {
    const int64_t n = std::min(chunk, rows_ - r0);
    model::vocab::tree_sum(
        0, P, d + r0 * C, n, C,
        [&](int k, float*) { PO_THROW(core::Internal, "pipeline: no rank sent piece ", k, "'s part"); },
        [&](int lo, int hi) -> const float* {
          const auto it = parts.find({lo, hi});
          return it == parts.end() ? nullptr : it->second + r0 * C;
        },
        scratch.data());
  }
  for (const auto& [node, buffer] : parts) messages_->give(buffer);
  return d;
}

// Before the update: every other rank's rows of the head weight's gradient
// into the owner's (the head's rank), in place of the zeros there.
void PipelineExecutor::vocab_gather_grads() {
  if (!vocab_) return;
  const pipeline::Schedule& s = setup_.schedule;
  VocabPart& v = *vocab_;
  const int64_t C = config_.n_embd;
  if (rank_ != head_rank_) {
    setup_.pipe->send(v.dw, static_cast<size_t>(v.rows * C), DType::kF32, head_rank_, kVocabGradTag);
    backend::device_zero(v.dw, static_cast<size_t>(v.rows * C) * sizeof(float));
    return;
  }
  for (int q : s.holders) {
    if (q == rank_) continue;
    const auto [q0, q1] = s.pieces_of(q, v.pieces.count());
    const int64_t r0 = v.pieces.begin(q0), n = v.pieces.begin(q1) - r0;
    setup_.pipe->recv(v.table_grad + r0 * C, static_cast<size_t>(n * C), DType::kF32, q, kVocabGradTag);
  }
}

// After the update (or a load): the owner's rows to the ranks that copy theirs.
void PipelineExecutor::vocab_refresh() {
  if (!vocab_) return;
  const pipeline::Schedule& s = setup_.schedule;
  VocabPart& v = *vocab_;
  const int64_t C = config_.n_embd;
  if (rank_ == head_rank_) {
    for (int q : s.holders) {
      if (q == rank_ || !vocab_copies(layout_, setup_, q).first) continue;
      const auto [q0, q1] = s.pieces_of(q, v.pieces.count());
      const int64_t r0 = v.pieces.begin(q0), n = v.pieces.begin(q1) - r0;
      setup_.pipe->send(v.table + r0 * C, static_cast<size_t>(n * C), DType::kF32, q, kVocabRowsTag);
    }
  } else if (v.w_copy.size() > 0) {
    setup_.pipe->recv(v.w_copy.data(), static_cast<size_t>(v.rows * C), DType::kF32, head_rank_,
                      kVocabRowsTag);
  }
}

}  // namespace po::parallel
