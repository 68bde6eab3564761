// Causal self-attention on CPU, FlashAttention-2 block formulation.
//
// Tiles are kBlock = 64 queries x 64 keys; every product is a small GEMM done
// by the register-blocked micro-kernel of attention_tiles.h (6 rows x 64
// columns of accumulators) on operands packed into per-thread scratch,
// zero-padded (T up to a multiple of 64, the head size hs up to HP, a
// multiple of 16) so tiles always have full vector width. q is packed
// pre-multiplied by scale = 1/sqrt(hs) (exact when hs is a power of 4).
// Diagonal tiles skip, per 6-row group, the part above the diagonal.
//
// Forward, work item = one head (b, h) (or one query block of it when there
// are few heads), K^T and V packed once: for each query block i, for each key
// block j <= i: S = Qs_i K_j^T; online softmax per row (running max m and sum
// l, O rescaled by exp(m_old - m_new)); O += P V_j. Then out = O / l and
// lse = m + log l.
// Backward, work item = one head (b, h), in transposed form so that every
// product is a row-major GEMM: for each key block j, for each i >= j,
//   S^T = K_j Qs_i^T, dP^T = V_j dO_i^T, P^T = exp(S^T - lse_i),
//   dS^T = P^T (dP^T - D_i), D_i = rowsum(dO_i * O_i)    (scale folded in),
//   dV_j += P^T dO_i,  dK_j += dS^T Qs_i,  dQ_i^T += K_j^T dS^T,
// dK_j, dV_j are written when j is done, dq = scale * (dQ^T)^T at the end.
// Only out and lse cross from forward to backward; no T x T matrix exists
// (the largest score buffer is one 64 x 64 tile per thread).
//
// Determinism: every out/lse/dqkv element belongs to exactly one work item
// (a head's rows of out/lse, resp. a head's q/k/v columns of dqkv), and inside
// an item all accumulations run in a fixed order (key blocks ascending, query
// blocks ascending, k ascending inside the micro-kernel, one FMA per term).
// No atomics and no cross-thread reductions, so the bits depend neither on
// the dynamic schedule nor on the thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "backend/cpu/attention_parts.h"
#include "backend/cpu/attention_tiles.h"
#include "backend/cpu/kernel_isa.h"
#include "backend/cpu/simd_math.h"
#include "backend/ops.h"
#include "core/bf16.h"
#include "core/error.h"

PO_KERNELS_BEGIN

namespace {

using tiles::Causal;
using tiles::gemm_tile;
using namespace attn;

// A query block's results: out = O / l, lse = m + log l.
void finish_rows(float* out, float* lse, const float* O, const float* m, const float* l,
                 int64_t b, int64_t h, int64_t i0, int64_t nq, int64_t T, const Heads& g) {
  const int64_t hs = g.hs, HP = round_up(hs, tiles::kW), C = g.NH * hs;
  for (int64_t ii = 0; ii < nq; ii++) {
    const int64_t i = i0 + ii;
    const float inv = 1.0f / l[ii];
    float* dst = out + (b * T + i) * C + h * hs;
    const float* o = O + ii * HP;
#pragma omp simd
    for (int64_t d = 0; d < hs; d++) dst[d] = o[d] * inv;
    lse[(b * g.NH + h) * T + i] = m[ii] + std::log(l[ii]);
  }
}

// D[t] = rowsum(dO * O) over the head's columns, and the lse padded to Tp rows.
// (One copy of the dot product's code for both input types, so that its
// vector reduction adds in the same order: bf16 rows are widened first.)
[[gnu::noinline]] float row_dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; d++) sum += a[d] * b[d];
  return sum;
}

template <typename In>
void backward_rows(float* D, float* Lp, const float* go, const In* o, const float* L,
                   int64_t T, int64_t Tp, int64_t hs, int64_t C) {
  std::vector<float> row(std::is_same_v<In, float> ? 0 : static_cast<size_t>(hs));
  for (int64_t t = 0; t < Tp; t++) {
    float sum = 0.0f;
    if (t < T) {
      const In* ot = o + t * C;
      if constexpr (std::is_same_v<In, float>) {
        sum = row_dot(go + t * C, ot, hs);
      } else {
        for (int64_t d = 0; d < hs; d++) row[static_cast<size_t>(d)] = detail::get(ot, d);
        sum = row_dot(go + t * C, row.data(), hs);
      }
    }
    D[t] = sum;
    Lp[t] = t < T ? L[t] : 0.0f;
  }
}

