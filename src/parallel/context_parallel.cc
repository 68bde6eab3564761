#include "parallel/context_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/ops.h"
#include "core/error.h"
#include "core/timer.h"

namespace po::parallel {
namespace ops = backend::cpu;
using tensor::DType;

CpMode parse_cp_mode(const std::string& mode) {
  if (mode == "ring") return CpMode::kRing;
  if (mode == "allgather") return CpMode::kAllGather;
  PO_THROW(core::InvalidArgument, "parallel.cp_mode = \"", mode,
           "\": choose \"ring\" or \"allgather\"");
}

ContextParallelOps::ContextParallelOps(comm::Communicator& group, CpMode mode, bool zigzag,
                                       model::ParallelOps& inner)
    : group_(group), mode_(mode), split_{group.size(), group.rank(), zigzag}, inner_(inner) {}

void ContextParallelOps::pack_kv(float* kv, const float* qkv, const Shape& s) const {
  const int64_t KV = s.kv(), QKV = s.qkv(), rows = s.B * s.T, q = s.NH * s.hs;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; r++) std::memcpy(kv + r * KV, qkv + r * QKV + q, KV * sizeof(float));
}

template <class Fn>
void ContextParallelOps::each_block(int owner, Fn fn) const {
  const model::ContextSplit theirs{split_.size, owner, split_.zigzag};
  const int n = split_.local_chunks();
  for (int a = 0; a < n; a++)
    for (int i = 0; i < n; i++) {
      const int qa = split_.chunk(a), kb = theirs.chunk(i);
      if (kb <= qa) fn(a, i, kb == qa);  // (kb > qa: every key follows every query)
    }
}

void ContextParallelOps::forward_blocks(float* out, float* lse, const float* qkv, const float* kv,
                                        int owner, const Shape& s) {
  const int64_t S = s.T / split_.local_chunks(), QKV = s.qkv(), KV = s.kv(), C = s.NH * s.hs,
                kcol = s.NKV * s.hs;
  each_block(owner, [&](int64_t a, int64_t i, bool causal) {
    ops::attention_block_forward(
        {out + a * S * C, C, s.T * C}, lse + a * S, s.T, {qkv + a * S * QKV, QKV, s.T * QKV},
        {kv + i * S * KV, KV, s.T * KV}, {kv + i * S * KV + kcol, KV, s.T * KV}, s.B, S, S, s.NH,
        s.NKV, s.hs, causal);
  });
}

void ContextParallelOps::backward_blocks(float* dqkv, float* dkv, const float* dout,
                                         const float* qkv, const float* out, const float* lse,
                                         const float* kv, int owner, const Shape& s) {
  const int64_t S = s.T / split_.local_chunks(), QKV = s.qkv(), KV = s.kv(), C = s.NH * s.hs,
                kcol = s.NKV * s.hs;
  each_block(owner, [&](int64_t a, int64_t i, bool causal) {
    ops::attention_block_backward(
        {dqkv + a * S * QKV, QKV, s.T * QKV}, {dkv + i * S * KV, KV, s.T * KV},
        {dkv + i * S * KV + kcol, KV, s.T * KV}, {dout + a * S * C, C, s.T * C},
        {out + a * S * C, C, s.T * C}, lse + a * S, s.T, {qkv + a * S * QKV, QKV, s.T * QKV},
        {kv + i * S * KV, KV, s.T * KV}, {kv + i * S * KV + kcol, KV, s.T * KV}, s.B, S, S, s.NH,
        s.NKV, s.hs, causal);
  });
}

void ContextParallelOps::buffers(size_t n) {
  const int c = split_.size;
  const size_t bytes = predicted_buffer_bytes(mode_, c, 1, 1, 1) / (2 * sizeof(float)) * n * sizeof(float);
  if (storage_.size() < bytes) storage_ = tensor::Storage(bytes, tensor::Pool::kCompute);
  float* at = storage_.f32();
  auto take = [&](size_t count) {
    float* p = at;
    at += count;
    return p;
  };
  if (mode_ == CpMode::kRing) {
    kv_[0] = take(n);
    kv_[1] = take(n);
    acc_[0] = take(n);
    acc_[1] = take(n);
    mine_ = take(n);
  } else {
    mine_ = take(n);
    gathered_ = take(n * static_cast<size_t>(c));
    dgathered_ = take(n * static_cast<size_t>(c));
  }
}

void ContextParallelOps::wait(comm::Work& w) {
  core::Timer t;
  w.wait();
  wait_s_ += t.seconds();
}

