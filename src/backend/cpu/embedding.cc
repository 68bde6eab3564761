// Token embedding, plus learned positions where the model has them (GPT-2). The backward scatter into dwte is race-free and
// deterministic: each thread owns a slice of the C columns and walks all tokens
// in order, so repeated tokens add up in a fixed order.
#include <omp.h>

#include <cstdint>
#include <cstring>

#include "backend/cpu/kernel_isa.h"
#include "backend/ops.h"
#include "core/bf16.h"

PO_KERNELS_BEGIN

namespace {
// A table element as f32: itself, or bf16 bits widened (exact).
inline float value(float x) { return x; }
inline float value(uint16_t h) { return core::bf16_to_f32(core::bf16{h}); }

template <typename E>
void lookup(float* out, const int32_t* tokens, const E* wte, const float* wpe, int64_t B,
            int64_t T, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * T; bt++) {
    const E* e = wte + static_cast<int64_t>(tokens[bt]) * C;
    float* o = out + bt * C;
    if (wpe == nullptr) {
#pragma omp simd
      for (int64_t i = 0; i < C; i++) o[i] = value(e[i]);
      continue;
    }
    const float* p = wpe + (bt % T) * C;
#pragma omp simd
    for (int64_t i = 0; i < C; i++) o[i] = value(e[i]) + p[i];
  }
}

template <typename E>
void lookup_slice(float* out, const int32_t* tokens, const E* wte_slice, int64_t v0, int64_t nv,
                  int64_t n, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < n; bt++) {
    const int64_t t = static_cast<int64_t>(tokens[bt]) - v0;
    float* o = out + bt * C;
    if (t < 0 || t >= nv) {
      std::memset(o, 0, static_cast<size_t>(C) * sizeof(float));
      continue;
    }
    const E* e = wte_slice + t * C;
#pragma omp simd
    for (int64_t i = 0; i < C; i++) o[i] = value(e[i]);
  }
}
}  // namespace

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                       int64_t B, int64_t T, int64_t C) {
  lookup(out, tokens, wte, wpe, B, T, C);
}

void embedding_forward(float* out, const int32_t* tokens, const uint16_t* wte16, const float* wpe,
                       int64_t B, int64_t T, int64_t C) {
  lookup(out, tokens, wte16, wpe, B, T, C);
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                        int64_t B, int64_t T, int64_t C) {
  embedding_backward_slice(dwte, dwpe, dout, tokens, B, T, C, 0, INT64_MAX);
}

void embedding_forward_slice(float* out, const int32_t* tokens, const float* wte_slice,
                             int64_t v0, int64_t nv, int64_t n, int64_t C) {
  lookup_slice(out, tokens, wte_slice, v0, nv, n, C);
}

void embedding_forward_slice(float* out, const int32_t* tokens, const uint16_t* wte16_slice,
                             int64_t v0, int64_t nv, int64_t n, int64_t C) {
  lookup_slice(out, tokens, wte16_slice, v0, nv, n, C);
}

void position_embedding_add(float* out, const float* wpe, int64_t row0, int64_t n, int64_t T,
                            int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const float* p = wpe + ((row0 + i) % T) * C;
    float* o = out + i * C;
#pragma omp simd
    for (int64_t i = 0; i < C; i++) o[i] += p[i];
  }
}

void embedding_backward_slice(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                              int64_t B, int64_t T, int64_t C, int64_t v0, int64_t nv) {
#pragma omp parallel
  {
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t chunk = ((C + nt - 1) / nt + 15) / 16 * 16;
    const int64_t c0 = id * chunk, c1 = c0 + chunk < C ? c0 + chunk : C;
    for (int64_t bt = 0; bt < B * T; bt++) {
      const float* d = dout + bt * C;
      const int64_t t = static_cast<int64_t>(tokens[bt]) - v0;
      const bool held = t >= 0 && t < nv;
      if (dwpe != nullptr) {
        float* p = dwpe + (bt % T) * C;
        if (held) {
          float* w = dwte + t * C;
#pragma omp simd
          for (int64_t i = c0; i < c1; i++) {
            w[i] += d[i];
            p[i] += d[i];
          }
        } else {
#pragma omp simd
          for (int64_t i = c0; i < c1; i++) p[i] += d[i];
        }
        continue;
      }
      if (!held) continue;
      float* w = dwte + t * C;
#pragma omp simd
      for (int64_t i = c0; i < c1; i++) w[i] += d[i];
    }
  }
}

PO_KERNELS_END