// A key block's dK, dV into dqkv (written, or added for a kv group's later heads).
void store_kv_grads(float* dqkv, const float* dK, const float* dV, int64_t kbase, int64_t vbase,
                    int64_t j0, int64_t nk, int64_t C3, int64_t hs, int64_t HP,
                    bool accumulate_kv) {
  for (int64_t kk = 0; kk < nk; kk++) {
    float* dk = dqkv + kbase + (j0 + kk) * C3;
    float* dv = dqkv + vbase + (j0 + kk) * C3;
#pragma omp simd
    for (int64_t d = 0; d < hs; d++) {
      dk[d] = accumulate_kv ? dk[d] + dK[kk * HP + d] : dK[kk * HP + d];
      dv[d] = accumulate_kv ? dv[d] + dV[kk * HP + d] : dV[kk * HP + d];
    }
  }
}

// dq = scale * dQT^T, through a free 16 x 16 tile at a time.
void store_dq(float* dqkv, const float* dQT, float* tile, int64_t base3, int64_t T, int64_t Tp,
              int64_t C3, int64_t hs, float scale) {
  for (int64_t t0 = 0; t0 < T; t0 += 16)
    for (int64_t d0 = 0; d0 < hs; d0 += 16) {
      tiles::transpose16(dQT + d0 * Tp + t0, Tp, tile, 16);
      const int64_t nd = std::min<int64_t>(16, hs - d0);
      for (int64_t t = t0; t < std::min(T, t0 + 16); t++) {
        float* dq = dqkv + base3 + t * C3 + d0;
        const float* x = tile + (t - t0) * 16;
        for (int64_t d = 0; d < nd; d++) dq[d] = scale * x[d];
      }
    }
}

void forward_item(float* out, float* lse, const float* qkv, int64_t b, int64_t h, int64_t qb0,
                  int64_t qb1, int64_t T, const Heads& g) {
  const int64_t hs = g.hs, HP = round_up(hs, tiles::kW), C3 = g.row();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const float* q = qkv + b * T * C3 + h * hs;
  const float* k = qkv + b * T * C3 + g.k_col(h);
  const float* v = qkv + b * T * C3 + g.v_col(h);
  const int64_t r0 = qb0 * kBlock, r1 = std::min(T, qb1 * kBlock);  // query rows
  const int64_t Kp = round_up(r1, kBlock);                          // keys 0 .. r1-1

  float* Q = scratch((Kp - r0) * HP + HP * Kp + Kp * HP + std::max(kBlock * kBlock, Kp * HP) +
                     kBlock * HP + 2 * kBlock);
  float* KT = Q + (Kp - r0) * HP;
  float* V = KT + HP * Kp;
  float* S = V + Kp * HP;
  float* O = S + std::max(kBlock * kBlock, Kp * HP);
  float* m = O + kBlock * HP;
  float* l = m + kBlock;
  pack_rows(Q, q + r0 * C3, C3, r1 - r0, Kp - r0, hs, HP, scale);
  pack_rows(S, k, C3, r1, Kp, hs, HP, 1.0f);  // S holds K for now
  transpose_packed(KT, S, Kp, HP);
  pack_rows(V, v, C3, r1, Kp, hs, HP, 1.0f);

  for (int64_t i0 = r0; i0 < r1; i0 += kBlock) {
    const int64_t nq = std::min(kBlock, T - i0), nkeys = i0 + nq;
    const float* Qi = Q + (i0 - r0) * HP;
    for (int64_t ii = 0; ii < nq; ii++) {
      m[ii] = -INFINITY;
      l[ii] = 0.0f;
    }
    for (int64_t j0 = 0; j0 < nkeys; j0 += kBlock) {
      const int64_t nk = std::min(kBlock, nkeys - j0);
      const bool diag = j0 == i0;
      const Causal cz = diag ? Causal::kColsUpTo : Causal::kNone;
      gemm_tile(nq, kBlock, HP, Qi, HP, KT + j0, Kp, S, kBlock, false, cz);
      for (int64_t ii = 0; ii < nq; ii++)
        online_softmax_row(S + ii * kBlock, diag ? ii + 1 : kBlock, j0 == 0, m[ii], l[ii], O + ii * HP, HP);
      gemm_tile(nq, HP, nk, S, kBlock, V + j0 * HP, HP, O, HP, j0 != 0,
                diag ? Causal::kKUpTo : Causal::kNone);
    }
    finish_rows(out, lse, O, m, l, b, h, i0, nq, T, g);
  }
}

