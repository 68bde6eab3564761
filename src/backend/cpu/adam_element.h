// One AdamW element update, shared by adamw_update (adamw.cc) and the
// quantized-state step (adamw_quant.cc) so that both run the same float32
// operations in the same order (torch.optim.AdamW's): decay, the moments,
// then addcdiv(m, sqrt(v) / sqrt(bc2) + eps, -lr / bc1). The scalars are
// formed in double, as Python forms torch's.
#pragma once

#include <cmath>
#include <cstdint>

namespace po::backend::cpu {

struct AdamScalars {
  float beta1, beta2, eps, grad_scale;
  float decay;     // 1 - lr * weight_decay
  float neg_step;  // -lr / (1 - beta1^t)
  float bc2_sqrt;  // sqrt(1 - beta2^t)
  float omb1, omb2;

  static AdamScalars make(float lr, float beta1, float beta2, float eps, float weight_decay,
                          float grad_scale, int64_t t) {
    const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(t));
    const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(t));
    return {beta1,
            beta2,
            eps,
            grad_scale,
            static_cast<float>(1.0 - static_cast<double>(lr) * weight_decay),
            static_cast<float>(-(static_cast<double>(lr) / bc1)),
            static_cast<float>(std::sqrt(bc2)),
            static_cast<float>(1.0 - static_cast<double>(beta1)),
            static_cast<float>(1.0 - static_cast<double>(beta2))};
  }

  // p, m, v updated in place from the raw gradient gi.
  void update(float gi, float& p, float& m, float& v) const {
    const float g = gi * grad_scale;
    const float pd = p * decay;
    const float mi = m * beta1 + g * omb1;
    const float vi = v * beta2 + omb2 * g * g;
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    p = pd + neg_step * mi / denom;
    m = mi;
    v = vi;
  }
};

}  // namespace po::backend::cpu
