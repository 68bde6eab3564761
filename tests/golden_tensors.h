// A golden file's tensors read whole, for the tests held to tools/torch_ref's
// numpy ports bit for bit: f32 (any float dtype, widened), u8 (raw bytes:
// codes), and a float's bits (to compare and print them exactly).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"

namespace po::test {

inline std::vector<float> f32(const checkpoint::SafetensorsReader& f, const std::string& name) {
  return f.read_f32(name, f.get(name).shape);
}

inline std::vector<uint8_t> u8(const checkpoint::SafetensorsReader& f, const std::string& name) {
  const auto& t = f.get(name);
  const auto* p = reinterpret_cast<const uint8_t*>(t.data);
  return std::vector<uint8_t>(p, p + t.numel());
}

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

}  // namespace po::test