// accumulate_kv: add into dk, dv instead of writing them (the second and
// later query heads of a kv group).
template <typename In>
void backward_item(float* dqkv, const float* dout, const In* qkv, const In* out,
                   const float* lse, int64_t b, int64_t h, int64_t T, const Heads& g,
                   bool accumulate_kv) {
  const int64_t hs = g.hs, HP = round_up(hs, tiles::kW), C3 = g.row(), C = g.NH * hs,
                NH = g.NH;
  const int64_t Tp = round_up(T, kBlock);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const int64_t base3 = b * T * C3 + h * hs;
  const int64_t kbase = b * T * C3 + g.k_col(h), vbase = b * T * C3 + g.v_col(h);
  const In* q = qkv + base3;
  const In* k = qkv + kbase;
  const In* v = qkv + vbase;
  const float* go = dout + b * T * C + h * hs;
  const In* o = out + b * T * C + h * hs;
  const float* L = lse + (b * NH + h) * T;

  const int64_t TH = Tp * HP, BB = kBlock * kBlock, BH = kBlock * HP;
  float* Qs = scratch(8 * TH + 2 * BB + 2 * BH + 2 * Tp);
  float* QsT = Qs + TH;
  float* K = QsT + TH;
  float* KT = K + TH;
  float* V = KT + TH;
  float* dO = V + TH;
  float* dOT = dO + TH;
  float* dQT = dOT + TH;
  float* PT = dQT + TH;
  float* dST = PT + BB;
  float* dK = dST + BB;
  float* dV = dK + BH;
  float* D = dV + BH;
  float* Lp = D + Tp;
  pack_rows(Qs, q, C3, T, Tp, hs, HP, scale);
  transpose_packed(QsT, Qs, Tp, HP);
  pack_rows(K, k, C3, T, Tp, hs, HP, 1.0f);
  transpose_packed(KT, K, Tp, HP);
  pack_rows(V, v, C3, T, Tp, hs, HP, 1.0f);
  pack_rows(dO, go, C, T, Tp, hs, HP, 1.0f);
  transpose_packed(dOT, dO, Tp, HP);
  for (int64_t x = 0; x < TH; x++) dQT[x] = 0.0f;
  backward_rows(D, Lp, go, o, L, T, Tp, hs, C);

  for (int64_t j0 = 0; j0 < T; j0 += kBlock) {
    const int64_t nk = std::min(kBlock, T - j0);
    for (int64_t i0 = j0; i0 < T; i0 += kBlock) {
      const int64_t nq = std::min(kBlock, T - i0);
      const bool first = i0 == j0;
      const Causal cols = first ? Causal::kColsFrom : Causal::kNone;
      const Causal ks = first ? Causal::kKFrom : Causal::kNone;
      gemm_tile(nk, kBlock, HP, K + j0 * HP, HP, QsT + i0, Tp, PT, kBlock, false, cols);
      gemm_tile(nk, kBlock, HP, V + j0 * HP, HP, dOT + i0, Tp, dST, kBlock, false, cols);
      // causal: query i0+qq >= key j0+kk (columns before it may be stale)
      tile_score_grads(PT, dST, Lp + i0, D + i0, nk, nq, j0 - i0);
      gemm_tile(nk, HP, nq, PT, kBlock, dO + i0 * HP, HP, dV, HP, !first, ks);
      gemm_tile(nk, HP, nq, dST, kBlock, Qs + i0 * HP, HP, dK, HP, !first, ks);
      if (!first) {
        gemm_tile(HP, kBlock, nk, KT + j0, Tp, dST, kBlock, dQT + i0, Tp, true);
      } else {  // query column block c needs only keys <= c + 15
        for (int64_t c = 0; c < kBlock; c += tiles::kW)
          gemm_tile(HP, tiles::kW, std::min<int64_t>(nk, c + tiles::kW), KT + j0, Tp, dST + c,
                    kBlock, dQT + i0 + c, Tp, true);
      }
    }
    store_kv_grads(dqkv, dK, dV, kbase, vbase, j0, nk, C3, hs, HP, accumulate_kv);
  }
  store_dq(dqkv, dQT, PT, base3, T, Tp, C3, hs, scale);  // through the (now free) PT tile
}

