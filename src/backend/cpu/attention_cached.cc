// Attention of new queries against a KV cache (generation): query i sits at
// position pos0 + i and sees keys 0 .. pos0 + i. Scores are materialised per
// (query, head), which is cheap here: a handful of queries against at most
// the context length. Grouped-query as attention.cc: query head h reads kv
// head h / (NH/NKV). Each (query, head) item owns its output row slice. The paged
// variant (serving) reads positions through a block table.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/ops.h"
#include "backend/cpu/simd_math.h"
#include "core/error.h"

// GCC 12 reports the AVX-512 intrinsics' own "undefined" operands as maybe
// uninitialized once inlined (GCC bug 105593); nothing here is.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace po::backend::cpu {
namespace {

// q·k over hs elements. With AVX-512 and hs a multiple of 16: one vector
// accumulator and one reduction (an `omp simd` reduction compiles to a
// chain of 16 scalar adds per call here, which was the attention's cost).
inline float dot(const float* a, const float* b, int64_t n) {
#ifdef __AVX512F__
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float s = 0.0f;
  for (int64_t d = 0; d < n; d++) s += a[d] * b[d];
  return s;
}

// The kernel over any placement of the cached positions in blocks of
// `block_size` positions: `base(b)` is the element offset in k, v of block
// b's first position's keys (and values); positions in a block are
// kv_stride apart. Walking the blocks keeps a division per position out of
// the loops, and the exps run vectorised (exp_approx).
template <class Base>
void cached_attention(float* out, const float* q, int64_t q_stride, const float* k_cache,
                      const float* v_cache, int64_t n, int64_t pos0, int64_t NH, int64_t NKV,
                      int64_t hs, int64_t block_size, const char* who, Base base) {
  PO_CHECK(NH > 0 && NKV > 0 && NH % NKV == 0, who, ": NH=", NH,
           " must be a positive multiple of NKV=", NKV);
  const int64_t per = NH / NKV, kv_stride = NKV * hs;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hs)));
#pragma omp parallel
  {
    thread_local std::vector<float> scores;
    scores.resize(static_cast<size_t>(pos0 + n));
    float* p = scores.data();
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n * NH; it++) {
      const int64_t i = it / NH, h = it % NH, g = h / per, len = pos0 + i + 1;
      const float* qi = q + i * q_stride + h * hs;
      for (int64_t b0 = 0; b0 < len; b0 += block_size) {
        const float* kb = k_cache + base(b0 / block_size) + g * hs;
        const int64_t m = std::min(block_size, len - b0);
        for (int64_t j = 0; j < m; j++) p[b0 + j] = dot(qi, kb + j * kv_stride, hs) * scale;
      }
      float mx = -INFINITY;
      for (int64_t j = 0; j < len; j++) mx = std::max(mx, p[j]);
#pragma omp simd
      for (int64_t j = 0; j < len; j++) p[j] = detail::exp_approx(p[j] - mx);
      double sum = 0.0;
      for (int64_t j = 0; j < len; j++) sum += p[j];
      const float inv = static_cast<float>(1.0 / sum);
      float* o = out + i * NH * hs + h * hs;
      for (int64_t d = 0; d < hs; d++) o[d] = 0.0f;
      for (int64_t b0 = 0; b0 < len; b0 += block_size) {
        const float* vb = v_cache + base(b0 / block_size) + g * hs;
        const int64_t m = std::min(block_size, len - b0);
        for (int64_t j = 0; j < m; j++) {
          const float w = p[b0 + j] * inv;
          const float* vj = vb + j * kv_stride;
#pragma omp simd
          for (int64_t d = 0; d < hs; d++) o[d] += w * vj[d];
        }
      }
    }
  }
}

}  // namespace

void attention_cached_forward(float* out, const float* q, int64_t q_stride, const float* k_cache,
                              const float* v_cache, int64_t n, int64_t pos0, int64_t NH,
                              int64_t NKV, int64_t hs) {
  // One block of every position: the cache is contiguous.
  cached_attention(out, q, q_stride, k_cache, v_cache, n, pos0, NH, NKV, hs,
                   std::max<int64_t>(pos0 + n, 1), "attention_cached_forward",
                   [](int64_t) { return int64_t{0}; });
}

void paged_attention_forward(float* out, const float* q, int64_t q_stride, const float* k_pool,
                             const float* v_pool, const int32_t* block_table, int64_t block_size,
                             int64_t n, int64_t pos0, int64_t NH, int64_t NKV, int64_t hs) {
  PO_CHECK(block_size > 0, "paged_attention_forward: block size ", block_size);
  const int64_t block_elems = block_size * NKV * hs;
  cached_attention(out, q, q_stride, k_pool, v_pool, n, pos0, NH, NKV, hs, block_size,
                   "paged_attention_forward",
                   [=](int64_t b) { return block_table[b] * block_elems; });
}

}  // namespace po::backend::cpu

#pragma GCC diagnostic pop
