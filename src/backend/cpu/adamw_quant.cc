// Blockwise quantized optimizer state (ops.h: quantize_blockwise,
// dequantize_blockwise, adamw_update_quant). One block at a time: its codes
// are decoded into float32 scratch on the stack, updated there with
// adamw_update's arithmetic, and encoded again with the block's new absmax,
// so the state is read and written once per step, in its stored width.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "backend/codebook.h"
#include "backend/cpu/adam_element.h"
#include "backend/cpu/kernel_isa.h"
#include "backend/ops.h"
#include "core/bf16.h"

PO_KERNELS_BEGIN

namespace {

// Code of element i of a block's codes (4 bits: high nibble first).
inline int code_at(const uint8_t* codes, int64_t i, int bits) {
  if (bits == 8) return codes[i];
  const uint8_t b = codes[i >> 1];
  return (i & 1) ? (b & 0x0F) : (b >> 4);
}

// max |x|, NaN if any is NaN (torch.max's rule).
inline float block_absmax(const float* x, int64_t n) {
  float am = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (a > am || std::isnan(a)) am = a;
    if (std::isnan(am)) return am;
  }
  return am;
}

void decode_block(const Codebook& map, const uint8_t* codes, float absmax, int64_t n, float* x) {
  if (map.bits == 8) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] = map.value[codes[i]] * absmax;
    return;
  }
  for (int64_t i = 0; i < n; ++i) x[i] = map.value[static_cast<size_t>(code_at(codes, i, 4))] * absmax;
}

// Encodes x[n] (one block) into codes and returns its stored absmax.
float encode_block(const Codebook& map, const float* x, int64_t n, uint8_t* codes) {
  const float am = map.absmax_stored(block_absmax(x, n));
  if (map.bits == 8) {
    for (int64_t i = 0; i < n; ++i) codes[i] = map.code(x[i] / am);
    return am;
  }
  for (int64_t i = 0; i + 1 < n; i += 2)
    codes[i >> 1] = static_cast<uint8_t>((map.code(x[i] / am) << 4) | map.code(x[i + 1] / am));
  if (n & 1) codes[n >> 1] = static_cast<uint8_t>(map.code(x[n - 1] / am) << 4);
  return am;
}

inline int64_t code_offset(int64_t element, int bits) { return bits == 8 ? element : element / 2; }

// The blocks of n elements whose first block is `first` long (0: `block`):
// block b starts at start(b) and ends at start(b + 1) (clipped to n).
struct Blocks {
  int64_t n, block, first;
  Blocks(int64_t n_, int64_t block_, int64_t first_) : n(n_), block(block_), first(first_ > 0 && first_ < block_ ? first_ : block_) {}
  int64_t count() const { return n <= first ? (n > 0 ? 1 : 0) : 1 + (n - first + block - 1) / block; }
  int64_t start(int64_t b) const { return b == 0 ? 0 : std::min(n, first + (b - 1) * block); }
};

template <typename Grad>
void adamw_quant_kernel(float* param, const Grad* grad, uint16_t* param_out, const QuantMoments& q,
                        int64_t n, float lr, float beta1, float beta2, float eps,
                        float weight_decay, float grad_scale, int64_t t) {
  const AdamScalars k = AdamScalars::make(lr, beta1, beta2, eps, weight_decay, grad_scale, t);
  const Blocks cut(n, q.block, q.first_block);
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
  const Blocks cut(n, block, first_block);
  const int64_t blocks = cut.count();
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = cut.start(b);
    absmax[b] = encode_block(*map, x + lo, cut.start(b + 1) - lo, codes + code_offset(lo, map->bits));
  }
}

void dequantize_blockwise(const Codebook* map, const uint8_t* codes, const float* absmax,
                          int64_t n, int64_t block, float* x, int64_t first_block) {
  const Blocks cut(n, block, first_block);
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
