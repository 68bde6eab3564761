// A codebook: the values a quantized element's code stands for, scaled by its
// block's absmax (blockwise quantization, as bitsandbytes' and torchao's
// low-bit optimizer states are stored), and the rule that picks a value's code.
// The codebooks themselves (their construction) are backend/quant_map.h's; the
// kernels that read and write codes (ops.h: quantize_blockwise,
// dequantize_blockwise, adamw_update_quant) take one by pointer.
//
// A block of x is stored as absmax = max |x| (NaN if any element is NaN;
// a zero absmax is replaced by `zero_absmax`'s rule) and one code per element,
// the code of x / absmax. 4-bit codes are packed two to a byte, the first
// element in the high nibble (bitsandbytes' and torchao's order).
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace po::backend {

// Element i's code in packed codes of `bits` bits (4 bits: high nibble first).
inline int code_at(const uint8_t* codes, int64_t i, int bits) {
  if (bits == 8) return codes[i];
  return (i & 1) ? (codes[i >> 1] & 0x0F) : (codes[i >> 1] >> 4);
}
inline void set_code(uint8_t* codes, int64_t i, int c, int bits) {
  if (bits == 8) {
    codes[i] = static_cast<uint8_t>(c);
    return;
  }
  uint8_t& b = codes[i >> 1];
  b = (i & 1) ? static_cast<uint8_t>((b & 0xF0) | c) : static_cast<uint8_t>((b & 0x0F) | (c << 4));
}
// The byte element `element` of packed codes starts in.
inline int64_t code_offset(int64_t element, int bits) { return bits == 8 ? element : element / 2; }

// How n elements are cut into blocks of `block`, the first one `first` long
// (0 or >= block: a whole block): block k spans [start(k), start(k + 1)).
struct BlockCut {
  int64_t n, block, first;
  BlockCut(int64_t n_, int64_t block_, int64_t first_)
      : n(n_), block(block_), first(first_ > 0 && first_ < block_ ? first_ : block_) {}
  int64_t count() const { return n <= first ? (n > 0 ? 1 : 0) : 1 + (n - first + block - 1) / block; }
  int64_t start(int64_t k) const { return k == 0 ? 0 : (first + (k - 1) * block < n ? first + (k - 1) * block : n); }
  int64_t of(int64_t e) const { return e < first ? 0 : 1 + (e - first) / block; }
};

struct Codebook {
  // How a scaled value s in [-1, 1] finds its code:
  //  kFirstNearest: the code whose value is nearest |s - value| in float32,
  //    the lowest code on a tie (bitsandbytes' reference: argmin);
  //  kHalfUp: the highest code whose value is <= s (code 0 below the first),
  //    then the next one when s - value >= (next - value) * 0.5: ties go up
  //    (torchao's quantize_4bit_with_qmap).
  // A NaN s gets code 0 under both (what argmin and the comparisons give).
  enum class Rounding : uint8_t { kFirstNearest, kHalfUp };
  // What a block whose absmax is 0 stores: 1 (bitsandbytes), or absmax is
  // clipped below at 1e-12 (torchao); either way its codes decode to 0 where
  // the codebook holds 0.
  enum class ZeroAbsmax : uint8_t { kOne, kClip };

  const char* name = "";
  int bits = 8;   // 8 or 4
  int size = 256; // 2^bits codes, values ascending
  Rounding rounding = Rounding::kFirstNearest;
  ZeroAbsmax zero_absmax = ZeroAbsmax::kOne;
  std::array<float, 256> value{};
  // kFirstNearest: for each upper half of a float32's bits (sign, exponent,
  // 7 mantissa bits), the lowest code nearest any value in it; the nearest
  // code of a value in it is one of `candidates` codes from there (at most
  // kCandidates; found when the table is built: backend/quant_map.cc).
  static constexpr int kCandidates = 3;
  int candidates = kCandidates;
  std::vector<uint8_t> lo;
  // kFirstNearest, the same search as one table read: per bucket, the code
  // at its first bit pattern c0 (low 16 bits 0) and the low 16 bits t1 <= t2
  // (0x10000: none) from which the code is one and two further from c0
  // (up for positive floats, down for negative ones): code(s) = c0 ± [low >=
  // t1] ± [low >= t2]. Packed c0 | t1 << 8 | t2 << 32 (backend/quant_map.cc).
  std::vector<uint64_t> step;

  float absmax_stored(float absmax) const {
    if (zero_absmax == ZeroAbsmax::kOne) return absmax == 0.0f ? 1.0f : absmax;
    return absmax < 1e-12f ? 1e-12f : absmax;  // NaN stays NaN
  }

  uint8_t code(float s) const { return rounding == Rounding::kHalfUp ? half_up(s) : nearest(s); }

  // kFirstNearest's search.
  uint8_t nearest(float s) const {
    uint32_t b;
    std::memcpy(&b, &s, 4);
    const int first = lo[b >> 16];
    int best = first;
    float best_d = std::fabs(s - value[static_cast<size_t>(first)]);
    for (int k = 1; k < candidates; ++k) {
      const int c = first + k < size ? first + k : size - 1;
      const float d = std::fabs(s - value[static_cast<size_t>(c)]);
      best = d < best_d ? c : best;
      best_d = d < best_d ? d : best_d;
    }
    return static_cast<uint8_t>(s != s ? 0 : best);
  }

  // kHalfUp's binary search and rounding.
  uint8_t half_up(float s) const {
    int c = 0;
    for (int step = size / 2; step >= 1; step /= 2)
      c = s >= value[static_cast<size_t>(c + step)] ? c + step : c;
    const int up = c + 1 < size ? c + 1 : c;
    const float lo_v = value[static_cast<size_t>(c)], up_v = value[static_cast<size_t>(up)];
    return static_cast<uint8_t>(s - lo_v >= (up_v - lo_v) * 0.5f ? up : c);  // NaN: 0
  }
};

}  // namespace po::backend
