// SwiGLU (Llama's MLP activation): out = silu(gate) * up, with gate and up the
// two halves of one projection's output row, so that the gate and up weights
// run as one GEMM. Elementwise and memory bound.
#include "backend/cpu/kernel_isa.h"
#include "backend/cpu/simd_math.h"
#include "backend/ops.h"

PO_KERNELS_BEGIN

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

namespace {

template <typename In>
void swiglu_grad(float* dinp, const In* inp, const float* dout, int64_t BT, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < BT; r++) {
    const In* g = inp + r * 2 * F;
    const In* u = g + F;
    const float* dy = dout + r * F;
    float* dg = dinp + r * 2 * F;
    float* du = dg + F;
#pragma omp simd
    for (int64_t i = 0; i < F; i++) {
      const float gi = detail::get(g, i);
      const float s = 1.0f / (1.0f + detail::exp_approx(-gi));  // sigmoid(g)
      const float silu = gi * s;
      // d silu / dg = s (1 + g (1 - s))
      dg[i] = dy[i] * detail::get(u, i) * s * (1.0f + gi * (1.0f - s));
      du[i] = dy[i] * silu;
    }
  }
}

}  // namespace

void swiglu_backward(float* dinp, const float* inp, const float* dout, int64_t BT, int64_t F) {
  swiglu_grad(dinp, inp, dout, BT, F);
}
void swiglu_backward(float* dinp, const uint16_t* inp, const float* dout, int64_t BT, int64_t F) {
  swiglu_grad(dinp, inp, dout, BT, F);
}

PO_KERNELS_END
