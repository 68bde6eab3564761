// The data group's gradient sums (pipeline_executor.h): ZeRO 0-1's buckets
// at dp > 1 (their state: bucket_sums.h), and ZeRO 2-3's reduce-scatters
// into the shards (below).
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
  sums_ = std::make_unique<BucketSums>(BucketSums::Config{
      .data = setup_.data,
      .bf16 = bf16_,
      .reduce_bf16 = setup_.reduce_bf16,
      .overlap = setup_.overlap_comm,
      .micro_batches = setup_.schedule.micro_batches,
      .staging_numel = largest_unit(),
  });
  const int head = layout_.head_unit();
  for (auto& c : chunks_) {
    std::vector<BucketSums::Bucket> buckets;
    for (const auto& [lo, hi] : grad_buckets(layout_, c->first, c->last, setup_))
      buckets.push_back({lo, hi, (lo == 0 && !setup_.defer_lookup) || (vocab_ && lo <= head && head <= hi)});
    c->sum_chunk = sums_->add_chunk(c->grads.data(), c->first, std::move(buckets),
                                    [this](int u) { return layout_.unit_offset(u); });
  }
}

void PipelineExecutor::unit_finished(Chunk& c, int u) {
  early_finished(c, u);  // (update_in_backward on one data rank)
  if (!sums_) return;
  sums_->unit_finished(c.sum_chunk, u);
  early_sums_landed();
}

void PipelineExecutor::chunk_finished(Chunk& c) {
  for (int u = c.last; u >= c.first; --u) unit_finished(c, u);
}

// The step's: the buckets not yet started and the tied replicas' sums.
void PipelineExecutor::finish_sums() {
  std::vector<std::pair<void*, int64_t>> replicas;
  for (auto& c : chunks_)
    if (c->replica()) replicas.emplace_back(c->rep_grads.data(), layout_.unit_numel(0));
  sums_->finish(replicas);
  sum_wait_s_ = sums_->wait_seconds();
  early_sums_ = sums_->overlapped();
  all_sums_ = sums_->buckets();
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
void PipelineExecutor::reduce_into_shard(Chunk& c, int u, const UnitAccumulators::Acc& a, bool final) {
  const UnitShard g = shard_of(c, u, false);
  const ShardLayout& sl = *g.layout;
  const int64_t stride = sl.stride(g.index);
  if (sl.ranks() == 1) {
    add_into_shard(g, a.buf, DType::kF32, final);
    return accs_->release(a);
  }
  const AccLayout at = acc_layout(layout_.unit_numel(u), setup_);
  char* bytes = reinterpret_cast<char*>(a.buf);
  const DType wire = setup_.reduce_bf16 ? DType::kBF16 : DType::kF32;
  const void* send = a.buf;
  if (wire == DType::kBF16) {
    ops::f32_to_bf16(reinterpret_cast<uint16_t*>(bytes + at.send_at), a.buf, stride * sl.ranks());
    send = bytes + at.send_at;
  }
  const void* recv = bytes + at.recv_at;
  comm::Work work = setup_.data->ireduce_scatter(send, bytes + at.recv_at, static_cast<size_t>(stride), wire,
                                                 comm::ReduceOp::kSum);
  accs_->hold(a, reductions_->next_seq());
  reductions_->post(
      std::move(work),
      [this, g, recv, wire, final, a] {
        add_into_shard(g, recv, wire, final);
        accs_->release(a);
      },
      a.ring >= 0 && setup_.overlap_comm);
}

// The step's: the reductions still in flight; overlapped_sums() reports
// this step's reduce-scatters (those not waited for at their post, all).
void PipelineExecutor::finish_reductions() {
  reductions_->finish();
  sum_wait_s_ = reductions_->wait_seconds();
  early_sums_ = reductions_->overlapped();
  all_sums_ = reductions_->posted();
}

}  // namespace po::parallel