void ContextParallelOps::cp_attention_forward(float* out, float* lse, const float* qkv,
                                              int64_t B, int64_t T, int64_t NH, int64_t NKV,
                                              int64_t hs) {
  const Shape s{B, T, NH, NKV, hs};
  const int c = split_.size, r = split_.rank;
  const size_t n = static_cast<size_t>(B * T * s.kv());
  std::fill(out, out + B * T * NH * hs, 0.0f);
  std::fill(lse, lse + B * NH * T, -INFINITY);
  buffers(n);
  if (mode_ == CpMode::kAllGather) {
    pack_kv(mine_, qkv, s);
    comm::Work w = group_.iall_gather(mine_, gathered_, n, DType::kF32);
    wait(w);
    core::Timer t;
    for (int owner = 0; owner < c; owner++)  // ascending ranks: a fixed order
      forward_blocks(out, lse, qkv, gathered_ + owner * n, owner, s);
    attention_s_ += t.seconds();
    return;
  }
  pack_kv(kv_[0], qkv, s);
  const int next = (r + 1) % c, prev = (r + c - 1) % c;
  for (int step = 0; step < c; step++) {
    float* cur = kv_[step % 2];
    comm::Work send, recv;
    if (step + 1 < c) {  // the next block travels while this one is computed
      recv = group_.irecv(kv_[(step + 1) % 2], n, DType::kF32, prev, step);
      send = group_.isend(cur, n, DType::kF32, next, step);
    }
    core::Timer t;
    forward_blocks(out, lse, qkv, cur, (r + c - step) % c, s);
    attention_s_ += t.seconds();
    wait(recv);
    wait(send);
  }
}

void ContextParallelOps::cp_attention_backward(float* dqkv, const float* dout, const float* qkv,
                                               const float* out, const float* lse, int64_t B,
                                               int64_t T, int64_t NH, int64_t NKV, int64_t hs) {
  const Shape s{B, T, NH, NKV, hs};
  const int c = split_.size, r = split_.rank;
  const size_t n = static_cast<size_t>(B * T * s.kv());
  const int64_t QKV = s.qkv(), KV = s.kv(), q = NH * hs, rows = B * T;
  std::fill(dqkv, dqkv + rows * QKV, 0.0f);
  float* home = nullptr;  // this rank's summed key/value gradients [B, T, KV]
  buffers(n);
  if (mode_ == CpMode::kAllGather) {
    std::fill(dgathered_, dgathered_ + n * static_cast<size_t>(c), 0.0f);
    pack_kv(mine_, qkv, s);
    comm::Work w = group_.iall_gather(mine_, gathered_, n, DType::kF32);
    wait(w);
    core::Timer t;
    for (int owner = 0; owner < c; owner++)
      backward_blocks(dqkv, dgathered_ + owner * n, dout, qkv, out, lse, gathered_ + owner * n,
                      owner, s);
    attention_s_ += t.seconds();
    comm::Work rs =
        group_.ireduce_scatter(dgathered_, mine_, n, DType::kF32, comm::ReduceOp::kSum);
    wait(rs);
    home = mine_;
  } else {
    pack_kv(kv_[0], qkv, s);
    const int next = (r + 1) % c, prev = (r + c - 1) % c;
    comm::Work acc_send;
    // Tags: 2·step for the keys and values of step's block, 2·step + 1 for
    // the gradient accumulator of the block held at step (sent after it).
    for (int step = 0; step < c; step++) {
      float* cur = kv_[step % 2];
      comm::Work send, recv, acc_recv;
      if (step + 1 < c) {
        recv = group_.irecv(kv_[(step + 1) % 2], n, DType::kF32, prev, 2 * step);
        send = group_.isend(cur, n, DType::kF32, next, 2 * step);
      }
      // The accumulator of this step's block, from the rank that held it last
      // step, lands in acc_[step % 2] (the other one may still be sending).
      float* acc = acc_[step % 2];
      if (step > 0) acc_recv = group_.irecv(acc, n, DType::kF32, prev, 2 * step - 1);
      std::fill(mine_, mine_ + n, 0.0f);
      core::Timer t;
      backward_blocks(dqkv, mine_, dout, qkv, out, lse, cur, (r + c - step) % c, s);
      attention_s_ += t.seconds();
      if (step > 0) {
        wait(acc_recv);
        for (size_t x = 0; x < n; x++) acc[x] += mine_[x];
      } else {
        std::copy(mine_, mine_ + n, acc);
      }
      wait(acc_send);  // the previous accumulator's buffer is free again
      acc_send = group_.isend(acc, n, DType::kF32, next, 2 * step + 1);
      wait(recv);
      wait(send);
    }
    // After the last hop the accumulator of this rank's own block comes home.
    comm::Work last = group_.irecv(mine_, n, DType::kF32, prev, 2 * c - 1);
    wait(last);
    wait(acc_send);
    home = mine_;
  }
#pragma omp parallel for schedule(static)
  for (int64_t x = 0; x < rows; x++)
    std::memcpy(dqkv + x * QKV + q, home + x * KV, KV * sizeof(float));
}

double ContextParallelOps::take_wait_seconds() {
  const double s = wait_s_;
  wait_s_ = 0;
  return s;
}

double ContextParallelOps::take_attention_seconds() {
  const double s = attention_s_;
  attention_s_ = 0;
  return s;
}

size_t ContextParallelOps::predicted_buffer_bytes(CpMode mode, int cp, int64_t B,
                                                 int64_t T_local, int64_t kv_width) {
  const auto n = static_cast<size_t>(B * T_local * 2 * kv_width);  // one rank's keys and values
  // ring: two key/value buffers, two accumulators and this rank's share;
  // allgather: this rank's, every rank's, and every rank's gradients.
  return (mode == CpMode::kRing ? 5 * n : (1 + 2 * static_cast<size_t>(cp)) * n) * sizeof(float);
}

}  // namespace po::parallel
