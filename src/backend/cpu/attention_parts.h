// The pieces the flash-style attention kernels share (attention.cc, the
// whole causal sequence; attention_block.cc, context parallel's blocks):
// tile sizes, per-thread scratch, packing into zero-padded tiles and the
// online-softmax row step.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "backend/cpu/attention_tiles.h"
#include "backend/cpu/kernel_isa.h"
#include "backend/cpu/simd_math.h"
#include "backend/ops.h"
#include "core/bf16.h"

PO_KERNELS_BEGIN
namespace attn {

constexpr int64_t kBlock = 64;    // queries and keys per tile
constexpr int64_t kPrefetch = 8;  // rows ahead when packing

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Where a query head's q and its kv group's k and v sit in a qkv row.
struct Heads {
  int64_t NH, NKV, hs;
  int64_t row() const { return (NH + 2 * NKV) * hs; }
  int64_t group(int64_t h) const { return h / (NH / NKV); }
  int64_t k_col(int64_t h) const { return (NH + group(h)) * hs; }
  int64_t v_col(int64_t h) const { return (NH + NKV + group(h)) * hs; }
};

// Thread-local scratch, 64-byte aligned, grown once.
inline float* scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n + 16) buf.resize(n + 16);
  const auto p = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<float*>((p + 63) & ~uintptr_t{63});
}

// dst[t, d] = s * src[t * stride + d] for t < n, d < hs; zero elsewhere in
// the rows x HP tile. src f32, or saved bf16 (its widened values).
template <typename In>
inline void pack_rows(float* dst, const In* src, int64_t stride, int64_t n, int64_t rows, int64_t hs,
                      int64_t HP, float s) {
  for (int64_t t = 0; t < rows; t++) {
    float* o = dst + t * HP;
    const In* x = src + t * stride;
    const int64_t m = t < n ? hs : 0;
    if (t + kPrefetch < n)  // rows are strided: the hardware prefetcher misses them
      for (int64_t d = 0; d < hs; d += 16) __builtin_prefetch(x + kPrefetch * stride + d);
    for (int64_t d = 0; d < m; d++) o[d] = s * detail::get(x, d);
    for (int64_t d = m; d < HP; d++) o[d] = 0.0f;
  }
}

// dst[d, t] = src[t, d] for a rows x HP packed tile (both multiples of 16).
inline void transpose_packed(float* dst, const float* src, int64_t rows, int64_t HP) {
  for (int64_t t0 = 0; t0 < rows; t0 += 16)
    for (int64_t d0 = 0; d0 < HP; d0 += 16)
      tiles::transpose16(src + t0 * HP + d0, HP, dst + d0 * rows + t0, rows);
}

// Online-softmax step on one score row: returns the new running max
// max(m_old, s[0..lim)), writes s[jj] = exp(s[jj] - max) (0 for jj >= lim)
// and psum = their sum.
template <bool kMasked>
inline float softmax_row(float* __restrict s, int lim, float m_old, float& psum) {
  float mx = m_old;
#pragma omp simd reduction(max : mx)
  for (int jj = 0; jj < static_cast<int>(kBlock); jj++)
    mx = std::max(mx, !kMasked || jj < lim ? s[jj] : -INFINITY);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int jj = 0; jj < static_cast<int>(kBlock); jj++) {
    const float p = !kMasked || jj < lim ? detail::exp_approx(s[jj] - mx) : 0.0f;
    s[jj] = p;
    sum += p;
  }
  psum = sum;
  return mx;
}

// Online softmax of one query row against a new key tile of which the
// first lim columns count (the rest are masked, or past the keys' end): its
// scores s (in place: the probabilities after), the running max m and sum l,
// and the row of O rescaled to the new max.
inline void online_softmax_row(float* s, int64_t lim, bool first_tile, float& m, float& l,
                               float* o, int64_t HP) {
  float psum;
  const float m_new = lim < kBlock ? softmax_row<true>(s, static_cast<int>(lim), m, psum)
                                   : softmax_row<false>(s, static_cast<int>(kBlock), m, psum);
  if (first_tile) {
    l = psum;
  } else {
    const float alpha = detail::exp_approx(m - m_new);
    l = l * alpha + psum;
#pragma omp simd
    for (int64_t d = 0; d < HP; d++) o[d] *= alpha;
  }
  m = m_new;
}