#if PO_AVX512BF16
// bf16 tiles (gemm_precision() == kBF16 on a CPU with AVX512-BF16): the same
// items with every product's operands rounded to bf16 once, as they are
// packed (q pre-scaled, k, v, dO; the probabilities P and dS of each tile),
// f32 accumulation (vdpbf16ps), and the online softmax, the running max and
// sum, lse, D and the accumulators dQ, dK, dV in f32. B operands are packed
// pair-interleaved (attention_tiles.h): pairs_of_columns when the product
// sums over a packed tile's columns (head dims), pairs_of_rows when it sums
// over its rows (positions).


void forward_item16(float* out, float* lse, const float* qkv, int64_t b, int64_t h, int64_t qb0,
                    int64_t qb1, int64_t T, const Heads& g) {
  const int64_t hs = g.hs, HP = round_up(hs, tiles::kW), C3 = g.row();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const float* q = qkv + b * T * C3 + h * hs;
  const float* k = qkv + b * T * C3 + g.k_col(h);
  const float* v = qkv + b * T * C3 + g.v_col(h);
  const int64_t r0 = qb0 * kBlock, r1 = std::min(T, qb1 * kBlock);
  const int64_t Kp = round_up(r1, kBlock);

  uint16_t* Q = scratch16((Kp - r0) * HP + 3 * Kp * HP + kBlock * kBlock);
  uint16_t* KTp = Q + (Kp - r0) * HP;  // keys' columns paired: [HP/2][Kp][2]
  uint16_t* Vp = KTp + Kp * HP;        // values' rows paired: [Kp/2][HP][2]
  uint16_t* rows = Vp + Kp * HP;       // k, then v, packed [Kp, HP]
  uint16_t* P = rows + Kp * HP;        // a tile's probabilities [kBlock, kBlock]
  float* S = scratch(kBlock * kBlock + kBlock * HP + 2 * kBlock);
  float* O = S + kBlock * kBlock;
  float* m = O + kBlock * HP;
  float* l = m + kBlock;
  pack_rows16(Q, q + r0 * C3, C3, r1 - r0, Kp - r0, hs, HP, scale);
  pack_rows16(rows, k, C3, r1, Kp, hs, HP, 1.0f);
  pairs_of_columns(KTp, rows, Kp, HP);
  pack_rows16(rows, v, C3, r1, Kp, hs, HP, 1.0f);
  pairs_of_rows(Vp, rows, Kp, HP);

  for (int64_t i0 = r0; i0 < r1; i0 += kBlock) {
    const int64_t nq = std::min(kBlock, T - i0), nkeys = i0 + nq;
    const uint16_t* Qi = Q + (i0 - r0) * HP;
    for (int64_t ii = 0; ii < nq; ii++) {
      m[ii] = -INFINITY;
      l[ii] = 0.0f;
    }
    for (int64_t j0 = 0; j0 < nkeys; j0 += kBlock) {
      const int64_t nk = std::min(kBlock, nkeys - j0);
      const bool diag = j0 == i0;
      tiles::gemm_tile16(nq, kBlock, HP, Qi, HP, KTp + 2 * j0, 2 * Kp, S, kBlock, false,
                         diag ? Causal::kColsUpTo : Causal::kNone);
      for (int64_t ii = 0; ii < nq; ii++) {
        float* sr = S + ii * kBlock;
        online_softmax_row(sr, diag ? ii + 1 : kBlock, j0 == 0, m[ii], l[ii], O + ii * HP, HP);
        uint16_t* pr = P + ii * kBlock;
#pragma omp simd
        for (int64_t jj = 0; jj < kBlock; jj++) pr[jj] = bf16_bits(sr[jj]);
      }
      tiles::gemm_tile16(nq, HP, even(nk), P, kBlock, Vp + j0 * HP, 2 * HP, O, HP, j0 != 0,
                         diag ? Causal::kKUpTo : Causal::kNone);
    }
    finish_rows(out, lse, O, m, l, b, h, i0, nq, T, g);
  }
}

