// Generation's linear layer over weights stored in GGUF's block formats
// (backend/block_formats.h): dequantization inside the dot product, in
// registers, so a decode step reads each weight's stored bytes once and
// never a widened copy of the matrix.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <vector>

#include "backend/block_formats.h"
#include "backend/cpu/kernel_isa.h"
#include "backend/ops.h"
#include "core/error.h"
#include "core/f16.h"

PO_KERNELS_BEGIN

namespace {

#if PO_AVX512
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// out[r · OC] = bias + the lanes of acc[r] summed, for each input row r.
template <int NR>
inline void store_sums(const __m512* acc, float* out, const float* bias, int64_t OC) {
  for (int r = 0; r < NR; ++r) {
    const float s = _mm512_reduce_add_ps(acc[r]);
    out[r * OC] = bias != nullptr ? *bias + s : s;
  }
}

inline __m512 half_scale(const void* p) {
  uint16_t bits;
  __builtin_memcpy(&bits, p, 2);
  return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(bits)));
}

// The 32 codes of block `b` of a row as floats in two registers (elements
// 0-15, 16-31) and the block's scale: q and d for Q8_0, nibble − 8 and d for
// Q4_0 (element j < 16 is byte j's low nibble, 16 + j its high one); the
// values themselves and 1 for BF16 and F16 (kScaled false: no scale).
template <GgmlType T>
constexpr bool kScaled = T == GgmlType::kQ8_0 || T == GgmlType::kQ4_0;

template <GgmlType T>
inline void load_block(const uint8_t* row, int64_t b, __m512* lo, __m512* hi, __m512* d) {
  if constexpr (T == GgmlType::kQ8_0) {
    const uint8_t* blk = row + b * 34;
    *d = half_scale(blk);
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
    *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
  } else if constexpr (T == GgmlType::kQ4_0) {
    const uint8_t* blk = row + b * 18;
    *d = half_scale(blk);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i mask = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const __m128i l = _mm_sub_epi8(_mm_and_si128(q, mask), eight);
    const __m128i h = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), mask), eight);
    *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(l));
    *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(h));
  } else if constexpr (T == GgmlType::kBF16) {
    const __m512i v = _mm512_loadu_si512(row + b * 64);
    *lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
    *hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
  } else {  // F16
    const __m512i v = _mm512_loadu_si512(row + b * 64);
    *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(v));
    *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1));
  }
}

// The K-quants' super-blocks of 256, in registers. Q4_K: eight groups of 32
// whose values are (d·sc)·q − dmin·m, dotted as (d·sc)·Σx·q − (dmin·m)·Σx;
// Q6_K: sixteen groups of 16 whose values are (d·sc)·(q − 32). Lanes carry
// partial sums across super-blocks; one reduction at the end.
inline float half_at(const uint8_t* p) {
  return core::f16_to_f32(core::f16{static_cast<uint16_t>(p[0] | (p[1] << 8))});
}

template <int NR>
void dot_row_q4k(float* out, const float* x, const uint8_t* w, const float* bias, int64_t C, int64_t OC) {
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < C / 256; ++b) {
    const uint8_t* blk = w + b * 144;
    const float d = half_at(blk), dmin = half_at(blk + 2);
    const uint8_t* s = blk + 4;
    const uint8_t* q = blk + 16;
    for (int g = 0; g < 8; ++g) {  // group g: 32 values, qs[32·(g/2) ..] low (g even) or high nibbles
      uint8_t sc, m;
      if (g < 4) {
        sc = s[g] & 63;
        m = s[g + 4] & 63;
      } else {
        sc = static_cast<uint8_t>((s[g + 4] & 0xF) | ((s[g - 4] >> 6) << 4));
        m = static_cast<uint8_t>((s[g + 4] >> 4) | ((s[g] >> 6) << 4));
      }
      const __m512 scale = _mm512_set1_ps(d * sc), min = _mm512_set1_ps(dmin * m);
      const uint8_t* qg = q + 32 * (g / 2);
      __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg));
      __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + 16));
      if (g % 2 == 1) {
        a = _mm_srli_epi16(a, 4);
        c = _mm_srli_epi16(c, 4);
      }
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(a, mask)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(c, mask)));
      for (int r = 0; r < NR; ++r) {
        const float* xr = x + r * C + b * 256 + g * 32;
        const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);
        const __m512 t = _mm512_fmadd_ps(x1, hi, _mm512_mul_ps(x0, lo));
        acc[r] = _mm512_fmadd_ps(t, scale, acc[r]);
        acc[r] = _mm512_fnmadd_ps(_mm512_add_ps(x0, x1), min, acc[r]);
      }
    }
  }
  store_sums<NR>(acc, out, bias, OC);
}

