// LayerNorm over the last axis (eps from the config, GPT-2's 1e-5 by default), statistics saved for the backward.
// Row statistics accumulate in double: cheap next to the memory traffic and it
// keeps mean/rstd exact to f32 rounding for large C.
#include <omp.h>

#include <cmath>
#include <vector>

#include "backend/cpu/kernel_isa.h"
#include "backend/cpu/simd_math.h"
#include "backend/ops.h"

PO_KERNELS_BEGIN

namespace {

template <typename Out>
void layernorm_rows(Out* out, float* mean, float* rstd, const float* inp, const float* weight,
                    const float* bias, int64_t BT, int64_t C, double eps) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < BT; r++) {
    const float* x = inp + r * C;
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < C; i++) s += x[i];
    const double m = s / static_cast<double>(C);
    double v = 0.0;
#pragma omp simd reduction(+ : v)
    for (int64_t i = 0; i < C; i++) {
      const double d = x[i] - m;
      v += d * d;
    }
    const double rs = 1.0 / std::sqrt(v / static_cast<double>(C) + eps);
    const float mf = static_cast<float>(m), rsf = static_cast<float>(rs);
    Out* o = out + r * C;
#pragma omp simd
    for (int64_t i = 0; i < C; i++) detail::put(o + i, (x[i] - mf) * rsf * weight[i] + bias[i]);
    mean[r] = mf;
    rstd[r] = rsf;
  }
}

}  // namespace

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                       const float* weight, const float* bias, int64_t BT, int64_t C,
                       double eps) {
  layernorm_rows(out, mean, rstd, inp, weight, bias, BT, C, eps);
}

void layernorm_forward(uint16_t* out, float* mean, float* rstd, const float* inp,
                       const float* weight, const float* bias, int64_t BT, int64_t C,
                       double eps) {
  layernorm_rows(out, mean, rstd, inp, weight, bias, BT, C, eps);
}

namespace {

template <typename In>
void layernorm_grad(float* dinp, float* dweight, float* dbias, const float* dout, const In* inp,
                    const float* weight, const float* mean, const float* rstd, int64_t BT,
                    int64_t C) {
  // Per-thread partial dweight/dbias, reduced after the row loop; grows once.
  // One per calling thread: models computing on several threads at once
  // (tensor-parallel ranks in one process, a server's requests) must not share it.
  thread_local std::vector<float> scratch;
  const int max_t = omp_get_max_threads();
  const size_t need = static_cast<size_t>(max_t) * 2 * static_cast<size_t>(C);
  if (scratch.size() < need) scratch.resize(need);
  float* part = scratch.data();
#pragma omp parallel
  {
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    float* pw = part + static_cast<size_t>(id) * 2 * C;
    float* pb = pw + C;
    for (int64_t i = 0; i < C; i++) pw[i] = pb[i] = 0.0f;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < BT; r++) {
      const In* x = inp + r * C;
      const float* dy = dout + r * C;
      float* dx = dinp + r * C;
      const float m = mean[r], rs = rstd[r];
      // dnorm = dy * w; dx += rs * (dnorm - mean(dnorm) - xhat * mean(dnorm * xhat))
      double s1 = 0.0, s2 = 0.0;
#pragma omp simd reduction(+ : s1, s2)
      for (int64_t i = 0; i < C; i++) {
        const float xh = (detail::get(x, i) - m) * rs;
        const float dn = dy[i] * weight[i];
        s1 += dn;
        s2 += dn * xh;
      }
      const float a = static_cast<float>(s1 / static_cast<double>(C));
      const float b = static_cast<float>(s2 / static_cast<double>(C));
#pragma omp simd
      for (int64_t i = 0; i < C; i++) {
        const float xh = (detail::get(x, i) - m) * rs;
        const float dn = dy[i] * weight[i];
        pb[i] += dy[i];
        pw[i] += dy[i] * xh;
        dx[i] += rs * (dn - a - xh * b);
      }
    }
    // implicit barrier: all partials complete
#pragma omp for schedule(static)
    for (int64_t i = 0; i < C; i++) {
      float w = 0.0f, bb = 0.0f;
      for (int t = 0; t < nt; t++) {
        w += part[static_cast<size_t>(t) * 2 * C + i];
        bb += part[static_cast<size_t>(t) * 2 * C + C + i];
      }
      dweight[i] += w;
      dbias[i] += bb;
    }
  }
}

}  // namespace

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean,
                        const float* rstd, int64_t BT, int64_t C) {
  layernorm_grad(dinp, dweight, dbias, dout, inp, weight, mean, rstd, BT, C);
}
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const uint16_t* inp, const float* weight, const float* mean,
                        const float* rstd, int64_t BT, int64_t C) {
  layernorm_grad(dinp, dweight, dbias, dout, inp, weight, mean, rstd, BT, C);
}

PO_KERNELS_END
