// Context parallel's attention blocks (ops.h, attention_block_forward and
// _backward): one chunk of queries against one chunk of keys and values,
// with the tiles, packing and online softmax of attention.cc.
//
// Forward, work item = one head (b, h): Q (pre-scaled), K^T and V of the two
// chunks packed once; per query tile the online softmax over the block's key
// tiles (a causal block stops at the diagonal tile, masked as attention.cc
// masks it; a full block masks only the last tile's columns past nk); the
// tile's normalised rows and their lse are then merged into out and lse.
// Backward, work item = one (b, kv group), its query heads in order; per key
// tile, per query tile that sees it, attention.cc's transposed products with
// the final lse and D = rowsum(dO · O): dV_j += P^T dO_i, dK_j += dS^T Qs_i
// (added into dk, dv when the key tile is done), dQ_i^T += K_j^T dS^T (added
// into dq, scaled, at the end).
//
// Determinism as in attention.cc: every out/lse/dq row of a head and every
// dk/dv row of a kv group belongs to one item, and inside it accumulations
// run in a fixed order.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "backend/cpu/attention_parts.h"
#include "backend/cpu/attention_tiles.h"
#include "backend/cpu/kernel_isa.h"
#include "backend/cpu/simd_math.h"
#include "backend/ops.h"
#include "core/error.h"

PO_KERNELS_BEGIN