template <int NR>
void dot_row_q6k(float* out, const float* x, const uint8_t* w, const float* bias, int64_t C, int64_t OC) {
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  const __m128i low4 = _mm_set1_epi8(0x0F), low2 = _mm_set1_epi8(0x03), bias32 = _mm_set1_epi8(32);
  for (int64_t b = 0; b < C / 256; ++b) {
    const uint8_t* blk = w + b * 210;
    const float d = half_at(blk + 208);
    const auto* sc = reinterpret_cast<const int8_t*>(blk + 192);
    for (int n = 0; n < 2; ++n) {  // halves of 128: ql += 64, qh += 32, sc += 8
      const uint8_t* ql = blk + 64 * n;
      const uint8_t* qh = blk + 128 + 32 * n;
      for (int h = 0; h < 2; ++h) {  // lanes l = 16h .. 16h + 15
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + 16 * h));
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + 32 + 16 * h));
        const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + 16 * h));
        const __m128i hi2[4] = {_mm_and_si128(e, low2), _mm_and_si128(_mm_srli_epi16(e, 2), low2),
                                _mm_and_si128(_mm_srli_epi16(e, 4), low2), _mm_and_si128(_mm_srli_epi16(e, 6), low2)};
        const __m128i lo4[4] = {_mm_and_si128(a, low4), _mm_and_si128(c, low4),
                                _mm_and_si128(_mm_srli_epi16(a, 4), low4), _mm_and_si128(_mm_srli_epi16(c, 4), low4)};
        for (int k = 0; k < 4; ++k) {  // y[l + 32k] = (d·sc[8n + 2k + h])·q
          const __m128i qk = _mm_sub_epi8(_mm_or_si128(lo4[k], _mm_slli_epi16(hi2[k], 4)), bias32);
          const __m512 qv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(qk));
          const __m512 scale = _mm512_set1_ps(d * static_cast<float>(sc[8 * n + 2 * k + h]));
          for (int r = 0; r < NR; ++r) {
            const __m512 xv = _mm512_loadu_ps(x + r * C + b * 256 + 128 * n + 32 * k + 16 * h);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(xv, qv), scale, acc[r]);
          }
        }
      }
    }
  }
  store_sums<NR>(acc, out, bias, OC);
}

// out[r, j] for NR input rows and one weight row, each block decoded once
// for all of them: per lane, x·q over the block then times the block's scale
// (d·Σ x·q, not Σ x·(d·q): the same up to rounding, one multiply a block
// instead of two), blocks ascending, one reduction at the end, so an output
// does not depend on the other rows or the threads.
template <GgmlType T, int NR>
void dot_row_32(float* out, const float* x, const uint8_t* w, const float* bias, int64_t C, int64_t OC) {
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < C / 32; ++b) {
    __m512 lo, hi, d;
    load_block<T>(w, b, &lo, &hi, &d);
    for (int r = 0; r < NR; ++r) {
      const float* xr = x + r * C + b * 32;
      if constexpr (kScaled<T>) {
        const __m512 t = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), hi, _mm512_mul_ps(_mm512_loadu_ps(xr), lo));
        acc[r] = _mm512_fmadd_ps(t, d, acc[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), lo, acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), hi, acc[r]);
      }
    }
  }
  store_sums<NR>(acc, out, bias, OC);
}

// One weight row of type T against NR input rows.
template <GgmlType T, int NR>
void dot_row(float* out, const float* x, const uint8_t* w, const float* bias, int64_t C, int64_t OC) {
  if constexpr (T == GgmlType::kQ4_K)
    dot_row_q4k<NR>(out, x, w, bias, C, OC);
  else if constexpr (T == GgmlType::kQ6_K)
    dot_row_q6k<NR>(out, x, w, bias, C, OC);
  else
    dot_row_32<T, NR>(out, x, w, bias, C, OC);
}

