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
#include <regex>
#include <string>
#include <vector>

#include "../background_run.h"
#include "../test_util.h"
#include "train/run_state.h"

namespace fs = std::filesystem;
using po::test::expect_same_curve;
using po::test::losses;
using po::test::run_command;

namespace {

const std::string kBin = PO_BINARY;
using po::test::kMpirun;
using po::test::BackgroundRun;
using po::test::find_rank_pid;
using po::test::alive;

class Ddp : public po::test::TinyTraining {
 protected:
  std::string train(const std::string& run, int dp, const std::string& extra = "") {
    return train_ok(run, dp, "--set train.batch_size=8 --set train.micro_batch_size=2 " + extra);
  }
};

TEST_F(Ddp, TwoAndFourRanksMatchOneRank) {
  const auto one = losses(train("dp1", 1), 20);
  expect_same_curve(one, losses(train("dp2", 2), 20), "dp=2 vs dp=1");
  expect_same_curve(one, losses(train("dp4", 4), 20), "dp=4 vs dp=1");
  // Small buckets: every unit reduced on its own while the backward goes on.
  expect_same_curve(one, losses(train("dp2b", 2, "--set parallel.bucket_size=4KiB"), 20),
                    "dp=2 with 4 KiB buckets vs dp=1");
  // Every bucket after the backward, the embedding's lookup rows not deferred.
  expect_same_curve(one, losses(train("dp2n", 2, "--set parallel.overlap_comm=false"), 20),
                    "dp=2 without overlap vs dp=1");
}

TEST_F(Ddp, CheckpointFromTwoRanksResumesOnOne) {
  const auto one = losses(train("dp1", 1), 20);
  const std::string two = train("dp2", 2);
  const std::string resumed = dir_ / "resumed";
  fs::create_directories(resumed + "/checkpoints");
  fs::copy(po::train::checkpoint_path(two, 9), po::train::checkpoint_path(resumed, 9),
           fs::copy_options::recursive);
  train("resumed", 1, "--resume");
  const auto tail = losses(resumed, 11);
  expect_same_curve(std::vector<double>(one.begin() + 9, one.end()), tail,
                    "dp=2 checkpoint resumed at dp=1");
}

TEST_F(Ddp, WorldThatDoesNotDivideTheBatchIsAClearError) {
  auto r = run_command(kBin + " train -c " + config_ + " --set run.dir=" + (dir_ / "x") +
                       " --set train.batch_size=8 --set train.micro_batch_size=2 --nproc 3");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("train.batch_size = 8 must be a multiple of parallel.dp × "
                          "train.micro_batch_size = 3 × 2"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "x"));
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
  const auto one = losses(train("dp1", 1), 20);
  const std::string cmd = kBin + " train -c " + config_ + " --set run.dir=" + (dir_ / "n2") +
                          " --set train.batch_size=8 --set train.micro_batch_size=2 --nproc 2";
  auto r = run_command(cmd);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_curve(one, losses(dir_ / "n2", 20), "--nproc 2 vs dp=1");
  EXPECT_EQ(r.output.find("trained 20 steps"), r.output.rfind("trained 20 steps"))
      << "only rank 0 reports:\n" << r.output;
}

// Two processes started on their own with torchrun's variables (no mpirun):
// they meet at MASTER_ADDR:MASTER_PORT, form one MPI world and train as dp=2.
TEST_F(Ddp, TorchrunStyleLaunchMatchesOneRank) {
  const auto one = losses(train("dp1", 1), 20);
  const std::string port = std::to_string(po::test::free_tcp_port());
  std::string cmd;
  for (int r = 0; r < 2; ++r) {
    cmd += "env RANK=" + std::to_string(r) + " WORLD_SIZE=2 LOCAL_RANK=" + std::to_string(r) +
           " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port + " " + kBin + " train -c " + config_ +
           " --set run.dir=" + (dir_ / "tr") + " --set parallel.dp=2 --set train.batch_size=8" +
           " --set train.micro_batch_size=2 > " + (dir_ / ("tr" + std::to_string(r) + ".log")) +
           " 2>&1 & p" + std::to_string(r) + "=$!; ";
  }
  cmd += "wait $p0; e0=$?; wait $p1; e1=$?; exit $((e0 | e1))";
  auto r = run_command("timeout 120 sh -c '" + cmd + "'");
  ASSERT_EQ(r.exit_code, 0) << r.output << po::test::read_file(dir_ / "tr0.log")
                            << po::test::read_file(dir_ / "tr1.log");
  expect_same_curve(one, losses(dir_ / "tr", 20), "torchrun-style dp=2 vs dp=1");
}


