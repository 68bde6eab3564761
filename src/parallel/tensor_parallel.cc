#include "parallel/tensor_parallel.h"

#include "core/timer.h"

namespace po::parallel {
using tensor::DType;

void TensorParallelOps::tp_all_reduce(float* x, int64_t n) {
  core::Timer t;
  group_.allreduce(x, static_cast<size_t>(n), DType::kF32, comm::ReduceOp::kSum);
  seconds_ += t.seconds();
}

void TensorParallelOps::tp_all_reduce_max(float* x, int64_t n) {
  core::Timer t;
  group_.allreduce(x, static_cast<size_t>(n), DType::kF32, comm::ReduceOp::kMax);
  seconds_ += t.seconds();
}

void TensorParallelOps::tp_all_gather(const float* x, float* out, int64_t n) {
  core::Timer t;
  group_.all_gather(x, out, static_cast<size_t>(n), DType::kF32);
  seconds_ += t.seconds();
}

void TensorParallelOps::tp_reduce_scatter(const float* x, float* out, int64_t n) {
  core::Timer t;
  group_.reduce_scatter(x, out, static_cast<size_t>(n), DType::kF32, comm::ReduceOp::kSum);
  seconds_ += t.seconds();
}

void TensorParallelOps::tp_all_reduce(double* x, int64_t n) {
  core::Timer t;
  const auto count = static_cast<size_t>(n);
  gathered_.resize(count * static_cast<size_t>(group_.size()));
  group_.all_gather(x, gathered_.data(), 2 * count, DType::kI32);  // doubles, bit-exact
  for (size_t i = 0; i < count; ++i) {
    double s = gathered_[i];
    for (size_t r = 1; r < static_cast<size_t>(group_.size()); ++r) s += gathered_[r * count + i];
    x[i] = s;
  }
  seconds_ += t.seconds();
}

void TensorParallelOps::tp_all_reduce_async(float* x, int64_t n) {
  core::Timer t;
  pending_.push_back(
      group_.iallreduce(x, static_cast<size_t>(n), DType::kF32, comm::ReduceOp::kSum));
  seconds_ += t.seconds();
}

void TensorParallelOps::tp_all_gather_async(const float* x, float* out, int64_t n) {
  core::Timer t;
  pending_.push_back(group_.iall_gather(x, out, static_cast<size_t>(n), DType::kF32));
  seconds_ += t.seconds();
}

void TensorParallelOps::tp_reduce_scatter_async(const float* x, float* out, int64_t n) {
  core::Timer t;
  pending_.push_back(
      group_.ireduce_scatter(x, out, static_cast<size_t>(n), DType::kF32, comm::ReduceOp::kSum));
  seconds_ += t.seconds();
}

void TensorParallelOps::tp_wait() {
  core::Timer t;
  for (comm::Work& w : pending_) w.wait();
  pending_.clear();
  seconds_ += t.seconds();
}

double TensorParallelOps::take_seconds() {
  const double s = seconds_;
  seconds_ = 0;
  return s;
}

}  // namespace po::parallel
