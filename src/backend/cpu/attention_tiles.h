// Register-blocked tile GEMM for the attention kernels (attention.cc).
//
// gemm_tile computes C[M,N] (= or +=) A[M,K] · B[K,N] on small row-major tiles
// already in cache, with N a multiple of kW. The micro-kernel keeps an R x NV
// block of kW-float vectors of C in registers (up to 6 x 4 = 24 zmm on
// AVX-512) and streams K: per k it loads NV vectors of B's row k and
// broadcasts R scalars of A's column k. Written with GCC vector extensions, so
// without AVX-512 the compiler splits each vector into narrower ones.
// Every C element is accumulated k = 0, 1, ..., K-1, one multiply-add each
// (fused: GCC contracts by default in gnu++ mode), so the result does not
// depend on M, N, the blocking or the thread.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "backend/cpu/kernel_isa.h"

// Without AVX-512 the 64-byte vectors are passed in memory; these helpers are
// all inline, so GCC's note about that ABI is noise.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

PO_KERNELS_BEGIN
namespace tiles {

constexpr int64_t kW = 16;  // floats per vector
typedef float Vec __attribute__((vector_size(kW * sizeof(float))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, const Vec& v) { std::memcpy(p, &v, sizeof v); }

// The micro-kernel's own vector: a zmm with AVX-512, a ymm without. GCC lowers
// a 64-byte Vec on AVX2 through general registers and the stack (vmovq,
// vpinsrq per load), so the kernel works in register-sized pieces; each C
// element still sees the same multiply-adds in the same order.
#if PO_AVX512
constexpr int kRW = 16;
#else
constexpr int kRW = 8;
#endif
typedef float RVec __attribute__((vector_size(kRW * sizeof(float))));
constexpr int kPieces = kW / kRW;  // RVecs per Vec

inline RVec rload(const float* p) {
  RVec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void rstore(float* p, const RVec& v) { std::memcpy(p, &v, sizeof v); }

template <int R, int NV>
inline void micro(int64_t K, const float* __restrict A, int64_t lda, const float* __restrict B,
                  int64_t ldb, float* __restrict C, int64_t ldc, bool acc) {
  constexpr int NP = NV * kPieces;
  RVec c[R][NP];
#pragma GCC unroll 8
  for (int r = 0; r < R; r++)
#pragma GCC unroll 8
    for (int v = 0; v < NP; v++) c[r][v] = acc ? rload(C + r * ldc + v * kRW) : RVec{};
  for (int64_t k = 0; k < K; k++) {
    RVec b[NP];
#pragma GCC unroll 8
    for (int v = 0; v < NP; v++) b[v] = rload(B + k * ldb + v * kRW);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      const float a = A[r * lda + k];
#pragma GCC unroll 8
      for (int v = 0; v < NP; v++) c[r][v] += a * b[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; r++)
#pragma GCC unroll 8
    for (int v = 0; v < NP; v++) rstore(C + r * ldc + v * kRW, c[r][v]);
}

// 16 x 16 transpose in registers: stage w swaps the off-diagonal w x w blocks
// of every 2w x 2w block (bit w of the row index <-> bit w of the column).
template <int w, int... j>
inline void transpose_stage(Vec* r, std::integer_sequence<int, j...>) {
#pragma GCC unroll 16
  for (int i = 0; i < kW; i++) {
    if (i & w) continue;
    const Vec a = r[i], b = r[i + w];
    r[i] = __builtin_shufflevector(a, b, ((j & w) ? 16 + j - w : j)...);
    r[i + w] = __builtin_shufflevector(a, b, ((j & w) ? 16 + j : j + w)...);
  }
}
// dst[c * ldd + r] = src[r * lds + c] for a 16 x 16 block.
inline void transpose16(const float* src, int64_t lds, float* dst, int64_t ldd) {
  static_assert(kW == 16);
  Vec r[kW];
#pragma GCC unroll 16
  for (int i = 0; i < kW; i++) r[i] = load(src + i * lds);
  constexpr auto lanes = std::make_integer_sequence<int, kW>{};
  transpose_stage<8>(r, lanes);
  transpose_stage<4>(r, lanes);
  transpose_stage<2>(r, lanes);
  transpose_stage<1>(r, lanes);
#pragma GCC unroll 16
  for (int i = 0; i < kW; i++) store(dst + i * ldd, r[i]);
}

using MicroFn = void (*)(int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t,
                         bool);
constexpr int kR = 6;  // rows per micro-kernel call
// Vectors of C per micro-kernel call. AVX-512: 6 x 4 = 24 of the 32 zmm. AVX2
// has 16 ymm and a Vec is two of them, so 6 x 4 would be 48 accumulators,
// spilled to the stack on every k (measured on Zen 3: attention 60x slower than
// the sgemm); 6 x 1 = 12 ymm fit. The blocking does not change the bits (see
// the file comment).
#if PO_AVX512
constexpr int64_t kMaxNV = 4;
#else
constexpr int64_t kMaxNV = 1;
#endif

template <int NV, int... R>
constexpr std::array<MicroFn, kR> row_table(std::integer_sequence<int, R...>) {
  return {&micro<R + 1, NV>...};
}
inline constexpr std::array<std::array<MicroFn, kR>, 4> kMicro = {
    row_table<1>(std::make_integer_sequence<int, kR>{}),
    row_table<2>(std::make_integer_sequence<int, kR>{}),
    row_table<3>(std::make_integer_sequence<int, kR>{}),
    row_table<4>(std::make_integer_sequence<int, kR>{})};

// Diagonal tiles of causal attention: with rows and columns (or rows and k)
// indexing the same positions, only part of each row is needed. Per group of
// kR rows [m, m + kR) the kernel then computes
//   kColsUpTo: columns < m + kR (rounded up to kW), leaving the rest untouched;
//   kColsFrom: columns >= m (rounded down to kW), leaving the rest untouched;
//   kKUpTo / kKFrom: all columns, summing only k < m + kR / k >= m
// (the caller guarantees the skipped A entries are zero).
enum class Causal { kNone, kColsUpTo, kColsFrom, kKUpTo, kKFrom };

// C[M,N] (+)= A[M,K] · B[K,N], all row-major with leading dimensions; N % kW ==
// 0.
// The columns [n_lo, n_hi) and the k range [k_lo, k_hi) a group of `rows`
// rows from m computes under cz, k rounded out to multiples of k_step.
struct TileRange {
  int64_t n_lo, n_hi, k_lo, k_hi;
};
inline TileRange causal_range(Causal cz, int64_t m, int64_t rows, int64_t N, int64_t K,
                              int64_t k_step) {
  TileRange r{0, N, 0, K};
  switch (cz) {
    case Causal::kNone:
      break;
    case Causal::kColsUpTo:
      r.n_hi = std::min(N, (m + rows + kW - 1) / kW * kW);
      break;
    case Causal::kColsFrom:
      r.n_lo = std::min(N, m / kW * kW);
      break;
    case Causal::kKUpTo:
      r.k_hi = std::min(K, (m + rows + k_step - 1) / k_step * k_step);
      break;
    case Causal::kKFrom:
      r.k_lo = std::min(K, m / k_step * k_step);
      break;
  }
  return r;
}

inline void gemm_tile(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                      int64_t ldb, float* C, int64_t ldc, bool acc, Causal cz = Causal::kNone) {
  for (int64_t m = 0; m < M; m += kR) {
    const int64_t rows = std::min<int64_t>(kR, M - m);
    const auto [n_lo, n_hi, k_lo, k_hi] = causal_range(cz, m, rows, N, K, 1);
    for (int64_t n0 = n_lo; n0 < n_hi; n0 += kMaxNV * kW) {
      const int64_t nv = std::min<int64_t>(kMaxNV, (n_hi - n0) / kW);
      kMicro[nv - 1][rows - 1](k_hi - k_lo, A + m * lda + k_lo, lda, B + k_lo * ldb + n0, ldb,
                               C + m * ldc + n0, ldc, acc);
    }
  }
}

// bf16 tiles (AVX512-BF16's vdpbf16ps): C[M,N] (+)= A[M,K] · B[K,N] with A
// bf16 row-major (K even, pairs of k adjacent) and B in pair-interleaved
// form Bp[k/2][n][2] (ldb: bf16 elements from one k pair to the next), f32
// C. Per k pair each C element gets one vdpbf16ps term, a[k] b[k] +
// a[k+1] b[k+1] (exact products), pairs in ascending order: as with the f32
// tiles the bits do not depend on the blocking. The causal variants round
// their k ranges to whole pairs (the A entries that adds are zero).
#if PO_AVX512BF16
constexpr bool kBf16Tiles = true;

template <int R, int NV>
inline void micro16(int64_t K, const uint16_t* __restrict A, int64_t lda,
                    const uint16_t* __restrict B, int64_t ldb, float* __restrict C, int64_t ldc,
                    bool acc) {
  __m512 c[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; r++)
#pragma GCC unroll 8
    for (int v = 0; v < NV; v++)
      c[r][v] = acc ? _mm512_loadu_ps(C + r * ldc + v * kW) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    __m512bh b[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; v++)
      b[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(B + (k / 2) * ldb + v * 2 * kW));
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      uint32_t pair;
      std::memcpy(&pair, A + r * lda + k, sizeof pair);
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
#pragma GCC unroll 8
      for (int v = 0; v < NV; v++) c[r][v] = _mm512_dpbf16_ps(c[r][v], a, b[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; r++)
#pragma GCC unroll 8
    for (int v = 0; v < NV; v++) _mm512_storeu_ps(C + r * ldc + v * kW, c[r][v]);
}

using MicroFn16 = void (*)(int64_t, const uint16_t*, int64_t, const uint16_t*, int64_t, float*,
                           int64_t, bool);
template <int NV, int... R>
constexpr std::array<MicroFn16, kR> row_table16(std::integer_sequence<int, R...>) {
  return {&micro16<R + 1, NV>...};
}
inline constexpr std::array<std::array<MicroFn16, kR>, 4> kMicro16 = {
    row_table16<1>(std::make_integer_sequence<int, kR>{}),
    row_table16<2>(std::make_integer_sequence<int, kR>{}),
    row_table16<3>(std::make_integer_sequence<int, kR>{}),
    row_table16<4>(std::make_integer_sequence<int, kR>{})};

// gemm_tile on bf16 tiles; K even, N % kW == 0.
inline void gemm_tile16(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda,
                        const uint16_t* B, int64_t ldb, float* C, int64_t ldc, bool acc,
                        Causal cz = Causal::kNone) {
  for (int64_t m = 0; m < M; m += kR) {
    const int64_t rows = std::min<int64_t>(kR, M - m);
    const auto [n_lo, n_hi, k_lo, k_hi] = causal_range(cz, m, rows, N, K, 2);
    for (int64_t n0 = n_lo; n0 < n_hi; n0 += kMaxNV * kW) {
      const int64_t nv = std::min<int64_t>(kMaxNV, (n_hi - n0) / kW);
      kMicro16[nv - 1][rows - 1](k_hi - k_lo, A + m * lda + k_lo, lda, B + (k_lo / 2) * ldb + 2 * n0,
                                 ldb, C + m * ldc + n0, ldc, acc);
    }
  }
}
#else
constexpr bool kBf16Tiles = false;
#endif

}  // namespace tiles
PO_KERNELS_END

#pragma GCC diagnostic pop
