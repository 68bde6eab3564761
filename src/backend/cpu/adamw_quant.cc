// Blockwise quantized optimizer state (ops.h: quantize_blockwise,
// dequantize_blockwise, adamw_update_quant). One block at a time: its codes
// are decoded into float32 scratch on the stack, updated there with
// adamw_update's arithmetic, and encoded again with the block's new absmax,
// so the state is read and written once per step, in its stored width.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "backend/codebook.h"
#include "backend/cpu/adam_element.h"
#include "backend/cpu/kernel_isa.h"
#include "backend/ops.h"
#include "core/bf16.h"

// GCC 12 reports the AVX-512 intrinsics' own "undefined" operands as maybe
// uninitialized once inlined (GCC bug 105593); nothing here is.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

PO_KERNELS_BEGIN

namespace {

// max |x|, NaN if any is NaN (torch.max's rule).
inline float block_absmax(const float* x, int64_t n) {
  int64_t i = 0;
  float am = 0.0f;
#if PO_AVX512
  __m512 vm = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vm = _mm512_max_ps(vm, _mm512_abs_ps(v));
  }
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  am = _mm512_reduce_max_ps(vm);
#endif
  for (; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (a > am || std::isnan(a)) am = a;
    if (std::isnan(am)) return am;
  }
  return am;
}

#if PO_AVX512
// The low 32 bits of 2 × 8 lanes of 64, as 16 lanes of 32.
inline __m512i halves(__m512i a, __m512i b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(a)), _mm512_cvtepi64_epi32(b), 1);
}

// 16 codes of x[0..16) / am under `map` (its nearest() or half_up(), the
// same float32 operations in vector form), as int32 lanes.
inline __m512i codes16(const Codebook& map, const float* x, __m512 am) {
  const __m512 s = _mm512_div_ps(_mm512_loadu_ps(x), am);
  const __mmask16 nan = _mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q);
  const __m512i last = _mm512_set1_epi32(map.size - 1);
  __m512i best;
  if (map.rounding == Codebook::Rounding::kFirstNearest) {
    // One read of the bucket's steps (Codebook::step), two 8-lane gathers.
    const __m512i bits = _mm512_castps_si512(s);
    const __m512i key = _mm512_srli_epi32(bits, 16);
    const __m512i low = _mm512_and_si512(bits, _mm512_set1_epi32(0xFFFF));
    const auto* table = reinterpret_cast<const long long*>(map.step.data());
    const __m512i e0 = _mm512_i32gather_epi64(_mm512_castsi512_si256(key), table, 8);
    const __m512i e1 = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(key, 1), table, 8);
    const __m512i lo32 = halves(e0, e1);
    const __m512i t2 = halves(_mm512_srli_epi64(e0, 32), _mm512_srli_epi64(e1, 32));
    const __m512i c0 = _mm512_and_si512(lo32, _mm512_set1_epi32(0xFF));
    const __m512i t1 = _mm512_srli_epi32(lo32, 8);
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i n = _mm512_add_epi32(_mm512_maskz_mov_epi32(_mm512_cmpge_epi32_mask(low, t1), one),
                                       _mm512_maskz_mov_epi32(_mm512_cmpge_epi32_mask(low, t2), one));
    const __mmask16 negative = _mm512_cmplt_epi32_mask(bits, _mm512_setzero_si512());
    best = _mm512_mask_sub_epi32(_mm512_add_epi32(c0, n), negative, c0, n);
  } else {  // 16 values: one register
    const __m512 table = _mm512_loadu_ps(map.value.data());
    best = _mm512_setzero_si512();
    for (int step = map.size / 2; step >= 1; step /= 2) {
      const __m512i c = _mm512_add_epi32(best, _mm512_set1_epi32(step));
      const __mmask16 ge = _mm512_cmp_ps_mask(s, _mm512_permutexvar_ps(c, table), _CMP_GE_OQ);
      best = _mm512_mask_mov_epi32(best, ge, c);
    }
    const __m512i up = _mm512_min_epi32(_mm512_add_epi32(best, _mm512_set1_epi32(1)), last);
    const __m512 lo_v = _mm512_permutexvar_ps(best, table), up_v = _mm512_permutexvar_ps(up, table);
    const __mmask16 round = _mm512_cmp_ps_mask(_mm512_sub_ps(s, lo_v),
                                               _mm512_mul_ps(_mm512_sub_ps(up_v, lo_v), _mm512_set1_ps(0.5f)),
                                               _CMP_GE_OQ);
    best = _mm512_mask_mov_epi32(best, round, up);
  }
  return _mm512_mask_mov_epi32(best, nan, _mm512_setzero_si512());
}
#else
// The AVX2 forms of codes16 and of a 16-value table lookup, 8 lanes at a
// time, with the same float32 operations.
inline __m256 lookup16(const Codebook& map, __m256i c) {  // value[c], c in [0, 16)
  const __m256 lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(map.value.data()), c);
  const __m256 hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(map.value.data() + 8), c);
  return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_cmpgt_epi32(c, _mm256_set1_epi32(7))));
}

