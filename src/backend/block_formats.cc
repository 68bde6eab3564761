#include "backend/block_formats.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "core/f16.h"

namespace po::backend {
namespace {

constexpr int64_t kQK = 32;    // Q8_0, Q4_0
constexpr int64_t kQKK = 256;  // the K-quants' super-block

struct BlockQ8_0 {
  uint16_t d;
  int8_t q[kQK];
};
struct BlockQ4_0 {
  uint16_t d;
  uint8_t qs[kQK / 2];
};
struct BlockQ4_K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qs[kQKK / 2];
};
struct BlockQ6_K {
  uint8_t ql[kQKK / 2];
  uint8_t qh[kQKK / 4];
  int8_t scales[kQKK / 16];
  uint16_t d;
};
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_K) == 144 &&
              sizeof(BlockQ6_K) == 210);

float half(uint16_t bits) { return core::f16_to_f32(core::f16{bits}); }
uint16_t to_half(float x) { return core::f32_to_f16(x).bits; }

// The 6-bit scale and min of group j (0-7) of a Q4_K block: groups 0-3 in the
// low 6 bits of bytes j and j + 4; groups 4-7 split, low 4 bits in byte j + 4's
// nibbles, high 2 bits in the top bits of bytes j − 4 and j.
void scale_min_k4(int j, const uint8_t* s, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

void dequant_q8_0(const BlockQ8_0* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = half(b[i].d);
    for (int j = 0; j < kQK; ++j) y[j] = static_cast<float>(b[i].q[j]) * d;
  }
}

void dequant_q4_0(const BlockQ4_0* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = half(b[i].d);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = static_cast<float>((b[i].qs[j] & 0xF) - 8) * d;
      y[j + kQK / 2] = static_cast<float>((b[i].qs[j] >> 4) - 8) * d;
    }
  }
}

void dequant_q4_k(const BlockQ4_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = half(b[i].d), dmin = half(b[i].dmin);
    const uint8_t* q = b[i].qs;
    for (int g = 0; g < 8; g += 2, q += 32) {  // 64 elements: 32 low nibbles, 32 high
      uint8_t sc, m;
      scale_min_k4(g, b[i].scales, &sc, &m);
      const float d1 = d * sc, m1 = dmin * m;
      scale_min_k4(g + 1, b[i].scales, &sc, &m);
      const float d2 = d * sc, m2 = dmin * m;
      for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0xF) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
    }
  }
}

void dequant_q6_k(const BlockQ6_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = half(b[i].d);
    const uint8_t* ql = b[i].ql;
    const uint8_t* qh = b[i].qh;
    const int8_t* sc = b[i].scales;
    for (int n = 0; n < kQKK; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * static_cast<float>(sc[is]) * static_cast<float>(q1);
        y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
        y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
        y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
      }
    }
  }
}

void quant_q8_0(const float* x, BlockQ8_0* b, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK) {
    float amax = 0.0f;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    b[i].d = to_half(d);
    for (int j = 0; j < kQK; ++j) b[i].q[j] = static_cast<int8_t>(std::round(x[j] * id));
  }
}

