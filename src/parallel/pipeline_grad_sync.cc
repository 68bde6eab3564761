// The data group's gradient sums (pipeline_executor.h): ZeRO 0-1's buckets
// at dp > 1, and ZeRO 2-3's reduce-scatters into the shards (below).
//
// ZeRO 0-1: each chunk's units are summed in buckets (grad_buckets:
// consecutive units of about parallel.bucket_size, in the order the backward
// finishes them). With parallel.overlap_comm a bucket's all-reduce starts,
// non-blocking, as soon as every micro-batch's backward has finished its
// units, and runs while the backward goes on; the step starts the rest and
// waits for all, the tied replicas' sums with them (finish_sums). A bucket
// is the same in-place all-reduce of the same elements whenever it starts,
// so overlap changes no bit.
//
// A unit is finished by a micro-batch when the model's grads_ready hook
// reports it during a whole backward (kBackward), or, for a split backward,
// when the micro-batch's weight half (kBackwardWeight) has run: the input
// half reports units whose weight gradients are still to come. The bucket
// with unit 0 waits for the step (the backward finishes it last) unless the
// lookup is deferred (defer_lookup: unit 0 alone, final right after the
// head, its lookup rows added after the sum); a bucket with the
// vocabulary-parallel head (its rows come from the other stages at the
// step) always waits.
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
  }
  reset_buckets();
}

// A step's start: no bucket started, no unit finished.
void PipelineExecutor::reset_buckets() {
  for (auto& c : chunks_) {
    c->started.assign(c->buckets.size(), 0);
    c->finished.assign(c->bucket_of.size(), 0);
    c->unfinished.clear();
    for (const auto& [lo, hi] : c->buckets) c->unfinished.push_back(hi - lo + 1);
  }
}

void PipelineExecutor::unit_finished(Chunk& c, int u) {
  early_finished(c, u);  // (update_in_backward on one data rank)
  if (c.buckets.empty() || !c.holds(u)) return;
  for (Sum& s : sums_) s.work.test();  // (progress for the ones in flight)
  early_sums_landed();
  const auto i = static_cast<size_t>(u - c.first);
  if (++c.finished[i] != setup_.schedule.micro_batches) return;
  const auto b = static_cast<size_t>(c.bucket_of[i]);
  if (--c.unfinished[b] > 0 || !setup_.overlap_comm) return;
  const auto [lo, hi] = c.buckets[b];
  const int head = layout_.head_unit();
  // Unit 0's bucket waits for the step unless the lookup is deferred: then
  // the last micro-batch reports it right after the head (its lookup rows
  // are added after the sum), and its sum runs under the rest of the backward.
  if ((lo == 0 && !setup_.defer_lookup) || (vocab_ && lo <= head && head <= hi)) return;  // (at the step)
  start_bucket(c, b);
  ++started_sums_;
}

void PipelineExecutor::chunk_finished(Chunk& c) {
  for (int u = c.last; u >= c.first; --u) unit_finished(c, u);
}

void PipelineExecutor::start_bucket(Chunk& c, size_t b) {
  const auto [lo, hi] = c.buckets[b];
  c.started[b] = 1;
  start_sum(static_cast<char*>(c.grads.data()) + static_cast<size_t>(layout_.unit_offset(lo) - c.base) * stored_esz(),
            layout_.unit_offset(hi + 1) - layout_.unit_offset(lo));
  sums_.back().chunk = &c;  // (update_in_backward: its units are final once it lands)
  sums_.back().lo = lo;
  sums_.back().hi = hi;
}

// fp32 in place; bf16 over the wire in bf16, or (parallel.reduce_dtype
// fp32) widened into the one f32 staging buffer (one unit at most:
// grad_buckets), summed, and rounded back by narrow_staged.
void PipelineExecutor::start_sum(void* grads, int64_t n) {
  Sum s;
  if (!bf16_) {
    s.work = setup_.data->iallreduce(grads, static_cast<size_t>(n), DType::kF32, comm::ReduceOp::kSum);
  } else if (setup_.reduce_bf16) {
    s.work = setup_.data->iallreduce(grads, static_cast<size_t>(n), DType::kBF16, comm::ReduceOp::kSum);
  } else {  // the previous staged sum first
    narrow_staged();
    ops::bf16_to_f32(staging_.f32(), static_cast<const uint16_t*>(grads), n);
    s.work = setup_.data->iallreduce(staging_.f32(), static_cast<size_t>(n), DType::kF32, comm::ReduceOp::kSum);
    s.narrow_into = static_cast<uint16_t*>(grads);
    s.n = n;
  }
  sums_.push_back(std::move(s));
}

