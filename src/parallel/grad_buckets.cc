// Stages 0-1: gradients summed over the group in buckets of consecutive
// units, each all-reduced once the backward has finished its lowest unit (or
// all after the backward without overlap); bf16 gradients summed in fp32 go
// through at most kMaxStaged staging buffers at once. The deferred embedding's
// lookup rows are all-gathered at the end of the backward.
#include "parallel/data_parallel.h"

#include <algorithm>

#include "backend/ops.h"
#include "core/timer.h"
#include "parallel/units.h"

namespace po::parallel {
namespace ops = po::backend::cpu;
using tensor::DType;

// Buckets of consecutive units in the order the backward finishes them.
std::vector<std::pair<int, int>> DataParallel::bucket_units(const std::vector<int64_t>& unit_numel,
                                                            size_t esz, uint64_t bucket_bytes,
                                                            bool defer) {
  std::vector<std::pair<int, int>> out;
  const uint64_t limit = std::max<uint64_t>(1, bucket_bytes);
  int hi = static_cast<int>(unit_numel.size()) - 1;
  while (hi >= 0) {
    int lo = hi;
    uint64_t bytes = static_cast<uint64_t>(unit_numel[static_cast<size_t>(lo)]) * esz;
    // With the embedding deferred, unit 0 goes alone (it is ready first),
    // and so does unit 1: the backward finishes it last, so nothing can
    // hide its reduction and it should be as short as possible.
    const int floor = !defer || hi == 0 ? 0 : hi == 1 ? 1 : 2;
    while (lo > floor && bytes < limit)
      bytes += static_cast<uint64_t>(unit_numel[static_cast<size_t>(--lo)]) * esz;
    out.emplace_back(lo, hi);
    hi = lo - 1;
  }
  return out;
}

std::function<void(int)> DataParallel::unit_ready() {
  if (options_.zero_stage >= 2) return {};
  if (group_ == nullptr) {  // one rank: a unit is final when its backward ends
    if (!early_) return {};
    return [this](int unit) { unit_final(unit); };
  }
  if (!options_.overlap) return {};
  return [this](int unit) { on_unit_ready(unit); };
}

void DataParallel::on_unit_ready(int unit) {
  for (auto& p : pending_) p.work.test();  // MPI progresses inside its calls
  if (unit == buckets_[static_cast<size_t>(bucket_of_[static_cast<size_t>(unit)])].lo)
    issue_allreduce(unit);
  if (early_) fire_reduced_buckets();
}

void DataParallel::issue_allreduce(int unit) {
  const int index = bucket_of_[static_cast<size_t>(unit)];
  const Bucket& b = buckets_[static_cast<size_t>(index)];
  Pending p;
  p.bucket = index;
  if (!bf16()) {
    p.work = group_->iallreduce(model_.grads() + b.offset, static_cast<size_t>(b.numel),
                                DType::kF32, comm::ReduceOp::kSum);
  } else if (options_.reduce_dtype == DType::kBF16) {
    p.work = group_->iallreduce(units_->full_grads() + b.offset, static_cast<size_t>(b.numel),
                                DType::kBF16, comm::ReduceOp::kSum);
  } else {  // bf16 gradients summed in fp32: staged, a bounded number at once
    size_t staged = 0;
    for (const Pending& q : pending_) staged += q.staged.size() == 0 ? 0 : 1;
    for (auto it = pending_.begin(); staged >= kMaxStaged && it != pending_.end(); ++it)
      if (it->staged.size() != 0) {
        const double before = comm_wait_s_;
        finish(*it);
        staged_wait_s_ += comm_wait_s_ - before;
        --staged;
      }
    p.staged = tensor::Storage(static_cast<size_t>(b.numel) * sizeof(float));
    ops::bf16_to_f32(p.staged.f32(), units_->full_grads() + b.offset, b.numel);
    p.work = group_->iallreduce(p.staged.f32(), static_cast<size_t>(b.numel), DType::kF32,
                                comm::ReduceOp::kSum);
  }
  pending_.push_back(std::move(p));
}

// Waits for one all-reduce (timed) and narrows a staged one back to bf16.
void DataParallel::finish(Pending& p) {
  if (p.bucket < 0) return;
  if (!p.work.done()) {
    core::Timer wait;
    p.work.wait();
    comm_wait_s_ += wait.seconds();
  }
  if (p.staged.size() != 0) {
    const Bucket& b = buckets_[static_cast<size_t>(p.bucket)];
    ops::f32_to_bf16(units_->full_grads() + b.offset, p.staged.f32(), b.numel);
    p.staged = tensor::Storage();
  }
  p.bucket = -1;
}

void DataParallel::backward_done(const int32_t* tokens) {
  backward_end_ns_ = now_ns();
  if (group_ == nullptr || options_.zero_stage >= 2) return;
  if (!options_.overlap)  // every unit after the backward: the comm time, unhidden
    for (int u = model_.num_units() - 1; u >= 0; --u) on_unit_ready(u);
  if (defer_embedding_) {
    const size_t rows = static_cast<size_t>(model_.batch() * model_.seq_len());
    Pending t, g;
    t.work = group_->iall_gather(tokens, lookup_tokens_.data(), rows, DType::kI32);
    g.work = group_->iall_gather(model_.embedding_output_grad(), lookup_grads_.f32(),
                                 rows * static_cast<size_t>(model_.config().n_embd), DType::kF32);
    pending_.push_back(std::move(t));
    pending_.push_back(std::move(g));
  }
  if (early_) fire_reduced_buckets();
}

// Stages 0-1: the buckets whose all-reduce has landed make their units final
// (the deferred embedding's waits for its lookup rows, added in step()).
void DataParallel::fire_reduced_buckets() {
  for (Pending& p : pending_) {
    if (p.bucket < 0 || !p.work.test()) continue;
    const int index = p.bucket;
    finish(p);  // (a staged bf16 bucket is narrowed back first)
    for (int u = 0; u < model_.num_units(); ++u)
      if (bucket_of_[static_cast<size_t>(u)] == index && !(u == 0 && defer_embedding_)) unit_final(u);
  }
}

}  // namespace po::parallel
