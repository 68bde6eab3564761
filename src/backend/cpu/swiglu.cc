// SwiGLU (Llama's MLP activation): out = silu(gate) * up, with gate and up the
// two halves of one projection's output row, so that the gate and up weights
// run as one GEMM. Elementwise and memory bound.
#include "backend/cpu/simd_math.h"
#include "backend/ops.h"

namespace po::backend::cpu {

namespace {

template <typename Out>
void swiglu_rows(Out* out, const float* inp, int64_t BT, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < BT; r++) {
    const float* g = inp + r * 2 * F;
    const float* u = g + F;
    Out* o = out + r * F;
#pragma omp simd
    for (int64_t i = 0; i < F; i++)
      detail::put(o + i, g[i] / (1.0f + detail::exp_approx(-g[i])) * u[i]);
  }
}

}  // namespace

void swiglu_forward(float* out, const float* inp, int64_t BT, int64_t F) {
  swiglu_rows(out, inp, BT, F);
}

void swiglu_forward(uint16_t* out, const float* inp, int64_t BT, int64_t F) {
  swiglu_rows(out, inp, BT, F);
}

void swiglu_backward(float* dinp, const float* inp, const float* dout, int64_t BT, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < BT; r++) {
    const float* g = inp + r * 2 * F;
    const float* u = g + F;
    const float* dy = dout + r * F;
    float* dg = dinp + r * 2 * F;
    float* du = dg + F;
#pragma omp simd
    for (int64_t i = 0; i < F; i++) {
      const float s = 1.0f / (1.0f + detail::exp_approx(-g[i]));  // sigmoid(g)
      const float silu = g[i] * s;
      // d silu / dg = s (1 + g (1 - s))
      dg[i] = dy[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
      du[i] = dy[i] * silu;
    }
  }
}

}  // namespace po::backend::cpu