namespace {

using tiles::Causal;
using tiles::gemm_tile;
using namespace attn;

void check_heads(const char* what, int64_t NH, int64_t NKV, int64_t hs, int64_t nq, int64_t nk,
                 bool causal) {
  PO_CHECK(NH > 0 && NKV > 0 && NH % NKV == 0 && hs > 0, what, ": NH=", NH,
           " must be a positive multiple of NKV=", NKV);
  PO_CHECK(nq > 0 && nk > 0 && (!causal || nq == nk), what, ": a causal block needs nq = nk, got ",
           nq, " and ", nk);
}

// A query tile's normalised rows (O / l) and their lse (m + log l), merged
// into out and lse; ob is a row of scratch.
void merge_tile(AttnRowsOut out, float* lse, int64_t lse_stride, const float* O, const float* m,
                const float* l, float* ob, int64_t b, int64_t h, int64_t i0, int64_t ni,
                int64_t NH, int64_t hs, int64_t HP) {
  for (int64_t ii = 0; ii < ni; ii++) {
    const float inv = 1.0f / l[ii];
    for (int64_t d = 0; d < hs; d++) ob[d] = O[ii * HP + d] * inv;
    attention_lse_merge(out.p + b * out.batch + (i0 + ii) * out.row + h * hs,
                        lse + (b * NH + h) * lse_stride + i0 + ii, ob, m[ii] + std::log(l[ii]), hs);
  }
}

// D[t] = rowsum(dO · O) over the head's columns and the lse, padded to Qp rows.
void backward_rows(float* D, float* Lp, const float* go, int64_t go_row, const float* o,
                   int64_t o_row, const float* L, int64_t nq, int64_t Qp, int64_t hs) {
  for (int64_t t = 0; t < Qp; t++) {
    float sum = 0.0f;
    if (t < nq)
      for (int64_t d = 0; d < hs; d++) sum += go[t * go_row + d] * o[t * o_row + d];
    D[t] = sum;
    Lp[t] = t < nq ? L[t] : 0.0f;
  }
}

// A key tile's dK, dV added into kv group g's rows of dk, dv.
void add_kv_tile(AttnRowsOut dk, AttnRowsOut dv, const float* dK, const float* dV, int64_t b,
                 int64_t g, int64_t j0, int64_t nj, int64_t hs, int64_t HP) {
  for (int64_t kk = 0; kk < nj; kk++) {
    float* dkr = dk.p + b * dk.batch + (j0 + kk) * dk.row + g * hs;
    float* dvr = dv.p + b * dv.batch + (j0 + kk) * dv.row + g * hs;
#pragma omp simd
    for (int64_t d = 0; d < hs; d++) {
      dkr[d] += dK[kk * HP + d];
      dvr[d] += dV[kk * HP + d];
    }
  }
}

// dq += scale · dQT^T, a 16 x 16 tile at a time through `tile`.
void add_dq(AttnRowsOut dq, const float* dQT, float* tile, int64_t b, int64_t h, int64_t nq,
            int64_t Qp, int64_t hs, int64_t HP, float scale) {
  for (int64_t t0 = 0; t0 < nq; t0 += 16)
    for (int64_t d0 = 0; d0 < HP; d0 += 16) {
      tiles::transpose16(dQT + d0 * Qp + t0, Qp, tile, 16);
      const int64_t nd = std::min<int64_t>(16, hs - d0);
      for (int64_t t = t0; t < std::min(nq, t0 + 16); t++) {
        float* r = dq.p + b * dq.batch + t * dq.row + h * hs + d0;
        const float* x = tile + (t - t0) * 16;
        for (int64_t d = 0; d < nd; d++) r[d] += scale * x[d];
      }
    }
}

void block_forward_item(AttnRowsOut out, float* lse, int64_t lse_stride, AttnRows q, AttnRows k,
                        AttnRows v, int64_t b, int64_t h, int64_t nq, int64_t nk, int64_t NH,
                        int64_t NKV, int64_t hs, bool causal) {
  const int64_t HP = round_up(hs, tiles::kW), Qp = round_up(nq, kBlock), Kp = round_up(nk, kBlock);
  const int64_t g = h / (NH / NKV);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  float* Q = scratch(Qp * HP + HP * Kp + Kp * HP + std::max(kBlock * kBlock, Kp * HP) +
                     kBlock * HP + 2 * kBlock + HP);
  float* KT = Q + Qp * HP;
  float* V = KT + HP * Kp;
  float* S = V + Kp * HP;
  float* O = S + std::max(kBlock * kBlock, Kp * HP);
  float* m = O + kBlock * HP;
  float* l = m + kBlock;
  float* ob = l + kBlock;
  pack_rows(Q, q.p + b * q.batch + h * hs, q.row, nq, Qp, hs, HP, scale);
  pack_rows(S, k.p + b * k.batch + g * hs, k.row, nk, Kp, hs, HP, 1.0f);  // S holds K for now
  transpose_packed(KT, S, Kp, HP);
  pack_rows(V, v.p + b * v.batch + g * hs, v.row, nk, Kp, hs, HP, 1.0f);

  for (int64_t i0 = 0; i0 < nq; i0 += kBlock) {
    const int64_t ni = std::min(kBlock, nq - i0), key_end = causal ? i0 + ni : nk;
    const float* Qi = Q + i0 * HP;
    for (int64_t ii = 0; ii < ni; ii++) {
      m[ii] = -INFINITY;
      l[ii] = 0.0f;
    }
    for (int64_t j0 = 0; j0 < key_end; j0 += kBlock) {
      const int64_t nj = std::min(kBlock, key_end - j0);
      const bool diag = causal && j0 == i0;
      gemm_tile(ni, kBlock, HP, Qi, HP, KT + j0, Kp, S, kBlock, false,
                diag ? Causal::kColsUpTo : Causal::kNone);
      for (int64_t ii = 0; ii < ni; ii++)
        online_softmax_row(S + ii * kBlock, diag ? ii + 1 : nj, j0 == 0, m[ii], l[ii],
                           O + ii * HP, HP);
      gemm_tile(ni, HP, nj, S, kBlock, V + j0 * HP, HP, O, HP, j0 != 0,
                diag ? Causal::kKUpTo : Causal::kNone);
    }
    merge_tile(out, lse, lse_stride, O, m, l, ob, b, h, i0, ni, NH, hs, HP);
  }
}

void block_backward_item(AttnRowsOut dq, AttnRowsOut dk, AttnRowsOut dv, AttnRows dout,
                         AttnRows out, const float* lse, int64_t lse_stride, AttnRows q,
                         AttnRows k, AttnRows v, int64_t b, int64_t h, int64_t nq, int64_t nk,
                         int64_t NH, int64_t NKV, int64_t hs, bool causal) {
  const int64_t HP = round_up(hs, tiles::kW), Qp = round_up(nq, kBlock), Kp = round_up(nk, kBlock);
  const int64_t g = h / (NH / NKV);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const int64_t QH = Qp * HP, KH = Kp * HP, BB = kBlock * kBlock, BH = kBlock * HP;
  float* Qs = scratch(5 * QH + 3 * KH + 2 * BB + 2 * BH + 2 * Qp + 16 * 16);
  float* QsT = Qs + QH;
  float* dO = QsT + QH;
  float* dOT = dO + QH;
  float* dQT = dOT + QH;
  float* K = dQT + QH;
  float* KT = K + KH;
  float* V = KT + KH;
  float* PT = V + KH;
  float* dST = PT + BB;
  float* dK = dST + BB;
  float* dV = dK + BH;
  float* D = dV + BH;
  float* Lp = D + Qp;
  float* tile = Lp + Qp;
  const float* go = dout.p + b * dout.batch + h * hs;
  const float* o = out.p + b * out.batch + h * hs;
  pack_rows(Qs, q.p + b * q.batch + h * hs, q.row, nq, Qp, hs, HP, scale);
  transpose_packed(QsT, Qs, Qp, HP);
  pack_rows(dO, go, dout.row, nq, Qp, hs, HP, 1.0f);
  transpose_packed(dOT, dO, Qp, HP);
  pack_rows(K, k.p + b * k.batch + g * hs, k.row, nk, Kp, hs, HP, 1.0f);
  transpose_packed(KT, K, Kp, HP);
  pack_rows(V, v.p + b * v.batch + g * hs, v.row, nk, Kp, hs, HP, 1.0f);
  for (int64_t x = 0; x < QH; x++) dQT[x] = 0.0f;
  backward_rows(D, Lp, go, dout.row, o, out.row, lse + (b * NH + h) * lse_stride, nq, Qp, hs);

  for (int64_t j0 = 0; j0 < nk; j0 += kBlock) {
    const int64_t nj = std::min(kBlock, nk - j0), i_start = causal ? j0 : 0;
    for (int64_t i0 = i_start; i0 < nq; i0 += kBlock) {
      const int64_t ni = std::min(kBlock, nq - i0);
      const bool diag = causal && i0 == j0;
      const Causal cols = diag ? Causal::kColsFrom : Causal::kNone;
      const Causal ks = diag ? Causal::kKFrom : Causal::kNone;
      gemm_tile(nj, kBlock, HP, K + j0 * HP, HP, QsT + i0, Qp, PT, kBlock, false, cols);
      gemm_tile(nj, kBlock, HP, V + j0 * HP, HP, dOT + i0, Qp, dST, kBlock, false, cols);
      // causal diagonal: query i0+qq >= key j0+kk (columns before it may be stale)
      tile_score_grads(PT, dST, Lp + i0, D + i0, nj, ni, diag ? 0 : -kBlock);
      const bool acc = i0 != i_start;
      gemm_tile(nj, HP, ni, PT, kBlock, dO + i0 * HP, HP, dV, HP, acc, ks);
      gemm_tile(nj, HP, ni, dST, kBlock, Qs + i0 * HP, HP, dK, HP, acc, ks);
      if (!diag) {
        gemm_tile(HP, kBlock, nj, KT + j0, Kp, dST, kBlock, dQT + i0, Qp, true);
      } else {  // query column block c needs only keys <= c + 15
        for (int64_t c = 0; c < kBlock; c += tiles::kW)
          gemm_tile(HP, tiles::kW, std::min<int64_t>(nj, c + tiles::kW), KT + j0, Kp, dST + c,
                    kBlock, dQT + i0 + c, Qp, true);
      }
    }
    if (i_start >= nq) continue;  // no query tile sees this key tile
    add_kv_tile(dk, dv, dK, dV, b, g, j0, nj, hs, HP);
  }
  add_dq(dq, dQT, tile, b, h, nq, Qp, hs, HP, scale);
}

#if PO_AVX512BF16
// The same blocks on bf16 tiles (attention.cc's bf16 items: operands rounded
// to bf16 as they are packed, the probabilities and score gradients of each
// tile rounded before their products, f32 accumulation, the softmax, lse, D
// and the accumulators in f32).
void block_forward_item16(AttnRowsOut out, float* lse, int64_t lse_stride, AttnRows q,
                          AttnRows k, AttnRows v, int64_t b, int64_t h, int64_t nq, int64_t nk,
                          int64_t NH, int64_t NKV, int64_t hs, bool causal) {
  const int64_t HP = round_up(hs, tiles::kW), Qp = round_up(nq, kBlock), Kp = round_up(nk, kBlock);
  const int64_t g = h / (NH / NKV);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  uint16_t* Q = scratch16(Qp * HP + 3 * Kp * HP + kBlock * kBlock);
  uint16_t* KTp = Q + Qp * HP;   // keys' columns paired: [HP/2][Kp][2]
  uint16_t* Vp = KTp + Kp * HP;  // values' rows paired: [Kp/2][HP][2]
  uint16_t* rows = Vp + Kp * HP; // k, then v, packed [Kp, HP]
  uint16_t* P = rows + Kp * HP;  // a tile's probabilities [kBlock, kBlock]
  float* S = scratch(kBlock * kBlock + kBlock * HP + 2 * kBlock + HP);
  float* O = S + kBlock * kBlock;
  float* m = O + kBlock * HP;
  float* l = m + kBlock;
  float* ob = l + kBlock;
  pack_rows16(Q, q.p + b * q.batch + h * hs, q.row, nq, Qp, hs, HP, scale);
  pack_rows16(rows, k.p + b * k.batch + g * hs, k.row, nk, Kp, hs, HP, 1.0f);
  pairs_of_columns(KTp, rows, Kp, HP);
  pack_rows16(rows, v.p + b * v.batch + g * hs, v.row, nk, Kp, hs, HP, 1.0f);
  pairs_of_rows(Vp, rows, Kp, HP);

  for (int64_t i0 = 0; i0 < nq; i0 += kBlock) {
    const int64_t ni = std::min(kBlock, nq - i0), key_end = causal ? i0 + ni : nk;
    const uint16_t* Qi = Q + i0 * HP;
    for (int64_t ii = 0; ii < ni; ii++) {
      m[ii] = -INFINITY;
      l[ii] = 0.0f;
    }
    for (int64_t j0 = 0; j0 < key_end; j0 += kBlock) {
      const int64_t nj = std::min(kBlock, key_end - j0);
      const bool diag = causal && j0 == i0;
      tiles::gemm_tile16(ni, kBlock, HP, Qi, HP, KTp + 2 * j0, 2 * Kp, S, kBlock, false,
                         diag ? Causal::kColsUpTo : Causal::kNone);
      for (int64_t ii = 0; ii < ni; ii++) {
        float* sr = S + ii * kBlock;
        online_softmax_row(sr, diag ? ii + 1 : nj, j0 == 0, m[ii], l[ii], O + ii * HP, HP);
        uint16_t* pr = P + ii * kBlock;
#pragma omp simd
        for (int64_t jj = 0; jj < kBlock; jj++) pr[jj] = bf16_bits(sr[jj]);
      }
      tiles::gemm_tile16(ni, HP, even(nj), P, kBlock, Vp + j0 * HP, 2 * HP, O, HP, j0 != 0,
                         diag ? Causal::kKUpTo : Causal::kNone);
    }
    merge_tile(out, lse, lse_stride, O, m, l, ob, b, h, i0, ni, NH, hs, HP);
  }
}

void block_backward_item16(AttnRowsOut dq, AttnRowsOut dk, AttnRowsOut dv, AttnRows dout,
                           AttnRows out, const float* lse, int64_t lse_stride, AttnRows q,
                           AttnRows k, AttnRows v, int64_t b, int64_t h, int64_t nq, int64_t nk,
                           int64_t NH, int64_t NKV, int64_t hs, bool causal) {
  const int64_t HP = round_up(hs, tiles::kW), Qp = round_up(nq, kBlock), Kp = round_up(nk, kBlock);
  const int64_t g = h / (NH / NKV);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const int64_t QH = Qp * HP, KH = Kp * HP, BB = kBlock * kBlock, BH = kBlock * HP;
  uint16_t* rows = scratch16(5 * QH + 3 * KH + 3 * BB);  // q (scaled), then dO, packed [Qp, HP]
  uint16_t* QsTp = rows + QH;  // B of S^T: q's columns paired
  uint16_t* Qsp = QsTp + QH;   // B of dK: q's rows paired
  uint16_t* dOTp = Qsp + QH;   // B of dP^T: dO's columns paired
  uint16_t* dOp = dOTp + QH;   // B of dV: dO's rows paired
  uint16_t* K = dOp + QH;      // A of S^T [Kp, HP]
  uint16_t* KT = K + KH;       // A of dQ^T [HP, Kp]
  uint16_t* V = KT + KH;       // A of dP^T [Kp, HP]
  uint16_t* PT16 = V + KH;     // a tile's P^T and dS^T in bf16 [kBlock, kBlock]
  uint16_t* dST16 = PT16 + BB;
  uint16_t* dSTp = dST16 + BB;  // B of dQ^T: dS^T's rows paired
  float* dQT = scratch(QH + 2 * BB + 2 * BH + 2 * Qp + 16 * 16);
  float* PT = dQT + QH;
  float* dST = PT + BB;
  float* dK = dST + BB;
  float* dV = dK + BH;
  float* D = dV + BH;
  float* Lp = D + Qp;
  float* tile = Lp + Qp;
  const float* go = dout.p + b * dout.batch + h * hs;
  const float* o = out.p + b * out.batch + h * hs;
  pack_rows16(rows, q.p + b * q.batch + h * hs, q.row, nq, Qp, hs, HP, scale);
  pairs_of_columns(QsTp, rows, Qp, HP);
  pairs_of_rows(Qsp, rows, Qp, HP);
  pack_rows16(K, k.p + b * k.batch + g * hs, k.row, nk, Kp, hs, HP, 1.0f);
  for (int64_t t = 0; t < Kp; t++)
    for (int64_t d = 0; d < HP; d++) KT[d * Kp + t] = K[t * HP + d];
  pack_rows16(V, v.p + b * v.batch + g * hs, v.row, nk, Kp, hs, HP, 1.0f);
  pack_rows16(rows, go, dout.row, nq, Qp, hs, HP, 1.0f);
  pairs_of_columns(dOTp, rows, Qp, HP);
  pairs_of_rows(dOp, rows, Qp, HP);
  for (int64_t x = 0; x < QH; x++) dQT[x] = 0.0f;
  backward_rows(D, Lp, go, dout.row, o, out.row, lse + (b * NH + h) * lse_stride, nq, Qp, hs);

  for (int64_t j0 = 0; j0 < nk; j0 += kBlock) {
    const int64_t nj = std::min(kBlock, nk - j0), i_start = causal ? j0 : 0;
    for (int64_t i0 = i_start; i0 < nq; i0 += kBlock) {
      const int64_t ni = std::min(kBlock, nq - i0);
      const bool diag = causal && i0 == j0;
      const Causal cols = diag ? Causal::kColsFrom : Causal::kNone;
      const Causal ks = diag ? Causal::kKFrom : Causal::kNone;
      tiles::gemm_tile16(nj, kBlock, HP, K + j0 * HP, HP, QsTp + 2 * i0, 2 * Qp, PT, kBlock, false,
                         cols);
      tiles::gemm_tile16(nj, kBlock, HP, V + j0 * HP, HP, dOTp + 2 * i0, 2 * Qp, dST, kBlock,
                         false, cols);
      tile_score_grads(PT, dST, Lp + i0, D + i0, nj, ni, diag ? 0 : -kBlock);
      for (int64_t x = 0; x < nj * kBlock; x++) {
        PT16[x] = bf16_bits(PT[x]);
        dST16[x] = bf16_bits(dST[x]);
      }
      if (nj % 2 != 0) {  // the pair's second key is past nk: zero, not stale
        std::memset(PT16 + nj * kBlock, 0, kBlock * sizeof(uint16_t));
        std::memset(dST16 + nj * kBlock, 0, kBlock * sizeof(uint16_t));
      }
      const bool acc = i0 != i_start;
      tiles::gemm_tile16(nj, HP, even(ni), PT16, kBlock, dOp + i0 * HP, 2 * HP, dV, HP, acc, ks);
      tiles::gemm_tile16(nj, HP, even(ni), dST16, kBlock, Qsp + i0 * HP, 2 * HP, dK, HP, acc, ks);
      pairs_of_rows(dSTp, dST16, even(nj), kBlock);
      if (!diag) {
        tiles::gemm_tile16(HP, kBlock, even(nj), KT + j0, Kp, dSTp, 2 * kBlock, dQT + i0, Qp, true);
      } else {  // query column block c needs only keys <= c + 15
        for (int64_t c = 0; c < kBlock; c += tiles::kW)
          tiles::gemm_tile16(HP, tiles::kW, even(std::min<int64_t>(nj, c + tiles::kW)), KT + j0,
                             Kp, dSTp + 2 * c, 2 * kBlock, dQT + i0 + c, Qp, true);
      }
    }
    if (i_start >= nq) continue;
    add_kv_tile(dk, dv, dK, dV, b, g, j0, nj, hs, HP);
  }
  add_dq(dq, dQT, tile, b, h, nq, Qp, hs, HP, scale);
}
#endif  // PO_AVX512BF16

}  // namespace