void quant_q4_0(const float* x, BlockQ4_0* b, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK) {
    float amax = 0.0f, max = 0.0f;  // the first element of largest magnitude, signed
    for (int j = 0; j < kQK; ++j)
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    b[i].d = to_half(d);
    for (int j = 0; j < kQK / 2; ++j) {
      const auto lo = static_cast<uint8_t>(std::min(15, static_cast<int>(static_cast<int8_t>(x[j] * id + 8.5f))));
      const auto hi =
          static_cast<uint8_t>(std::min(15, static_cast<int>(static_cast<int8_t>(x[j + kQK / 2] * id + 8.5f))));
      b[i].qs[j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

// ggml's type names by id (ggml.c's type traits), for messages about types
// this engine does not read.
constexpr std::array<const char*, 40> kNames = {
    "F32",     "F16",    "Q4_0",   "Q4_1",   nullptr,  nullptr, "Q5_0",  "Q5_1", "Q8_0",   "Q8_1",
    "Q2_K",    "Q3_K",   "Q4_K",   "Q5_K",   "Q6_K",   "Q8_K",  "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S",
    "IQ4_NL",  "IQ3_S",  "IQ2_S",  "IQ4_XS", "I8",     "I16",   "I32",   "I64",  "F64",    "IQ1_M",
    "BF16",    nullptr,  nullptr,  nullptr,  "TQ1_0",  "TQ2_0", nullptr, nullptr, nullptr,  "MXFP4"};

}  // namespace

std::optional<GgmlType> ggml_type_from_id(uint32_t id) {
  switch (id) {
    case 0: case 1: case 2: case 8: case 12: case 14: case 30:
      return static_cast<GgmlType>(id);
    default:
      return std::nullopt;
  }
}

std::string ggml_type_name(uint32_t id) {
  if (id < kNames.size() && kNames[id] != nullptr) return kNames[id];
  return "type " + std::to_string(id);
}

std::string_view ggml_type_name(GgmlType t) { return kNames[static_cast<uint32_t>(t)]; }

std::optional<GgmlType> ggml_type_from_name(std::string_view name) {
  for (GgmlType t : {GgmlType::kF32, GgmlType::kF16, GgmlType::kBF16, GgmlType::kQ8_0, GgmlType::kQ4_0,
                     GgmlType::kQ4_K, GgmlType::kQ6_K}) {
    const std::string_view n = ggml_type_name(t);
    if (n.size() == name.size() &&
        std::equal(n.begin(), n.end(), name.begin(), [](char a, char b) { return a == std::toupper(b); }))
      return t;
  }
  return std::nullopt;
}

int64_t ggml_block_elems(GgmlType t) {
  switch (t) {
    case GgmlType::kQ8_0: case GgmlType::kQ4_0: return kQK;
    case GgmlType::kQ4_K: case GgmlType::kQ6_K: return kQKK;
    default: return 1;
  }
}

int64_t ggml_block_bytes(GgmlType t) {
  switch (t) {
    case GgmlType::kF32: return 4;
    case GgmlType::kF16: case GgmlType::kBF16: return 2;
    case GgmlType::kQ8_0: return sizeof(BlockQ8_0);
    case GgmlType::kQ4_0: return sizeof(BlockQ4_0);
    case GgmlType::kQ4_K: return sizeof(BlockQ4_K);
    case GgmlType::kQ6_K: return sizeof(BlockQ6_K);
  }
  return 0;
}

void ggml_dequantize(GgmlType t, const void* src, float* dst, int64_t n) {
  PO_ASSERT(n % ggml_block_elems(t) == 0, "ggml_dequantize: ", n, " elements, not whole blocks of ",
            ggml_type_name(t));
  const int64_t nb = n / ggml_block_elems(t);
  // A file's tensor may start at any byte (a GGUF with general.alignment =
  // 1): the typed reads below need their type's alignment, so a misaligned
  // tensor is read from an aligned copy (the fuzzer found an F16 one).
  std::vector<float> aligned;
  if (reinterpret_cast<uintptr_t>(src) % alignof(float) != 0) {
    const size_t bytes = static_cast<size_t>(nb) * ggml_block_bytes(t);
    aligned.resize((bytes + sizeof(float) - 1) / sizeof(float));
    std::memcpy(aligned.data(), src, bytes);
    src = aligned.data();
  }
  switch (t) {
    case GgmlType::kF32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case GgmlType::kF16: {
      const auto* h = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = half(h[i]);
      return;
    }
    case GgmlType::kBF16: {
      const auto* h = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = core::bf16_to_f32(core::bf16{h[i]});
      return;
    }
    case GgmlType::kQ8_0: return dequant_q8_0(static_cast<const BlockQ8_0*>(src), dst, nb);
    case GgmlType::kQ4_0: return dequant_q4_0(static_cast<const BlockQ4_0*>(src), dst, nb);
    case GgmlType::kQ4_K: return dequant_q4_k(static_cast<const BlockQ4_K*>(src), dst, nb);
    case GgmlType::kQ6_K: return dequant_q6_k(static_cast<const BlockQ6_K*>(src), dst, nb);
  }
}

void ggml_quantize(GgmlType t, const float* src, void* dst, int64_t n) {
  PO_ASSERT(n % ggml_block_elems(t) == 0, "ggml_quantize: ", n, " elements, not whole blocks of ",
            ggml_type_name(t));
  const int64_t nb = n / ggml_block_elems(t);
  switch (t) {
    case GgmlType::kF32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case GgmlType::kF16: {
      auto* h = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) h[i] = to_half(src[i]);
      return;
    }
    case GgmlType::kBF16: {
      auto* h = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) h[i] = core::f32_to_bf16(src[i]).bits;
      return;
    }
    case GgmlType::kQ8_0: return quant_q8_0(src, static_cast<BlockQ8_0*>(dst), nb);
    case GgmlType::kQ4_0: return quant_q4_0(src, static_cast<BlockQ4_0*>(dst), nb);
    case GgmlType::kQ4_K:
    case GgmlType::kQ6_K:
      PO_THROW(core::InvalidArgument, ggml_type_name(t), " is read, not written: write Q8_0, Q4_0, F16, BF16 or F32");
  }
}

}  // namespace po::backend
