// AdamW and the reductions the optimizer needs (global grad norm, scaling).
// adamw_update reproduces torch.optim.AdamW (single-tensor path): scalars are
// formed in double as Python does, then applied in f32 in the same order:
// decay, moment updates, addcdiv(m, sqrt(v)/sqrt(bc2) + eps, -lr/bc1).
#include <cmath>

#include "backend/ops.h"

namespace po::backend::cpu {

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

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, float grad_scale,
                  int64_t t) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(t));
  const float decay = static_cast<float>(1.0 - static_cast<double>(lr) * weight_decay);
  const float neg_step = static_cast<float>(-(static_cast<double>(lr) / bc1));
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float omb1 = static_cast<float>(1.0 - static_cast<double>(beta1));
  const float omb2 = static_cast<float>(1.0 - static_cast<double>(beta2));
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const float g = grad[i] * grad_scale;
    const float p = param[i] * decay;
    const float mi = m[i] * beta1 + g * omb1;
    const float vi = v[i] * beta2 + omb2 * g * g;
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    param[i] = p + neg_step * mi / denom;
    m[i] = mi;
    v[i] = vi;
  }
}

}  // namespace po::backend::cpu
