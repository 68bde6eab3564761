// Running through interruptions (train/stop.h, cli/supervise.h):
// - SIGTERM at a random moment: a checkpoint at the step it arrived in, exit
//   75 ("resume me"), and the resumed run ends bit-identical to an
//   uninterrupted one; one process and two ranks under --nproc;
// - a second signal aborts, and the last complete checkpoint still loads;
// - the soak: a rank SIGKILLed at 20 random moments, restarted each time by
//   --max-restarts from the newest checkpoint, ends bit-identical, with the
//   restarts logged in events.jsonl.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <random>
#include <set>
#include <thread>

#include "../background_run.h"
#include "../test_util.h"
#include "train/run_state.h"

namespace {

namespace fs = std::filesystem;
using po::test::read_file;

using po::test::Child;

// The step of a run's newest complete checkpoint (-1: none).
int64_t newest_step(const std::string& run) {
  const auto all = po::train::list_checkpoints(run + "/checkpoints");
  if (all.empty()) return -1;
  return std::stoll(fs::path(all.back()).filename().string().substr(5));
}

// The end of a log (CI shows a failure's first and last lines only).
std::string tail(const std::string& log) { return log.substr(log.size() > 6000 ? log.size() - 6000 : 0); }

int64_t last_metrics_step(const std::string& run) {
  int64_t step = -1;
  for (const auto& r : po::test::read_metrics_so_far(run))  // the run may be writing
    if (r.contains("loss")) step = r["step"].get<int64_t>();
  return step;
}

// Waits until the run has written `steps` metrics records (training runs).
bool wait_for_steps(const std::string& run, int64_t steps, Child& c) {
  for (int i = 0; i < 600 && c.running(); ++i) {
    if (fs::exists(run + "/metrics.jsonl") && last_metrics_step(run) >= steps) return true;
    usleep(50000);
  }
  return false;
}

class Preemption : public po::test::TinyTraining {
 protected:
  int steps() const override { return kSteps; }
  static constexpr int kSteps = 400;
  // Skips the GEMM probe at start-up (restarts are many).
  const std::string common_ = " --set train.peak_gflops=100 --set train.eval_interval=0 --set train.log_interval=50";
};

// SIGTERM at a random moment: the run checkpoints the step it is in and exits
// 75; --resume finishes it bit-identical to a run never interrupted.
TEST_F(Preemption, SigtermCheckpointsTheCurrentStepAndTheResumedRunIsBitIdentical) {
  std::mt19937 rng(20261202);
  for (int nproc : {1, 2}) {
    const std::string tag = "np" + std::to_string(nproc);
    const std::string ref = train_ok("ref" + tag, nproc, common_ + " --set checkpoint.keep=1");
    const std::string run = dir_ / ("term" + tag);
    const std::string args = "train -c " + config_ + " --set run.dir=" + run + " --set parallel.dp=" +
                             std::to_string(nproc) + common_ + " --set train.checkpoint_interval=0" +
                             (nproc > 1 ? " --nproc 2" : "");
    Child c(args, run + ".log");
    const int64_t after = std::uniform_int_distribution<int64_t>(5, 100)(rng);
    ASSERT_TRUE(wait_for_steps(run, after, c)) << tag << ": the run did not reach step " << after
                                               << ":\n" << read_file(run + ".log");
    ASSERT_EQ(newest_step(run), -1) << tag << ": checkpoint_interval = 0 wrote a checkpoint";
    kill(c.pid(), SIGTERM);
    const int code = c.wait(60);
    const std::string log = read_file(run + ".log");
    ASSERT_EQ(code, 75) << tag << ": SIGTERM after step " << after << " should exit 75 (resume me):\n" << log;
    const int64_t stopped = newest_step(run);
    EXPECT_GE(stopped, after) << tag << ": no checkpoint at or after the step SIGTERM arrived in";
    EXPECT_LT(stopped, kSteps) << tag << ": the run finished instead of stopping";
    EXPECT_EQ(stopped, last_metrics_step(run)) << tag << ": the checkpoint is not the last step trained";
    EXPECT_NE(log.find("stopped on request after step " + std::to_string(stopped)), std::string::npos) << log;
    // The resumed run continues from it to the end, bit-identical.
    const std::string resumed = train_ok("term" + tag, nproc, common_ + " --set train.checkpoint_interval=0 --resume");
    po::test::expect_same_checkpoint(ref, resumed, kSteps,
                                     tag + ": stopped at step " + std::to_string(stopped) + " and resumed");
  }
}

// A second signal aborts at once; the checkpoints that are there all load.
// (One process: the supervisor's second signal is SIGTERM to mpirun, which kills the ranks.)
TEST_F(Preemption, ASecondSignalAbortsAndLeavesTheLastCheckpointGood) {
  const std::string run = dir_ / "abort";
  Child c("train -c " + config_ + " --set run.dir=" + run + common_ +
              " --set train.checkpoint_interval=1 --set checkpoint.keep=2",
          run + ".log");
  ASSERT_TRUE(wait_for_steps(run, 20, c)) << read_file(run + ".log");
  // Two different signals at once (two of one kind may merge into one): the
  // stop signal, then SIGTERM before the stop can finish.
  kill(c.pid(), SIGUSR1);
  kill(c.pid(), SIGTERM);
  const int code = c.wait(30);
  EXPECT_NE(code, 0) << read_file(run + ".log");
  EXPECT_NE(code, 75) << "a second signal should abort, not finish the stop:\n" << read_file(run + ".log");
  ASSERT_GE(newest_step(run), 1);
  for (const auto& ck : po::train::list_checkpoints(run + "/checkpoints")) {
    const auto r = po::test::run_command(std::string(PO_BINARY) + " export " + ck + " --out " + ck + ".safetensors");
    EXPECT_EQ(r.exit_code, 0) << ck << " does not load after the abort:\n" << r.output;
  }
}

// The soak: rank 0 or 1 SIGKILLed at 20 random moments (during steps,
// checkpoint writes and start-up alike); --max-restarts brings the run back
// from its newest checkpoint each time, and the end is bit-identical.
TEST_F(Preemption, SoakKilledAtTwentyRandomMomentsEndsBitIdentical) {
  constexpr int kKills = 20;
  const std::string ref = train_ok("soakref", 2, common_ + " --set checkpoint.keep=1");
  const std::string run = dir_ / "soak";
  Child c("train -c " + config_ + " --set run.dir=" + run + " --set parallel.dp=2" + common_ +
              " --set train.checkpoint_interval=1 --set checkpoint.keep=2 --nproc 2 --max-restarts " +
              std::to_string(kKills + 5),
          run + ".log");
  std::mt19937 rng(17);
  std::string moments;
  std::set<int> old_pids;  // every rank of the attempts already killed
  for (int k = 0; k < kKills; ++k) {
    // A rank of a new attempt (the last one's may still be dying), within a
    // minute (start-up is seconds on two loaded cores).
    const int rank = static_cast<int>(rng() % 2);
    int pid = -1, other = -1;
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (c.running() && std::chrono::steady_clock::now() < give_up) {
      pid = po::test::find_rank_pid(rank, run);
      other = po::test::find_rank_pid(1 - rank, run);
      // Both ranks of the new attempt up: a kill now fails that attempt alone.
      if (pid > 0 && other > 0 && !old_pids.contains(pid) && !old_pids.contains(other) &&
          po::test::alive(pid))
        break;
      pid = -1;
      usleep(20000);
    }
    ASSERT_GT(pid, 0) << "kill " << k + 1 << ": no rank " << rank << " to kill (the run ended?) after"
                      << moments << "\n" << tail(read_file(run + ".log"));
    // Half of the kills land in start-up, half once the attempt trains (in
    // a step or a checkpoint write: one is written every step). Either way
    // the attempt trains a few steps at most before it dies, so that the 20
    // kills fit in the run however fast this machine steps (a delay in
    // milliseconds alone let a fast machine finish the run first).
    const bool in_training = rng() % 2 == 0;
    const int64_t resumed_at = newest_step(run);
    const int64_t steps_in = in_training ? std::uniform_int_distribution<int>(1, 6)(rng) : 2;
    const int delay_ms = std::uniform_int_distribution<int>(0, in_training ? 5 : 700)(rng);
    const auto until = std::chrono::steady_clock::now() +
                       (in_training ? std::chrono::milliseconds(30000) : std::chrono::milliseconds(delay_ms));
    // Training: until the attempt has checkpointed `steps_in` steps, then
    // up to 5 ms more. Start-up: `delay_ms`, unless it trains 2 steps first.
    while (po::test::alive(pid) && std::chrono::steady_clock::now() < until &&
           newest_step(run) < resumed_at + steps_in)
      usleep(2000);
    if (in_training) usleep(delay_ms * 1000);
    kill(pid, SIGKILL);
    old_pids.insert(pid);
    old_pids.insert(other);
    moments += " rank " + std::to_string(rank) + (in_training ? " training" : " starting") + " +" +
               std::to_string(delay_ms) + " ms (checkpoint " + std::to_string(newest_step(run)) + ");";
  }
  const int code = c.wait(300);
  const std::string log = read_file(run + ".log");
  ASSERT_EQ(code, 0) << "after kills:" << moments << "\n" << tail(log);
  po::test::expect_same_checkpoint(ref, run, kSteps, "killed" + moments);
  // Every kill shows as one restart in the run's events.
  int restarts = 0;
  std::ifstream events(run + "/events.jsonl");
  for (std::string line; std::getline(events, line);)
    restarts += nlohmann::json::parse(line).value("event", "") == "restart";
  EXPECT_EQ(restarts, kKills) << "events.jsonl:\n" << read_file(run + "/events.jsonl");
}

}  // namespace