TEST_F(Ddp, KilledWorkerStopsTheRunNamingItsRank) {
  BackgroundRun job(config_, dir_ / "victim", "");
  const int victim = job.rank_pid(1);
  ASSERT_GT(victim, 0) << "rank 1 never started:\n" << job.output();
  const auto t0 = std::chrono::steady_clock::now();
  kill(victim, SIGKILL);
  const double secs = job.finish(t0);
  const std::string out = job.output();
  EXPECT_LT(secs, 10.0) << "the run took " << secs << " s to stop after rank 1 was killed";
  EXPECT_FALSE(job.exited_zero()) << "launcher exited 0:\n" << out;
  EXPECT_NE(out.find("rank 1"), std::string::npos) << "output does not name rank 1:\n" << out;
  EXPECT_NE(out.find("signal 9"), std::string::npos) << "output does not name the signal:\n" << out;
}

// A rank that hangs (here: stopped with SIGSTOP, so it neither computes nor
// answers) ends the run after parallel.timeout with an error naming the
// collective, the group and the rank that did not arrive.
TEST_F(Ddp, HungRankEndsTheRunAfterTheTimeoutNamingIt) {
  BackgroundRun job(config_, dir_ / "hang", "--set parallel.timeout=2");
  const int victim = job.rank_pid(1);
  ASSERT_GT(victim, 0) << "rank 1 never started:\n" << job.output();
  const auto t0 = std::chrono::steady_clock::now();
  kill(victim, SIGSTOP);
  const double secs = job.finish(t0);
  kill(victim, SIGKILL);
  const std::string out = job.output();
  EXPECT_LT(secs, 15.0) << "the run took " << secs << " s to stop after rank 1 hung";
  EXPECT_FALSE(job.exited_zero()) << "launcher exited 0:\n" << out;
  // Whichever collective of the step rank 0 was in (the gradient all-reduce,
  // the loss sum, the memory ledger's all-gather ...) is named first.
  EXPECT_TRUE(std::regex_search(
      out, std::regex(R"(\[rank 0\] pagedoptim: error: (allreduce|all_gather|reduce_scatter)\()")))
      << out;
  EXPECT_NE(out.find("on group 'world'"), std::string::npos) << out;
  EXPECT_NE(out.find("did not complete within 2000 ms"), std::string::npos) << out;
  EXPECT_NE(out.find("that did not arrive at collective #"), std::string::npos) << out;
  EXPECT_NE(out.find(": rank 1 (no answer"), std::string::npos) << out;
}

// SIGTERM and SIGINT to the launcher reach every worker: they checkpoint the
// step they are in and are all gone within seconds; the launcher exits 75
// ("resume me": train/stop.h).
TEST_F(Ddp, SignalsToTheLauncherStopEveryWorker) {
  for (int sig : {SIGTERM, SIGINT}) {
    BackgroundRun job(config_, dir_ / ("sig" + std::to_string(sig)), "");
    const int r0 = job.rank_pid(0), r1 = job.rank_pid(1);
    ASSERT_GT(r0, 0) << job.output();
    ASSERT_GT(r1, 0) << job.output();
    const int launcher = job.launcher_pid();
    ASSERT_GT(launcher, 0) << "no launcher process found";
    const auto t0 = std::chrono::steady_clock::now();
    kill(launcher, sig);
    const double secs = job.finish(t0);
    EXPECT_LT(secs, 10.0) << "signal " << sig << ": launcher took " << secs << " s to exit";
    EXPECT_EQ(job.exit_code(), 75) << "signal " << sig << ":\n" << job.output();
    EXPECT_FALSE(po::train::list_checkpoints(dir_ / ("sig" + std::to_string(sig)) + "/checkpoints").empty())
        << "signal " << sig << ": no checkpoint written on the way out";
    usleep(200000);
    EXPECT_FALSE(alive(r0)) << "signal " << sig << ": rank 0 (pid " << r0 << ") still runs";
    EXPECT_FALSE(alive(r1)) << "signal " << sig << ": rank 1 (pid " << r1 << ") still runs";
  }
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
