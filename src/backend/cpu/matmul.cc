// Linear layer (llm.c matmul_forward/backward) on top of gemm(). Weights are
// [OC, C] as torch.nn.Linear; dweight/dbias accumulate, dinp is written unless
// the caller asks to accumulate.
#include <immintrin.h>
#include <omp.h>

#include <vector>

#include "backend/cpu/kernel_isa.h"
#include "backend/ops.h"
#include "core/error.h"

PO_KERNELS_BEGIN

void matmul_forward(float* out, Operand inp, Operand weight, const float* bias, int64_t BT,
                    int64_t C, int64_t OC) {
  float beta = 0.0f;
  if (bias != nullptr) {
    // Broadcast the bias first and let the GEMM add onto it (beta = 1).
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < BT; r++) {
      float* o = out + r * OC;
#pragma omp simd
      for (int64_t j = 0; j < OC; j++) o[j] = bias[j];
    }
    beta = 1.0f;
  }
  // out[BT,OC] = inp[BT,C] · weight[OC,C]^T
  gemm(false, true, BT, OC, C, 1.0f, inp, C, weight, C, beta, out, OC);
}

#if PO_AVX512
// GCC 12 reports the AVX-512 reduction's own "undefined" operands as
// uninitialized once inlined (GCC bug 105593); nothing here is.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace {
// One tile of rows_out: NR input rows against NJ weight rows, every product a
// dot over C in 16 lanes (c ascending) and one reduction: a tile's values do
// not depend on the tile's neighbours, the row count or the threads.
template <int NR, int NJ>
void dot_tile(float* out, const float* x, const float* w, const float* bias, int64_t C,
              int64_t OC) {
  __m512 acc[NR][NJ];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NJ; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; c += 16) {
    __m512 wv[NJ];
    for (int j = 0; j < NJ; ++j) wv[j] = _mm512_loadu_ps(w + j * C + c);
    for (int r = 0; r < NR; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * C + c);
      for (int j = 0; j < NJ; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NJ; ++j) {
      const float s = _mm512_reduce_add_ps(acc[r][j]);
      out[r * OC + j] = bias != nullptr ? bias[j] + s : s;
    }
}

template <int NJ>
void dot_tiles(float* out, const float* x, const float* w, const float* bias, int64_t rows,
               int64_t C, int64_t OC) {
  int64_t r = 0;
  for (; r + 6 <= rows; r += 6) dot_tile<6, NJ>(out + r * OC, x + r * C, w, bias, C, OC);
  float* o = out + r * OC;
  const float* xr = x + r * C;
  switch (rows - r) {
    case 5: dot_tile<5, NJ>(o, xr, w, bias, C, OC); break;
    case 4: dot_tile<4, NJ>(o, xr, w, bias, C, OC); break;
    case 3: dot_tile<3, NJ>(o, xr, w, bias, C, OC); break;
    case 2: dot_tile<2, NJ>(o, xr, w, bias, C, OC); break;
    case 1: dot_tile<1, NJ>(o, xr, w, bias, C, OC); break;
    default: break;
  }
}

// out[rows, OC] for a few rows: each thread takes blocks of four weight rows,
// read from memory once and reused from cache for every input row. One or
// two rows stream one weight row at a time (faster there: 16-19 against
// 19-24 ms for gpt2-124M's weights at one row, Zen 5); every output is the
// same dot product either way.
void dot_rows(float* out, const float* x, const float* w, const float* bias, int64_t rows,
              int64_t C, int64_t OC) {
  if (rows <= 2) {
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < OC; ++j)
      dot_tiles<1>(out + j, x, w + j * C, bias != nullptr ? bias + j : nullptr, rows, C, OC);
    return;
  }
  const int64_t blocks = (OC + 3) / 4;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t j = b * 4;
    const float* bj = bias != nullptr ? bias + j : nullptr;
    if (j + 4 <= OC) {
      dot_tiles<4>(out + j, x, w + j * C, bj, rows, C, OC);
    } else {
      for (int64_t k = j; k < OC; ++k)
        dot_tiles<1>(out + k, x, w + k * C, bias != nullptr ? bias + k : nullptr, rows, C, OC);
    }
  }
}
}  // namespace
#pragma GCC diagnostic pop
#endif

void matmul_forward_decode(float* out, const float* inp, const float* weight, const float* bias,
                           int64_t BT, int64_t C, int64_t OC) {
#if PO_AVX512
  if (BT <= kDecodeRowsTiled && C % 16 == 0) return dot_rows(out, inp, weight, bias, BT, C, OC);
#endif
  if (BT > 4) return matmul_forward(out, inp, weight, bias, BT, C, OC);
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < OC; j++) {
    const float* w = weight + j * C;
    for (int64_t r = 0; r < BT; r++) {
      const float* x = inp + r * C;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < C; c++) s += x[c] * w[c];
      out[r * OC + j] = bias != nullptr ? bias[j] + s : s;
    }
  }
}

void matmul_backward(float* dinp, float* dweight, float* dbias, Operand dout, Operand inp,
                     Operand weight, int64_t BT, int64_t C, int64_t OC, bool accumulate_dinp) {
  // Both products read dout: at kBF16 it is rounded once here, not in each.
  thread_local std::vector<uint16_t> dout16;
  if (gemm_precision() == GemmPrecision::kBF16 && dout.bf16 == nullptr && dinp != nullptr &&
      dweight != nullptr) {
    dout16.resize(static_cast<size_t>(BT * OC));
    f32_to_bf16(dout16.data(), dout.f32, BT * OC);
    dout.bf16 = dout16.data();
  }
  // dinp[BT,C] (=|+=) dout[BT,OC] · weight[OC,C]
  if (dinp != nullptr)
    gemm(false, false, BT, C, OC, 1.0f, dout, OC, weight, C, accumulate_dinp ? 1.0f : 0.0f,
         dinp, C);
  // dweight[OC,C] += dout^T · inp
  if (dweight != nullptr) gemm(true, false, OC, C, BT, 1.0f, dout, OC, inp, C, 1.0f, dweight, C);
  if (dbias != nullptr) {
    PO_CHECK(dout.f32 != nullptr, "matmul_backward: the bias gradient needs dout in f32");
    // Column sums; each thread owns a slice of columns so rows stream in order.
#pragma omp parallel
    {
      const int nt = omp_get_num_threads(), id = omp_get_thread_num();
      const int64_t chunk = ((OC + nt - 1) / nt + 15) / 16 * 16;
      const int64_t j0 = id * chunk, j1 = j0 + chunk < OC ? j0 + chunk : OC;
      for (int64_t r = 0; r < BT; r++) {
        const float* d = dout.f32 + r * OC;
#pragma omp simd
        for (int64_t j = j0; j < j1; j++) dbias[j] += d[j];
      }
    }
  }
}

PO_KERNELS_END
