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

// The same math with the row's reductions split out (vocabulary parallel).
void vocab_ce_max(float* row_max, const float* logits, int64_t n, int64_t Vl, int64_t nv) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; r++) {
    const float* z = logits + r * Vl;
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < nv; j++) mx = z[j] > mx ? z[j] : mx;
    row_max[r] = mx;
  }
}

void vocab_ce_sums(double* sums, float* logits, const int32_t* targets, const float* row_max,
                   int64_t n, int64_t Vl, int64_t nv, int64_t v0, bool store_exp) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; r++) {
    float* z = logits + r * Vl;
    const float mx = row_max[r];
    const int64_t t = static_cast<int64_t>(targets[r]) - v0;
    sums[2 * r + 1] = t >= 0 && t < nv ? static_cast<double>(z[t]) : 0.0;
    double sum = 0.0;
    if (store_exp) {
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < nv; j++) {
        const float e = detail::exp_approx(z[j] - mx);
        z[j] = e;
        sum += e;
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < nv; j++) sum += detail::exp_approx(z[j] - mx);
    }
    sums[2 * r] = sum;
  }
}

void vocab_ce_finish(float* losses, float* logits, const int32_t* targets, const float* row_max,
                     const double* sums, int64_t n, int64_t Vl, int64_t nv, int64_t v0,
                     float grad_scale) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; r++) {
    const double sum = sums[2 * r];
    losses[r] = static_cast<float>(std::log(sum) + static_cast<double>(row_max[r]) - sums[2 * r + 1]);
    if (grad_scale == 0.0f) continue;
    float* z = logits + r * Vl;
    const float k = static_cast<float>(static_cast<double>(grad_scale) / sum);
#pragma omp simd
    for (int64_t j = 0; j < nv; j++) z[j] *= k;
    for (int64_t j = nv; j < Vl; j++) z[j] = 0.0f;
    const int64_t t = static_cast<int64_t>(targets[r]) - v0;
    if (t >= 0 && t < nv) z[t] -= grad_scale;
  }
}

}  // namespace po::backend::cpu
