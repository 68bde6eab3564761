// IEEE binary16 storage type: conversion with round-to-nearest-even (the
// compiler's _Float16, F16C instructions where the CPU has them). Like bf16,
// f16 is a storage and transport format; compute stays f32.
#pragma once

#include <cstdint>
#include <cstring>

namespace po::core {

struct f16 {
  uint16_t bits = 0;
};

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

}  // namespace po::core
