// The tensor storage formats of GGUF files (ggml's types): plain F32, F16 and
// BF16, and the block-quantized Q8_0, Q4_0, Q4_K and Q6_K. A row of a
// quantized tensor is a run of blocks, each a fixed number of elements with
// its own scales; a row's length must be a multiple of the block's.
//
// Block layouts (ggml-common.h's structs; little-endian, packed):
//   Q8_0  32 elements, 34 bytes: f16 d, int8 q[32]            x = q·d
//   Q4_0  32 elements, 18 bytes: f16 d, uint8 qs[16]          x = (nibble − 8)·d;
//         element j < 16 is qs[j]'s low nibble, 16 + j its high nibble
//   Q4_K 256 elements, 144 bytes: f16 d, f16 dmin, uint8 scales[12] (eight
//         6-bit scales and eight 6-bit mins), uint8 qs[128]; eight groups of 32,
//         x = (d·sc)·q − dmin·m
//   Q6_K 256 elements, 210 bytes: uint8 ql[128] (low 4 bits), uint8 qh[64]
//         (high 2 bits), int8 scales[16] (one per 16), f16 d; x = (d·sc)·(q − 32)
// Dequantization evaluates ggml's float32 expressions in its order, unfused
// (no FMA contraction: this file is compiled with -ffp-contract=off), so the
// values equal the reference's bit for bit (tests/checkpoint/gguf_test.cc holds
// them to a numpy port of the layouts).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace po::backend {

// ggml's type ids, as stored in a GGUF tensor info.
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ6_K = 14,
  kBF16 = 30,
};

// The type of a ggml id this engine reads; nullopt for any other (ggml has
// more: Q4_1, Q5_*, IQ*, ... which are named by ggml_type_name for messages).
std::optional<GgmlType> ggml_type_from_id(uint32_t id);
// "F32", "Q4_K", ... for the types above; ggml's name for other known ids
// ("Q5_1", "IQ4_XS"); "type N" for an id ggml does not have.
std::string ggml_type_name(uint32_t id);
std::string_view ggml_type_name(GgmlType t);
// The type named (case-insensitive: "q8_0", "BF16"); nullopt if none.
std::optional<GgmlType> ggml_type_from_name(std::string_view name);

// Elements per block (1 for F32, F16, BF16) and bytes per block.
int64_t ggml_block_elems(GgmlType t);
int64_t ggml_block_bytes(GgmlType t);
// Bytes of a row of `n` elements (n a multiple of the block's elements).
inline int64_t ggml_row_bytes(GgmlType t, int64_t n) { return n / ggml_block_elems(t) * ggml_block_bytes(t); }

// Decodes `n` elements (a multiple of the block's) from `src` into `dst`.
void ggml_dequantize(GgmlType t, const void* src, float* dst, int64_t n);

// Encodes `n` elements (a multiple of the block's) of `src` into `dst`
// (ggml_row_bytes(t, n) bytes). F16 and BF16 round to nearest even; Q8_0 and
// Q4_0 follow ggml's reference quantizers (quantize_row_q8_0_ref: d = amax/127,
// q = round half away from zero of x·(1/d); quantize_row_q4_0_ref: d = the
// element of largest magnitude / −8, q = min(15, trunc(x·(1/d) + 8.5))), so a
// file they write holds the bytes ggml's tools would. Q4_K and Q6_K are read
// only: InvalidArgument naming the type.
void ggml_quantize(GgmlType t, const float* src, void* dst, int64_t n);

}  // namespace po::backend
