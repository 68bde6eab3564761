// Launcher environment detection: each flavour, the priority between them, and
// clear errors for incomplete or inconsistent values. Uses the real process
// environment (setenv/unsetenv), restored after each test.
#include "comm/env.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <optional>
#include <string>

#include "core/error.h"

namespace po::comm {
namespace {

const char* const kAllVars[] = {
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"};

// Clears every launcher variable for the test and restores them afterwards, so
// the test also passes when itself run under mpirun or srun.
class EnvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : kAllVars) {
      if (const char* old = std::getenv(v)) saved_[v] = old;
      unsetenv(v);
    }
  }
  void TearDown() override {
    for (const char* v : kAllVars) unsetenv(v);
    for (const auto& [k, v] : saved_) setenv(k.c_str(), v.c_str(), 1);
  }
  static void set(const char* name, const char* value) { setenv(name, value, 1); }

 private:
  std::map<std::string, std::string> saved_;
};

TEST_F(EnvTest, NoLauncherIsSingleProcess) {
  const LaunchEnv e = detect_launch_env();
  EXPECT_EQ(e.source, LaunchSource::kNone);
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.local_rank, 0);
}

TEST_F(EnvTest, OpenMpi) {
  set("OMPI_COMM_WORLD_RANK", "5");
  set("OMPI_COMM_WORLD_SIZE", "8");
  set("OMPI_COMM_WORLD_LOCAL_RANK", "1");
  const LaunchEnv e = detect_launch_env();
  EXPECT_EQ(e.source, LaunchSource::kOpenMpi);
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
}

TEST_F(EnvTest, Slurm) {
  set("SLURM_PROCID", "3");
  set("SLURM_NTASKS", "4");
  set("SLURM_LOCALID", "3");
  const LaunchEnv e = detect_launch_env();
  EXPECT_EQ(e.source, LaunchSource::kSlurm);
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 3);
}

TEST_F(EnvTest, TorchrunWithRendezvous) {
  set("RANK", "1");
  set("WORLD_SIZE", "2");
  set("LOCAL_RANK", "0");
  set("MASTER_ADDR", "10.0.0.7");
  set("MASTER_PORT", "29500");
  const LaunchEnv e = detect_launch_env();
  EXPECT_EQ(e.source, LaunchSource::kTorchrun);
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world_size, 2);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.master_addr, "10.0.0.7");
  EXPECT_EQ(e.master_port, 29500);
}

TEST_F(EnvTest, MissingLocalRankDefaultsToRank) {
  set("RANK", "2");
  set("WORLD_SIZE", "3");
  EXPECT_EQ(detect_launch_env().local_rank, 2);
}

// mpirun inside a Slurm batch job inherits SLURM_PROCID=0 for every process:
// the per-process OpenMPI variables must win.
TEST_F(EnvTest, OpenMpiWinsOverInheritedSlurm) {
  set("SLURM_PROCID", "0");
  set("SLURM_NTASKS", "4");
  set("OMPI_COMM_WORLD_RANK", "2");
  set("OMPI_COMM_WORLD_SIZE", "4");
  const LaunchEnv e = detect_launch_env();
  EXPECT_EQ(e.source, LaunchSource::kOpenMpi);
  EXPECT_EQ(e.rank, 2);
}

TEST_F(EnvTest, TorchrunWinsOverInheritedSlurm) {
  set("SLURM_PROCID", "0");
  set("SLURM_NTASKS", "1");
  set("RANK", "1");
  set("WORLD_SIZE", "2");
  EXPECT_EQ(detect_launch_env().source, LaunchSource::kTorchrun);
}

TEST_F(EnvTest, OpenMpiWinsOverTorchrun) {
  set("RANK", "0");
  set("WORLD_SIZE", "2");
  set("OMPI_COMM_WORLD_RANK", "1");
  set("OMPI_COMM_WORLD_SIZE", "2");
  const LaunchEnv e = detect_launch_env();
  EXPECT_EQ(e.source, LaunchSource::kOpenMpi);
  EXPECT_EQ(e.rank, 1);
}

void expect_error(const std::string& needle) {
  try {
    detect_launch_env();
    ADD_FAILURE() << "expected InvalidArgument mentioning '" << needle << "'";
  } catch (const core::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST_F(EnvTest, RankOutOfRange) {
  set("SLURM_PROCID", "4");
  set("SLURM_NTASKS", "4");
  expect_error("SLURM_PROCID=4 is not in [0, SLURM_NTASKS=4)");
}

TEST_F(EnvTest, RankWithoutWorldSize) {
  set("RANK", "0");
  expect_error("WORLD_SIZE is not");
}

TEST_F(EnvTest, NotAnInteger) {
  set("OMPI_COMM_WORLD_RANK", "one");
  set("OMPI_COMM_WORLD_SIZE", "2");
  expect_error("OMPI_COMM_WORLD_RANK='one' is not an integer");
}

TEST_F(EnvTest, ZeroWorldSize) {
  set("RANK", "0");
  set("WORLD_SIZE", "0");
  expect_error("WORLD_SIZE=0 must be at least 1");
}

TEST_F(EnvTest, LocalRankOutOfRange) {
  set("OMPI_COMM_WORLD_RANK", "0");
  set("OMPI_COMM_WORLD_SIZE", "2");
  set("OMPI_COMM_WORLD_LOCAL_RANK", "-1");
  expect_error("OMPI_COMM_WORLD_LOCAL_RANK=-1 is not in [0, OMPI_COMM_WORLD_SIZE=2)");
}

TEST_F(EnvTest, BadMasterPort) {
  set("RANK", "0");
  set("WORLD_SIZE", "1");
  set("MASTER_PORT", "70000");
  expect_error("MASTER_PORT=70000");
}

TEST(EnvLookupTest, InjectedLookup) {
  const std::map<std::string, std::string> vars = {{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}};
  const LaunchEnv e = detect_launch_env([&](const std::string& k) -> std::optional<std::string> {
    auto it = vars.find(k);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
  EXPECT_EQ(e.source, LaunchSource::kSlurm);
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_STREQ(launch_source_name(e.source), "slurm");
}

}  // namespace
}  // namespace po::comm
