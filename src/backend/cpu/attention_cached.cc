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
#include <type_traits>
#include <vector>

#include "backend/cpu/kernel_isa.h"
#include "backend/cpu/simd_math.h"
#include "backend/ops.h"
#include "core/error.h"

// GCC 12 reports the AVX-512 intrinsics' own "undefined" operands as maybe
// uninitialized once inlined (GCC bug 105593); nothing here is.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

PO_KERNELS_BEGIN
namespace {

// q·k over hs elements. With AVX-512 and hs a multiple of 16: one vector
// accumulator and one reduction (an `omp simd` reduction compiles to a
// chain of 16 scalar adds per call here, which was the attention's cost).
inline float dot(const float* a, const float* b, int64_t n) {
#if PO_AVX512
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

#if PO_AVX512
constexpr int kGroup = 4;  // query rows of one head that share their key and value loads

// Query rows i0 .. i0+G-1 of head h (query i at position pos0 + i sees keys
// 0 .. pos0 + i). Per row this is the one-row loop of cached_attention below,
// operation for operation: dot's fused multiply-adds over hs in steps of 16
// and its reduction, the scale, the max, exp_approx, the sum in double in key
// order, w = p · (1/sum), and each output element's fused multiply-adds in
// key order from 0. Only the loads of a key's and a value's row are shared by
// the G rows, the sums of the G rows run side by side, and the outputs stay
// in registers (hs ≤ 64). So the bits of a row do not depend on G, on how a
// prompt is cut into chunks, or on which blocks hold it.
template <int G, class Base>
void attend_group(float* out, const float* q, int64_t q_stride, const float* k_cache,
                  const float* v_cache, int64_t i0, int64_t h, int64_t pos0, int64_t NH, int64_t hs,
                  int64_t per, int64_t kv_stride, int64_t block_size, float scale, float* scores,
                  int64_t ld, const Base& base) {
  const int64_t g = h / per, nv = hs / 16;
  int64_t len[G];
  const float* qr[G];
  float* pr[G];
  for (int r = 0; r < G; ++r) {
    len[r] = pos0 + i0 + r + 1;
    qr[r] = q + (i0 + r) * q_stride + h * hs;
    pr[r] = scores + r * ld;
  }
  const int64_t lmax = len[G - 1];
  for (int64_t b0 = 0; b0 < lmax; b0 += block_size) {
    const float* kb = k_cache + base(b0 / block_size) + g * hs;
    const int64_t m = std::min(block_size, lmax - b0);
    for (int64_t j = 0; j < m; ++j) {
      const float* kj = kb + j * kv_stride;
      __m512 acc[G];
      for (int r = 0; r < G; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t d = 0; d < hs; d += 16) {
        const __m512 kv = _mm512_loadu_ps(kj + d);
        for (int r = 0; r < G; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(qr[r] + d), kv, acc[r]);
      }
      for (int r = 0; r < G; ++r)
        if (b0 + j < len[r]) pr[r][b0 + j] = _mm512_reduce_add_ps(acc[r]) * scale;
    }
  }
  float inv[G];
  {
    float mx[G];
    double sum[G];
    for (int r = 0; r < G; ++r) {
      mx[r] = -INFINITY;
      for (int64_t j = 0; j < len[r]; j++) mx[r] = std::max(mx[r], pr[r][j]);
      float* p = pr[r];
      const float mr = mx[r];
#pragma omp simd
      for (int64_t j = 0; j < len[r]; j++) p[j] = detail::exp_approx(p[j] - mr);
      sum[r] = 0.0;
    }
    for (int64_t j = 0; j < len[0]; j++)  // every row's sum in key order, the G chains side by side
      for (int r = 0; r < G; ++r) sum[r] += pr[r][j];
    for (int r = 1; r < G; ++r)
      for (int64_t j = len[0]; j < len[r]; j++) sum[r] += pr[r][j];
    for (int r = 0; r < G; ++r) inv[r] = static_cast<float>(1.0 / sum[r]);
  }
  __m512 o[G][4];
  for (int r = 0; r < G; ++r)
    for (int64_t v = 0; v < nv; ++v) o[r][v] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < lmax; b0 += block_size) {
    const float* vb = v_cache + base(b0 / block_size) + g * hs;
    const int64_t m = std::min(block_size, lmax - b0);
    for (int64_t j = 0; j < m; ++j) {
      const float* vj = vb + j * kv_stride;
      __m512 vv[4];
      for (int64_t v = 0; v < nv; ++v) vv[v] = _mm512_loadu_ps(vj + 16 * v);
      for (int r = 0; r < G; ++r) {
        if (b0 + j >= len[r]) continue;
        const __m512 w = _mm512_set1_ps(pr[r][b0 + j] * inv[r]);
        for (int64_t v = 0; v < nv; ++v) o[r][v] = _mm512_fmadd_ps(w, vv[v], o[r][v]);
      }
    }
  }
  for (int r = 0; r < G; ++r) {
    float* orow = out + (i0 + r) * NH * hs + h * hs;
    for (int64_t v = 0; v < nv; ++v) _mm512_storeu_ps(orow + 16 * v, o[r][v]);
  }
}
#endif

// The kernel over any placement of the cached positions in blocks of
// `block_size` positions: `base(b)` is the element offset in k, v of block
// b's first position's keys (and values); positions in a block are
// kv_stride apart. Walking the blocks keeps a division per position out of
// the loops, and the exps run vectorised (exp_approx). With AVX-512 and
// hs a multiple of 16 up to 64, rows go through attend_group in groups of
// up to kGroup (the same bits, fewer loads); otherwise one row at a time.
template <class Base>
void cached_attention(float* out, const float* q, int64_t q_stride, const float* k_cache,
                      const float* v_cache, int64_t n, int64_t pos0, int64_t NH, int64_t NKV,
                      int64_t hs, int64_t block_size, const char* who, Base base) {
  PO_CHECK(NH > 0 && NKV > 0 && NH % NKV == 0, who, ": NH=", NH,
           " must be a positive multiple of NKV=", NKV);
  const int64_t per = NH / NKV, kv_stride = NKV * hs;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hs)));
#if PO_AVX512
  if (hs % 16 == 0 && hs <= 64) {
    const int64_t groups = (n + kGroup - 1) / kGroup, ld = pos0 + n;
#pragma omp parallel
    {
      thread_local std::vector<float> scores;
      scores.resize(static_cast<size_t>(kGroup * ld));
#pragma omp for schedule(dynamic, 1)
      for (int64_t it = 0; it < groups * NH; it++) {
        const int64_t i0 = (it / NH) * kGroup, h = it % NH;
        auto rows = [&](auto G) {
          attend_group<decltype(G)::value>(out, q, q_stride, k_cache, v_cache, i0, h, pos0, NH, hs, per,
                                           kv_stride, block_size, scale, scores.data(), ld, base);
        };
        switch (std::min<int64_t>(kGroup, n - i0)) {
          case 1: rows(std::integral_constant<int, 1>{}); break;
          case 2: rows(std::integral_constant<int, 2>{}); break;
          case 3: rows(std::integral_constant<int, 3>{}); break;
          default: rows(std::integral_constant<int, 4>{});
        }
      }
    }
    return;
  }
#endif
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

PO_KERNELS_END

#pragma GCC diagnostic pop