template <GgmlType T>
void dot_rows_blocks(float* out, const float* x, const void* weight, const float* bias, int64_t rows, int64_t C,
                     int64_t OC) {
  const int64_t row_bytes = ggml_row_bytes(T, C);
  const auto* w = static_cast<const uint8_t*>(weight);
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < OC; ++j) {
    const float* bj = bias != nullptr ? bias + j : nullptr;
    const uint8_t* wj = w + j * row_bytes;
    for (int64_t r = 0; r < rows; r += 8) {  // eight input rows share each decoded block
      float* o = out + r * OC + j;
      const float* xr = x + r * C;
      switch (std::min<int64_t>(8, rows - r)) {
        case 8: dot_row<T, 8>(o, xr, wj, bj, C, OC); break;
        case 7: dot_row<T, 7>(o, xr, wj, bj, C, OC); break;
        case 6: dot_row<T, 6>(o, xr, wj, bj, C, OC); break;
        case 5: dot_row<T, 5>(o, xr, wj, bj, C, OC); break;
        case 4: dot_row<T, 4>(o, xr, wj, bj, C, OC); break;
        case 3: dot_row<T, 3>(o, xr, wj, bj, C, OC); break;
        case 2: dot_row<T, 2>(o, xr, wj, bj, C, OC); break;
        default: dot_row<T, 1>(o, xr, wj, bj, C, OC); break;
      }
    }
  }
}
#pragma GCC diagnostic pop
#endif

// Any type, any path: each thread decodes one weight row into its scratch and
// dots it with the input rows (f32, c ascending).
void dot_rows_decoded(float* out, const float* x, const void* weight, GgmlType type, const float* bias,
                      int64_t rows, int64_t C, int64_t OC) {
  const int64_t row_bytes = ggml_row_bytes(type, C);
#pragma omp parallel
  {
    std::vector<float> wr(static_cast<size_t>(C));
#pragma omp for schedule(static)
    for (int64_t j = 0; j < OC; ++j) {
      ggml_dequantize(type, static_cast<const uint8_t*>(weight) + j * row_bytes, wr.data(), C);
      for (int64_t r = 0; r < rows; ++r) {
        float s = 0.0f;
        const float* xr = x + r * C;
        for (int64_t c = 0; c < C; ++c) s += xr[c] * wr[c];
        out[r * OC + j] = bias != nullptr ? bias[j] + s : s;
      }
    }
  }
}

}  // namespace

void matmul_forward_decode_blocks(float* out, const float* inp, const void* weight, GgmlType type,
                                  const float* bias, int64_t BT, int64_t C, int64_t OC) {
  PO_ASSERT(C % ggml_block_elems(type) == 0, "matmul_forward_decode_blocks: ", C, " columns, not whole ",
            ggml_type_name(type), " blocks");
#if PO_AVX512
  if (C % 32 == 0) {
    switch (type) {
      case GgmlType::kQ8_0: return dot_rows_blocks<GgmlType::kQ8_0>(out, inp, weight, bias, BT, C, OC);
      case GgmlType::kQ4_0: return dot_rows_blocks<GgmlType::kQ4_0>(out, inp, weight, bias, BT, C, OC);
      case GgmlType::kBF16: return dot_rows_blocks<GgmlType::kBF16>(out, inp, weight, bias, BT, C, OC);
      case GgmlType::kF16: return dot_rows_blocks<GgmlType::kF16>(out, inp, weight, bias, BT, C, OC);
      case GgmlType::kQ4_K: return dot_rows_blocks<GgmlType::kQ4_K>(out, inp, weight, bias, BT, C, OC);
      case GgmlType::kQ6_K: return dot_rows_blocks<GgmlType::kQ6_K>(out, inp, weight, bias, BT, C, OC);
      default: break;
    }
  }
#endif
  dot_rows_decoded(out, inp, weight, type, bias, BT, C, OC);
}

PO_KERNELS_END
