// Linear layer (llm.c matmul_forward/backward) on top of gemm(). Weights are
// [OC, C] as torch.nn.Linear; dweight/dbias accumulate, dinp is written unless
// the caller asks to accumulate.
#include <omp.h>

#include <vector>

#include "backend/ops.h"
#include "core/error.h"

namespace po::backend::cpu {

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

void matmul_forward_decode(float* out, const float* inp, const float* weight, const float* bias,
                           int64_t BT, int64_t C, int64_t OC) {
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

}  // namespace po::backend::cpu
