// AdamW and the reductions the optimizer needs (global grad norm, scaling).
// adamw_update reproduces torch.optim.AdamW (single-tensor path): scalars are
// formed in double as Python does, then applied in f32 in the same order:
// decay, moment updates, addcdiv(m, sqrt(v)/sqrt(bc2) + eps, -lr/bc1).
#include <cmath>
#include <cstddef>
#include <type_traits>

#include "backend/cpu/adam_element.h"
#include "backend/cpu/kernel_isa.h"
#include "backend/ops.h"
#include "core/bf16.h"

PO_KERNELS_BEGIN

double sum_squares(const float* x, int64_t n) {
  double s = 0.0;
#pragma omp parallel for simd reduction(+ : s) schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const double d = x[i];
    s += d * d;
  }
  return s;
}

void scale(float* x, float s, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) x[i] *= s;
}

namespace {

// One AdamW update; Grad is float or uint16_t (bf16 bits), Out is std::nullptr_t
// (the master is the parameter) or uint16_t* (bf16 parameters written too).
template <typename Grad, typename Out>
void adamw_kernel(float* param, const Grad* grad, float* m, float* v, Out out, int64_t n,
                  float lr, float beta1, float beta2, float eps, float weight_decay,
                  float grad_scale, int64_t t) {
  const AdamScalars k = AdamScalars::make(lr, beta1, beta2, eps, weight_decay, grad_scale, t);
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) {
    float gi;
    if constexpr (std::is_same_v<Grad, float>) {
      gi = grad[i];
    } else {
      gi = core::bf16_to_f32(core::bf16{grad[i]});
    }
    k.update(gi, param[i], m[i], v[i]);
    if constexpr (!std::is_same_v<Out, std::nullptr_t>) out[i] = core::f32_to_bf16(param[i]).bits;
  }
}

}  // namespace

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, float grad_scale,
                  int64_t t) {
  adamw_kernel(param, grad, m, v, nullptr, n, lr, beta1, beta2, eps, weight_decay, grad_scale, t);
}

void adamw_update_mixed(float* master, const uint16_t* grad, float* m, float* v,
                        uint16_t* param_out, int64_t n, float lr, float beta1, float beta2,
                        float eps, float weight_decay, float grad_scale, int64_t t) {
  adamw_kernel(master, grad, m, v, param_out, n, lr, beta1, beta2, eps, weight_decay, grad_scale,
               t);
}

PO_KERNELS_END
