// The supervisor of `--nproc` and `--max-restarts` (cli/supervise.h), with
// shell commands standing in for mpirun: a launcher that hangs with a dead
// worker it never reaps is killed and restarted, and a worker left running
// by its launcher is ended (SIGTERM, a grace to clean up, then SIGKILL)
// before the supervisor goes on.
#include "cli/supervise.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <fstream>

#include "../background_run.h"
#include "../test_util.h"

namespace {

namespace fs = std::filesystem;
using po::test::read_file;

class Supervise : public ::testing::Test {
 protected:
  void SetUp() override { fs::create_directories(dir_); }
  void TearDown() override { fs::remove_all(dir_); }
  std::vector<std::string> events() const {
    std::vector<std::string> out;
    std::ifstream f(dir_ / "events.jsonl");
    for (std::string line; std::getline(f, line);) out.push_back(line);
    return out;
  }
  const fs::path dir_ = fs::temp_directory_path() / ("po_supervise_" + std::to_string(getpid()));
};

TEST_F(Supervise, ALauncherThatNeverReapsADeadWorkerIsKilledAndRestarted) {
  // The worker (a subshell) dies once the shell that started it has become
  // `sleep 600`, which never reaps it: mpirun's hang, as OpenMPI shows it.
  // (A worker that died before the exec could be reaped by the shell first,
  // and then nothing hangs: `sleep 0 &` here timed out once in a loaded CI,
  // 2026-12-06. $$ in the subshell is the launcher's pid.)
  const std::string pid_file = dir_ / "launcher.pid";
  po::cli::Supervision s;
  s.command = {"sh", "-c",
               "(while [ \"$(cat /proc/$$/comm)\" != sleep ]; do sleep 0.05; done) & echo $$ > " + pid_file +
                   "; exec sleep 600"};
  s.resume_command = {"true"};
  s.max_restarts = 1;
  s.run_dir = dir_;
  s.reap_timeout_s = 1;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(po::cli::supervise(s), 0) << "the restart (`true`) should end the run with 0";
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 30) << "the hung launcher was not killed within the reap timeout";
  const std::string pid = read_file(pid_file);
  ASSERT_FALSE(pid.empty());
  EXPECT_FALSE(po::test::alive(std::stoi(pid))) << "the hung launcher " << pid << " still runs";
  const auto ev = events();
  ASSERT_EQ(ev.size(), 1u) << "one restart expected in events.jsonl";
  EXPECT_NE(ev[0].find("hung: worker process"), std::string::npos) << ev[0];
  EXPECT_NE(ev[0].find("never reaped"), std::string::npos) << ev[0];
}

TEST_F(Supervise, AWorkerLeftRunningByItsLauncherIsKilled) {
  // The launcher exits 3 and leaves its worker behind (mpirun killed first):
  // the worker comes back to the supervisor, which kills it.
  const std::string pid_file = dir_ / "worker.pid";
  po::cli::Supervision s;
  s.command = {"sh", "-c", "sleep 600 & echo $! > " + pid_file + "; exit 3"};
  s.resume_command = s.command;
  s.run_dir = dir_;
  EXPECT_EQ(po::cli::supervise(s), 3) << "the launcher's exit code should be the supervisor's";
  const std::string pid = read_file(pid_file);
  ASSERT_FALSE(pid.empty());
  EXPECT_FALSE(po::test::alive(std::stoi(pid))) << "the stray worker " << pid << " still runs";
  EXPECT_FALSE(fs::exists(dir_ / "events.jsonl")) << "no restarts were allowed";
}

TEST_F(Supervise, AStrayWorkerCleansUpOnSigtermBeforeTheSupervisorReturns) {
  // The launcher exits first; its worker removes its file on SIGTERM, slowly
  // (as a rank unlinks its swap files): the supervisor returns only after it.
  const std::string pid_file = dir_ / "worker.pid", swap = dir_ / "swap.file";
  po::cli::Supervision s;
  s.command = {"sh", "-c",
               "sh -c 'trap \"sleep 1; rm -f " + swap + "; exit 0\" TERM; touch " + swap +
                   "; while :; do sleep 0.1; done' & echo $! > " + pid_file +
                   "; while [ ! -e " + swap + " ]; do sleep 0.05; done; exit 75"};
  s.resume_command = s.command;
  s.run_dir = dir_;
  s.stray_grace_s = 20;
  EXPECT_EQ(po::cli::supervise(s), 75) << "the launcher's exit code should be the supervisor's";
  const std::string pid = read_file(pid_file);
  ASSERT_FALSE(pid.empty());
  EXPECT_FALSE(po::test::alive(std::stoi(pid))) << "the stray worker " << pid << " still runs";
  EXPECT_FALSE(fs::exists(swap)) << "the supervisor returned before the stray worker cleaned up";
}

TEST_F(Supervise, AStrayWorkerThatIgnoresSigtermIsKilledAfterTheGrace) {
  const std::string pid_file = dir_ / "worker.pid";
  po::cli::Supervision s;
  s.command = {"sh", "-c",
               "sh -c 'trap \"\" TERM; while :; do sleep 0.1; done' & echo $! > " + pid_file +
                   "; sleep 0.3; exit 3"};
  s.resume_command = s.command;
  s.run_dir = dir_;
  s.stray_grace_s = 1;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(po::cli::supervise(s), 3);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string pid = read_file(pid_file);
  ASSERT_FALSE(pid.empty());
  EXPECT_FALSE(po::test::alive(std::stoi(pid))) << "the stray worker " << pid << " still runs";
  EXPECT_GE(secs, 1.0) << "killed before its grace was over";
  EXPECT_LT(secs, 30) << "the grace did not end";
}

TEST_F(Supervise, ALauncherThatReapsItsWorkersIsLeftAlone) {
  // Workers that die and are reaped at once (a shell waits for them) are no
  // hang, however long the launcher then runs.
  po::cli::Supervision s;
  s.command = {"sh", "-c", "sleep 0; sleep 0 & wait; sleep 2; exit 0"};
  s.resume_command = s.command;
  s.max_restarts = 2;
  s.run_dir = dir_;
  s.reap_timeout_s = 0.5;
  EXPECT_EQ(po::cli::supervise(s), 0);
  EXPECT_TRUE(events().empty()) << "a launcher that reaps its workers was restarted: " << events()[0];
}

}  // namespace