// The sum in the staging buffer (if any), waited and rounded back into its place.
void PipelineExecutor::narrow_staged() {
  for (Sum& s : sums_) {
    if (s.narrow_into == nullptr) continue;
    s.work.wait();
    ops::f32_to_bf16(s.narrow_into, staging_.f32(), s.n);
    s.narrow_into = nullptr;
  }
}

void PipelineExecutor::finish_sums() {
  core::Timer wait;
  early_sums_ = std::exchange(started_sums_, 0);
  all_sums_ = 0;
  for (auto& c : chunks_) {
    all_sums_ += static_cast<int>(c->buckets.size());
    for (size_t b = 0; b < c->buckets.size(); ++b)
      if (!c->started[b]) start_bucket(*c, b);
  }
  for (auto& c : chunks_)  // the tied head's replica of the table
    if (c->replica()) start_sum(c->rep_grads.data(), layout_.unit_numel(0));
  narrow_staged();
  for (Sum& s : sums_) s.work.wait();
  sums_.clear();
  sum_wait_s_ = wait.seconds();
  reset_buckets();
}

// ZeRO 2-3: one micro-batch's gradient of unit u (accumulator a, padded)
// into this rank's shard: summed over the data group by a reduce-scatter
// (in parallel.reduce_dtype), then added as stored; with one data rank the
// accumulator is the sum. add_block's arithmetic (unit_blocks.h), so the
// shards hold pp = 1's bits. With parallel.overlap_comm the reduction runs
// while the backward goes on; a deferred block's (its weight half ran
// later than the others') and, without overlap, every one completes at its
// post. What completes does so in post order, whatever landed first: the
// shards add the same blocks in the same order, and the accumulators held
// at every point do not depend on timing (predict counts them).
void PipelineExecutor::reduce_into_shard(Chunk& c, int u, const Acc& a, bool final) {
  const UnitShard g = shard_of(c, u, false);
  const ShardLayout& sl = *g.layout;
  const int64_t stride = sl.stride(g.index);
  if (sl.ranks() == 1) {
    add_into_shard(g, a.buf, DType::kF32, final);
    return release_acc(a.ring, a.slot, a.buf);
  }
  const AccLayout at = acc_layout(layout_.unit_numel(u), setup_);
  char* bytes = reinterpret_cast<char*>(a.buf);
  Reduction r;
  r.seq = posted_reductions_++;
  ++step_reductions_;
  r.dst = g;
  r.final = final;
  r.recv = bytes + at.recv_at;
  r.wire = setup_.reduce_bf16 ? DType::kBF16 : DType::kF32;
  r.stride = stride;
  r.ring = a.ring;
  r.slot = a.slot;
  r.acc = a.buf;
  const void* send = a.buf;
  if (r.wire == DType::kBF16) {
    ops::f32_to_bf16(reinterpret_cast<uint16_t*>(bytes + at.send_at), a.buf, stride * sl.ranks());
    send = bytes + at.send_at;
  }
  r.work = setup_.data->ireduce_scatter(send, bytes + at.recv_at, static_cast<size_t>(stride), r.wire,
                                        comm::ReduceOp::kSum);
  if (a.ring >= 0) rings_[a.ring].reduction[static_cast<size_t>(a.slot)] = r.seq;
  reductions_.push_back(std::move(r));
  if (a.ring < 0 || !setup_.overlap_comm) return complete_reductions(reductions_.back().seq);
  ++overlapped_reductions_;
}

// Every reduction posted up to `through` (its seq), oldest first: waited,
// added into its shard, its accumulator free again.
void PipelineExecutor::complete_reductions(int64_t through) {
  core::Timer wait;
  while (!reductions_.empty() && reductions_.front().seq <= through) {
    Reduction& r = reductions_.front();
    r.work.wait();
    add_into_shard(r.dst, r.recv, r.wire, r.final);
    release_acc(r.ring, r.slot, r.acc);
    reductions_.pop_front();
  }
  reduction_wait_s_ += wait.seconds();
}

// An accumulator whose sum has landed, free again: its ring's slot, or
// back to the deferred pool (ring -1).
void PipelineExecutor::release_acc(int ring, int slot, float* buf) {
  if (ring < 0)
    acc_free_.push_back(buf);
  else
    rings_[ring].reduction[static_cast<size_t>(slot)] = -1;
}

// The step's: the reductions still in flight; overlapped_sums() reports
// this step's reduce-scatters (those not waited for at their post, all).
void PipelineExecutor::finish_reductions() {
  complete_reductions(posted_reductions_ - 1);
  sum_wait_s_ = std::exchange(reduction_wait_s_, 0.0);
  early_sums_ = std::exchange(overlapped_reductions_, 0);
  all_sums_ = static_cast<int>(std::exchange(step_reductions_, 0));
}

}  // namespace po::parallel
