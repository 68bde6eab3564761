// Causal self-attention, flash style (FlashAttention-2 order of work) on CPU.
//
// Forward: work items are (b, h, query block); each streams the key blocks at
// or before its diagonal, keeps a running max m and sum l per query row (online
// softmax) and an f32 output accumulator, and writes out = acc / l and
// lse = m + log l. Backward: work items are (b, h); each recomputes
// P = exp(q·k * scale - lse) block by block, with D_i = dout_i · out_i, and
// accumulates dq, dk, dv for that head only, so no two threads write the same
// dqkv element and no T×T matrix ever exists. Scratch (packed K^T/V^T tiles,
// score rows, accumulators) is thread_local and grows once.
//
// Inner loops run over a full block of kBlock keys (padded lanes are masked)
// or over hs, both vectorisable; the head size is a template parameter for the
// common sizes so those loops fully unroll into registers.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/simd_math.h"
#include "backend/ops.h"
#include "core/error.h"

namespace po::backend::cpu {

namespace {

constexpr int64_t kBlock = 64;  // query rows and key columns per tile

float* scratch(std::vector<float>& buf, size_t n) {
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// KT[d][jj] = src[(j0 + jj) row][d] for jj < nk; zero-padded to kBlock columns.
inline void pack_transposed(float* KT, const float* src, int64_t stride, int64_t nk,
                            int64_t hs) {
  for (int64_t d = 0; d < hs; d++) {
    float* dst = KT + d * kBlock;
    for (int64_t jj = 0; jj < nk; jj++) dst[jj] = src[jj * stride + d];
    for (int64_t jj = nk; jj < kBlock; jj++) dst[jj] = 0.0f;
  }
}

// s[jj] = x · KT[:, jj] for all kBlock columns.
template <int kHS>
inline void row_times_packed(float* __restrict s, const float* __restrict x,
                             const float* __restrict KT, int64_t hs_rt) {
  const int64_t hs = kHS ? kHS : hs_rt;
  float acc[kBlock];
#pragma omp simd
  for (int64_t jj = 0; jj < kBlock; jj++) acc[jj] = 0.0f;
  for (int64_t d = 0; d < hs; d++) {
    const float xd = x[d];
    const float* kt = KT + d * kBlock;
#pragma omp simd
    for (int64_t jj = 0; jj < kBlock; jj++) acc[jj] += xd * kt[jj];
  }
#pragma omp simd
  for (int64_t jj = 0; jj < kBlock; jj++) s[jj] = acc[jj];
}

template <int kHS>
void forward_item(float* out, float* lse, const float* qkv, int64_t b, int64_t h, int64_t i0,
                  int64_t T, int64_t C, int64_t NH, int64_t hs_rt) {
  const int64_t hs = kHS ? kHS : hs_rt;
  const int64_t C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const float* q = qkv + b * T * C3 + h * hs;
  const float* k = q + C;
  const float* v = q + 2 * C;
  const int64_t nq = std::min(kBlock, T - i0);

  thread_local std::vector<float> buf;
  float* KT = scratch(buf, kBlock * hs + kBlock * kBlock + kBlock * hs + 2 * kBlock);
  float* S = KT + kBlock * hs;
  float* O = S + kBlock * kBlock;
  float* m = O + kBlock * hs;
  float* l = m + kBlock;
  for (int64_t ii = 0; ii < nq; ii++) {
    m[ii] = -INFINITY;
    l[ii] = 0.0f;
  }
  for (int64_t x = 0; x < nq * hs; x++) O[x] = 0.0f;

  for (int64_t j0 = 0; j0 < i0 + nq; j0 += kBlock) {
    const int64_t nk = std::min(kBlock, i0 + nq - j0);
    pack_transposed(KT, k + j0 * C3, C3, nk, hs);
    for (int64_t ii = 0; ii < nq; ii++) {
      const int64_t i = i0 + ii;
      const int64_t lim = std::min(nk, i - j0 + 1);  // causal: keys j <= i
      if (lim <= 0) continue;
      float* s = S + ii * kBlock;
      row_times_packed<kHS>(s, q + i * C3, KT, hs);
      float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
      for (int64_t jj = 0; jj < kBlock; jj++) {
        const float x = jj < lim ? s[jj] * scale : -INFINITY;
        s[jj] = x;
        mx = std::max(mx, x);
      }
      const float m_new = std::max(m[ii], mx);
      const float alpha = m[ii] == -INFINITY ? 0.0f : detail::exp_approx(m[ii] - m_new);
      float psum = 0.0f;
#pragma omp simd reduction(+ : psum)
      for (int64_t jj = 0; jj < kBlock; jj++) {
        const float p = jj < lim ? detail::exp_approx(s[jj] - m_new) : 0.0f;
        s[jj] = p;
        psum += p;
      }
      m[ii] = m_new;
      l[ii] = l[ii] * alpha + psum;
      float* o = O + ii * hs;
      float acc[kHS ? kHS : 1];
      if constexpr (kHS != 0) {
#pragma omp simd
        for (int64_t d = 0; d < hs; d++) acc[d] = o[d] * alpha;
        for (int64_t jj = 0; jj < lim; jj++) {
          const float p = s[jj];
          const float* vr = v + (j0 + jj) * C3;
#pragma omp simd
          for (int64_t d = 0; d < hs; d++) acc[d] += p * vr[d];
        }
#pragma omp simd
        for (int64_t d = 0; d < hs; d++) o[d] = acc[d];
      } else {
        (void)acc;
#pragma omp simd
        for (int64_t d = 0; d < hs; d++) o[d] *= alpha;
        for (int64_t jj = 0; jj < lim; jj++) {
          const float p = s[jj];
          const float* vr = v + (j0 + jj) * C3;
#pragma omp simd
          for (int64_t d = 0; d < hs; d++) o[d] += p * vr[d];
        }
      }
    }
  }
  for (int64_t ii = 0; ii < nq; ii++) {
    const int64_t i = i0 + ii;
    const float inv = 1.0f / l[ii];
    float* dst = out + (b * T + i) * C + h * hs;
    const float* o = O + ii * hs;
#pragma omp simd
    for (int64_t d = 0; d < hs; d++) dst[d] = o[d] * inv;
    lse[(b * NH + h) * T + i] = m[ii] + std::log(l[ii]);
  }
}

template <int kHS>
void backward_item(float* dqkv, const float* dout, const float* qkv, const float* out,
                   const float* lse, int64_t b, int64_t h, int64_t T, int64_t C, int64_t NH,
                   int64_t hs_rt) {
  const int64_t hs = kHS ? kHS : hs_rt;
  const int64_t C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const int64_t base3 = b * T * C3 + h * hs;
  const float* q = qkv + base3;
  const float* k = q + C;
  const float* v = q + 2 * C;
  float* dq = dqkv + base3;
  float* dk = dq + C;
  float* dv = dq + 2 * C;
  const float* L = lse + (b * NH + h) * T;

  thread_local std::vector<float> buf;
  float* KT = scratch(buf, 2 * kBlock * hs + 2 * kBlock + T);
  float* VT = KT + kBlock * hs;
  float* P = VT + kBlock * hs;
  float* dS = P + kBlock;
  float* D = dS + kBlock;

  for (int64_t t = 0; t < T; t++) {
    const float* go = dout + (b * T + t) * C + h * hs;
    const float* o = out + (b * T + t) * C + h * hs;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < hs; d++) s += go[d] * o[d];
    D[t] = s;
    for (int64_t d = 0; d < hs; d++) dq[t * C3 + d] = dk[t * C3 + d] = dv[t * C3 + d] = 0.0f;
  }

  for (int64_t j0 = 0; j0 < T; j0 += kBlock) {
    const int64_t nk = std::min(kBlock, T - j0);
    pack_transposed(KT, k + j0 * C3, C3, nk, hs);
    pack_transposed(VT, v + j0 * C3, C3, nk, hs);
    for (int64_t i = j0; i < T; i++) {
      const int64_t lim = std::min(nk, i - j0 + 1);
      const float* qi = q + i * C3;
      const float* goi = dout + (b * T + i) * C + h * hs;
      row_times_packed<kHS>(P, qi, KT, hs);
      row_times_packed<kHS>(dS, goi, VT, hs);
      const float li = L[i], Di = D[i];
#pragma omp simd
      for (int64_t jj = 0; jj < kBlock; jj++) {
        const float p = jj < lim ? detail::exp_approx(P[jj] * scale - li) : 0.0f;
        P[jj] = p;
        dS[jj] = p * (dS[jj] - Di) * scale;
      }
      float* dqi = dq + i * C3;
      if constexpr (kHS != 0) {
        // Local copies: the compiler cannot prove dq/dk/dv rows do not alias,
        // so without them q_i, dout_i and the dq_i accumulator would be
        // reloaded and stored on every key.
        float qv[kHS], gv[kHS], dqv[kHS];
#pragma omp simd
        for (int64_t d = 0; d < kHS; d++) {
          qv[d] = qi[d];
          gv[d] = goi[d];
          dqv[d] = dqi[d];
        }
        for (int64_t jj = 0; jj < lim; jj++) {
          const float p = P[jj], ds = dS[jj];
          const int64_t row = (j0 + jj) * C3;
          const float* kr = k + row;
          float* dvr = dv + row;
          float* dkr = dk + row;
#pragma omp simd
          for (int64_t d = 0; d < kHS; d++) {
            dvr[d] += p * gv[d];
            dkr[d] += ds * qv[d];
            dqv[d] += ds * kr[d];
          }
        }
#pragma omp simd
        for (int64_t d = 0; d < kHS; d++) dqi[d] = dqv[d];
      } else {
        for (int64_t jj = 0; jj < lim; jj++) {
          const float p = P[jj], ds = dS[jj];
          const int64_t row = (j0 + jj) * C3;
          const float* kr = k + row;
          float* dvr = dv + row;
          float* dkr = dk + row;
#pragma omp simd
          for (int64_t d = 0; d < hs; d++) {
            dvr[d] += p * goi[d];
            dkr[d] += ds * qi[d];
            dqi[d] += ds * kr[d];
          }
        }
      }
    }
  }
}

template <int kHS>
void forward_all(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t C,
                 int64_t NH) {
  const int64_t hs = C / NH;
  const int64_t nqb = (T + kBlock - 1) / kBlock;
  const int64_t items = B * NH * nqb;
  // Heaviest query blocks (last) first, for better dynamic balance.
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t it = 0; it < items; it++) {
    const int64_t qb = nqb - 1 - it / (B * NH);
    const int64_t bh = it % (B * NH);
    forward_item<kHS>(out, lse, qkv, bh / NH, bh % NH, qb * kBlock, T, C, NH, hs);
  }
}

template <int kHS>
void backward_all(float* dqkv, const float* dout, const float* qkv, const float* out,
                  const float* lse, int64_t B, int64_t T, int64_t C, int64_t NH) {
  const int64_t hs = C / NH;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bh = 0; bh < B * NH; bh++)
    backward_item<kHS>(dqkv, dout, qkv, out, lse, bh / NH, bh % NH, T, C, NH, hs);
}

}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                       int64_t C, int64_t NH) {
  PO_CHECK(NH > 0 && C % NH == 0, "attention_forward: C=", C, " not divisible by NH=", NH);
  switch (C / NH) {
    case 64: forward_all<64>(out, lse, qkv, B, T, C, NH); break;
    case 128: forward_all<128>(out, lse, qkv, B, T, C, NH); break;
    case 32: forward_all<32>(out, lse, qkv, B, T, C, NH); break;
    default: forward_all<0>(out, lse, qkv, B, T, C, NH); break;
  }
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int64_t B, int64_t T, int64_t C, int64_t NH) {
  PO_CHECK(NH > 0 && C % NH == 0, "attention_backward: C=", C, " not divisible by NH=", NH);
  switch (C / NH) {
    case 64: backward_all<64>(dqkv, dout, qkv, out, lse, B, T, C, NH); break;
    case 128: backward_all<128>(dqkv, dout, qkv, out, lse, B, T, C, NH); break;
    case 32: backward_all<32>(dqkv, dout, qkv, out, lse, B, T, C, NH); break;
    default: backward_all<0>(dqkv, dout, qkv, out, lse, B, T, C, NH); break;
  }
}

}  // namespace po::backend::cpu
