// Counter-based random numbers (Philox4x32-10, Salmon et al. 2011). A value is
// a pure function of (key, counter), so initialisation and sampling give the
// same numbers whatever the layout, rank count or resume point.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>

namespace po::core {

// One Philox4x32-10 block: 4 uniform 32-bit words from a 128-bit counter and 64-bit key.
inline std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> ctr, std::array<uint32_t, 2> key) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = uint64_t{kM0} * ctr[0];
    uint64_t p1 = uint64_t{kM1} * ctr[2];
    ctr = {static_cast<uint32_t>(p1 >> 32) ^ ctr[1] ^ key[0], static_cast<uint32_t>(p1),
           static_cast<uint32_t>(p0 >> 32) ^ ctr[3] ^ key[1], static_cast<uint32_t>(p0)};
    key[0] += kW0;
    key[1] += kW1;
  }
  return ctr;
}

// Stream of random numbers for one (seed, stream) pair, addressed by index.
class Philox {
 public:
  Philox(uint64_t seed, uint64_t stream) : seed_(seed), stream_(stream) {}

  // Four uniform words for block `index`.
  std::array<uint32_t, 4> block(uint64_t index) const {
    return philox4x32({static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32),
                       static_cast<uint32_t>(stream_), static_cast<uint32_t>(stream_ >> 32)},
                      {static_cast<uint32_t>(seed_), static_cast<uint32_t>(seed_ >> 32)});
  }
  // Uniform in [0, 1) with 24 bits, element `i` of the stream.
  float uniform(uint64_t i) const { return (block(i)[0] >> 8) * (1.0f / 16777216.0f); }
  // Uniform 64-bit integer, element `i` of the stream.
  uint64_t next_u64(uint64_t i) const {
    auto b = block(i);
    return (uint64_t{b[0]} << 32) | b[1];
  }
  // Standard normal (Box-Muller on one block), element `i` of the stream.
  float normal(uint64_t i) const {
    auto b = block(i);
    double u1 = (static_cast<double>(b[0]) + 1.0) / 4294967297.0;  // (0, 1]
    double u2 = static_cast<double>(b[1]) / 4294967296.0;
    return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }

 private:
  uint64_t seed_, stream_;
};

}  // namespace po::core
