// Fused softmax + cross-entropy over logits[BT,V], gradient written in place.
// Stable: every exp is of (logit - row max) <= 0. A row's sum is of f32
// partial sums over blocks of 1024 columns (16 lanes of 64 terms each, all
// <= 1), added in double: a double reduction inside the vector loop runs at a
// tenth of the speed (kernels_bench), and the blocks keep the error at that
// of 64-term f32 sums.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "backend/cpu/kernel_isa.h"
#include "backend/cpu/simd_math.h"
#include "backend/ops.h"
#include "core/bf16.h"

PO_KERNELS_BEGIN

namespace {

constexpr int64_t kSumBlock = 1024;

// sum_j exp(z[j] - mx) over [0, n), the exps stored in place when `store`.
double exp_sum(float* z, int64_t n, float mx, bool store) {
  double sum = 0.0;
  for (int64_t j0 = 0; j0 < n; j0 += kSumBlock) {
    const int64_t j1 = std::min(n, j0 + kSumBlock);
    float part = 0.0f;
    if (store) {
#pragma omp simd reduction(+ : part)
      for (int64_t j = j0; j < j1; j++) {
        const float e = detail::exp_approx(z[j] - mx);
        z[j] = e;
        part += e;
      }
    } else {
#pragma omp simd reduction(+ : part)
      for (int64_t j = j0; j < j1; j++) part += detail::exp_approx(z[j] - mx);
    }
    sum += part;
  }
  return sum;
}

// One row's loss; with grad_scale != 0 its gradient grad_scale * (softmax -
// onehot) goes to grad[0, V) (f32 in place over z, or bf16 bits rounded to
// nearest even in the same pass that scales).
template <typename G>
float crossentropy_row(float* z, G* grad, int32_t tgt, int64_t V, float grad_scale) {
  if (tgt < 0) {  // an ignored row (ops::kIgnoreTarget): no loss, no gradient
    if (grad_scale != 0.0f) std::fill_n(grad, V, G{0});
    return 0.0f;
  }
  float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < V; j++) mx = z[j] > mx ? z[j] : mx;
  const float zt = z[tgt];
  // With a gradient: exp(z - max) stored in place, then scaled to it.
  const double sum = exp_sum(z, V, mx, grad_scale != 0.0f);
  if (grad_scale != 0.0f) {
    const float k = static_cast<float>(static_cast<double>(grad_scale) / sum);
    if constexpr (std::is_same_v<G, float>) {
#pragma omp simd
      for (int64_t j = 0; j < V; j++) grad[j] = z[j] * k;
      grad[tgt] -= grad_scale;
    } else {
      // The target's product rounded to f32 before the subtraction, as the
      // f32 path stores it (volatile: never contracted into an FMA).
      volatile float zk = z[tgt] * k;
#pragma omp simd
      for (int64_t j = 0; j < V; j++) grad[j] = core::f32_to_bf16(z[j] * k).bits;
      grad[tgt] = core::f32_to_bf16(zk - grad_scale).bits;
    }
  }
  return static_cast<float>(std::log(sum) + static_cast<double>(mx) - static_cast<double>(zt));
}

}  // namespace

void crossentropy_forward(float* losses, float* logits, const int32_t* targets, int64_t BT,
                          int64_t V, float grad_scale) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < BT; r++)
    losses[r] = crossentropy_row(logits + r * V, logits + r * V, targets[r], V, grad_scale);
}

void crossentropy_forward_bf16(float* losses, float* logits, uint16_t* grad16,
                               const int32_t* targets, int64_t BT, int64_t V, float grad_scale) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < BT; r++)
    losses[r] = crossentropy_row(logits + r * V, grad16 + r * V, targets[r], V, grad_scale);
}

// Vocabulary pieces (ops.h): crossentropy_row's steps, the row's reductions
// split by pieces and combined in piece order.
void ce_piece_stats(float* mx, double* sum, float* zt, float* logits, const int32_t* targets,
                    int64_t n, int64_t Vk, int64_t v0, bool store_exp) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; r++) {
    float* z = logits + r * Vk;
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < Vk; j++) m = z[j] > m ? z[j] : m;
    const int64_t t = static_cast<int64_t>(targets[r]) - v0;
    if (t >= 0 && t < Vk) zt[r] = z[t];
    mx[r] = m;
    sum[r] = exp_sum(z, Vk, m, store_exp);
  }
}