template <typename In>
void backward_item16(float* dqkv, const float* dout, const In* qkv, const In* out,
                     const float* lse, int64_t b, int64_t h, int64_t T, const Heads& g,
                     bool accumulate_kv) {
  const int64_t hs = g.hs, HP = round_up(hs, tiles::kW), C3 = g.row(), C = g.NH * hs,
                NH = g.NH;
  const int64_t Tp = round_up(T, kBlock);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const int64_t base3 = b * T * C3 + h * hs;
  const int64_t kbase = b * T * C3 + g.k_col(h), vbase = b * T * C3 + g.v_col(h);
  const float* go = dout + b * T * C + h * hs;
  const In* o = out + b * T * C + h * hs;
  const float* L = lse + (b * NH + h) * T;

  const int64_t TH = Tp * HP, BB = kBlock * kBlock, BH = kBlock * HP;
  uint16_t* rows = scratch16(8 * TH + 3 * BB);  // q (scaled), then dO, packed [Tp, HP]
  uint16_t* QsTp = rows + TH;  // B of S^T: q's columns paired
  uint16_t* Qsp = QsTp + TH;   // B of dK: q's rows paired
  uint16_t* K = Qsp + TH;      // A of S^T [Tp, HP]
  uint16_t* KT = K + TH;       // A of dQ^T [HP, Tp]
  uint16_t* V = KT + TH;       // A of dP^T [Tp, HP]
  uint16_t* dOTp = V + TH;     // B of dP^T: dO's columns paired
  uint16_t* dOp = dOTp + TH;   // B of dV: dO's rows paired
  uint16_t* PT16 = dOp + TH;   // a tile's P^T and dS^T in bf16 [kBlock, kBlock]
  uint16_t* dST16 = PT16 + BB;
  uint16_t* dSTp = dST16 + BB;  // B of dQ^T: dS^T's rows paired
  float* dQT = scratch(TH + 2 * BB + 2 * BH + 2 * Tp);
  float* PT = dQT + TH;
  float* dST = PT + BB;
  float* dK = dST + BB;
  float* dV = dK + BH;
  float* D = dV + BH;
  float* Lp = D + Tp;
  pack_rows16(rows, qkv + base3, C3, T, Tp, hs, HP, scale);
  pairs_of_columns(QsTp, rows, Tp, HP);
  pairs_of_rows(Qsp, rows, Tp, HP);
  pack_rows16(K, qkv + kbase, C3, T, Tp, hs, HP, 1.0f);
  for (int64_t t = 0; t < Tp; t++)
    for (int64_t d = 0; d < HP; d++) KT[d * Tp + t] = K[t * HP + d];
  pack_rows16(V, qkv + vbase, C3, T, Tp, hs, HP, 1.0f);
  pack_rows16(rows, go, C, T, Tp, hs, HP, 1.0f);
  pairs_of_columns(dOTp, rows, Tp, HP);
  pairs_of_rows(dOp, rows, Tp, HP);
  for (int64_t x = 0; x < TH; x++) dQT[x] = 0.0f;
  backward_rows(D, Lp, go, o, L, T, Tp, hs, C);

  for (int64_t j0 = 0; j0 < T; j0 += kBlock) {
    const int64_t nk = std::min(kBlock, T - j0);
    for (int64_t i0 = j0; i0 < T; i0 += kBlock) {
      const int64_t nq = std::min(kBlock, T - i0);
      const bool first = i0 == j0;
      const Causal cols = first ? Causal::kColsFrom : Causal::kNone;
      const Causal ks = first ? Causal::kKFrom : Causal::kNone;
      tiles::gemm_tile16(nk, kBlock, HP, K + j0 * HP, HP, QsTp + 2 * i0, 2 * Tp, PT, kBlock, false,
                         cols);
      tiles::gemm_tile16(nk, kBlock, HP, V + j0 * HP, HP, dOTp + 2 * i0, 2 * Tp, dST, kBlock,
                         false, cols);
      const float* Li = Lp + i0;
      const float* Di = D + i0;
      for (int64_t kk = 0; kk < nk; kk++) {
        const int lo = static_cast<int>(j0 + kk - i0), hi = static_cast<int>(nq);
        float* p = PT + kk * kBlock;
        float* ds = dST + kk * kBlock;
        uint16_t* p16 = PT16 + kk * kBlock;
        uint16_t* ds16 = dST16 + kk * kBlock;
#pragma omp simd
        for (int qq = 0; qq < static_cast<int>(kBlock); qq++) {
          const bool ok = qq >= lo && qq < hi;
          const float e = detail::exp_approx(p[qq] - Li[qq]);
          const float pv = ok ? e : 0.0f;
          const float dv = ok ? e * (ds[qq] - Di[qq]) : 0.0f;
          p16[qq] = bf16_bits(pv);
          ds16[qq] = bf16_bits(dv);
        }
      }
      if (nk % 2 != 0) {  // the pair's second key is past T: zero, not stale
        std::memset(PT16 + nk * kBlock, 0, kBlock * sizeof(uint16_t));
        std::memset(dST16 + nk * kBlock, 0, kBlock * sizeof(uint16_t));
      }
      tiles::gemm_tile16(nk, HP, even(nq), PT16, kBlock, dOp + i0 * HP, 2 * HP, dV, HP, !first, ks);
      tiles::gemm_tile16(nk, HP, even(nq), dST16, kBlock, Qsp + i0 * HP, 2 * HP, dK, HP, !first, ks);
      pairs_of_rows(dSTp, dST16, even(nk), kBlock);
      if (!first) {
        tiles::gemm_tile16(HP, kBlock, even(nk), KT + j0, Tp, dSTp, 2 * kBlock, dQT + i0, Tp, true);
      } else {  // query column block c needs only keys <= c + 15
        for (int64_t c = 0; c < kBlock; c += tiles::kW)
          tiles::gemm_tile16(HP, tiles::kW, even(std::min<int64_t>(nk, c + tiles::kW)), KT + j0,
                             Tp, dSTp + 2 * c, 2 * kBlock, dQT + i0 + c, Tp, true);
      }
    }
    store_kv_grads(dqkv, dK, dV, kbase, vbase, j0, nk, C3, hs, HP, accumulate_kv);
  }
  store_dq(dqkv, dQT, PT, base3, T, Tp, C3, hs, scale);  // through the (now free) PT tile
}
#endif  // PO_AVX512BF16


}  // namespace

