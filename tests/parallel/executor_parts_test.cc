// The pipeline executor's state parts that need no collective to check:
// ParamGathers' order, prefetch and buffers, and UnitAccumulators' rings,
// pool and held slots (the collectives behind them run in the mp suites:
// pipeline_mp_test, OneStageInvariants, PlanVsPipeline).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "parallel/param_gathers.h"
#include "parallel/unit_accumulators.h"

namespace po::parallel {
namespace {

// Each started gather writes its (stage, unit) into the buffer, so a use can
// check that what it got is what it asked for; the log keeps the starts.
struct Gathers {
  std::vector<std::pair<int, int>> started;
  std::vector<std::pair<int, int>> ahead;
  ParamGathers g;
  explicit Gathers(int prefetch)
      : g({64, 64}, prefetch,
          [this](int stage, int u, void* buf) {
            started.emplace_back(stage, u);
            const int at[2] = {stage, u};
            std::memcpy(buf, at, sizeof at);
            return comm::Work();
          },
          [this](int stage, int u) { ahead.emplace_back(stage, u); }) {}
  // One use: what the buffer holds, "stage/unit".
  std::string use(int stage, int u) {
    const auto* at = static_cast<const int*>(g.use(stage, u));
    const std::string got = std::to_string(at[0]) + "/" + std::to_string(at[1]);
    EXPECT_EQ(g.in_use(u), static_cast<const void*>(at)) << "unit " << u << "'s buffer in use";
    g.release(u);
    return got;
  }
};

const std::vector<std::pair<int, int>> kOrder = {{0, 3}, {0, 2}, {0, 1}, {0, 0}, {0, 1}, {0, 2}};

TEST(ParamGathers, TheFirstStepRecordsTheOrderAndLaterStepsRunAhead) {
  Gathers t(1);
  t.g.begin_step();
  for (const auto& [st, u] : kOrder) EXPECT_EQ(t.use(st, u), std::to_string(st) + "/" + std::to_string(u));
  t.g.end_step();
  EXPECT_EQ(t.g.uses(), 6);
  EXPECT_EQ(t.g.prefetched(), 0) << "the first step has no order to run ahead along";
  EXPECT_EQ(t.started, kOrder) << "the first step gathers each request at its use";
  t.started.clear();
  t.g.begin_step();
  for (const auto& [st, u] : kOrder) EXPECT_EQ(t.use(st, u), std::to_string(st) + "/" + std::to_string(u));
  t.g.end_step();
  EXPECT_EQ(t.g.uses(), 6);
  EXPECT_EQ(t.g.prefetched(), 5) << "every use but the step's first finds its gather issued ahead";
  EXPECT_EQ(t.started, kOrder) << "the same gathers, in the same order";
  EXPECT_FALSE(t.ahead.empty()) << "the owner hears of the gather after those issued";
}

TEST(ParamGathers, ARequestOffTheOrderIsGatheredAlone) {
  Gathers t(2);
  t.g.begin_step();
  for (const auto& [st, u] : kOrder) t.use(st, u);
  t.g.end_step();
  t.started.clear();
  t.g.begin_step();
  EXPECT_EQ(t.use(0, 3), "0/3");
  EXPECT_EQ(t.use(1, 5), "1/5") << "an unknown request gets its own unit, not what was prefetched";
  EXPECT_EQ(t.use(0, 2), "0/2") << "back on the order after a detour";
  t.g.end_step();
  EXPECT_EQ(t.g.uses(), 3);
}

TEST(ParamGathers, NoPrefetchGathersEachUseAlone) {
  Gathers t(0);
  for (int step = 0; step < 2; ++step) {
    t.g.begin_step();
    for (const auto& [st, u] : kOrder) t.use(st, u);
    t.g.end_step();
    EXPECT_EQ(t.g.prefetched(), 0) << "step " << step;
  }
  EXPECT_EQ(t.g.bytes(), 2u * 64) << "one buffer of each kind at prefetch 0";
}

TEST(ParamGathers, TwoUnitsOfOneKindAtOnceIsAnError) {
  Gathers t(1);
  t.g.begin_step();
  (void)t.g.use(0, 2);
  EXPECT_THROW((void)t.g.use(0, 3), core::Internal);
  t.g.release(2);
}

TEST(UnitAccumulators, RingsRotateAndAHeldSlotWaitsForItsReduction) {
  UnitAccumulators a({16, 32}, {1, 3});
  std::vector<int64_t> waited;
  auto wait = [&](int64_t seq) {
    waited.push_back(seq);
  };
  std::vector<float*> got;
  for (int micro = 0; micro < 3; ++micro) {
    const UnitAccumulators::Key key{micro, 0, 1};
    got.push_back(a.take(key, false, 0, 32, wait));
    EXPECT_EQ(a.find(key), got.back());
    const UnitAccumulators::Acc acc = a.remove(key);
    a.hold(acc, 10 + micro);  // a reduction in flight reads it
  }
  EXPECT_NE(got[0], got[1]);
  EXPECT_NE(got[1], got[2]);
  EXPECT_TRUE(waited.empty()) << "three slots, none taken again yet";
  // The fourth take comes back to the first slot: its reduction (seq 10)
  // must complete first; here the wait releases it as the owner would.
  float* again = a.take({3, 0, 1}, false, 0, 32, [&](int64_t seq) {
    waited.push_back(seq);
    a.release({got[0], 1, 0});
  });
  EXPECT_EQ(again, got[0]) << "the ring takes its slots in turn";
  EXPECT_EQ(waited, std::vector<int64_t>{10});
  EXPECT_EQ(a.ring_bytes(), 16u + 3 * 32);
  EXPECT_EQ(a.pool_bytes(), 0u);
  a.release(a.remove({3, 0, 1}));
  a.release({got[1], 1, 1});
  a.release({got[2], 1, 2});
}

TEST(UnitAccumulators, DeferredBlocksTakePooledBuffersThatAreReused) {
  UnitAccumulators a({16, 16}, {1, 1});
  auto never = [](int64_t seq) { FAIL() << "no reduction to wait for (seq " << seq << ")"; };
  float* first = a.take({0, 0, 1}, true, 64, 64, never);
  float* second = a.take({0, 0, 2}, true, 64, 64, never);
  EXPECT_NE(first, second);
  EXPECT_TRUE(a.pooled({0, 0, 1}));
  EXPECT_EQ(a.taken().size(), 2u);
  a.release(a.remove({0, 0, 1}));
  EXPECT_EQ(a.take({1, 0, 1}, true, 64, 64, never), first) << "a released pooled buffer is taken again";
  EXPECT_EQ(a.pool_bytes(), 2u * 64) << "the pool grows only to the most held at once";
  const float zeros[16] = {};
  EXPECT_EQ(std::memcmp(first, zeros, sizeof zeros), 0) << "a taken accumulator starts at zero";
  a.release(a.remove({1, 0, 1}));
  a.release(a.remove({0, 0, 2}));
}

TEST(UnitAccumulators, ASecondAccumulatorOfAKindWhileOneAccumulatesIsAnError) {
  UnitAccumulators a({16, 16}, {1, 2});
  auto never = [](int64_t) {};
  (void)a.take({0, 0, 1}, false, 0, 16, never);
  EXPECT_THROW((void)a.take({0, 0, 2}, false, 0, 16, never), core::Internal)
      << "the others' ring hands out one accumulating buffer at a time";
  a.release(a.remove({0, 0, 1}));
}

}  // namespace
}  // namespace po::parallel
