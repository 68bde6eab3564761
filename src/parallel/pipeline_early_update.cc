// Updates during the backward (pipeline_executor.h, PipelineSetup::
// update_in_backward): with paged state and no clipping (the scale is 1,
// known before the norm), each state page of a chunk's AdamW is updated as
// soon as every unit whose gradient it holds is final, while the backward
// goes on; the step updates the rest. A unit is final
// - ZeRO 2-3: when its last micro-batch's reduction has been added into
//   its shard (add_into_shard), paged or not;
// - ZeRO 0-1 on one data rank: when every micro-batch's backward has
//   finished it (its bf16 part rounded in);
// - ZeRO 0-1 over dp > 1: when its bucket's all-reduce is seen landed (at
//   the model's hooks; a staged bf16 sum waits for the step).
// Unit 0 (the tied pair, the deferred lookup rows) and a vocabulary-parallel
// head wait for the step; under sequence parallel every page does (a block
// is final once the step has summed its norms over the tensor group). A page's update is the sweep's arithmetic on the
// same values, so the bits are the sweep's; how many pages go early may
// depend on timing over dp > 1 at ZeRO 0-1, never what they compute.
#include "parallel/pipeline_executor.h"
#include "parallel/pipeline_executor_state.h"

#include <algorithm>

#include "backend/device.h"
#include "core/error.h"

