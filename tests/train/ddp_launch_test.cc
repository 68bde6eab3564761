// Data parallel through real processes: `mpirun -np N pagedoptim train` with
// parallel.dp = N gives the loss curve of dp = 1 with the same global batch
// (fp32, relative 1e-5 over 20 steps), and its checkpoints resume at another dp.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../test_util.h"
#include "train/run_state.h"

namespace fs = std::filesystem;
using po::test::expect_same_curve;
using po::test::losses;
using po::test::run_command;

namespace {

const std::string kBin = PO_BINARY;
const std::string kMpirun =
    "mpirun --allow-run-as-root --oversubscribe --bind-to none --mca mpi_yield_when_idle 1";

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
  // Small buckets: every unit reduced on its own while the backward goes on.
  expect_same_curve(one, losses(train("dp2b", 2, "--set parallel.bucket_size=4KiB")),
                    "dp=2 with 4 KiB buckets vs dp=1");
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

namespace {

TEST_F(Ddp, NprocLaunchesWorkersThatMatchOneRank) {
  const auto one = losses(train("dp1", 1));
  const std::string cmd = kBin + " train -c " + config_ + " --set run.dir=" + (dir_ / "n2") +
                          " --set train.batch_size=8 --set train.micro_batch_size=2 --nproc 2";
  auto r = run_command(cmd);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_curve(one, losses(dir_ / "n2"), "--nproc 2 vs dp=1");
  EXPECT_EQ(r.output.find("trained 20 steps"), r.output.rfind("trained 20 steps"))
      << "only rank 0 reports:\n" << r.output;
}

// PID of the worker process whose environment says it is OpenMPI rank `rank`
// and whose command line contains `marker`; -1 when there is none (yet).
int find_rank_pid(int rank, const std::string& marker) {
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string pid = e.path().filename().string();
    if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string cmdline = po::test::read_file(e.path().string() + "/cmdline");
    if (cmdline.find(marker) == std::string::npos || cmdline.rfind("mpirun", 0) == 0) continue;
    const std::string env = po::test::read_file(e.path().string() + "/environ");
    if (env.find("OMPI_COMM_WORLD_RANK=" + std::to_string(rank) + '\0') != std::string::npos)
      return std::stoi(pid);
  }
  return -1;
}

TEST_F(Ddp, KilledWorkerStopsTheRunNamingItsRank) {
  const std::string run = dir_ / "victim";
  const std::string log = dir_ / "launcher.log";
  const std::string cmd = kBin + " train -c " + config_ + " --set run.dir=" + run +
                          " --set train.steps=1000000 --set train.checkpoint_interval=0" +
                          " --set train.eval_interval=0 --nproc 2 > " + log + " 2>&1";
  FILE* launcher = popen(("sh -c '" + cmd + "; echo exit=$?'").c_str(), "r");
  ASSERT_NE(launcher, nullptr);
  int victim = -1;
  for (int i = 0; i < 300 && victim < 0; ++i) {  // up to 30 s to start
    if (fs::exists(run + "/metrics.jsonl")) victim = find_rank_pid(1, run);
    if (victim < 0) usleep(100000);
  }
  ASSERT_GT(victim, 0) << "rank 1 never started:\n" << po::test::read_file(log);
  const auto t0 = std::chrono::steady_clock::now();
  kill(victim, SIGKILL);
  std::string tail;
  char buf[256];
  while (fgets(buf, sizeof buf, launcher) != nullptr) tail += buf;
  pclose(launcher);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string out = po::test::read_file(log);
  EXPECT_LT(secs, 10.0) << "the run took " << secs << " s to stop after rank 1 was killed";
  EXPECT_EQ(tail.find("exit=0"), std::string::npos) << "launcher exited 0:\n" << out;
  EXPECT_NE(out.find("rank 1"), std::string::npos) << "output does not name rank 1:\n" << out;
  EXPECT_NE(out.find("signal 9"), std::string::npos) << "output does not name the signal:\n" << out;
}

}  // namespace

namespace {

TEST_F(Ddp, RanksWithDifferentConfigsOrBinariesStopBeforeTraining) {
  const std::string base = " train -c " + config_ + " --set run.dir=" + (dir_ / "mm") +
                           " --set parallel.dp=2";
  auto r = run_command(kMpirun + " -np 1 " + kBin + base + " --set train.lr=1e-3 : -np 1 " +
                       kBin + base + " --set train.lr=2e-3");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("rank(s) 1 resolved a different config"), std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "mm/metrics.jsonl")) << "training started anyway";
  // The same program with one byte appended: a different build as far as the check goes.
  const std::string other = dir_ / "pagedoptim-other";
  fs::copy_file(kBin, other);
  { std::ofstream(other, std::ios::app | std::ios::binary) << '\n'; }
  fs::permissions(other, fs::perms::owner_all);
  r = run_command(kMpirun + " -np 1 " + kBin + base + " : -np 1 " + other + base);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("rank(s) 1 run a different pagedoptim binary"), std::string::npos)
      << r.output;
}

}  // namespace
