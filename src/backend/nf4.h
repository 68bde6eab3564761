// NF4 with double quantization: the 4-bit weight format of QLoRA's frozen
// base (Dettmers et al. 2023), bitsandbytes' quantize_4bit(quant_type="nf4",
// blocksize=64, compress_statistics=True) and dequantize_4bit, in its layout.
//
// n weights w[n] are cut into blocks of kNf4Block = 64 (the last one short
// when n is not a multiple of 64: it holds n % 64 elements and is scaled by
// its own absmax, as bitsandbytes does).
//  - Block b: absmax[b] = max |w| over the block (float32). Each element is
//    stored as the code (0..15) of the NF4 value (backend/quant_map.h: nf4_map)
//    nearest s = clamp(w * (1 / absmax[b]), -1, 1): argmin |s - value| in
//    float32, the lowest code on a tie. A zero block gives s = 0 * inf = NaN,
//    code 0 (CUDA's dQuantizeNF4 and the argmin reference alike).
//  - codes: two to a byte, element 2i in the HIGH nibble, 2i + 1 in the low
//    one (bitsandbytes' order); (n + 1) / 2 bytes; an odd n's last low nibble
//    is 7 (NF4's 0: bitsandbytes pads the scaled values with 0.0).
//  - Double quantization of the absmaxes: offset = their mean (float64 sum in
//    block order / count, rounded to float32: bitsandbytes' float32 mean is
//    its device's reduction order, which this fixes); absmax - offset is
//    quantized blockwise in blocks of kNf4NestedBlock = 256 with the SIGNED
//    8-bit dynamic map (quant_map.h kSigned8; no -1.0): absmax_codes, one
//    byte per block, and nested_absmax, one float32 per 256 blocks, by the
//    rule above (reciprocal, clamp, first nearest; a zero nested block codes 0).
//  - Decoding: absmax'[b] = dynamic[absmax_codes[b]] * nested_absmax[b / 256]
//    + offset (two float32 roundings, never fused), w' = nf4[code] * absmax'[b].
//    A zero block therefore decodes to -absmax'[b], which the double
//    quantization leaves near, not at, 0: bitsandbytes' CUDA kernel and its
//    argmin reference do the same (its default backend since June 2026,
//    PR #1960, scales by 1 / 1e-38 instead and codes such a block 7, i.e. 0).
//    A value exactly on one of 6 of NF4's float32 midpoints takes the upper
//    code here, the lower one in CUDA's dQuantizeNF4 (x > midpoint).
//
// Size per parameter: 4 bits of code + 8 / 64 (absmax code) + 32 / (64 * 256)
// (nested absmax) = 4.127 bits, about 0.516 bytes, plus 4 bytes of offset per
// tensor. bitsandbytes' checkpoint names (HF "-bnb-4bit"): `weight` = codes,
// `absmax` = absmax_codes, `nested_absmax`, `nested_quant_map` = the dynamic
// map, `quant_map` = the NF4 map, and the offset in quant_state's JSON.
//
// The tests (tests/optim/nf4_test.cc) hold all of it bit for bit against a
// numpy port of bitsandbytes' code (tools/torch_ref/make_nf4.py).
#pragma once

#include <cstdint>
#include <vector>

namespace po::backend {

inline constexpr int64_t kNf4Block = 64;
inline constexpr int64_t kNf4NestedBlock = 256;

struct Nf4Tensor {
  int64_t numel = 0;
  std::vector<uint8_t> codes;         // (numel + 1) / 2 bytes, high nibble first
  std::vector<uint8_t> absmax_codes;  // one signed dynamic 8-bit code per block of 64
  std::vector<float> nested_absmax;   // one float32 per 256 blocks
  float offset = 0.0f;                // the mean of the block absmaxes

  int64_t blocks() const { return (numel + kNf4Block - 1) / kNf4Block; }
};

// w[n], n > 0, every element finite (a NaN or Inf absmax would reach every
// block through the offset): throws core::InvalidArgument naming the element.
Nf4Tensor quantize_nf4(const float* w, int64_t n);

// out[t.numel] = the decoded weights.
void dequantize_nf4(const Nf4Tensor& t, float* out);

// Block b's recovered absmax: dynamic[absmax_codes[b]] * nested_absmax[b / 256] + offset.
float nf4_absmax(const Nf4Tensor& t, int64_t block);

// out[count] = decoded elements [first, first + count), any range inside the
// tensor, bit for bit what dequantize_nf4 writes there (a GEMM tile's rows).
void dequantize_nf4_rows(const Nf4Tensor& t, int64_t first, int64_t count, float* out);

}  // namespace po::backend
