// Fused softmax + cross-entropy over logits[BT,V], gradient written in place.
// Stable: every exp is of (logit - row max) <= 0. Row sums and the loss are
// accumulated in double (V = 50257 terms).
#include <cmath>

#include "backend/cpu/simd_math.h"
#include "backend/ops.h"

namespace po::backend::cpu {

void crossentropy_forward(float* losses, float* logits, const int32_t* targets, int64_t BT,
                          int64_t V, float grad_scale) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < BT; r++) {
    float* z = logits + r * V;
    const int32_t tgt = targets[r];
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < V; j++) mx = z[j] > mx ? z[j] : mx;
    const float zt = z[tgt];
    double sum = 0.0;
    if (grad_scale != 0.0f) {
      // Store exp(z - max) in place, then scale to the gradient.
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < V; j++) {
        const float e = detail::exp_approx(z[j] - mx);
        z[j] = e;
        sum += e;
      }
      const float k = static_cast<float>(static_cast<double>(grad_scale) / sum);
#pragma omp simd
      for (int64_t j = 0; j < V; j++) z[j] *= k;
      z[tgt] -= grad_scale;
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < V; j++) sum += detail::exp_approx(z[j] - mx);
    }
    losses[r] = static_cast<float>(std::log(sum) + static_cast<double>(mx) -
                                   static_cast<double>(zt));
  }
}

}  // namespace po::backend::cpu
