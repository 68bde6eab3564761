// AdamW with 8- and 4-bit moments (optim.state_bits): the ranges' blocks on
// their unit's grid, the 32-bit ranges beside them, the moments read and
// written as fp32 for checkpoints (recovered exactly, or quantized), and the
// bytes the ledger counts.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "core/error.h"
#include "optim/adamw.h"
#include "backend/quant_map.h"

namespace {

namespace cpu = po::backend::cpu;
using po::optim::AdamW;
using po::optim::AdamWConfig;
using po::optim::ParamRange;
using po::backend::QuantMap;
using po::optim::StateKind;

std::vector<float> randoms(size_t n, uint32_t seed, float scale) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b, std::string* where) {
  if (a.size() != b.size()) return *where = "sizes differ", false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], 4) != 0) {
      *where = "element " + std::to_string(i) + ": " + std::to_string(a[i]) + " vs " + std::to_string(b[i]);
      return false;
    }
  return true;
}

// Three tensors in one unit: one quantized starting off the grid (unit
// offset 100), a small 32-bit one, and a quantized one ending in a short
// block; unit offsets as the layout gives them.
struct Model {
  int bits;
  AdamWConfig cfg;
  std::vector<ParamRange> ranges;
  int64_t n = 0;
  explicit Model(int b) : bits(b) {
    cfg.state_bits = b;
    cfg.block_size = b == 8 ? 256 : 128;
    const int64_t sizes[] = {100, 5000, 640, 9000};
    const bool quantized[] = {false, true, false, true};
    for (int i = 0; i < 4; ++i) {
      ranges.push_back({n, sizes[i], i != 2, -1, quantized[i], n});
      n += sizes[i];
    }
  }
};

TEST(QuantizedAdamW, StepsAreTheKernelOnEachRangesGridBlocks) {
  for (int bits : {8, 4}) {
    Model md(bits);
    AdamW opt(md.cfg, md.ranges, md.n);
    std::vector<float> p = randoms(static_cast<size_t>(md.n), 1, 0.02f), p_ref = p;
    // The reference: each range by hand, a quantized one's first block cut at
    // the grid line (offset 100: 156 or 28 elements), fp32 ranges as adamw_update.
    const auto& mmap = po::backend::codebook(bits == 8 ? QuantMap::kSigned8 : QuantMap::kSigned4);
    const auto& vmap = po::backend::codebook(bits == 8 ? QuantMap::kUnsigned8 : QuantMap::kUnsigned4);
    struct Ref {
      std::vector<uint8_t> m, v;
      std::vector<float> am, av, fm, fv;
    };
    std::vector<Ref> ref(md.ranges.size());
    for (size_t i = 0; i < md.ranges.size(); ++i) {
      const auto& r = md.ranges[i];
      ref[i].m.assign(static_cast<size_t>(r.numel), 0);
      ref[i].v = ref[i].m;
      ref[i].am.assign(static_cast<size_t>(r.numel), 0.0f);
      ref[i].av = ref[i].am;
      ref[i].fm.assign(static_cast<size_t>(r.numel), 0.0f);
      ref[i].fv = ref[i].fm;
    }
    for (int t = 1; t <= 4; ++t) {
      const std::vector<float> g = randoms(static_cast<size_t>(md.n), 10 + t, 0.1f);
      opt.apply(p.data(), g.data(), 1e-3, 1.0);
      for (size_t i = 0; i < md.ranges.size(); ++i) {
        const auto& r = md.ranges[i];
        const float wd = r.decay ? 0.1f : 0.0f;
        if (r.quantized) {
          cpu::QuantMoments q{ref[i].m.data(), ref[i].am.data(), ref[i].v.data(), ref[i].av.data(),
                              &mmap, &vmap, md.cfg.block_size,
                              (md.cfg.block_size - r.unit_offset % md.cfg.block_size) % md.cfg.block_size};
          cpu::adamw_update_quant(p_ref.data() + r.offset, g.data() + r.offset, nullptr, nullptr, &q,
                                  r.numel, 1e-3f, 0.9f, 0.95f, 1e-8f, wd, 1.0f, t);
        } else {
          cpu::adamw_update(p_ref.data() + r.offset, g.data() + r.offset, ref[i].fm.data(),
                            ref[i].fv.data(), r.numel, 1e-3f, 0.9f, 0.95f, 1e-8f, wd, 1.0f, t);
        }
      }
      std::string where;
      ASSERT_TRUE(same_bits(p, p_ref, &where)) << bits << " bits, step " << t << ": " << where;
    }
    // The state's bytes: 8 per 32-bit element; codes and two absmaxes per block otherwise.
    const int64_t quantized_bytes = po::optim::moment_bytes(md.cfg, true, 5000, 100) +
                                    po::optim::moment_bytes(md.cfg, true, 9000, 5740);
    EXPECT_EQ(static_cast<int64_t>(opt.state_bytes()), 8 * (100 + 640) + quantized_bytes);
    EXPECT_EQ(po::optim::quant_blocks(5000, 256, 100), 1 + (5000 - 156 + 255) / 256);
  }
}

