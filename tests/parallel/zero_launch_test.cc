// ZeRO stages 1, 2 and 3 give the loss curve of stage 0 (fp32, relative 1e-5
// over 20 steps) and its trained weights (relative 1e-4 per unit) at dp = 1,
// 2 and 4, through real processes under mpirun; and
// the gradient norm they report (clipping across shards) is the unsharded one.
// Stage 3 also at every prefetch depth, with activation checkpointing and with
// evaluations (val_loss of stage 0), holding a quarter of the parameters per
// rank at dp = 4, and its checkpoints resume at other layouts.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "../test_util.h"
#include "parallel/tied_pair.h"
#include "train/run_state.h"

namespace fs = std::filesystem;

namespace {

using po::test::expect_same_curve;
using po::test::losses;
using po::test::metric;
using po::test::run_command;

// The trained weights of a run against stage 0 dp 1's, per unit, relative to
// the unit's largest weight (its step-20 checkpoint): dp changes the
// reduction order and Adam turns a gradient's last-digit difference into an
// update's (measured 2026-12-05 over these tests: at most 5.4e-6).
constexpr double kWeightTolerance = 1e-4;

// n_embd 34: blocks of 14314 elements, which 2 ranks split evenly (gathered
// in place) and 4 do not (padded shards).
class Zero : public po::test::TinyTraining {
 protected:
  std::string train(const std::string& run, int dp, int stage, const std::string& extra = "") {
    return train_ok(run, dp,
                    "--set parallel.zero_stage=" + std::to_string(stage) +
                        " --set model.n_embd=34 --set train.grad_clip=0.5" +
                        " --set train.checkpoint_interval=20 --set train.eval_interval=0" +
                        " --set train.batch_size=8 --set train.micro_batch_size=2 " + extra);
  }
};

TEST_F(Zero, StagesOneAndTwoMatchStageZero) {
  const std::string ref = train("s0dp1", 1, 0);
  const auto base = losses(ref, 20);
  const auto base_norm = metric(ref, "grad_norm", 20);
  for (int stage : {1, 2}) {
    for (int dp : {1, 2, 4}) {
      const std::string what = "stage " + std::to_string(stage) + " dp " + std::to_string(dp);
      const std::string run = train("s" + std::to_string(stage) + "dp" + std::to_string(dp), dp,
                                    stage);
      expect_same_curve(base, losses(run, 20), what + " vs stage 0 dp 1");
      po::test::expect_close_weights(ref, run, 20, kWeightTolerance, what + " vs stage 0 dp 1");
      const auto norm = metric(run, "grad_norm", 20);
      ASSERT_EQ(norm.size(), base_norm.size()) << what;
      for (size_t i = 0; i < norm.size(); ++i)
        EXPECT_NEAR(norm[i], base_norm[i], 1e-5 * base_norm[i])
            << what << ": grad_norm at step " << i + 1 << " (clipping across shards)";
      if (stage == 2) {  // the full gradient is never held: only the shard (padded to 4 ranks)
        const auto rows = po::test::last_metric(run, "memory_per_rank");
        ASSERT_EQ(rows.size(), static_cast<size_t>(dp)) << what;
        for (size_t r = 0; r < rows.size(); ++r)
          EXPECT_LE(rows[r]["grads"].get<double>(), 1.01 * rows[r]["params"].get<double>() / dp)
              << what << " rank " << r << ": gradient bytes vs the whole parameters'";
      }
    }
  }
}

TEST_F(Zero, StagesTwoAndThreeWithoutOverlapAndWithAccumulation) {
  const auto base = losses(train("ref", 1, 0, "--set train.micro_batch_size=1"), 20);
  const std::string micro1_no_overlap =
      "--set train.micro_batch_size=1 --set parallel.overlap_comm=false";
  for (int stage : {2, 3})
    expect_same_curve(base,
                      losses(train("s" + std::to_string(stage) + "n", 2, stage, micro1_no_overlap), 20),
                      "stage " + std::to_string(stage) + " dp 2, 4 micro-batches, no overlap");
}

TEST_F(Zero, StageThreeMatchesStageZero) {
  const std::string eval = "--set train.eval_interval=2";
  const std::string ref = train("s0", 1, 0, eval);
  const auto base = losses(ref, 20), base_norm = metric(ref, "grad_norm", 20),
             base_val = metric(ref, "val_loss", 10);
  struct Case {
    int dp, prefetch;
    bool checkpointing;
  };
  for (const Case& c : {Case{1, 1, false}, Case{2, 1, false}, Case{4, 1, false}, Case{2, 0, false},
                        Case{4, 2, false}, Case{2, 2, true}}) {
    const std::string what = "stage 3 dp " + std::to_string(c.dp) + " prefetch " +
                             std::to_string(c.prefetch) + (c.checkpointing ? " recompute" : "");
    const std::string run = train(
        "s3dp" + std::to_string(c.dp) + "p" + std::to_string(c.prefetch) +
            (c.checkpointing ? "c" : ""),
        c.dp, 3,
        eval + " --set parallel.prefetch=" + std::to_string(c.prefetch) +
            " --set model.activation_checkpointing=" + (c.checkpointing ? "true" : "false"));
    expect_same_curve(base, losses(run, 20), what + " vs stage 0 dp 1");
    po::test::expect_close_weights(ref, run, 20, kWeightTolerance, what + " vs stage 0 dp 1");
    const auto norm = metric(run, "grad_norm", 20);
    ASSERT_EQ(norm.size(), base_norm.size()) << what;
    for (size_t i = 0; i < norm.size(); ++i)
      EXPECT_NEAR(norm[i], base_norm[i], 1e-5 * base_norm[i])
          << what << ": grad_norm at step " << i + 1;
    const auto val = metric(run, "val_loss", 10);
    ASSERT_EQ(val.size(), base_val.size()) << what;
    for (size_t i = 0; i < val.size(); ++i)
      EXPECT_NEAR(val[i], base_val[i], 1e-5 * base_val[i])
          << what << ": val_loss at step " << 2 * (i + 1);
  }
  // What each rank holds, at 6 blocks (so that a few units are visibly less
  // than the model); every unit divides by 4 ranks here, no padding:
  // a quarter of the parameters, a gather pool of prefetch + 2 units (the
  // head holds units 0 and L+1), a quarter of the gradients, and (buckets)
  // the accumulators in flight (unit 0 through the backward, the final
  // LayerNorm's, at most 1 + kMaxReductionsInFlight blocks; each with its
  // reduce-scatter's receive block), and the tied table's lookup rows of a
  // step (a rank's micro 2 × T 16 rows, the data group's at the step).
  const std::string mem =
      train("s3mem", 4, 3, "--set model.n_layer=6 --set model.n_embd=36 --set train.steps=2");
  const double C = 36, unit0 = (64 + 16) * C, block = 12 * C * C + 13 * C, lnf = 2 * C;
  const double model = 4 * (unit0 + 6 * block + lnf);  // bytes
  const auto tied_rows = static_cast<double>(po::parallel::LookupRows::predicted_bytes(2 * 16, 36, 4));
  const auto rows = po::test::last_metric(mem, "memory_per_rank");
  ASSERT_EQ(rows.size(), 4u);
  for (size_t r = 0; r < rows.size(); ++r) {
    const double p = rows[r]["params"], g = rows[r]["grads"], gathered = rows[r]["gathered"],
                 acc = rows[r]["buckets"];
    EXPECT_EQ(p, model / 4) << "rank " << r << ": parameters held";
    EXPECT_GT(gathered, 0) << "rank " << r;
    EXPECT_LE(gathered, 4 * (unit0 + 2 * block + lnf)) << "rank " << r << ": gather pool bytes";
    EXPECT_EQ(g, model / 4) << "rank " << r << ": gradient shard";
    EXPECT_GT(acc, 0) << "rank " << r;
    EXPECT_LE(acc - tied_rows, 1.25 * 4 * (unit0 + lnf + 3 * block)) << "rank " << r << ": accumulators";
  }
  const double predicted = po::test::last_metric(mem, "predicted_bytes").get<double>();
  EXPECT_EQ(predicted, 4 * model / 4 + rows[0]["activations"].get<double>())
      << "predicted_bytes: 16 bytes per parameter over 4 ranks + activations";
}

}  // namespace

namespace {

// A checkpoint written at (dp 4, stage 3) — parameter, m and v shards
// (param_shard, adam_m_shard, adam_v_shard) — resumes at (dp 2, stage 1),
// (dp 1, stage 0), (dp 2, stage 3) and (dp 4, stage 2): the continued curve is
// the uninterrupted one.
TEST_F(Zero, CheckpointsReshardBetweenLayouts) {
  const auto base = losses(train("ref", 1, 0), 20);
  const std::string src = train("src", 4, 3, "--set train.checkpoint_interval=3");
  expect_same_curve(base, losses(src, 20), "dp 4 stage 3 source run");
  for (auto [dp, stage] :
       {std::pair{2, 1}, std::pair{1, 0}, std::pair{2, 3}, std::pair{4, 2}}) {
    const std::string name = "to_dp" + std::to_string(dp) + "_s" + std::to_string(stage);
    const std::string run = copy_checkpoint(src, 9, name);
    train(name, dp, stage, "--resume");
    const auto tail = losses(run, 11);
    expect_same_curve(std::vector<double>(base.begin() + 9, base.end()), tail,
                      "dp 4 stage 3 checkpoint resumed at dp " + std::to_string(dp) + " stage " +
                          std::to_string(stage));
  }
}

}  // namespace