namespace po::parallel {
using namespace executor_detail;  // its helpers and names (pipeline_executor_state.h)

// Which units each AdamW's pages hold (after enable_paging).
void PipelineExecutor::setup_early() {
  if (!early_) return;
  auto pages_of = [](optim::AdamW& a, const ShardLayout& sl, EarlyPages& e) {
    const size_t n = a.paged_state()->state_pages();
    e.units.assign(n, 0);
    for (int i = 0; i < sl.num_units(); ++i) {
      if (sl.stride(i) == 0) continue;
      const auto [first, last] = a.pages_of(sl.local_offset(i), sl.stride(i));
      for (size_t p = first; p <= last; ++p) ++e.units[p];
    }
    e.waiting = e.units;
    e.done.assign(n, 0);
  };
  for (auto& c : chunks_) {
    pages_of(*c->adam, *c->shard, c->early);
    if (c->replica()) pages_of(*c->rep_adam, *c->rep_shard, c->rep_early);
  }
}

void PipelineExecutor::begin_step(double lr) {
  step_lr_ = lr;
  lr_known_ = true;
}

// Where a page's update finds what the pages do not hold (the arguments
// update() gives apply / apply_mixed).
optim::OutsidePages PipelineExecutor::outside_pages(Chunk& c, bool replica) {
  optim::OutsidePages o;
  if (paged_shards_) return o;  // all in the pages
  tensor::Storage& params = replica ? c.rep_params : c.params;
  tensor::Storage& grads = replica ? c.rep_grads : c.grads;
  if (bf16_) {
    o.params_out = static_cast<uint16_t*>(params.data());
    o.grads_bf16 = static_cast<const uint16_t*>(grads.data());
    o.grads_by_state = shard_grads_;
    return o;
  }
  const ShardLayout& sl = replica ? *c.rep_shard : *c.shard;
  o.params = params.f32();
  o.grads_state = sl.ranks() > 1 && !shard_grads_ ? (replica ? c.rep_grad_shard : c.grad_shard).f32() : grads.f32();
  return o;
}

// fp32 ZeRO-1: this rank's shard of unit i's reduced gradient, where the update reads it.
void PipelineExecutor::copy_grad_shard(Chunk& c, bool replica, int i) {
  const ShardLayout& sl = replica ? *c.rep_shard : *c.shard;
  if (bf16_ || shard_grads_ || sl.ranks() == 1) return;
  float* shard = (replica ? c.rep_grad_shard : c.grad_shard).f32();
  const float* grads = (replica ? c.rep_grads : c.grads).f32();
  const int64_t at = replica ? 0 : layout_.unit_offset(c.first + i) - c.base;  // unit i's first element in the buffers
  backend::device_copy(shard + sl.local_offset(i), grads + at + sl.begin(i),
                       static_cast<size_t>(sl.owned(i)) * sizeof(float));
}

// Unit u of chunk c is final: the pages waiting for no other unit are
// updated now, from the top down as the backward walks, and the pages of
// the unit the backward finishes next start coming in.
void PipelineExecutor::early_unit_final(Chunk& c, int u) {
  if (!early_ || !lr_known_ || u == 0 || (vocab_ && u == layout_.head_unit()) || !c.holds(u)) return;
  const ShardLayout& sl = *c.shard;
  const int i = u - c.first;
  if (sl.stride(i) == 0) return;
  optim::AdamW& a = *c.adam;
  EarlyPages& e = c.early;
  copy_grad_shard(c, false, i);
  const optim::OutsidePages outside = outside_pages(c, false);
  const auto [first, last] = a.pages_of(sl.local_offset(i), sl.stride(i));
  for (auto p = static_cast<int64_t>(last); p >= static_cast<int64_t>(first); --p) {
    const auto k = static_cast<size_t>(p);
    if (--e.waiting[k] > 0 || e.done[k]) continue;
    if (!e.begun) {
      a.begin_paged_step();
      e.begun = true;
    }
    a.update_page(k, step_lr_, 1.0, outside);
    e.done[k] = 1;
    ++early_count_;
  }
  if (i == 0 || sl.stride(i - 1) == 0) return;
  memory::Pager& pager = a.paged_state()->pager();
  const auto [next_first, next_last] = a.pages_of(sl.local_offset(i - 1), sl.stride(i - 1));
  const auto top = static_cast<int64_t>(next_last);
  const auto bottom = std::max(static_cast<int64_t>(next_first), top - static_cast<int64_t>(pager.usable_frames() / 2) + 1);
  for (int64_t p = top; p >= bottom; --p)
    if (!e.done[static_cast<size_t>(p)]) pager.prefetch(static_cast<size_t>(p));
}

// ZeRO 0-1 on one data rank: a unit is final once every micro-batch's
// backward has finished it.
void PipelineExecutor::early_finished(Chunk& c, int u) {
  if (!early_ || shard_grads_ || setup_.data != nullptr) return;
  if (++early_micro_[{c.stage, u}] == setup_.schedule.micro_batches) early_unit_final(c, u);
}

// ZeRO 0-1 over dp > 1: the units of every bucket whose all-reduce has
// landed (in place: a staged bf16 sum is rounded back at the step).
void PipelineExecutor::early_sums_landed() {
  if (!early_ || !lr_known_ || !sums_) return;
  sums_->landed([this](int chunk, int lo, int hi) {  // (setup_buckets adds chunks_ in order)
    Chunk& c = *chunks_[static_cast<size_t>(chunk)];
    PO_ASSERT(c.sum_chunk == chunk, "pipeline: bucket sums of chunk ", chunk, " landed on chunk ", c.sum_chunk);
    for (int u = hi; u >= lo; --u) early_unit_final(c, u);
  });
}

// The step's end: the pages the backward did not update, then the counts start over.
void PipelineExecutor::finish_early(Chunk& c, bool replica, double lr) {
  optim::AdamW& a = replica ? *c.rep_adam : *c.adam;
  EarlyPages& e = replica ? c.rep_early : c.early;
  const ShardLayout& sl = replica ? *c.rep_shard : *c.shard;
  PO_ASSERT(lr == step_lr_, "pipeline: step(", lr, ") after begin_step(", step_lr_, ")");
  for (int i = 0; i < sl.num_units(); ++i) copy_grad_shard(c, replica, i);
  if (!e.begun) a.begin_paged_step();
  const optim::OutsidePages outside = outside_pages(c, replica);
  for (size_t p = 0; p < e.done.size(); ++p)
    if (!e.done[p]) a.update_page(p, lr, 1.0, outside);
  e.waiting = e.units;
  std::fill(e.done.begin(), e.done.end(), 0);
  e.begun = false;
}

}  // namespace po::parallel