void ce_piece_combine(float* losses, float* scale, const float* mx, const double* sum,
                      const float* zt, const int32_t* targets, int64_t pieces, int64_t n,
                      float grad_scale) {
  for (int64_t r = 0; r < n; r++) {
    if (targets[r] < 0) {  // an ignored row: ce_piece_grad then leaves exps · 0
      losses[r] = 0.0f;
      if (grad_scale != 0.0f)
        for (int64_t k = 0; k < pieces; k++) scale[k * n + r] = 0.0f;
      continue;
    }
    float M = -INFINITY;
    for (int64_t k = 0; k < pieces; k++) M = std::max(M, mx[k * n + r]);
    double S = 0.0;
    for (int64_t k = 0; k < pieces; k++)
      S += sum[k * n + r] * std::exp(static_cast<double>(mx[k * n + r]) - static_cast<double>(M));
    losses[r] = static_cast<float>(std::log(S) + static_cast<double>(M) - static_cast<double>(zt[r]));
    if (grad_scale == 0.0f) continue;
    for (int64_t k = 0; k < pieces; k++)
      scale[k * n + r] = static_cast<float>(
          static_cast<double>(grad_scale) *
          std::exp(static_cast<double>(mx[k * n + r]) - static_cast<double>(M)) / S);
  }
}

void ce_piece_grad(float* exps, const float* scale, const int32_t* targets, int64_t n, int64_t Vk,
                   int64_t v0, float grad_scale) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; r++) {
    float* z = exps + r * Vk;
    const float k = scale[r];
#pragma omp simd
    for (int64_t j = 0; j < Vk; j++) z[j] *= k;
    const int64_t t = static_cast<int64_t>(targets[r]) - v0;
    if (t >= 0 && t < Vk) z[t] -= grad_scale;
  }
}

void ce_piece_grad(uint16_t* grad16, const float* exps, const float* scale, const int32_t* targets,
                   int64_t n, int64_t Vk, int64_t v0, float grad_scale) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; r++) {
    const float* z = exps + r * Vk;
    uint16_t* g = grad16 + r * Vk;
    const float k = scale[r];
#pragma omp simd
    for (int64_t j = 0; j < Vk; j++) g[j] = core::f32_to_bf16(z[j] * k).bits;
    const int64_t t = static_cast<int64_t>(targets[r]) - v0;
    if (t >= 0 && t < Vk) {
      volatile float zk = z[t] * k;  // rounded to f32 before the subtraction, as in f32
      g[t] = core::f32_to_bf16(zk - grad_scale).bits;
    }
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
    sums[2 * r] = exp_sum(z, nv, mx, store_exp);
  }
}

void vocab_ce_finish(float* losses, float* logits, const int32_t* targets, const float* row_max,
                     const double* sums, int64_t n, int64_t Vl, int64_t nv, int64_t v0,
                     float grad_scale) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; r++) {
    const double sum = sums[2 * r];
    float* z = logits + r * Vl;
    if (targets[r] < 0) {  // an ignored row: no loss, no gradient
      losses[r] = 0.0f;
      if (grad_scale != 0.0f) std::fill_n(z, Vl, 0.0f);
      continue;
    }
    losses[r] = static_cast<float>(std::log(sum) + static_cast<double>(row_max[r]) - sums[2 * r + 1]);
    if (grad_scale == 0.0f) continue;
    const float k = static_cast<float>(static_cast<double>(grad_scale) / sum);
#pragma omp simd
    for (int64_t j = 0; j < nv; j++) z[j] *= k;
    for (int64_t j = nv; j < Vl; j++) z[j] = 0.0f;
    const int64_t t = static_cast<int64_t>(targets[r]) - v0;
    if (t >= 0 && t < nv) z[t] -= grad_scale;
  }
}

PO_KERNELS_END
