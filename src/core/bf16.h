// bfloat16 storage type: conversion with round-to-nearest-even, NaN kept quiet.
// Compute stays f32; bf16 is a storage and transport format (later issues).
#pragma once

#include <cstdint>
#include <cstring>

namespace po::core {

struct bf16 {
  uint16_t bits = 0;
};

inline bf16 f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

inline float bf16_to_f32(bf16 h) {
  uint32_t u = uint32_t{h.bits} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace po::core
