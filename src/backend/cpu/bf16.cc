// bf16 storage conversions, element-wise and vectorisable: the rounding is
// integer arithmetic on the bits (core/bf16.h), NaNs stay quiet NaNs.
#include "backend/cpu/kernel_isa.h"
#include "backend/ops.h"
#include "core/bf16.h"

PO_KERNELS_BEGIN
namespace {

inline float widen(uint16_t b) { return core::bf16_to_f32(core::bf16{b}); }
inline uint16_t round(float f) { return core::f32_to_bf16(f).bits; }

}  // namespace

void bf16_to_f32(float* dst, const uint16_t* src, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) dst[i] = widen(src[i]);
}

void f32_to_bf16(uint16_t* dst, const float* src, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) dst[i] = round(src[i]);
}

void bf16_round_f32(float* dst, const float* src, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) dst[i] = widen(round(src[i]));
}

void bf16_add_f32(uint16_t* dst, const float* src, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) dst[i] = round(widen(dst[i]) + src[i]);
}

void bf16_add_bf16(uint16_t* dst, const uint16_t* src, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) dst[i] = round(widen(dst[i]) + widen(src[i]));
}

double sum_squares_bf16(const uint16_t* x, int64_t n) {
  double s = 0.0;
#pragma omp parallel for simd reduction(+ : s) schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const double d = widen(x[i]);
    s += d * d;
  }
  return s;
}

PO_KERNELS_END
