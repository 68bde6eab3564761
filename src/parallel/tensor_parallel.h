// Tensor parallel's collectives for the model (model/parallel_ops.h), over
// the tensor group of the device mesh (comm/mesh.h: tp consecutive ranks).
//
// Every member of the group must get the same bits from every reduction, or
// the replicated activations, and with them the replicated parameters, drift
// apart. f32 sums and maxima go through the communicator's all-reduce: the
// ring (comm/mpi/ring.h) above its minimum size, which reduces each chunk
// once in a fixed order and hands the result around, and MPI's all-reduce
// below it, whose results agree on every rank for commutative operations
// (every rank combines the same pairs). Double sums (the loss's per-row
// sums of exponentials) have no wire type: they are all-gathered as raw bits
// and added in rank order on every rank.
//
// The time spent in these calls is counted (it is on the critical path:
// nothing else runs while a tensor-parallel all-reduce waits).
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "model/parallel_ops.h"

namespace po::parallel {

class TensorParallelOps final : public model::ParallelOps {
 public:
  // `group` must outlive this object.
  explicit TensorParallelOps(comm::Communicator& group) : group_(group) {}

  int tp_size() const override { return group_.size(); }
  int tp_rank() const override { return group_.rank(); }
  void tp_all_reduce(float* x, int64_t n) override;
  void tp_all_reduce(double* x, int64_t n) override;
  void tp_all_reduce_max(float* x, int64_t n) override;
  void tp_all_gather(const float* x, float* out, int64_t n) override;
  void tp_reduce_scatter(const float* x, float* out, int64_t n) override;
  void tp_all_reduce_async(float* x, int64_t n) override;
  void tp_all_gather_async(const float* x, float* out, int64_t n) override;
  void tp_reduce_scatter_async(const float* x, float* out, int64_t n) override;
  void tp_wait() override;

  // Seconds spent in this group's collectives since the last call: blocked
  // in them (the exposed time; an asynchronous one counts from issue to its
  // tp_wait only where it had not finished).
  double take_seconds();
  comm::Communicator& group() { return group_; }

 private:
  comm::Communicator& group_;
  std::vector<double> gathered_;
  std::vector<comm::Work> pending_;
  double seconds_ = 0;
};

}  // namespace po::parallel
