// Rotary position embedding (RoPE), Hugging Face's rotate-half convention:
// within each head of hs channels, channel i and channel i + hs/2 (i < hs/2)
// form a pair rotated by angle pos * inv_freq[i]. (llama2.c and Meta rotate
// interleaved pairs 2i, 2i+1; their weights are permuted at import, so one
// kernel serves both.) The backward is the rotation by the opposite angle.
// The tables are built in double and rounded once, so a position's angles do
// not depend on T or on which rank computes them.
#include <cmath>

#include "backend/cpu/kernel_isa.h"
#include "backend/ops.h"
#include "core/error.h"

PO_KERNELS_BEGIN

void rope_inv_freq(double* inv_freq, int64_t hs, const RopeScaling& rs) {
  PO_CHECK(hs % 2 == 0, "RoPE needs an even head size, got ", hs);
  constexpr double kPi = 3.14159265358979323846;
  for (int64_t i = 0; i < hs / 2; i++) {
    double f = 1.0 / std::pow(rs.theta, static_cast<double>(2 * i) / static_cast<double>(hs));
    if (rs.factor > 0) {  // Llama-3.1: long wavelengths slowed down, short kept, smooth between
      const double wavelen = 2.0 * kPi / f;
      const double low_wavelen = rs.original_max_position / rs.low_freq_factor;
      const double high_wavelen = rs.original_max_position / rs.high_freq_factor;
      if (wavelen > low_wavelen) {
        f = f / rs.factor;
      } else if (wavelen >= high_wavelen) {
        const double smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) /
                              (rs.high_freq_factor - rs.low_freq_factor);
        f = (1.0 - smooth) * f / rs.factor + smooth * f;
      }
    }
    inv_freq[i] = f;
  }
}

void rope_table(float* cos_t, float* sin_t, int64_t T, int64_t hs, const RopeScaling& rs,
                int64_t pos0) {
  const int64_t half = hs / 2;
  double inv_freq[1024];
  PO_CHECK(half <= 1024, "RoPE head size ", hs, " above 2048");
  this_path::rope_inv_freq(inv_freq, hs, rs);
  for (int64_t t = 0; t < T; t++)
    for (int64_t i = 0; i < half; i++) {
      const double a = static_cast<double>(pos0 + t) * inv_freq[i];
      cos_t[t * half + i] = static_cast<float>(std::cos(a));
      sin_t[t * half + i] = static_cast<float>(std::sin(a));
    }
}

namespace {

template <bool kInverse>
void rotate(float* x, int64_t B, int64_t T, int64_t stride, int64_t n_heads, int64_t hs,
            const float* cos_t, const float* sin_t, int64_t pos0) {
  const int64_t half = hs / 2;
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * T; bt++) {
    const int64_t pos = pos0 + bt % T;
    const float* c = cos_t + pos * half;
    const float* s = sin_t + pos * half;
    for (int64_t h = 0; h < n_heads; h++) {
      float* a = x + bt * stride + h * hs;
      float* b = a + half;
#pragma omp simd
      for (int64_t i = 0; i < half; i++) {
        const float sn = kInverse ? -s[i] : s[i];
        const float x1 = a[i], x2 = b[i];
        a[i] = x1 * c[i] - x2 * sn;
        b[i] = x2 * c[i] + x1 * sn;
      }
    }
  }
}

}  // namespace

void rope_forward(float* x, int64_t B, int64_t T, int64_t stride, int64_t n_heads, int64_t hs,
                  const float* cos_t, const float* sin_t, int64_t pos0) {
  rotate<false>(x, B, T, stride, n_heads, hs, cos_t, sin_t, pos0);
}

void rope_backward(float* dx, int64_t B, int64_t T, int64_t stride, int64_t n_heads, int64_t hs,
                   const float* cos_t, const float* sin_t, int64_t pos0) {
  rotate<true>(dx, B, T, stride, n_heads, hs, cos_t, sin_t, pos0);
}

PO_KERNELS_END