TEST(QuantizedAdamW, MomentsRoundTripExactlyThroughFp32) {
  for (int bits : {8, 4}) {
    Model md(bits);
    AdamW a(md.cfg, md.ranges, md.n), b(md.cfg, md.ranges, md.n);
    std::vector<float> pa = randoms(static_cast<size_t>(md.n), 2, 0.02f);
    for (int t = 1; t <= 3; ++t) {
      const std::vector<float> g = randoms(static_cast<size_t>(md.n), 20 + t, 0.05f);
      a.apply(pa.data(), g.data(), 1e-3, 1.0);
    }
    // What a checkpoint holds: both moments as fp32, for all elements.
    std::vector<float> m(static_cast<size_t>(md.n)), v(m.size());
    a.read_moment(StateKind::kAdamM, 0, md.n, m.data());
    a.read_moment(StateKind::kAdamV, 0, md.n, v.data());
    EXPECT_EQ(b.write_moment(StateKind::kAdamM, 0, md.n, m.data()), 0) << bits << " bits: m";
    EXPECT_EQ(b.write_moment(StateKind::kAdamV, 0, md.n, v.data()), 0) << bits << " bits: v";
    b.set_steps_taken(a.steps_taken());
    // The next steps from either give the same bits.
    std::vector<float> pb = pa;
    for (int t = 4; t <= 5; ++t) {
      const std::vector<float> g = randoms(static_cast<size_t>(md.n), 20 + t, 0.05f);
      a.apply(pa.data(), g.data(), 1e-3, 1.0);
      b.apply(pb.data(), g.data(), 1e-3, 1.0);
    }
    std::string where;
    EXPECT_TRUE(same_bits(pa, pb, &where)) << bits << " bits, after reloading the moments: " << where;
    // Reads of a part (a checkpoint slice) are the same values.
    std::vector<float> part(1000), all(static_cast<size_t>(md.n));
    a.read_moment(StateKind::kAdamM, 0, md.n, all.data());
    a.read_moment(StateKind::kAdamM, 777, 1000, part.data());
    EXPECT_EQ(0, std::memcmp(part.data(), all.data() + 777, 4000));
  }
}

TEST(QuantizedAdamW, Fp32MomentsAreQuantizedAndCounted) {
  Model md(8);
  AdamW opt(md.cfg, md.ranges, md.n);
  // A 32-bit run's moments: no codes decode to them exactly.
  std::vector<float> m = randoms(static_cast<size_t>(md.n), 3, 0.01f), v(m.size());
  for (size_t i = 0; i < v.size(); ++i) v[i] = m[i] * m[i];
  const int64_t blocks = po::optim::quant_blocks(5000, 256, 100) + po::optim::quant_blocks(9000, 256, 5740);
  EXPECT_EQ(opt.write_moment(StateKind::kAdamM, 0, md.n, m.data()), blocks);
  EXPECT_EQ(opt.write_moment(StateKind::kAdamV, 0, md.n, v.data()), blocks);
  // They read back as their quantization; the 32-bit ranges as written.
  std::vector<float> back(m.size());
  opt.read_moment(StateKind::kAdamM, 0, md.n, back.data());
  EXPECT_EQ(0, std::memcmp(back.data(), m.data(), 100 * 4)) << "a 32-bit range changed";
  double worst = 0;
  for (int64_t i = 100; i < 5100; ++i) worst = std::max(worst, std::fabs(static_cast<double>(back[i] - m[i])));
  EXPECT_GT(worst, 0.0);
  EXPECT_LT(worst, 0.05 * 0.04) << "beyond the 8-bit map's largest relative step of a block's absmax";
}

TEST(QuantizedAdamW, RefusesWhatItCannotDo) {
  Model md(8);
  AdamW opt(md.cfg, md.ranges, md.n);
  try {
    (void)opt.m();
    ADD_FAILURE() << "m() of quantized moments";
  } catch (const po::core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("optim.state_bits"), std::string::npos) << e.what();
  }
  // Writes take whole blocks: element 200 is inside range 1's first block.
  std::vector<float> x(300, 0.0f);
  try {
    (void)opt.write_moment(StateKind::kAdamM, 200, 300, x.data());
    ADD_FAILURE() << "a write that cuts a block";
  } catch (const po::core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("whole blocks"), std::string::npos) << e.what();
  }
  AdamWConfig bad = md.cfg;
  bad.block_size = 100;
  EXPECT_THROW(AdamW(bad, md.ranges, md.n), po::core::Error);
}

TEST(QuantizedAdamW, FirstBlockCutsTheKernelsBlocks) {
  // quantize_blockwise with a first block of 60 = the same values quantized
  // as [0, 60) and then blocks of 256 from 60.
  const auto& cb = po::backend::codebook(QuantMap::kSigned8);
  const std::vector<float> x = randoms(700, 4, 1.0f);
  std::vector<uint8_t> c1(700), c2(700);
  std::vector<float> a1(4), a2(4);
  cpu::quantize_blockwise(&cb, x.data(), 700, 256, c1.data(), a1.data(), 60);
  cpu::quantize_blockwise(&cb, x.data(), 60, 256, c2.data(), a2.data());
  cpu::quantize_blockwise(&cb, x.data() + 60, 640, 256, c2.data() + 60, a2.data() + 1);
  EXPECT_EQ(c1, c2);
  EXPECT_EQ(a1, a2);
}

}  // namespace
