// Pipeline stages (parallel/pipeline_stages.h): the units cut into
// contiguous ranges covering the model once, balanced by forward FLOPs (the
// head of GPT-2's vocabulary weighs about five 124M blocks, so the last stage
// gets fewer blocks), or set by parallel.stage_layers, whose mistakes are
// one-line errors naming the keys.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "core/error.h"
#include "parallel/pipeline_stages.h"

namespace {

namespace pl = po::parallel::pipeline;
using po::model::TransformerConfig;

void expect_cover(const std::vector<po::model::UnitRange>& st, int64_t L, const std::string& what) {
  ASSERT_FALSE(st.empty()) << what;
  EXPECT_EQ(st.front().first, 0) << what;
  EXPECT_EQ(st.back().last, L + 1) << what;
  for (size_t s = 1; s < st.size(); ++s) EXPECT_EQ(st[s].first, st[s - 1].last + 1) << what << " stage " << s;
}

TEST(PipelineStages, BalancedByCostWithTheHeadWeighed) {
  const TransformerConfig c = TransformerConfig::preset("gpt2-124M");
  const double block = pl::unit_cost(c, 1024, 1), head = pl::unit_cost(c, 1024, 13);
  EXPECT_NEAR(head / block, 4.9, 0.1) << "GPT-2's head against a block";
  EXPECT_EQ(pl::unit_cost(c, 1024, 0), 0.0);
  const auto st = pl::partition_stages(c, 1024, 4);
  expect_cover(st, 12, "gpt2-124M pp 4");
  // Blocks per stage: the last stage, with the head, gets the fewest; at a
  // tie the earlier stage is lighter (it holds the most micro-batches in flight).
  std::vector<int> blocks;
  for (size_t s = 0; s < st.size(); ++s)
    blocks.push_back(st[s].last - st[s].first + 1 - (s == 0) - (s + 1 == st.size()));
  EXPECT_EQ(blocks, (std::vector<int>{3, 4, 4, 1})) << blocks[0] << "," << blocks[1] << ","
                                                    << blocks[2] << "," << blocks[3];
  // One stage: the whole model.
  const auto one = pl::partition_stages(c, 1024, 1);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].first, 0);
  EXPECT_EQ(one[0].last, 13);
  // A small vocabulary: blocks split evenly.
  TransformerConfig l = TransformerConfig::preset("llama-tiny");
  l.n_layer = 8;
  l.vocab_size = 64;
  const auto even = pl::partition_stages(l, 16, 4);
  for (const auto& r : even) EXPECT_LE(r.last - r.first + 1, 4);
  expect_cover(even, 8, "llama-tiny pp 4");
}

TEST(PipelineStages, StageLayersByHandAndItsErrors) {
  const TransformerConfig c = TransformerConfig::preset("gpt2-124M");
  const auto st = pl::partition_stages(c, 1024, 3, "6,5,1");
  ASSERT_EQ(st.size(), 3u);
  EXPECT_EQ(st[0].first, 0);
  EXPECT_EQ(st[0].last, 6);  // embedding + blocks 1..6
  EXPECT_EQ(st[1].first, 7);
  EXPECT_EQ(st[1].last, 11);
  EXPECT_EQ(st[2].first, 12);
  EXPECT_EQ(st[2].last, 13);  // block 12 + head
  for (const auto& [text, want] :
       std::vector<std::pair<std::string, std::string>>{{"6,5", "gives 2 stages of 11 blocks"},
                                                        {"6,x,1", "'x' is not a positive block count"},
                                                        {"6,0,6", "'0' is not a positive"}}) {
    try {
      (void)pl::partition_stages(c, 1024, 3, text);
      FAIL() << text << " was accepted";
    } catch (const po::core::InvalidArgument& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("parallel.stage_layers = \"" + text + "\""), std::string::npos) << msg;
      EXPECT_NE(msg.find(want), std::string::npos) << msg;
    }
  }
  EXPECT_THROW(pl::partition_stages(c, 1024, 13), po::core::InvalidArgument);
}

// With several stages per rank (zbv, interleaved) the split balances the
// ranks' totals. On bench-small (6 blocks, a head of about ten) interleaved
// puts stages 1 and 3 (the head's) on rank 1: the stage-balanced split gives
// stage 1 two blocks, the rank-balanced one a single block, and rank 1 is
// lighter. Under zbv the stage-balanced split is already the best one (the
// head's rank holds stage 0 with one block); it is kept. One stage per
// rank: the stage-balanced split itself.
double busiest(const TransformerConfig& c, const pl::Schedule& s,
               const std::vector<po::model::UnitRange>& st) {
  std::vector<double> rank(static_cast<size_t>(s.ranks), 0.0);
  const std::vector<pl::Costs> k = pl::stage_costs(c, 256, st);
  for (int i = 0; i < s.stages(); ++i)
    rank[static_cast<size_t>(s.rank_of(i))] += k[static_cast<size_t>(i)].forward + k[static_cast<size_t>(i)].backward();
  return *std::max_element(rank.begin(), rank.end());
}

