// IEEE binary16 storage type: conversion with round-to-nearest-even (the
// compiler's _Float16, F16C instructions where the CPU has them; bit
// arithmetic where the compiler has no _Float16, as clang 14 on x86, which
// builds the fuzzers). Like bf16, f16 is a storage and transport format;
// compute stays f32.
#pragma once

#include <cstdint>
#include <cstring>

namespace po::core {

struct f16 {
  uint16_t bits = 0;
};

#if defined(__FLT16_MAX__)

inline f16 f32_to_f16(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  f16 r;
  std::memcpy(&r.bits, &h, 2);
  return r;
}

inline float f16_to_f32(f16 h) {
  _Float16 x;
  std::memcpy(&x, &h.bits, 2);
  return static_cast<float>(x);
}

#else

inline float f16_to_f32(f16 h) {
  const uint32_t sign = uint32_t{h.bits & 0x8000u} << 16;
  const uint32_t exp = (h.bits >> 10) & 0x1f, man = h.bits & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);  // Inf, NaN (payload kept)
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: man * 2^-24, exact in f32
    float f = static_cast<float>(man) * 5.9604644775390625e-8f;
    std::memcpy(&u, &f, 4);
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline f16 f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const auto sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return f16{static_cast<uint16_t>(sign | 0x7e00u | ((u >> 13) & 0x3ffu))};  // NaN, quiet
  if (u >= 0x477ff000u) return f16{static_cast<uint16_t>(sign | 0x7c00u)};  // rounds to Inf (>= 65520)
  if (u < 0x38800000u) {  // below 2^-14: a subnormal half, round to nearest even on 2^-24 steps
    float a;
    std::memcpy(&a, &u, 4);
    const float scaled = a * 16777216.0f;  // exact: a power of two
    auto m = static_cast<uint32_t>(scaled);
    const float rest = scaled - static_cast<float>(m);
    if (rest > 0.5f || (rest == 0.5f && (m & 1u))) ++m;
    return f16{static_cast<uint16_t>(sign | m)};
  }
  const uint32_t lsb = (u >> 13) & 1u;
  u += 0xfffu + lsb;  // round to nearest even on the 13 dropped bits
  return f16{static_cast<uint16_t>(sign | (((u >> 23) - 112) << 10) | ((u >> 13) & 0x3ffu))};
}

#endif

}  // namespace po::core
