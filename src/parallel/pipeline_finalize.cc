// The end of a pipeline step (pipeline_executor.h), in one order: the data
// group's reductions (pipeline_grad_sync.cc; ZeRO 0-1: the buckets' sums;
// ZeRO 2-3: each micro-batch's reduce-scatters into the shards), sequence
// parallel's norm gradients over the tensor group, the tied pair's two
// parts, the one global norm in the order of pp = 1, clipping and the
// update.
#include "parallel/pipeline_executor.h"
#include "backend/device.h"
#include "parallel/pipeline_executor_state.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "backend/ops.h"
#include "core/error.h"
#include "parallel/grad_norm.h"
#include "parallel/unit_blocks.h"

namespace po::parallel {
namespace ops = po::backend::cpu;
using namespace executor_detail;  // its helpers and names (pipeline_executor_state.h)

// The tied table (tied_pair.h): elements [lo, hi) of it, H on the head's
// copy at `head_at` (the replica's gradient, already summed over the data
// group) and nothing yet on the embedding's at `emb_at`; the embedding's
// rank gathers its data group's lookup rows, takes H, adds E once and sends
// the sum back, so both copies hold pp = 1's H + E. On one rank (zbv) the
// head's part is already in the embedding chunk's gradient.
void PipelineExecutor::tied_pair(void* emb_at, void* head_at, int64_t lo, int64_t hi) {
  const DType stored = bf16_ ? DType::kBF16 : DType::kF32;
  const auto k = static_cast<size_t>(std::max<int64_t>(hi - lo, 0));
  if (rank_ == emb_rank_) {
    LookupRows& rows = *chunk_of_stage(0).rows;
    rows.gather(setup_.data);
    if (head_rank_ != rank_ && k > 0) setup_.pipe->recv(emb_at, k, stored, head_rank_, kPairTag + 2);
    rows.add_into(emb_at, stored, lo, hi);
    rows.clear();
    if (head_rank_ != rank_ && k > 0) setup_.pipe->send(emb_at, k, stored, head_rank_, kPairTag + 1);
  } else if (rank_ == head_rank_ && k > 0) {
    setup_.pipe->send(head_at, k, stored, emb_rank_, kPairTag + 2);
    setup_.pipe->recv(head_at, k, stored, emb_rank_, kPairTag + 1);
  }
}

// Sequence parallel over tp > 1: a tp rank's gradient of the norms is its
// own rows' part (the model sums nothing over the group for them). Once the
// data group's sums are in, the tensor group sums them: the norm elements of
// this rank's units in one f32 buffer, in unit order, each at the same place
// on every rank (ZeRO 2-3: those outside this rank's shards stay 0, so the
// buffer and its one all-reduce do not depend on the data rank), written back
// into what this rank holds (bf16: rounded once). Megatron-Core's
// finalize_model_grads sums its sequence-parallel norms the same way.
void PipelineExecutor::sum_norm_rows() {
  if (norm_sums_.size() == 0) return;
  struct Run {  // elements [lo, lo + n) of the flat parameters, at `at` of the buffer
    Chunk* c;
    int u;
    int64_t lo, n, at;
    int64_t in_shard;  // ZeRO 2-3: lo's place in this rank's shard of unit u
  };
  std::vector<Run> runs;
  int64_t at = 0;
  for (auto& c : chunks_)
    for (int u = c->first; u <= c->last; ++u) {
      const int64_t ulo = layout_.unit_offset(u), uhi = ulo + layout_.unit_numel(u);
      int64_t lo = ulo, hi = uhi;  // what this rank holds of the unit
      if (shard_grads_) {
        const ShardLayout& sl = *c->shard;
        lo = ulo + sl.begin(u - c->first);
        hi = std::min(uhi, lo + sl.stride(u - c->first));
      }
      for_each_norm_piece(norms_, ulo, uhi, [&](int64_t b, int64_t e) {  // the norm's piece in unit u
        const int64_t hb = std::max(b, lo), he = std::min(e, hi);
        if (hb < he) runs.push_back({c.get(), u, hb, he - hb, at + (hb - b), hb - lo});
        at += e - b;
      });
    }
  PO_ASSERT(static_cast<size_t>(at) * sizeof(float) == norm_sums_.size(), "pipeline: ", at,
            " norm elements for a buffer of ", norm_sums_.size() / sizeof(float));
  float* sums = norm_sums_.f32();
  backend::device_zero(sums, norm_sums_.size());
  std::vector<char> paged;  // ZeRO-3 paged: a run's elements out of the pages
  // Run r's elements as stored (f32 or bf16): in place, or out of the pages.
  auto stored = [&](const Run& r, bool out) -> char* {
    if (!shard_grads_) return static_cast<char*>(r.c->grads.data()) + static_cast<size_t>(r.lo - r.c->base) * stored_esz();
    const UnitShard g = shard_of(*r.c, r.u, false);
    if (!paged_shards_) return g.at(stored_esz()) + static_cast<size_t>(r.in_shard) * stored_esz();
    paged.resize(static_cast<size_t>(r.n) * stored_esz());
    if (out) shard_out(g, r.in_shard, r.n, paged.data());
    return paged.data();
  };
  for (const Run& r : runs) {
    const char* src = stored(r, true);
    if (bf16_)
      ops::bf16_to_f32(sums + r.at, reinterpret_cast<const uint16_t*>(src), r.n);
    else
      backend::device_copy(sums + r.at, src, static_cast<size_t>(r.n) * sizeof(float));
  }
  setup_.tensor->allreduce(sums, static_cast<size_t>(at), DType::kF32, comm::ReduceOp::kSum);
  std::vector<int> touched;
  for (const Run& r : runs) {
    char* dst = stored(r, false);
    if (bf16_)
      ops::f32_to_bf16(reinterpret_cast<uint16_t*>(dst), sums + r.at, r.n);
    else
      backend::device_copy(dst, sums + r.at, static_cast<size_t>(r.n) * sizeof(float));
    if (!paged_shards_) continue;
    shard_in(shard_of(*r.c, r.u, false), r.in_shard, r.n, dst);
    if (touched.empty() || touched.back() != r.u) touched.push_back(r.u);
  }
  for (int u : touched) shard_squares(u);  // (the squares summed as the unit landed are stale)
}

// ZeRO 0-1: the whole table on both copies.
void PipelineExecutor::sum_tied_pair() {
  if (!layout_.tied_trains() || (rank_ != emb_rank_ && rank_ != head_rank_)) return;
  const model::TensorSpec& wte = layout_.token_embedding();
  auto table = [&](tensor::Storage& g) {  // unit 0 is the buffer's first
    return static_cast<char*>(g.data()) + static_cast<size_t>(wte.offset) * stored_esz();
  };
  void* emb_at = nullptr;
  void* head_at = nullptr;
  if (rank_ == emb_rank_) emb_at = table(chunk_of_stage(0).grads);
  for (auto& c : chunks_)
    if (c->replica()) head_at = table(c->rep_grads);
  tied_pair(emb_at, head_at, 0, wte.numel());
}

// defer_lookup: the embedding's last micro-batch's lookup rows and tokens,
// kept until the step.
void PipelineExecutor::keep_lookup_tail(const float* rows, const int32_t* tokens, int64_t n) {
  PO_ASSERT(static_cast<size_t>(n) * sizeof(int32_t) == tail_tokens_.size(), "pipeline: ", n,
            " deferred lookup rows for ", tail_tokens_.size() / sizeof(int32_t));
  backend::device_copy(tail_rows_.data(), rows, tail_rows_.size());
  backend::from_host(tail_tokens_.data(), tokens, tail_tokens_.size());
}

// defer_lookup: every data rank's last lookup rows, added into the reduced
// position table (and an untied token table) in rank order (a tied table
// takes its rows in the pair).
void PipelineExecutor::add_lookup_tail() {
  if (!setup_.defer_lookup || rows_all_.size() == 0) return;
  const int64_t C = config_.n_embd, T = setup_.T, B = setup_.micro * setup_.dp;
  const auto count = static_cast<size_t>(B * T);
  const model::TensorSpec* pos = layout_.position_embedding();
  char* g = static_cast<char*>(chunk_of_stage(0).grads.data());  // (unit 0 is its first)
  auto at = [&](int64_t offset) { return g + static_cast<size_t>(offset) * stored_esz(); };
  setup_.data->all_gather(tail_tokens_.data(), tokens_all_.data(), count / static_cast<size_t>(setup_.dp),
                          DType::kI32);
  setup_.data->all_gather(tail_rows_.data(), rows_all_.data(), tail_rows_.size() / sizeof(float), DType::kF32);
  add_deferred_lookup(layout_.tied_trains() ? nullptr : at(layout_.token_embedding().offset),
                      pos != nullptr ? at(pos->offset) : nullptr, bf16_ ? DType::kBF16 : DType::kF32,
                      rows_all_.f32(), static_cast<const int32_t*>(tokens_all_.data()), B, T, C,
                      layout_.vocab_begin(), layout_.vocab_real());
}

double PipelineExecutor::step(double lr) {
  if (gathers_) gathers_->drain();  // (none outside a step: the update changes what they read)
  double norm = 0;
  if (shard_grads_) {  // the micro-batches' sums are in the shards once the last reductions land
    finish_reductions();
    wait_end_ns_ = now_ns();  // (the data group's gradient sums: what the backward may hide)
    sum_norm_rows();
    sum_tied_shards();
    norm = shard_norm();
  } else {
    // Vocabulary parallel: the pieces' rows of the head's gradient to its owner.
    vocab_gather_grads();
    // The data group's sums (the buckets the backward has not started and
    // the tied replicas start now), the deferred lookup rows after them,
    // then the tied table's H + E.
    if (setup_.data != nullptr) finish_sums();
    wait_end_ns_ = now_ns();  // (the data group's gradient sums: what the backward may hide)
    add_lookup_tail();
    sum_norm_rows();
    sum_tied_pair();
    norm = unit_norm();
  }
  const double clip = chunks_.front()->adam->clip_scale(norm);
  for (auto& c : chunks_) {
    update(*c, false, lr, clip);
    if (c->replica()) update(*c, true, lr, clip);
  }
  vocab_refresh();
  lr_known_ = false;  // (update_in_backward: the next begin_step gives the next one)
  early_last_ = std::exchange(early_count_, 0);
  early_micro_.clear();
  return norm;
}

// The whole reduced gradient's norm: per unit, over the tensor group, then
// over the stages (grad_norm.h's order).
double PipelineExecutor::unit_norm() {
  std::vector<double> sq(static_cast<size_t>(layout_.num_units()), 0.0);
  for (auto& c : chunks_)
    for (int u = c->first; u <= c->last; ++u) {
      SumOfSquares acc;
      const int64_t at = layout_.unit_offset(u) - c->base;
      if (bf16_)
        add_counted_flat(acc, layout_.unit_offset(u), static_cast<const uint16_t*>(c->grads.data()) + at,
                         layout_.unit_numel(u), uncounted_);
      else
        add_counted_flat(acc, layout_.unit_offset(u), c->grads.f32() + at, layout_.unit_numel(u),
                         uncounted_);
      sq[static_cast<size_t>(u)] = acc.total();
    }
  sum_units_over(sq, setup_.tensor);
  sum_units_over(sq, setup_.pipe);  // each unit's owner's value, the others' 0
  return std::sqrt(sum_in_unit_order(sq));
}

// One AdamW step of a chunk's units (or of its replica of unit 0) from the
// full reduced gradient, which starts the next step at zero: bf16, the fp32
// master (this rank's shard) takes the update from the bf16 gradient (ZeRO
// 2-3: its shard), rounded into the stored parameters; fp32 ZeRO-1 copies
// this rank's shard of the gradient out first. With updates in the
// backward, the pages it left. ZeRO 1-2 then all-gather the updated shards
// unit by unit (ZeRO-3 keeps its shard).
void PipelineExecutor::update(Chunk& c, bool replica, double lr, double clip) {
  const ShardLayout& sl = replica ? *c.rep_shard : *c.shard;
  optim::AdamW& adam = replica ? *c.rep_adam : *c.adam;
  tensor::Storage& params = replica ? c.rep_params : c.params;
  tensor::Storage& grads = replica ? c.rep_grads : c.grads;
  if (early_ && lr_known_) {
    finish_early(c, replica, lr);
  } else if (bf16_) {
    adam.apply_mixed((replica ? c.rep_master : c.master).f32(), static_cast<const uint16_t*>(grads.data()),
                     shard_grads_, static_cast<uint16_t*>(params.data()), lr, clip);
  } else if (sl.ranks() == 1 || shard_grads_) {  // (ZeRO 2-3: the gradient is this rank's shard)
    adam.apply(params.f32(), grads.f32(), lr, clip);
  } else {
    for (int i = 0; i < sl.num_units(); ++i) copy_grad_shard(c, replica, i);
    adam.apply(params.f32(), (replica ? c.rep_grad_shard : c.grad_shard).f32(), lr, clip);
  }
  const DType stored = bf16_ ? DType::kBF16 : DType::kF32;
  char* p = static_cast<char*>(params.data());
  int64_t at = 0;  // unit i's first element in the buffers
  for (int i = 0; sl.ranks() > 1 && !shard_params_ && i < sl.num_units(); at += sl.unit_numel(i), ++i)
    gather_unit(sl, i, p + static_cast<size_t>(at + sl.begin(i)) * stored_esz(), p + static_cast<size_t>(at) * stored_esz(),
                stored);
  backend::device_zero(grads.data(), grads.size());
}


// ZeRO 2-3 (sharded over dp > 1): a unit's accumulator is padded to ranks ×
// stride, the blocks a reduce-scatter sends.
int64_t PipelineExecutor::acc_numel(int u) const { return acc_layout(layout_.unit_numel(u), setup_).numel; }

// ZeRO 2-3's tied pair: the table's elements in this rank's shard of unit 0
// (the same cut on both copies); H is in the head's shard (the replica's,
// or on one rank the embedding chunk's). Paged shards: the table's part
// out of the pages and back, and unit 0's squares counted again.
void PipelineExecutor::sum_tied_shards() {
  if (!layout_.tied_trains() || (rank_ != emb_rank_ && rank_ != head_rank_)) return;
  const model::TensorSpec& wte = layout_.token_embedding();
  const int64_t at = wte.offset - layout_.unit_offset(0), n = wte.numel();
  std::vector<UnitShard> copies;  // (the embedding's, then the head's replica)
  if (rank_ == emb_rank_) copies.push_back(shard_of(chunk_of_stage(0), 0, false));
  for (auto& c : chunks_)
    if (c->replica()) copies.push_back(shard_of(*c, 0, false));
  const TableShard t = table_in_shard(*copies.front().layout, 0, at, n);
  const int64_t k = t.hi - t.lo;
  std::vector<std::vector<char>> out(copies.size());
  void* table[2] = {nullptr, nullptr};  // (the embedding's, the head's)
  for (size_t i = 0; i < copies.size(); ++i) {
    const int which = copies[i].counted ? 0 : 1;
    if (!paged_shards_) {
      table[which] = copies[i].at(stored_esz()) + static_cast<size_t>(t.first) * stored_esz();
      continue;
    }
    out[i].resize(static_cast<size_t>(std::max<int64_t>(k, 0)) * stored_esz());
    if (k > 0) shard_out(copies[i], t.first, k, out[i].data());
    table[which] = out[i].data();
  }
  tied_pair(table[0], table[1], t.lo, t.hi);
  if (!paged_shards_) return;
  for (size_t i = 0; i < copies.size(); ++i)
    if (k > 0) shard_in(copies[i], t.first, k, out[i].data());
  if (rank_ == emb_rank_) shard_squares(0);
}

// The shards' global norm in grad_norm.h's order: each
// unit's counted squares of this rank's shard (the pipeline group puts them
// together), added in unit order; the data group's totals in rank order;
// then the tensor group's.
double PipelineExecutor::shard_norm() {
  std::vector<double> sq(static_cast<size_t>(layout_.num_units()), 0.0);
  for (auto& c : chunks_)
    for (int u = c->first; u <= c->last; ++u) {
      if (paged_shards_) {  // summed as the unit's last reduction landed (add_into_shard)
        sq[static_cast<size_t>(u)] = paged_sq_[static_cast<size_t>(u)];
        continue;
      }
      const ShardLayout& sl = *c->shard;
      const int i = u - c->first;
      const int64_t lo = layout_.unit_offset(u) + sl.begin(i);
      SumOfSquares acc;
      if (bf16_)
        add_counted_flat(acc, lo, static_cast<const uint16_t*>(c->grads.data()) + sl.local_offset(i),
                         sl.stride(i), uncounted_);
      else
        add_counted_flat(acc, lo, c->grads.f32() + sl.local_offset(i), sl.stride(i), uncounted_);
      sq[static_cast<size_t>(u)] = acc.total();
    }
  sum_units_over(sq, setup_.pipe);  // each unit's owner's value, the others' 0
  double mine = 0;
  for (double s : sq) mine += s;
  for (comm::Communicator* group : {setup_.data, setup_.tensor}) {
    if (group == nullptr) continue;
    std::vector<double> all(static_cast<size_t>(group->size()));
    group->all_gather(&mine, all.data(), 2, DType::kI32);  // doubles, bit-exact
    mine = 0;
    for (double s : all) mine += s;
  }
  return std::sqrt(mine);
}

}  // namespace po::parallel