bool bf16_attention_tiles() { return tiles::kBf16Tiles; }

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t NH,
                       int64_t NKV, int64_t hs) {
  PO_CHECK(NH > 0 && NKV > 0 && NH % NKV == 0 && hs > 0, "attention_forward: NH=", NH,
           " must be a positive multiple of NKV=", NKV);
  const Heads g{NH, NKV, hs};
  // Items are whole heads (K, V packed once) when there are enough of them,
  // else single query blocks, heaviest (last) first. Each item writes only its
  // own rows of out and lse, and a row's result does not depend on the split.
  const int64_t nqb = (T + kBlock - 1) / kBlock;
  const int64_t per = B * NH >= 4 * num_threads() ? nqb : 1;
  const int64_t groups = nqb / per, items = B * NH * groups;
  [[maybe_unused]] const bool bf16 = bf16_tiles();
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t it = 0; it < items; it++) {
    const int64_t qb = (groups - 1 - it / (B * NH)) * per;
    const int64_t bh = it % (B * NH);
#if PO_AVX512BF16
    if (bf16) {
      forward_item16(out, lse, qkv, bh / NH, bh % NH, qb, qb + per, T, g);
      continue;
    }
#endif
    forward_item(out, lse, qkv, bh / NH, bh % NH, qb, qb + per, T, g);
  }
}

namespace {

template <typename In>
void attention_grads(float* dqkv, const float* dout, const In* qkv, const In* out,
                     const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t hs) {
  PO_CHECK(NH > 0 && NKV > 0 && NH % NKV == 0 && hs > 0, "attention_backward: NH=", NH,
           " must be a positive multiple of NKV=", NKV);
  const Heads g{NH, NKV, hs};
  // One item per (b, kv group): it owns the group's q columns and its k and v
  // columns of dqkv; the group's query heads add into dk, dv in head order.
  const int64_t per = NH / NKV;
  [[maybe_unused]] const bool bf16 = bf16_tiles();
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bg = 0; bg < B * NKV; bg++)
    for (int64_t j = 0; j < per; j++) {
#if PO_AVX512BF16
      if (bf16) {
        backward_item16(dqkv, dout, qkv, out, lse, bg / NKV, (bg % NKV) * per + j, T, g, j > 0);
        continue;
      }
#endif
      backward_item(dqkv, dout, qkv, out, lse, bg / NKV, (bg % NKV) * per + j, T, g, j > 0);
    }
}

}  // namespace

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                        int64_t hs) {
  attention_grads(dqkv, dout, qkv, out, lse, B, T, NH, NKV, hs);
}
void attention_backward(float* dqkv, const float* dout, const uint16_t* qkv, const uint16_t* out,
                        const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                        int64_t hs) {
  attention_grads(dqkv, dout, qkv, out, lse, B, T, NH, NKV, hs);
}

PO_KERNELS_END
