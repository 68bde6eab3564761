// The data group's gradient sums of ZeRO 0-1 at dp > 1 (pipeline_executor.h).
// Each chunk's units are summed in DataParallel's buckets (grad_buckets:
// consecutive units of about parallel.bucket_size, in the order the backward
// finishes them). With parallel.overlap_comm a bucket's all-reduce starts,
// non-blocking, as soon as every micro-batch's backward has finished its
// units, and runs while the backward goes on; the step starts the rest and
// waits for all (finish_sums). A bucket is the same in-place all-reduce of
// the same elements whenever it starts, so overlap changes no bit, and at
// pp = 1 the buckets are DataParallel's.
//
// A unit is finished by a micro-batch when the model's grads_ready hook
// reports it during a whole backward (kBackward), or, for a split backward,
// when the micro-batch's weight half (kBackwardWeight) has run: the input
// half reports units whose weight gradients are still to come. Buckets with
// unit 0 (the tied pair's table, the deferred lookup rows, the one the
// backward finishes last) or the vocabulary-parallel head (its rows come
// from the other stages at the step) always wait for the step.
#include "parallel/pipeline_executor.h"
#include "parallel/pipeline_executor_state.h"

#include <algorithm>
#include <utility>

#include "backend/ops.h"
#include "core/timer.h"

namespace po::parallel {
namespace ops = po::backend::cpu;
using namespace executor_detail;  // its helpers and names (pipeline_executor_state.h)

void PipelineExecutor::setup_buckets() {
  if (setup_.data == nullptr || shard_grads_) return;
  for (auto& c : chunks_) {
    c->buckets = grad_buckets(layout_, c->first, c->last, setup_);
    c->bucket_of.assign(static_cast<size_t>(c->last - c->first + 1), 0);
    for (size_t b = 0; b < c->buckets.size(); ++b)
      for (int u = c->buckets[b].first; u <= c->buckets[b].second; ++u)
        c->bucket_of[static_cast<size_t>(u - c->first)] = static_cast<int>(b);
    c->started.assign(c->buckets.size(), 0);
    c->finished.assign(c->bucket_of.size(), 0);
    c->unfinished.clear();
    for (const auto& [lo, hi] : c->buckets) c->unfinished.push_back(hi - lo + 1);
  }
}

void PipelineExecutor::unit_finished(Chunk& c, int u) {
  if (c.buckets.empty() || !c.holds(u)) return;
  for (Sum& s : sums_) s.work.test();  // (progress for the ones in flight)
  const auto i = static_cast<size_t>(u - c.first);
  if (++c.finished[i] != setup_.schedule.micro_batches) return;
  const auto b = static_cast<size_t>(c.bucket_of[i]);
  if (--c.unfinished[b] > 0 || !setup_.overlap_comm) return;
  const auto [lo, hi] = c.buckets[b];
  const int head = layout_.head_unit();
  if (lo == 0 || (vocab_ && lo <= head && head <= hi)) return;  // (at the step)
  start_sum(c, b);
  ++started_sums_;
}

void PipelineExecutor::chunk_finished(Chunk& c) {
  for (int u = c.last; u >= c.first; --u) unit_finished(c, u);
}

void PipelineExecutor::start_sum(Chunk& c, size_t b) {
  const auto [lo, hi] = c.buckets[b];
  c.started[b] = 1;
  const int64_t n = layout_.unit_offset(hi + 1) - layout_.unit_offset(lo);
  void* g = static_cast<char*>(c.grads.data()) + static_cast<size_t>(layout_.unit_offset(lo) - c.base) * stored_esz();
  Sum s;
  s.chunk = &c;
  if (!bf16_) {
    s.work = setup_.data->iallreduce(g, static_cast<size_t>(n), DType::kF32, comm::ReduceOp::kSum);
  } else if (setup_.reduce_bf16) {
    s.work = setup_.data->iallreduce(g, static_cast<size_t>(n), DType::kBF16, comm::ReduceOp::kSum);
  } else {  // one unit (grad_buckets) widened into the one staging buffer: the previous one first
    narrow_staged();
    ops::bf16_to_f32(staging_.f32(), static_cast<const uint16_t*>(g), n);
    s.work = setup_.data->iallreduce(staging_.f32(), static_cast<size_t>(n), DType::kF32, comm::ReduceOp::kSum);
    s.staged = lo;
  }
  sums_.push_back(std::move(s));
}

// The sum in the staging buffer (if any), waited and rounded back into its unit.
void PipelineExecutor::narrow_staged() {
  for (Sum& s : sums_) {
    if (s.staged < 0) continue;
    s.work.wait();
    const int u = s.staged;
    auto* g = static_cast<uint16_t*>(s.chunk->grads.data()) + (layout_.unit_offset(u) - s.chunk->base);
    ops::f32_to_bf16(g, staging_.f32(), layout_.unit_numel(u));
    s.staged = -1;
  }
}

void PipelineExecutor::finish_sums() {
  core::Timer wait;
  early_sums_ = std::exchange(started_sums_, 0);
  all_sums_ = 0;
  for (auto& c : chunks_) {
    all_sums_ += static_cast<int>(c->buckets.size());
    for (size_t b = 0; b < c->buckets.size(); ++b)
      if (!c->started[b]) start_sum(*c, b);
  }
  narrow_staged();
  for (Sum& s : sums_) s.work.wait();
  sums_.clear();
  sum_wait_s_ = wait.seconds();
  for (auto& c : chunks_) {  // the next step's
    std::fill(c->started.begin(), c->started.end(), 0);
    std::fill(c->finished.begin(), c->finished.end(), 0);
    for (size_t b = 0; b < c->buckets.size(); ++b)
      c->unfinished[b] = c->buckets[b].second - c->buckets[b].first + 1;
  }
}

// The data group's sum of stored gradients: fp32 in place; bf16 over the
// wire in bf16, or (parallel.reduce_dtype fp32) widened unit by unit into
// an f32 staging buffer, summed, and rounded back, as DataParallel does.
void PipelineExecutor::allreduce_grads(void* grads, int first, int last) {
  const int64_t n = layout_.unit_offset(last + 1) - layout_.unit_offset(first);
  if (!bf16_) {
    setup_.data->allreduce(grads, static_cast<size_t>(n), DType::kF32, comm::ReduceOp::kSum);
    return;
  }
  if (setup_.reduce_bf16) {
    setup_.data->allreduce(grads, static_cast<size_t>(n), DType::kBF16, comm::ReduceOp::kSum);
    return;
  }
  auto* g = static_cast<uint16_t*>(grads);
  for (int u = first; u <= last; ++u) {
    const int64_t k = layout_.unit_numel(u);
    ops::bf16_to_f32(staging_.f32(), g, k);
    setup_.data->allreduce(staging_.f32(), static_cast<size_t>(k), DType::kF32, comm::ReduceOp::kSum);
    ops::f32_to_bf16(g, staging_.f32(), k);
    g += k;
  }
}

}  // namespace po::parallel
