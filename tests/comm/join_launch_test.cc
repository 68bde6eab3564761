// The torchrun-style MPI join through real processes: the test starts this
// binary again N times, as DISABLED_JoinWorker.Rank, with RANK / WORLD_SIZE /
// LOCAL_RANK / MASTER_ADDR / MASTER_PORT set and no mpirun (OMPI_*, PMIX_* and
// SLURM_* removed from their environment). The workers join one world with
// mpi::join_world_from_env and check collectives on it; the parent checks
// their exit codes and output.
#include "comm/mpi/join.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "../test_util.h"
#include "comm/env.h"
#include "core/bf16.h"
#include "core/error.h"

extern char** environ;

namespace po::comm::mpi {
namespace {

using tensor::DType;

// ---- worker (one rank) -----------------------------------------------------

void check_collectives(MpiCommunicator& world, const LaunchEnv& env) {
  const int n = env.world_size, r = env.rank;
  ASSERT_EQ(world.rank(), r) << "the joined world must keep RANK";
  ASSERT_EQ(world.size(), n) << "the joined world must hold WORLD_SIZE ranks";

  std::vector<float> x(1000);
  for (size_t j = 0; j < x.size(); ++j) x[j] = static_cast<float>(r) + static_cast<float>(j);
  world.allreduce(x.data(), x.size(), DType::kF32, ReduceOp::kSum);
  for (size_t j = 0; j < x.size(); ++j) {
    const float want = static_cast<float>(n * static_cast<int>(j) + n * (n - 1) / 2);
    ASSERT_EQ(x[j], want) << "allreduce sum element " << j << " on rank " << r;
  }

  std::vector<uint16_t> h(7);
  for (auto& v : h) v = core::f32_to_bf16(static_cast<float>(2 * r)).bits;
  world.allreduce(h.data(), h.size(), DType::kBF16, ReduceOp::kAvg);
  EXPECT_EQ(core::bf16_to_f32(core::bf16{h[0]}), static_cast<float>(n - 1)) << "bf16 avg on rank " << r;

  const int32_t mine = 10 * r;
  std::vector<int32_t> all(static_cast<size_t>(n), -1);
  world.all_gather(&mine, all.data(), 1, DType::kI32);
  for (int k = 0; k < n; ++k) EXPECT_EQ(all[static_cast<size_t>(k)], 10 * k) << "all_gather block " << k;

  int32_t b = r == n - 1 ? 4242 : 0;
  world.broadcast(&b, 1, DType::kI32, n - 1);
  EXPECT_EQ(b, 4242) << "broadcast from the last rank, on rank " << r;

  auto half = world.split(r % 2, r);
  ASSERT_NE(half, nullptr);
  EXPECT_EQ(half->size(), (n + 1 - r % 2) / 2) << "split by parity on rank " << r;
  EXPECT_EQ(half->rank(), r / 2) << "split by parity on rank " << r;
  world.barrier();
}

TEST(DISABLED_JoinWorker, Rank) {
  const char* mode = std::getenv("PO_JOIN_WORKER");
  if (mode == nullptr) GTEST_SKIP() << "a worker of the JoinLaunch tests, not a test by itself";
  const LaunchEnv env = detect_launch_env();
  ASSERT_EQ(env.source, LaunchSource::kTorchrun) << "workers get torchrun-style variables only";
  const char* fp = std::getenv("PO_JOIN_FINGERPRINT");
  MpiOptions options;
  options.timeout = std::chrono::seconds(60);
  if (std::string(mode) == "expect-error" || std::string(mode) == "init-first") {
    if (std::string(mode) == "init-first") init();
    try {
      join_world_from_env(env, std::chrono::seconds(20), options, fp ? fp : "");
      ADD_FAILURE() << "the join succeeded";
    } catch (const core::Error& e) {
      std::printf("JOIN-ERROR rank=%d: %s\n", env.rank, e.what());
    }
    finalize();  // a no-op unless init-first
    return;
  }
  auto world = join_world_from_env(env, std::chrono::seconds(20), options, fp ? fp : "");
  check_collectives(*world, env);
  std::printf("JOIN-OK rank=%d size=%d\n", world->rank(), world->size());
  world.reset();
  finalize();
}

// ---- parent ----------------------------------------------------------------

bool launcher_variable(const std::string& kv) {
  for (const char* p : {"OMPI_", "PMIX_", "SLURM_", "RANK=", "WORLD_SIZE=", "LOCAL_RANK=", "MASTER_ADDR=",
                        "MASTER_PORT=", "PO_JOIN_"}) {
    if (kv.rfind(p, 0) == 0) return true;
  }
  return false;
}

struct Worker {
  pid_t pid = -1;
  std::string log;
  int exit_code = -1;
  std::string output;
};

// Starts `n` workers of this binary and waits (at most `limit`) for all of
// them; a worker still running then is killed and reported with exit code -1.
std::vector<Worker> run_workers(int n, const std::string& mode, const std::vector<std::string>& fingerprints,
                                const test::TempDir& dir, std::chrono::seconds limit,
                                const std::vector<std::string>& extra_env = {}) {
  const int port = test::free_tcp_port();
  std::vector<Worker> workers(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e)
      if (!launcher_variable(*e)) env.emplace_back(*e);
    env.push_back("RANK=" + std::to_string(r));
    env.push_back("WORLD_SIZE=" + std::to_string(n));
    env.push_back("LOCAL_RANK=" + std::to_string(r));
    env.push_back("MASTER_ADDR=127.0.0.1");
    env.push_back("MASTER_PORT=" + std::to_string(port));
    env.push_back("PO_JOIN_WORKER=" + mode);
    env.push_back("PO_JOIN_FINGERPRINT=" + fingerprints[static_cast<size_t>(r) % fingerprints.size()]);
    for (const auto& kv : extra_env) {
      const std::string key = kv.substr(0, kv.find('=') + 1);
      std::erase_if(env, [&](const std::string& e) { return e.rfind(key, 0) == 0; });
      env.push_back(kv);
    }
    std::vector<char*> envp;
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string a0 = "/proc/self/exe", a1 = "--gtest_filter=DISABLED_JoinWorker.Rank",
                a2 = "--gtest_also_run_disabled_tests";
    char* argv[] = {a0.data(), a1.data(), a2.data(), nullptr};
    Worker& w = workers[static_cast<size_t>(r)];
    w.log = dir / ("rank" + std::to_string(r) + ".log");
    w.pid = fork();
    if (w.pid == 0) {
      FILE* f = std::freopen(w.log.c_str(), "w", stdout);
      if (f != nullptr) dup2(fileno(stdout), 2);
      execve("/proc/self/exe", argv, envp.data());
      _exit(127);
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (auto& w : workers) {
    int status = 0;
    while (waitpid(w.pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        kill(w.pid, SIGKILL);
        waitpid(w.pid, &status, 0);
        status = -1;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    w.exit_code = status == -1 ? -1 : WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    w.output = test::read_file(w.log);
  }
  return workers;
}

std::string all_output(const std::vector<Worker>& ws) {
  std::string s;
  for (size_t r = 0; r < ws.size(); ++r)
    s += "---- rank " + std::to_string(r) + " (exit " + std::to_string(ws[r].exit_code) + ")\n" + ws[r].output;
  return s;
}

TEST(JoinLaunch, ThreeProcessesWithoutMpirunFormOneWorld) {
  test::TempDir dir;
  const auto ws = run_workers(3, "collectives", {"same config"}, dir, std::chrono::seconds(120));
  for (size_t r = 0; r < ws.size(); ++r) {
    EXPECT_EQ(ws[r].exit_code, 0) << "rank " << r << " failed\n" << all_output(ws);
    const std::string ok = "JOIN-OK rank=" + std::to_string(r) + " size=3";
    EXPECT_NE(ws[r].output.find(ok), std::string::npos) << "rank " << r << " did not print '" << ok << "'\n"
                                                         << all_output(ws);
  }
}

TEST(JoinLaunch, DifferentFingerprintsStopEveryRank) {
  test::TempDir dir;
  const auto ws = run_workers(2, "expect-error", {"config A", "config B"}, dir, std::chrono::seconds(60));
  const std::string want = "ranks disagree on the run fingerprint (config or binary hash): rank 0 has "
                           "'config A', rank 1 has 'config B'";
  for (size_t r = 0; r < ws.size(); ++r) {
    EXPECT_EQ(ws[r].exit_code, 0) << "rank " << r << "\n" << all_output(ws);
    EXPECT_NE(ws[r].output.find(want), std::string::npos) << "rank " << r << " lacks: " << want << "\n"
                                                           << all_output(ws);
  }
}

TEST(JoinLaunch, MpiInitializedBeforeTheJoinIsAnError) {
  test::TempDir dir;
  const auto ws = run_workers(2, "init-first", {"same"}, dir, std::chrono::seconds(60));
  const std::string want = "join_world_from_env: MPI is already initialized";
  for (size_t r = 0; r < ws.size(); ++r) {
    EXPECT_EQ(ws[r].exit_code, 0) << "rank " << r << "\n" << all_output(ws);
    EXPECT_NE(ws[r].output.find(want), std::string::npos) << "rank " << r << " lacks: " << want << "\n"
                                                           << all_output(ws);
  }
}

TEST(JoinLaunch, MissingOmpiServerIsNamedOnEveryRank) {
  test::TempDir dir;
  const auto ws = run_workers(2, "expect-error", {"same"}, dir, std::chrono::seconds(60),
                              {"PATH=" + dir.path().string()});
  const std::string want = "cannot start ompi-server (openmpi-bin), which OpenMPI needs to join processes "
                           "started without mpirun: No such file or directory";
  for (size_t r = 0; r < ws.size(); ++r) {
    EXPECT_EQ(ws[r].exit_code, 0) << "rank " << r << "\n" << all_output(ws);
    EXPECT_NE(ws[r].output.find(want), std::string::npos) << "rank " << r << " lacks: " << want << "\n"
                                                           << all_output(ws);
  }
  EXPECT_NE(ws[1].output.find("rank 0 could not start ompi-server: "), std::string::npos) << all_output(ws);
}

}  // namespace
}  // namespace po::comm::mpi
