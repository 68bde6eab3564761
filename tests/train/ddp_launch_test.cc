// Data parallel through real processes: `mpirun -np N pagedoptim train` with
// parallel.dp = N gives the loss curve of dp = 1 with the same global batch
// (fp32, relative 1e-5 over 20 steps), and its checkpoints resume at another dp.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../test_util.h"
#include "train/run_state.h"

namespace fs = std::filesystem;
using po::test::run_command;

namespace {

const std::string kBin = PO_BINARY;
const std::string kMpirun =
    "mpirun --allow-run-as-root --oversubscribe --bind-to none --mca mpi_yield_when_idle 1";

std::vector<double> losses(const std::string& run_dir) {
  std::vector<double> out;
  std::ifstream f(run_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.push_back(j["loss"]);
  }
  return out;
}

void expect_same_curve(const std::vector<double>& a, const std::vector<double>& b,
                       const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_LE(std::fabs(a[i] - b[i]), 1e-5 * std::fabs(a[i]))
        << what << ": step " << i + 1 << " loss " << a[i] << " vs " << b[i];
}

class Ddp : public ::testing::Test {
 protected:
  void SetUp() override {
    po::test::write_tokens(train_, 30000, 64);
    po::test::write_tokens(val_, 3000, 64, 2);
    std::string cfg = po::test::tiny_config(train_, val_, dir_ / "unused", 20);
    cfg += "\n";
    po::test::write_file(config_, cfg);
  }
  std::string train(const std::string& run, int dp, const std::string& extra = "") {
    const std::string cmd = (dp > 1 ? kMpirun + " -np " + std::to_string(dp) + " " : "") + kBin +
                            " train -c " + config_ + " --set run.dir=" + (dir_ / run) +
                            " --set parallel.dp=" + std::to_string(dp) +
                            " --set train.batch_size=8 --set train.micro_batch_size=2 " + extra;
    auto r = run_command(cmd);
    EXPECT_EQ(r.exit_code, 0) << cmd << "\n" << r.output;
    return dir_ / run;
  }
  po::test::TempDir dir_;
  std::string train_ = dir_ / "train.bin", val_ = dir_ / "val.bin", config_ = dir_ / "c.toml";
};

TEST_F(Ddp, TwoAndFourRanksMatchOneRank) {
  const auto one = losses(train("dp1", 1));
  ASSERT_EQ(one.size(), 20u);
  expect_same_curve(one, losses(train("dp2", 2)), "dp=2 vs dp=1");
  expect_same_curve(one, losses(train("dp4", 4)), "dp=4 vs dp=1");
}

TEST_F(Ddp, CheckpointFromTwoRanksResumesOnOne) {
  const auto one = losses(train("dp1", 1));
  const std::string two = train("dp2", 2);
  const std::string resumed = dir_ / "resumed";
  fs::create_directories(resumed + "/checkpoints");
  fs::copy_file(po::train::checkpoint_path(two, 9), po::train::checkpoint_path(resumed, 9));
  train("resumed", 1, "--resume");
  const auto tail = losses(resumed);
  ASSERT_EQ(tail.size(), 11u);
  expect_same_curve(std::vector<double>(one.begin() + 9, one.end()), tail,
                    "dp=2 checkpoint resumed at dp=1");
}

TEST_F(Ddp, DpWithoutLauncherIsAClearError) {
  auto r = run_command(kBin + " train -c " + config_ + " --set run.dir=" + (dir_ / "x") +
                       " --set parallel.dp=2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("mpirun -np 2"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "x"));
}

}  // namespace