void attention_lse_merge(float* out, float* lse, const float* o_b, float lse_b, int64_t hs) {
  const float a = *lse;
  if (lse_b == -INFINITY) return;  // the block saw no key (not a block of this row)
  const float mx = std::max(a, lse_b);
  const float ea = std::exp(a - mx), eb = std::exp(lse_b - mx);  // ea = 0 while a = -inf
  const float merged = mx + std::log(ea + eb);
  const float wa = std::exp(a - merged), wb = std::exp(lse_b - merged);
  for (int64_t d = 0; d < hs; d++) out[d] = wa * out[d] + wb * o_b[d];
  *lse = merged;
}

void attention_block_forward(AttnRowsOut out, float* lse, int64_t lse_stride, AttnRows q,
                             AttnRows k, AttnRows v, int64_t B, int64_t nq, int64_t nk,
                             int64_t NH, int64_t NKV, int64_t hs, bool causal) {
  check_heads("attention_block_forward", NH, NKV, hs, nq, nk, causal);
  [[maybe_unused]] const bool bf16 = bf16_tiles();
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bh = 0; bh < B * NH; bh++) {
#if PO_AVX512BF16
    if (bf16) {
      block_forward_item16(out, lse, lse_stride, q, k, v, bh / NH, bh % NH, nq, nk, NH, NKV, hs,
                           causal);
      continue;
    }
#endif
    block_forward_item(out, lse, lse_stride, q, k, v, bh / NH, bh % NH, nq, nk, NH, NKV, hs,
                       causal);
  }
}

void attention_block_backward(AttnRowsOut dq, AttnRowsOut dk, AttnRowsOut dv, AttnRows dout,
                              AttnRows out, const float* lse, int64_t lse_stride, AttnRows q,
                              AttnRows k, AttnRows v, int64_t B, int64_t nq, int64_t nk,
                              int64_t NH, int64_t NKV, int64_t hs, bool causal) {
  check_heads("attention_block_backward", NH, NKV, hs, nq, nk, causal);
  const int64_t per = NH / NKV;
  [[maybe_unused]] const bool bf16 = bf16_tiles();
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bg = 0; bg < B * NKV; bg++)
    for (int64_t j = 0; j < per; j++) {
#if PO_AVX512BF16
      if (bf16) {
        block_backward_item16(dq, dk, dv, dout, out, lse, lse_stride, q, k, v, bg / NKV,
                              (bg % NKV) * per + j, nq, nk, NH, NKV, hs, causal);
        continue;
      }
#endif
      block_backward_item(dq, dk, dv, dout, out, lse, lse_stride, q, k, v, bg / NKV,
                          (bg % NKV) * per + j, nq, nk, NH, NKV, hs, causal);
    }
}

PO_KERNELS_END
