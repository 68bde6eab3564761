// GELU (tanh approximation) and the residual add: elementwise, memory bound.
// 0.5 x (1 + tanh(u)) == x * sigmoid(2u), which needs one exp and vectorises.
#include "backend/cpu/kernel_isa.h"
#include "backend/cpu/simd_math.h"
#include "backend/ops.h"

PO_KERNELS_BEGIN

namespace {
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCoef = 0.044715f;

template <typename Out>
void gelu_values(Out* out, const float* inp, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const float x = inp[i];
    const float u = kSqrt2OverPi * (x + kCoef * x * x * x);
    detail::put(out + i, x / (1.0f + detail::exp_approx(-2.0f * u)));
  }
}

}  // namespace

void gelu_forward(float* out, const float* inp, int64_t n) { gelu_values(out, inp, n); }
void gelu_forward(uint16_t* out, const float* inp, int64_t n) { gelu_values(out, inp, n); }

namespace {

template <typename In>
void gelu_grad(float* dinp, const In* inp, const float* dout, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const float x = detail::get(inp, i);
    const float u = kSqrt2OverPi * (x + kCoef * x * x * x);
    const float s = 1.0f / (1.0f + detail::exp_approx(-2.0f * u));  // = (1 + tanh u) / 2
    const float du = kSqrt2OverPi * (1.0f + 3.0f * kCoef * x * x);
    // d/dx [x s(2u)] = s + x * 2 s (1 - s) du
    dinp[i] = (s + 2.0f * x * s * (1.0f - s) * du) * dout[i];
  }
}

}  // namespace

void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
  gelu_grad(dinp, inp, dout, n);
}
void gelu_backward(float* dinp, const uint16_t* inp, const float* dout, int64_t n) {
  gelu_grad(dinp, inp, dout, n);
}

void residual_forward(float* out, const float* a, const float* b, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

PO_KERNELS_END