// A backward tile's probabilities and score gradients, in place on the
// transposed tiles (row kk = key j0 + kk, column qq = query i0 + qq):
// P^T = exp(S^T − lse), dS^T = P^T (dP^T − D), zero where a query does not
// see the key (qq < kk + offset: offset = j0 − i0 for the causal diagonal,
// −kBlock where every query sees every key) or past the nq queries.
inline void tile_score_grads(float* PT, float* dST, const float* Li, const float* Di, int64_t nk,
                             int64_t nq, int64_t offset) {
  for (int64_t kk = 0; kk < nk; kk++) {
    const int lo = static_cast<int>(kk + offset), hi = static_cast<int>(nq);
    float* p = PT + kk * kBlock;
    float* ds = dST + kk * kBlock;
#pragma omp simd
    for (int qq = 0; qq < static_cast<int>(kBlock); qq++) {
      const bool ok = qq >= lo && qq < hi;
      const float e = detail::exp_approx(p[qq] - Li[qq]);
      p[qq] = ok ? e : 0.0f;
      ds[qq] = ok ? e * (ds[qq] - Di[qq]) : 0.0f;
    }
  }
}

// Whether this call runs on bf16 tiles (gemm_precision() == kBF16 on a CPU
// with AVX512-BF16).
inline bool bf16_tiles() { return tiles::kBf16Tiles && gemm_precision() == GemmPrecision::kBF16; }

#if PO_AVX512BF16
// The bf16 tiles' packing (attention.cc's bf16 items, attention_block.cc's).
inline uint16_t* scratch16(size_t n) {
  thread_local std::vector<uint16_t> buf;
  if (buf.size() < n + 32) buf.resize(n + 32);
  const auto p = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<uint16_t*>((p + 63) & ~uintptr_t{63});
}

inline uint16_t bf16_bits(float x) { return core::f32_to_bf16(x).bits; }

// pack_rows, rounded to bf16 (bf16 src at s = 1: its bits).
template <typename In>
inline void pack_rows16(uint16_t* dst, const In* src, int64_t stride, int64_t n, int64_t rows,
                        int64_t hs, int64_t HP, float s) {
  for (int64_t t = 0; t < rows; t++) {
    uint16_t* o = dst + t * HP;
    const In* x = src + t * stride;
    const int64_t m = t < n ? hs : 0;
    if (t + kPrefetch < n)
      for (int64_t d = 0; d < hs; d += 16) __builtin_prefetch(x + kPrefetch * stride + d);
    for (int64_t d = 0; d < m; d++) o[d] = bf16_bits(s * detail::get(x, d));
    for (int64_t d = m; d < HP; d++) o[d] = 0;
  }
}

// A product's B operand summing over the columns of a packed [N, W] tile (W
// even): dst[p][n][2] = (src[n][2p], src[n][2p + 1]), i.e. the tile's pairs
// transposed.
inline void pairs_of_columns(uint16_t* dst, const uint16_t* src, int64_t N, int64_t W) {
  for (int64_t p = 0; p < W / 2; p++)
    for (int64_t n = 0; n < N; n++) std::memcpy(dst + (p * N + n) * 2, src + n * W + 2 * p, 4);
}

// ... summing over the rows of a packed [K, N] tile (K even): dst[k/2][n][2] =
// (src[k][n], src[k + 1][n]).
inline void pairs_of_rows(uint16_t* dst, const uint16_t* src, int64_t K, int64_t N) {
  for (int64_t k = 0; k < K; k += 2) {
    uint16_t* o = dst + k * N;
    const uint16_t* a = src + k * N;
    const uint16_t* b = a + N;
    for (int64_t n = 0; n < N; n++) {
      o[2 * n] = a[n];
      o[2 * n + 1] = b[n];
    }
  }
}

inline int64_t even(int64_t x) { return (x + 1) / 2 * 2; }
#endif  // PO_AVX512BF16

}  // namespace attn
PO_KERNELS_END
