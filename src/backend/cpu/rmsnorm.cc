// RMSNorm over the last axis (Llama): out = x * rstd * weight, rstd =
// 1/sqrt(mean(x^2) + eps), rstd saved for the backward. As in layernorm.cc the
// row statistic accumulates in double, and the weight gradient is reduced from
// per-thread partials in thread order, so the bits do not depend on the
// schedule for a fixed thread count.
#include <omp.h>

#include <cmath>
#include <vector>

#include "backend/cpu/kernel_isa.h"
#include "backend/cpu/simd_math.h"
#include "backend/ops.h"

PO_KERNELS_BEGIN

namespace {

template <typename Out>
void rmsnorm_rows(Out* out, float* rstd, const float* inp, const float* weight, int64_t BT,
                  int64_t C, double eps) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < BT; r++) {
    const float* x = inp + r * C;
    double ss = 0.0;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < C; i++) ss += static_cast<double>(x[i]) * x[i];
    const float rs = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(C) + eps));
    Out* o = out + r * C;
#pragma omp simd
    for (int64_t i = 0; i < C; i++) detail::put(o + i, x[i] * rs * weight[i]);
    rstd[r] = rs;
  }
}

}  // namespace

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t BT,
                     int64_t C, double eps) {
  rmsnorm_rows(out, rstd, inp, weight, BT, C, eps);
}

void rmsnorm_forward(uint16_t* out, float* rstd, const float* inp, const float* weight,
                     int64_t BT, int64_t C, double eps) {
  rmsnorm_rows(out, rstd, inp, weight, BT, C, eps);
}

namespace {

template <typename In>
void rmsnorm_grad(float* dinp, float* dweight, const float* dout, const In* inp,
                  const float* weight, const float* rstd, int64_t BT, int64_t C) {
  // Per-OpenMP-thread partial dweight, grows once; one per calling thread (as
  // layernorm_backward's).
  thread_local std::vector<float> scratch;
  const size_t need = static_cast<size_t>(omp_get_max_threads()) * static_cast<size_t>(C);
  if (scratch.size() < need) scratch.resize(need);
  float* part = scratch.data();
#pragma omp parallel
  {
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    float* pw = part + static_cast<size_t>(id) * C;
    for (int64_t i = 0; i < C; i++) pw[i] = 0.0f;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < BT; r++) {
      const In* x = inp + r * C;
      const float* dy = dout + r * C;
      float* dx = dinp + r * C;
      const float rs = rstd[r];
      // xhat = x * rs; dx += rs * (dy*w - xhat * mean(dy*w*xhat))
      double s = 0.0;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < C; i++) s += static_cast<double>(dy[i] * weight[i]) * (detail::get(x, i) * rs);
      const float b = static_cast<float>(s / static_cast<double>(C));
#pragma omp simd
      for (int64_t i = 0; i < C; i++) {
        const float xh = detail::get(x, i) * rs;
        pw[i] += dy[i] * xh;
        dx[i] += rs * (dy[i] * weight[i] - xh * b);
      }
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < C; i++) {
      float w = 0.0f;
      for (int t = 0; t < nt; t++) w += part[static_cast<size_t>(t) * C + i];
      dweight[i] += w;
    }
  }
}

}  // namespace

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t BT, int64_t C) {
  rmsnorm_grad(dinp, dweight, dout, inp, weight, rstd, BT, C);
}
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const uint16_t* inp,
                      const float* weight, const float* rstd, int64_t BT, int64_t C) {
  rmsnorm_grad(dinp, dweight, dout, inp, weight, rstd, BT, C);
}

PO_KERNELS_END
