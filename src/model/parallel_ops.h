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

// Where a context-parallel rank's rows sit in the sequence (Liu et al.'s
// ring attention; the zig-zag balance of Megatron-LM and torchtitan): the
// model.seq_len positions are cut into 2·size chunks (zigzag) or size chunks
// (contiguous) of equal length, and this rank holds chunks rank and
// 2·size − 1 − rank (zigzag) or chunk rank alone, in that order, as its
// local sequence of T / size rows. At size 1 the local sequence is the
// sequence.
struct ContextSplit {
  int size = 1, rank = 0;
  bool zigzag = true;
  int total_chunks() const { return size == 1 ? 1 : zigzag ? 2 * size : size; }
  int local_chunks() const { return size > 1 && zigzag ? 2 : 1; }
  // The global index of local chunk i.
  int chunk(int i) const { return i == 0 ? rank : 2 * size - 1 - rank; }
  // The global position of local row t of a local sequence of T_local rows.
  int64_t position(int64_t t, int64_t T_local) const {
    const int64_t S = T_local / local_chunks();
    return chunk(static_cast<int>(t / S)) * S + t % S;
  }
};

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

  // Context parallel (ring attention over the context group). The model's
  // sequence is this rank's rows (cp_split()); positions follow the split,
  // and the causal attention over the whole sequence is these two calls,
  // with the model's own shapes: qkv [B, T, (NH + 2·NKV)·hs] of this rank's
  // T rows, out [B, T, NH·hs], lse [B, NH, T]; dqkv written.
  virtual ContextSplit cp_split() const { return {}; }
  virtual void cp_attention_forward(float* /*out*/, float* /*lse*/, const float* /*qkv*/,
                                    int64_t /*B*/, int64_t /*T*/, int64_t /*NH*/,
                                    int64_t /*NKV*/, int64_t /*hs*/) {}
  virtual void cp_attention_backward(float* /*dqkv*/, const float* /*dout*/,
                                     const float* /*qkv*/, const float* /*out*/,
                                     const float* /*lse*/, int64_t /*B*/, int64_t /*T*/,
                                     int64_t /*NH*/, int64_t /*NKV*/, int64_t /*hs*/) {}
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
