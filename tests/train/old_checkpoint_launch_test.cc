// Checkpoints written by older builds load and resume: one written before
// the one training path (issue 35: pp = 1 and pp > 1 through one loop), and
// one in manifest version 1 (before the optimizer state schema, issue 36)
// written by two ranks at ZeRO-1, resumed resharded at dp 1 and as written.
//
// The first: tests/golden/checkpoint_d40e0b2
// holds step 3 of a pp = 1 fp32 run made by `pagedoptim` at d40e0b2 (its
// data, made by make_tokens.py, its config with the paths left out, and the
// losses of that run's six steps). Resumed here at pp = 1 and at pp = 2, the
// two continue bit for bit alike (at equal threads per rank: one), and their
// losses are the old run's (to 1e-5: another machine's GEMM may round
// differently; on the machine that wrote them they were the same bits, as
// the closing note of issue 35 records).
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "../test_util.h"
#include "checkpoint/sharded.h"
#include "train/run_state.h"

namespace {

namespace fs = std::filesystem;

const fs::path kFixture = fs::path(PO_SOURCE_DIR) / "tests/golden/checkpoint_d40e0b2";
// Step 4 of a 6-step run at dp 2, ZeRO-1, written by `pagedoptim` at 58a7809
// (manifest version 1): its data, its config with the paths left out, and
// the losses of that run's six steps (expected.json, made by the same build).
const fs::path kFixtureV1 = fs::path(PO_SOURCE_DIR) / "tests/golden/checkpoint_v1_dp2";

class OldCheckpoint : public ::testing::Test {
 protected:
  // A run directory holding a fixture's step-`step` checkpoint, and the
  // config to resume it with.
  std::string prepare(const std::string& name, const fs::path& fixture = kFixture, int step = 3) {
    const fs::path run = dir_ / name;
    fs::create_directories(run / "checkpoints");
    char step_dir[32];
    std::snprintf(step_dir, sizeof step_dir, "step_%08d", step);
    fs::copy(fixture / step_dir, po::train::checkpoint_path(run.string(), step),
             fs::copy_options::recursive);
    std::string config = po::test::read_file((fixture / "config.toml").string());
    for (const auto& [key, value] : {std::pair<std::string, std::string>{"@DATA@", fixture.string()},
                                     {"@RUN@", run.string()}})
      for (size_t at; (at = config.find(key)) != std::string::npos;) config.replace(at, key.size(), value);
    po::test::write_file((dir_ / (name + ".toml")), config);
    return run.string();
  }
  po::test::CommandResult resume(const std::string& name, int nproc, const std::string& extra) {
    return po::test::run_command(po::test::pagedoptim_command(
        nproc, "train -c " + (dir_ / (name + ".toml")) + " --resume " + extra));
  }
  po::test::TempDir dir_;
};

TEST_F(OldCheckpoint, ResumesAtPp1AndPp2WithTheOldRunsLosses) {
  const nlohmann::json want = nlohmann::json::parse(po::test::read_file((kFixture / "expected.json").string()));
  ASSERT_EQ(want["losses"].size(), 6u);
  const std::string one = prepare("pp1"), two = prepare("pp2");
  auto r = resume("pp1", 1, "");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = resume("pp2", 2, "--set parallel.pp=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto a = po::test::losses(one, 3), b = po::test::losses(two, 3);
  for (size_t i = 0; i < 3; ++i) {
    const double old = want["losses"][3 + i].get<double>();
    EXPECT_NEAR(a[i], old, 1e-5 * old) << "step " << i + 4 << ": resumed at pp 1 vs the old run";
    EXPECT_EQ(a[i], b[i]) << "step " << i + 4 << ": resumed at pp 2 vs at pp 1";
  }
  // The step-6 checkpoints hold the same state (each stage wrote its own
  // units at pp 2).
  po::test::expect_same_checkpoint(one, two, 6, "the pp 2 resume vs the pp 1 resume");
  // And the comparison sees a difference: step 3's state filed as step 6.
  const fs::path fake = dir_ / "fake";
  fs::create_directories(fake / "checkpoints");
  fs::copy(kFixture / "step_00000003", po::train::checkpoint_path(fake.string(), 6),
           fs::copy_options::recursive);
  testing::TestPartResultArray failures;
  {
    testing::ScopedFakeTestPartResultReporter reporter(
        testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &failures);
    po::test::expect_same_checkpoint(one, fake.string(), 6, "step 3 as step 6");
  }
  std::string said;
  for (int i = 0; i < failures.size(); ++i) said += failures.GetTestPartResult(i).message();
  EXPECT_NE(said.find("params of unit 0 differs from the reference run's at element"), std::string::npos)
      << "expect_same_checkpoint missed a different state:\n" << said;
}

// Resumed as written (dp 2, ZeRO-1), resharded at dp 2 ZeRO-0 (each rank
// reads both files whole: the same bits) and at dp 1 (one rank: dp changes
// the gradient's summation order, so within 1e-5 as ddp_launch_test holds).
TEST_F(OldCheckpoint, VersionOneManifestOfTwoRanksResumesAsWrittenAndResharded) {
  const nlohmann::json want = nlohmann::json::parse(po::test::read_file((kFixtureV1 / "expected.json").string()));
  ASSERT_EQ(want["losses"].size(), 6u);
  const po::checkpoint::Manifest old = po::checkpoint::read_manifest((kFixtureV1 / "step_00000004").string());
  ASSERT_EQ(old.version, 1) << "the fixture must be a version-1 checkpoint";
  ASSERT_EQ(old.writers, 2);
  const std::string as_written = prepare("z1", kFixtureV1, 4), whole = prepare("z0", kFixtureV1, 4),
                    one = prepare("dp1", kFixtureV1, 4);
  auto r = resume("z1", 2, "");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = resume("z0", 2, "--set parallel.zero_stage=0");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = resume("dp1", 1, "--set parallel.dp=1 --set parallel.zero_stage=0");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto a = po::test::losses(as_written, 2), b = po::test::losses(whole, 2), c = po::test::losses(one, 2);
  for (size_t i = 0; i < 2; ++i) {
    const double was = want["losses"][4 + i].get<double>();
    EXPECT_NEAR(a[i], was, 1e-5 * was) << "step " << i + 5 << ": resumed as written vs the old run";
    EXPECT_EQ(b[i], a[i]) << "step " << i + 5 << ": resumed at ZeRO-0 (every rank reads both files) vs as written";
    EXPECT_NEAR(c[i], a[i], 1e-5 * a[i]) << "step " << i + 5 << ": resumed at dp 1 vs at dp 2";
  }
  po::test::expect_same_checkpoint(as_written, whole, 6, "the ZeRO-0 resume vs the ZeRO-1 resume");
  EXPECT_EQ(po::checkpoint::read_manifest(po::train::checkpoint_path(as_written, 6)).version, 2)
      << "a resumed run writes the current manifest";
}

}  // namespace