inline __m256i codes8(const Codebook& map, const float* x, __m256 am) {
  const __m256 s = _mm256_div_ps(_mm256_loadu_ps(x), am);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(s, s, _CMP_UNORD_Q));
  __m256i best;
  if (map.rounding == Codebook::Rounding::kFirstNearest) {  // Codebook::step, as codes16
    const __m256i bits = _mm256_castps_si256(s);
    const __m256i key = _mm256_srli_epi32(bits, 16);
    const __m256i low = _mm256_and_si256(bits, _mm256_set1_epi32(0xFFFF));
    const auto* table = reinterpret_cast<const long long*>(map.step.data());
    const __m256i e0 = _mm256_i64gather_epi64(table, _mm256_cvtepu32_epi64(_mm256_castsi256_si128(key)), 8);
    const __m256i e1 = _mm256_i64gather_epi64(table, _mm256_cvtepu32_epi64(_mm256_extracti128_si256(key, 1)), 8);
    // Each 64-bit entry's low and high halves, lanes in order.
    const __m256i split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m256i p0 = _mm256_permutevar8x32_epi32(e0, split), p1 = _mm256_permutevar8x32_epi32(e1, split);
    const __m256i lo32 = _mm256_permute2x128_si256(p0, p1, 0x20), t2 = _mm256_permute2x128_si256(p0, p1, 0x31);
    const __m256i c0 = _mm256_and_si256(lo32, _mm256_set1_epi32(0xFF));
    const __m256i t1 = _mm256_srli_epi32(lo32, 8);
    // Thresholds passed: 2 less one for each threshold still above `low`.
    const __m256i n = _mm256_add_epi32(_mm256_set1_epi32(2), _mm256_add_epi32(_mm256_cmpgt_epi32(t1, low),
                                                                           _mm256_cmpgt_epi32(t2, low)));
    const __m256i negative = _mm256_cmpgt_epi32(_mm256_setzero_si256(), bits);
    best = _mm256_add_epi32(c0, _mm256_sub_epi32(_mm256_xor_si256(n, negative), negative));
  } else {  // Codebook::half_up over 16 values
    best = _mm256_setzero_si256();
    for (int step = map.size / 2; step >= 1; step /= 2) {
      const __m256i c = _mm256_add_epi32(best, _mm256_set1_epi32(step));
      const __m256 ge = _mm256_cmp_ps(s, lookup16(map, c), _CMP_GE_OQ);
      best = _mm256_blendv_epi8(best, c, _mm256_castps_si256(ge));
    }
    const __m256i up = _mm256_min_epi32(_mm256_add_epi32(best, _mm256_set1_epi32(1)), _mm256_set1_epi32(map.size - 1));
    const __m256 lo_v = lookup16(map, best), up_v = lookup16(map, up);
    const __m256 round = _mm256_cmp_ps(_mm256_sub_ps(s, lo_v), _mm256_mul_ps(_mm256_sub_ps(up_v, lo_v), _mm256_set1_ps(0.5f)),
                                       _CMP_GE_OQ);
    best = _mm256_blendv_epi8(best, up, _mm256_castps_si256(round));
  }
  return _mm256_andnot_si256(nan, best);
}
#endif

void decode_block(const Codebook& map, const uint8_t* codes, float absmax, int64_t n, float* x) {
  int64_t i = 0;
#if PO_AVX512
  const __m512 am = _mm512_set1_ps(absmax);
  if (map.bits == 8) {
    for (; i + 16 <= n; i += 16) {
      const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
      _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_i32gather_ps(c, map.value.data(), 4), am));
    }
  } else {
    const __m512 table = _mm512_loadu_ps(map.value.data());
    for (; i + 16 <= n; i += 16) {  // 8 bytes: high nibble first
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i / 2)));
      const __m512i hi = _mm512_srli_epi32(b, 4), lo = _mm512_and_si512(b, _mm512_set1_epi32(15));
      // lanes 0..7 hold bytes 0..7: element 2j is hi[j], 2j + 1 is lo[j]
      const __m512i idx_even = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
      const __m512i c = _mm512_permutex2var_epi32(hi, idx_even, lo);
      _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_permutexvar_ps(c, table), am));
    }
  }
#else
  const __m256 am = _mm256_set1_ps(absmax);
  if (map.bits == 8) {
    for (; i + 8 <= n; i += 8) {
      const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
      _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_i32gather_ps(map.value.data(), c, 4), am));
    }
  } else {
    for (; i + 8 <= n; i += 8) {  // 4 bytes: high nibble first
      int32_t c[8];
      for (int j = 0; j < 4; ++j) {
        c[2 * j] = codes[i / 2 + j] >> 4;
        c[2 * j + 1] = codes[i / 2 + j] & 15;
      }
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
      _mm256_storeu_ps(x + i, _mm256_mul_ps(lookup16(map, v), am));
    }
  }
