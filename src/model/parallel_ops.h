// The collectives the model's math needs when a layer is split across ranks
// (tensor, sequence and context parallel), as an interface: the model calls
// it at Megatron's conjugate points and never sees comm. The parallel layer
// implements it over its process groups; at tp = cp = 1 it is NullParallelOps,
// whose calls do nothing (a one-rank all-reduce is the identity).
//
// Points in a block (Megatron's f and g, Shoeybi et al. 2019):
//   forward:  after the row-parallel o_proj and down_proj GEMMs, g = all-reduce
//             of their [B·T, C] outputs over the tensor group;
//   backward: after the column-parallel q|k|v and gate|up (fc) input-gradient
//             GEMMs, f's conjugate = all-reduce of the [B·T, C] input gradients.
// A row-parallel bias is added by tp rank 0 alone, so the group's sum holds it
// once.
//
// With sequence parallel (Korthikanti et al. 2022) the norm and residual
// regions hold B·T/tp rows per rank, and each all-reduce above becomes its
// two halves: an all-gather of the norm's output before the column-parallel
// GEMM (its conjugate, a reduce-scatter of the input gradient) and a
// reduce-scatter of the row-parallel GEMM's partial sums (its conjugate, an
// all-gather of the output gradient). The vocabulary-parallel embedding sums its masked
// lookups, and the vocabulary-parallel loss reduces three numbers per row
// (max, sum of exponentials, target logit) and the head's input gradient.
//
// Every member of the group gets the same bits from each reduction: the
// replicated activations, and so the replicated parameters, stay identical.
#pragma once

#include <cstdint>
#include <cstring>

namespace po::model {

class ParallelOps {
 public:
  virtual ~ParallelOps() = default;
  // Ranks of the tensor-parallel group and this rank's place in it.
  virtual int tp_size() const = 0;
  virtual int tp_rank() const = 0;
  // x[n] = sum of x[n] over the tensor-parallel group, in a fixed rank order.
  virtual void tp_all_reduce(float* x, int64_t n) = 0;
  virtual void tp_all_reduce(double* x, int64_t n) = 0;
  // x[n] = elementwise max over the tensor-parallel group.
  virtual void tp_all_reduce_max(float* x, int64_t n) = 0;
  // out[tp·n] = every rank's x[n], in rank order.
  virtual void tp_all_gather(const float* x, float* out, int64_t n) = 0;
  // out[n] = block tp_rank() of the group's sum of x[tp·n], in a fixed order.
  virtual void tp_reduce_scatter(const float* x, float* out, int64_t n) = 0;

  // Non-blocking forms, for the backward to overlap a collective with the
  // weight-gradient GEMM (parallel.tp_overlap): issued now, their results
  // (and their buffers) are the caller's again after tp_wait(). The default
  // runs them at once: the same bits, no overlap.
  virtual void tp_all_reduce_async(float* x, int64_t n) { tp_all_reduce(x, n); }
  virtual void tp_all_gather_async(const float* x, float* out, int64_t n) {
    tp_all_gather(x, out, n);
  }
  virtual void tp_reduce_scatter_async(const float* x, float* out, int64_t n) {
    tp_reduce_scatter(x, out, n);
  }
  // Every collective issued asynchronously has completed.
  virtual void tp_wait() {}
};

class NullParallelOps final : public ParallelOps {
 public:
  int tp_size() const override { return 1; }
  int tp_rank() const override { return 0; }
  void tp_all_reduce(float*, int64_t) override {}
  void tp_all_reduce(double*, int64_t) override {}
  void tp_all_reduce_max(float*, int64_t) override {}
  void tp_all_gather(const float* x, float* out, int64_t n) override { copy(x, out, n); }
  void tp_reduce_scatter(const float* x, float* out, int64_t n) override { copy(x, out, n); }
  // The process-wide instance models use unless given another.
  static NullParallelOps& instance() {
    static NullParallelOps ops;
    return ops;
  }

 private:
  static void copy(const float* x, float* out, int64_t n) {
    if (x != out) std::memcpy(out, x, static_cast<size_t>(n) * sizeof(float));
  }
};

}  // namespace po::model