TEST(PipelineStages, SeveralStagesPerRankBalanceTheRanks) {
  TransformerConfig c = TransformerConfig::preset("bench-small");
  const pl::Schedule il = pl::make_schedule(pl::ScheduleKind::kInterleaved, 2, 4, 2);
  const auto st = pl::partition_stages(c, 256, il), by_stage = pl::partition_stages(c, 256, 4);
  expect_cover(st, 6, "bench-small interleaved");
  ASSERT_EQ(st.size(), 4u);
  EXPECT_EQ(by_stage[1].last - by_stage[1].first + 1, 2) << "the stage-balanced split's stage 1";
  EXPECT_EQ(st[1].last - st[1].first + 1, 1) << "rank 1 holds the head's stage: its other stage is lighter";
  EXPECT_LT(busiest(c, il, st), busiest(c, il, by_stage));
  const pl::Schedule zbv = pl::make_schedule(pl::ScheduleKind::kZbV, 2, 4, 2);
  const auto z = pl::partition_stages(c, 256, zbv);
  EXPECT_EQ(z[0].last - z[0].first, 1) << "zbv: the embedding and one block";
  EXPECT_EQ(z[3].last - z[3].first, 1) << "zbv: one block and the head";
  EXPECT_LE(busiest(c, zbv, z), busiest(c, zbv, by_stage));
  c = TransformerConfig::preset("gpt2-124M");
  const pl::Schedule f = pl::make_schedule(pl::ScheduleKind::k1F1B, 4, 8, 1);
  const auto a = pl::partition_stages(c, 256, f), b = pl::partition_stages(c, 256, 4);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].last, b[i].last) << "1f1b stage " << i;
}

}  // namespace

// Vocabulary parallel on bench-small (6 blocks, GPT-2's vocabulary, T 256)
// at pp 2, the engine's schedules (ordered at the stages' FLOP costs)
// simulated at those costs (the way docs/benchmarks.md found to predict
// measured bubbles within 0.03): with the head on the last stage no schedule
// gets under 0.28; with its pieces on both ranks every bubble falls, zb-h1's
// to at most half of 1f1b's and zbv's to at most a quarter, each rank within
// its schedule's cap on micro-batches in flight.
TEST(PipelineStages, VocabularyParallelBalancesBenchSmall) {
  TransformerConfig c = TransformerConfig::preset("bench-small");
  c.seq_len = 256;
  for (int m : {4, 8, 16}) {
    std::map<std::string, double> got;
    for (auto kind : {pl::ScheduleKind::k1F1B, pl::ScheduleKind::kZbH1, pl::ScheduleKind::kZbV}) {
      const std::string what = std::string(pl::schedule_name(kind)) + " m " + std::to_string(m);
      const pl::Pipeline plain = pl::make_pipeline(c, 256, kind, 2, m, 2);
      const double before = pl::simulate(plain.schedule, pl::stage_costs(c, 256, plain.stages)).bubble();
      const pl::Pipeline vocab = pl::make_pipeline(c, 256, kind, 2, m, 2, true);
      const std::vector<pl::Costs> costs = pl::stage_costs(c, 256, vocab.stages, 2);
      const pl::Timing t = pl::simulate(vocab.schedule, costs);
      EXPECT_GE(before, 0.28) << what << ": the head on the last stage";
      EXPECT_LT(t.bubble(), before / 2) << what << ": vocabulary parallel " << t.bubble() << " vs " << before;
      // Ordered at the stages' costs: never slower there than at unit costs.
      const pl::Schedule unit = pl::make_schedule(kind, 2, m, 2, true);
      EXPECT_LE(t.step, pl::simulate(unit, costs).step) << what;
      for (int r = 0; r < 2; ++r)
        EXPECT_LE(t.peak_in_flight[static_cast<size_t>(r)], vocab.schedule.in_flight_cap(r)) << what << " rank " << r;
      got[pl::schedule_name(kind)] = t.bubble();
    }
    EXPECT_LE(got["zb-h1"], 0.5 * got["1f1b"]) << "m " << m << ": zb-h1 " << got["zb-h1"] << ", 1f1b " << got["1f1b"];
    EXPECT_LE(got["zbv"], 0.25 * got["1f1b"]) << "m " << m << ": zbv " << got["zbv"] << ", 1f1b " << got["1f1b"];
  }
}