#endif
  if (map.bits == 8) {
    for (; i < n; ++i) x[i] = map.value[codes[i]] * absmax;
    return;
  }
  for (; i < n; ++i) x[i] = map.value[static_cast<size_t>(code_at(codes, i, 4))] * absmax;
}

// Encodes x[n] (one block) into codes and returns its stored absmax.
float encode_block(const Codebook& map, const float* x, int64_t n, uint8_t* codes) {
  const float am = map.absmax_stored(block_absmax(x, n));
  alignas(64) uint8_t c[kMaxQuantBlock];
  uint8_t* out = map.bits == 8 ? codes : c;
  int64_t i = 0;
#if PO_AVX512
  const __m512 vam = _mm512_set1_ps(am);
  for (; i + 16 <= n; i += 16) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(codes16(map, x + i, vam)));
#else
  const __m256 vam = _mm256_set1_ps(am);
  for (; i + 8 <= n; i += 8) {
    alignas(32) int32_t c[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(c), codes8(map, x + i, vam));
    for (int j = 0; j < 8; ++j) out[i + j] = static_cast<uint8_t>(c[j]);
  }
#endif
  for (; i < n; ++i) out[i] = map.code(x[i] / am);
  if (map.bits == 4) {
    for (int64_t j = 0; j + 1 < n; j += 2) codes[j >> 1] = static_cast<uint8_t>((c[j] << 4) | c[j + 1]);
    if (n & 1) codes[n >> 1] = static_cast<uint8_t>(c[n - 1] << 4);
  }
  return am;
}

template <typename Grad>
void adamw_quant_kernel(float* param, const Grad* grad, uint16_t* param_out, const QuantMoments& q,
                        int64_t n, float lr, float beta1, float beta2, float eps,
                        float weight_decay, float grad_scale, int64_t t) {
  const AdamScalars k = AdamScalars::make(lr, beta1, beta2, eps, weight_decay, grad_scale, t);
  const BlockCut cut(n, q.block, q.first_block);
  const int64_t blocks = cut.count();
  const Codebook& mm = *q.m_map;
  const Codebook& vm = *q.v_map;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    alignas(64) float m[kMaxQuantBlock];
    alignas(64) float v[kMaxQuantBlock];
    const int64_t lo = cut.start(b), len = cut.start(b + 1) - lo;
    uint8_t* mc = q.m + code_offset(lo, mm.bits);
    uint8_t* vc = q.v + code_offset(lo, vm.bits);
    decode_block(mm, mc, q.m_absmax[b], len, m);
    decode_block(vm, vc, q.v_absmax[b], len, v);
    float* p = param + lo;
    const Grad* g_in = grad + lo;
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) {
      float gi;
      if constexpr (std::is_same_v<Grad, float>) {
        gi = g_in[i];
      } else {
        gi = core::bf16_to_f32(core::bf16{g_in[i]});
      }
      k.update(gi, p[i], m[i], v[i]);
    }
    if (param_out != nullptr)
      for (int64_t i = 0; i < len; ++i) param_out[lo + i] = core::f32_to_bf16(p[i]).bits;
    q.m_absmax[b] = encode_block(mm, m, len, mc);
    q.v_absmax[b] = encode_block(vm, v, len, vc);
  }
}

}  // namespace

void quantize_blockwise(const Codebook* map, const float* x, int64_t n, int64_t block,
                        uint8_t* codes, float* absmax, int64_t first_block) {
  const BlockCut cut(n, block, first_block);
  const int64_t blocks = cut.count();
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = cut.start(b);
    absmax[b] = encode_block(*map, x + lo, cut.start(b + 1) - lo, codes + code_offset(lo, map->bits));
  }
}

void dequantize_blockwise(const Codebook* map, const uint8_t* codes, const float* absmax,
                          int64_t n, int64_t block, float* x, int64_t first_block) {
  const BlockCut cut(n, block, first_block);
  const int64_t blocks = cut.count();
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = cut.start(b);
    decode_block(*map, codes + code_offset(lo, map->bits), absmax[b], cut.start(b + 1) - lo, x + lo);
  }
}

void adamw_update_quant(float* param, const float* grad, const uint16_t* grad_bf16,
                        uint16_t* param_out, const QuantMoments* q, int64_t n, float lr,
                        float beta1, float beta2, float eps, float weight_decay,
                        float grad_scale, int64_t t) {
  if (grad != nullptr)
    adamw_quant_kernel(param, grad, param_out, *q, n, lr, beta1, beta2, eps, weight_decay,
                       grad_scale, t);
  else
    adamw_quant_kernel(param, grad_bf16, param_out, *q, n, lr, beta1, beta2, eps, weight_decay,
                       grad_scale, t);
}

PO_KERNELS_END

#pragma GCC diagnostic pop
