// Token embedding, plus learned positions where the model has them (GPT-2). The backward scatter into dwte is race-free and
// deterministic: each thread owns a slice of the C columns and walks all tokens
// in order, so repeated tokens add up in a fixed order.
#include <omp.h>

#include <cstdint>
#include <cstring>

#include "backend/ops.h"

namespace po::backend::cpu {

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                       int64_t B, int64_t T, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * T; bt++) {
    const float* e = wte + static_cast<int64_t>(tokens[bt]) * C;
    float* o = out + bt * C;
    if (wpe == nullptr) {
#pragma omp simd
      for (int64_t i = 0; i < C; i++) o[i] = e[i];
      continue;
    }
    const float* p = wpe + (bt % T) * C;
#pragma omp simd
    for (int64_t i = 0; i < C; i++) o[i] = e[i] + p[i];
  }
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                        int64_t B, int64_t T, int64_t C) {
  embedding_backward_slice(dwte, dwpe, dout, tokens, B, T, C, 0, INT64_MAX);
}

void embedding_forward_slice(float* out, const int32_t* tokens, const float* wte_slice,
                             int64_t v0, int64_t nv, int64_t n, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < n; bt++) {
    const int64_t t = static_cast<int64_t>(tokens[bt]) - v0;
    float* o = out + bt * C;
    if (t < 0 || t >= nv) {
      std::memset(o, 0, static_cast<size_t>(C) * sizeof(float));
      continue;
    }
    const float* e = wte_slice + t * C;
#pragma omp simd
    for (int64_t i = 0; i < C; i++) o[i] = e[i];
  }
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

}  // namespace po::backend::cpu
