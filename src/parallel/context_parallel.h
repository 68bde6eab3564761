// Context parallel's collectives for the model (model/parallel_ops.h): the
// causal attention of a sequence whose rows are spread over the context group
// (comm/mesh.h's cp axis), each rank holding its ContextSplit's chunks.
//
// ring (parallel.cp_mode = "ring", Liu et al. 2023): each rank keeps its
// queries; the keys and values of every rank pass around the ring, rank r
// sending to r + 1 and receiving from r − 1, the next block's transfer posted
// before the block in hand is computed. In the backward the key/value blocks
// go round again with an accumulator of their gradients beside them: each
// rank computes its share into a buffer of its own while the accumulator
// arrives, adds it, and passes the accumulator on; after the last hop it is
// home. Query-side gradients stay local.
// allgather (Llama 3's): the keys and values are all-gathered once per layer
// (again in the backward), and the key/value gradients reduce-scattered back
// to their owners.
//
// Exactness: a query chunk's blocks are merged in a fixed order (the ring's
// step order, or ascending chunks when all-gathered), by the log-sum-exp in
// f32, and the key/value gradients are summed in the ring's fixed order, so
// results do not depend on timing. They differ from cp = 1's single online
// softmax by rounding (the blocks are normalised and merged).
//
// The tensor-parallel calls go to `inner` (the tensor group's ops, or the
// null ones at tp = 1).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "model/parallel_ops.h"
#include "tensor/tensor.h"

namespace po::parallel {

enum class CpMode { kRing, kAllGather };
// "ring" | "allgather"; throws naming parallel.cp_mode otherwise.
CpMode parse_cp_mode(const std::string& mode);

class ContextParallelOps final : public model::ParallelOps {
 public:
  // `group` and `inner` must outlive this object; this rank holds chunks of
  // ContextSplit{group.size(), group.rank(), zigzag}.
  ContextParallelOps(comm::Communicator& group, CpMode mode, bool zigzag,
                     model::ParallelOps& inner);

  int tp_size() const override { return inner_.tp_size(); }
  int tp_rank() const override { return inner_.tp_rank(); }
  void tp_all_reduce(float* x, int64_t n) override { inner_.tp_all_reduce(x, n); }
  void tp_all_reduce(double* x, int64_t n) override { inner_.tp_all_reduce(x, n); }
  void tp_all_reduce_max(float* x, int64_t n) override { inner_.tp_all_reduce_max(x, n); }
  void tp_all_gather(const float* x, float* out, int64_t n) override {
    inner_.tp_all_gather(x, out, n);
  }
  void tp_reduce_scatter(const float* x, float* out, int64_t n) override {
    inner_.tp_reduce_scatter(x, out, n);
  }
  void tp_all_reduce_async(float* x, int64_t n) override { inner_.tp_all_reduce_async(x, n); }
  void tp_all_gather_async(const float* x, float* out, int64_t n) override {
    inner_.tp_all_gather_async(x, out, n);
  }
  void tp_reduce_scatter_async(const float* x, float* out, int64_t n) override {
    inner_.tp_reduce_scatter_async(x, out, n);
  }
  void tp_wait() override { inner_.tp_wait(); }

  model::ContextSplit cp_split() const override { return split_; }
  void cp_attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                            int64_t NH, int64_t NKV, int64_t hs) override;
  void cp_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                             const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                             int64_t hs) override;

  // Seconds blocked on the context group since the last call (communication
  // the attention did not hide), and seconds in the attention blocks.
  double take_wait_seconds();
  double take_attention_seconds();
  // Bytes of the ring's (or the gather's) buffers once the attention has
  // run (compute pool, besides the model's activations; freed with this
  // object), and that figure predicted for a micro-batch of B sequences of
  // T_local rows per rank and kv_width = NKV·hs.
  size_t buffer_bytes() const { return storage_.size(); }
  static size_t predicted_buffer_bytes(CpMode mode, int cp, int64_t B, int64_t T_local,
                                       int64_t kv_width);
  comm::Communicator& group() { return group_; }

 private:
  struct Shape {
    int64_t B, T, NH, NKV, hs;
    int64_t kv() const { return 2 * NKV * hs; }
    int64_t qkv() const { return (NH + 2 * NKV) * hs; }
  };
  // This rank's keys and values [B, T, 2·NKV·hs] (k then v per row).
  void pack_kv(float* kv, const float* qkv, const Shape& s) const;
  // fn(a, i, causal) for each block: this rank's local query chunk a against
  // `owner`'s local key chunk i, in a fixed order.
  template <class Fn>
  void each_block(int owner, Fn fn) const;
  // Every block of this rank's query chunks against the chunks of `owner`,
  // whose keys and values are kv (its local layout); backward: dkv += too.
  void forward_blocks(float* out, float* lse, const float* qkv, const float* kv, int owner,
                      const Shape& s);
  void backward_blocks(float* dqkv, float* dkv, const float* dout, const float* qkv,
                       const float* out, const float* lse, const float* kv, int owner,
                       const Shape& s);
  void wait(comm::Work& w);
  // The buffers for one rank's keys and values of n floats, carved out of
  // one compute-pool allocation of predicted_buffer_bytes (kept across
  // layers and steps, grown if a call needs more).
  void buffers(size_t n);

  comm::Communicator& group_;
  CpMode mode_;
  model::ContextSplit split_;
  model::ParallelOps& inner_;
  tensor::Storage storage_;
  // ring: kv_ (two blocks in flight), acc_ (two accumulators), mine_;
  // allgather: mine_, gathered_ (every rank's), dgathered_ (their gradients).
  float *kv_[2] = {}, *acc_[2] = {}, *mine_ = nullptr, *gathered_ = nullptr, *dgathered_ = nullptr;
  double wait_s_ = 0, attention_s_ = 0;
};

}  // namespace po::parallel
