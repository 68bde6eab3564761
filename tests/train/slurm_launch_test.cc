// Slurm for real: a single-node cluster (slurmctld + slurmd from Debian's
// slurm-wlm) started by the test in a temporary directory
// (tests/slurm/local_cluster.sh), then
//   - `srun --mpi=pmix -n 2 pagedoptim train` gives the losses of --nproc 2;
//   - srun without PMIx is a clear error, not an MPI abort;
//   - the script printed by `pagedoptim sbatch` is submitted with sbatch and
//     its run gives the same losses;
//   - `pagedoptim sbatch` refuses a layout the batch cannot be split over.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <fstream>
#include <sstream>
#include <signal.h>
#include <nlohmann/json.hpp>

#include "../test_util.h"
#include "train/run_state.h"

namespace fs = std::filesystem;
using po::test::expect_same_curve;
using po::test::losses;
using po::test::run_command;

namespace {

const std::string kBin = PO_BINARY;
const std::string kClusterScript = std::string(PO_SOURCE_DIR) + "/tests/slurm/local_cluster.sh";

class Slurm : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cluster_ = new po::test::TempDir();
    // The script bounds itself (three tries of 30 s); the timeout is for a hang
    // outside its loop, which then fails here instead of holding CI.
    auto r = run_command("timeout -k 5 200 bash " + kClusterScript + " start " +
                         (*cluster_ / "slurm"));
    started_ = r.exit_code == 0;
    start_output_ = "exit code " + std::to_string(r.exit_code) +
                    (r.exit_code == 124 ? " (timed out after 200 s)" : "") + "\n" + r.output;
    setenv("SLURM_CONF", (*cluster_ / "slurm/slurm.conf").c_str(), 1);
  }
  static void TearDownTestSuite() {
    run_command("timeout -k 5 60 bash " + kClusterScript + " stop " + (*cluster_ / "slurm"));
    delete cluster_;
    cluster_ = nullptr;
  }
  void SetUp() override {
    ASSERT_TRUE(started_) << "local Slurm cluster did not start:\n" << start_output_;
    po::test::write_tokens(train_, 30000, 64);
    po::test::write_tokens(val_, 3000, 64, 2);
    po::test::write_file(config_, po::test::tiny_config(train_, val_, dir_ / "unused", 8) +
                                      "\n");
  }
  std::string args(const std::string& run) const {
    return " train -c " + config_ + " --set run.dir=" + (dir_ / run) +
           " --set train.batch_size=8 --set train.micro_batch_size=2";
  }
  // The reference: the same job through our own single-node launcher.
  std::vector<double> nproc2() {
    auto r = run_command("timeout -k 5 300 " + kBin + args("nproc2") + " --nproc 2");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return losses(dir_ / "nproc2", 8);
  }

  static po::test::TempDir* cluster_;
  static bool started_;
  static std::string start_output_;
  po::test::TempDir dir_;
  std::string train_ = dir_ / "train.bin", val_ = dir_ / "val.bin", config_ = dir_ / "c.toml";
};

// srun, retried while slurmd fails to launch the step itself ("task 0 launch
// failed: Unspecified error", seen when the one-node test cluster is busy with
// another test's step): that is the harness, not the program under test.
po::test::CommandResult srun(const std::string& cmd) {
  po::test::CommandResult r;
  for (int attempt = 0; attempt < 4; ++attempt) {
    r = run_command(cmd);
    if (r.output.find("launch failed") == std::string::npos) break;
    sleep(2);
  }
  return r;
}

po::test::TempDir* Slurm::cluster_ = nullptr;
bool Slurm::started_ = false;
std::string Slurm::start_output_;

TEST_F(Slurm, SrunTwoTasksMatchesNprocTwo) {
  const auto ref = nproc2();
  const std::string cmd =
      "timeout -k 5 120 srun --mpi=pmix -n 2 " + kBin + args("srun") + " --set parallel.dp=2";
  auto r = srun(cmd);
  ASSERT_EQ(r.exit_code, 0) << cmd << "\n" << r.output;
  expect_same_curve(ref, losses(dir_ / "srun", 8), "srun -n 2 vs --nproc 2");
  EXPECT_EQ(r.output.find("trained 8 steps"), r.output.rfind("trained 8 steps"))
      << "only rank 0 reports:\n" << r.output;
}

TEST_F(Slurm, SrunWithoutPmixIsAClearError) {
  auto r = srun("timeout -k 5 60 srun --mpi=none -n 2 " + kBin + args("nopmix") +
                       " --set parallel.dp=2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("srun --mpi=pmix"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "nopmix")) << "the run directory was created anyway";
}

TEST_F(Slurm, SrunWithTheWrongTaskCountIsAClearError) {
  auto r = srun("timeout -k 5 60 srun --mpi=pmix -n 3 " + kBin + args("three") +
                       " --set parallel.dp=2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("parallel.dp = 2 but slurm started 3 processes"), std::string::npos)
      << r.output;
}

// The job state from `scontrol show job`, e.g. "COMPLETED"; "" when unknown.
std::string job_state(const std::string& id) {
  auto r = run_command("scontrol show job " + id);
  const auto at = r.output.find("JobState=");
  if (at == std::string::npos) return "";
  const auto from = at + 9;
  return r.output.substr(from, r.output.find_first_of(" \n", from) - from);
}

TEST_F(Slurm, SbatchScriptRunsToCompletion) {
  const auto ref = nproc2();
  const std::string script = dir_ / "job.sh";
  auto r = run_command(kBin + " sbatch -c " + config_ + " --nodes 1 --ntasks-per-node 2" +
                       " --time 0:10:00 --set run.dir=" + (dir_ / "sbatch") +
                       " --set train.batch_size=8 --set train.micro_batch_size=2 > " + script);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string text = po::test::read_file(script);
  EXPECT_NE(text.find("#SBATCH --nodes=1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("#SBATCH --ntasks-per-node=2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("#SBATCH --time=0:10:00\n"), std::string::npos) << text;
  EXPECT_NE(text.find("srun --mpi=pmix"), std::string::npos) << text;

  r = run_command("cd " + (dir_ / "") + " && sbatch --parsable --output=" + (dir_ / "job.out") +
                  " " + script);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string id = r.output.substr(0, r.output.find_first_of(";\n"));
  std::string state;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(180);
  while (std::chrono::steady_clock::now() < deadline) {
    state = job_state(id);
    if (state == "COMPLETED" || state == "FAILED" || state == "CANCELLED" || state == "TIMEOUT" ||
        state == "NODE_FAIL" || state == "OUT_OF_MEMORY")
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  ASSERT_EQ(state, "COMPLETED") << "job " << id << "; its output:\n"
                                << po::test::read_file(dir_ / "job.out");
  expect_same_curve(ref, losses(dir_ / "sbatch", 8),
                    "sbatch job vs --nproc 2; job output:\n" + po::test::read_file(dir_ / "job.out"));
}

TEST_F(Slurm, SbatchRefusesALayoutTheBatchCannotBeSplitOver) {
  auto r = run_command(kBin + " sbatch -c " + config_ + " --nodes 3 --ntasks-per-node 1" +
                       " --set train.batch_size=8 --set train.micro_batch_size=2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("train.batch_size = 8 must be a multiple of parallel.dp"),
            std::string::npos)
      << r.output;
  r = run_command(kBin + " sbatch -c " + config_ + " --nodes 1 --ntasks-per-node 2" +
                  " --partition 'a b'");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--partition 'a b'"), std::string::npos) << r.output;
  // A replica is tp × pp × cp tasks: 3 tasks do not split into replicas of 2.
  r = run_command(kBin + " sbatch -c " + config_ + " --nodes 3 --ntasks-per-node 1" +
                  " --set parallel.cp=2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("is not a multiple of parallel.tp × parallel.pp × parallel.cp = 2"),
            std::string::npos)
      << r.output;
}

// Waits for job `id` to end; returns its final state ("" after `secs`).
std::string wait_for_job(const std::string& id, int secs) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(secs);
  while (std::chrono::steady_clock::now() < deadline) {
    const std::string state = job_state(id);
    if (state == "COMPLETED" || state == "FAILED" || state == "CANCELLED" || state == "TIMEOUT" ||
        state == "NODE_FAIL" || state == "OUT_OF_MEMORY")
      return state;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return "";
}

// The newest step in a run's metrics.jsonl (-1: none yet).
int64_t trained_steps(const std::string& run) {
  int64_t step = -1;
  std::ifstream f(run + "/metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    try {
      const auto j = nlohmann::json::parse(line);
      if (j.contains("loss")) step = j["step"].get<int64_t>();
    } catch (const std::exception&) {  // a line being written
    }
  }
  return step;
}

// PID of the srun task of rank `rank` whose command line names `marker`.
int srun_rank_pid(int rank, const std::string& marker) {
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string pid = e.path().filename().string();
    if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string cmdline = po::test::read_file(e.path().string() + "/cmdline");
    if (cmdline.find(marker) == std::string::npos || cmdline.rfind(kBin, 0) != 0) continue;
    const std::string env = po::test::read_file(e.path().string() + "/environ");
    if (env.find("SLURM_PROCID=" + std::to_string(rank) + '\0') != std::string::npos) return std::stoi(pid);
  }
  return -1;
}

class SlurmLong : public Slurm {
 protected:
  static constexpr int kSteps = 1500;
  std::string long_args(const std::string& run) const {
    return " --set run.dir=" + (dir_ / run) + " --set train.steps=" + std::to_string(kSteps) +
           " --set train.checkpoint_interval=0 --set train.eval_interval=0 --set train.log_interval=100" +
           " --set train.peak_gflops=100 --set train.batch_size=8 --set train.micro_batch_size=2";
  }
  // The reference: the same run, uninterrupted, under --nproc 2.
  std::string reference() {
    auto r = run_command(kBin + " train -c " + config_ + long_args("ref") + " --nproc 2");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return dir_ / "ref";
  }
};

// `--chain 3`: three jobs, each after the last. The first two are told to
// stop as Slurm tells a job near its time limit (the --signal the script
// asks for, sent here with `scancel --signal`: Slurm's own limits are whole
// minutes); each checkpoints, exits 75 and leaves the rest to the next job,
// which resumes. The run ends bit-identical to an uninterrupted one.
TEST_F(SlurmLong, ChainOfThreeJobsCompletesTheRunBitIdentical) {
  const std::string ref = reference();
  const std::string run = dir_ / "chain";
  auto r = run_command("cd " + (dir_ / "") + " && " + kBin + " sbatch -c " + config_ +
                       " --nodes 1 --ntasks-per-node 2 --chain 3 --time 0:10:00" + long_args("chain"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_NE(r.output.find("submitted a chain of 3 jobs"), std::string::npos) << r.output;
  std::vector<std::string> ids;
  {
    std::istringstream is(r.output.substr(r.output.find("):") + 2));
    for (std::string id; is >> id;) ids.push_back(id);
  }
  ASSERT_EQ(ids.size(), 3u) << r.output;
  const std::string script = po::test::read_file(run + "/job.sh");
  EXPECT_NE(script.find("#SBATCH --signal=USR1@120\n"), std::string::npos) << script;
  EXPECT_NE(script.find("#SBATCH --requeue\n"), std::string::npos) << script;
  std::string stops;
  for (int k = 0; k < 2; ++k) {
    const int64_t before = trained_steps(run);
    // Signal once the job trains (past where the last one stopped).
    bool training = false;
    for (int i = 0; i < 1500 && !training; ++i) {
      training = job_state(ids[k]) == "RUNNING" && trained_steps(run) >= before + 50;
      if (!training) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ASSERT_TRUE(training) << "job " << k + 1 << " (" << ids[k] << ") never trained:\n"
                          << po::test::read_file(dir_ / ("slurm-" + ids[k] + ".out"));
    run_command("scancel --signal=USR1 " + ids[k]);
    EXPECT_EQ(wait_for_job(ids[k], 120), "COMPLETED")
        << "job " << k + 1 << ":\n" << po::test::read_file(dir_ / ("slurm-" + ids[k] + ".out"));
    stops.append(" ").append(std::to_string(trained_steps(run)));
  }
  ASSERT_EQ(wait_for_job(ids[2], 180), "COMPLETED") << po::test::read_file(dir_ / ("slurm-" + ids[2] + ".out"));
  const std::string out1 = po::test::read_file(dir_ / ("slurm-" + ids[0] + ".out"));
  EXPECT_NE(out1.find("the chain's next job resumes it"), std::string::npos) << out1;
  po::test::expect_same_checkpoint(ref, run, kSteps, "a chain of 3 jobs stopped after steps" + stops);
}

// Slurm's own time limit: a chain of 2 one-minute jobs that ask for the stop
// signal 40 s before their limit. Slurm sends it itself (20-50 s in: its
// limit checks run about every 30 s; late enough that the step's tasks have
// started, though one still starting holds it: train/stop.h's
// hold_early_signals); the first job checkpoints the step it
// is in, exits 75 and leaves the rest to the second, which resumes from that
// checkpoint. The run (10^6 steps) fits in no job; the test cancels the
// second once it trains past the first's checkpoint. (Bit-identity across
// the stop is the emulated chain's test above: the same signal, sent there
// with scancel.)
TEST_F(SlurmLong, SlurmsOwnTimeLimitStopsAJobAndTheChainResumesIt) {
  const std::string run = dir_ / "limit";
  auto r = run_command("cd " + (dir_ / "") + " && " + kBin + " sbatch -c " + config_ +
                       " --nodes 1 --ntasks-per-node 2 --chain 2 --time 0:01:00 --signal-lead 40" +
                       long_args("limit") + " --set train.steps=1000000");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::vector<std::string> ids;
  {
    std::istringstream is(r.output.substr(r.output.find("):") + 2));
    for (std::string id; is >> id;) ids.push_back(id);
  }
  ASSERT_EQ(ids.size(), 2u) << r.output;
  const std::string out1 = dir_ / ("slurm-" + ids[0] + ".out"), out2 = dir_ / ("slurm-" + ids[1] + ".out");
  ASSERT_EQ(wait_for_job(ids[0], 150), "COMPLETED") << po::test::read_file(out1);
  const std::string log1 = po::test::read_file(out1);
  const auto at = log1.find("stopped on request after step ");
  ASSERT_NE(at, std::string::npos) << "the first job was not stopped by its time limit's signal:\n" << log1;
  EXPECT_NE(log1.find("the chain's next job resumes it"), std::string::npos) << log1;
  const int64_t stopped = std::stoll(log1.substr(at + 30));
  EXPECT_GT(stopped, 0) << log1;
  EXPECT_LT(stopped, 1000000) << log1;
  // The second job resumes from the first's checkpoint and trains on.
  bool resumed = false;
  for (int i = 0; i < 600 && !resumed; ++i) {
    resumed = po::test::read_file(out2).find("resuming from " + po::train::checkpoint_path(run, stopped)) !=
                  std::string::npos &&
              trained_steps(run) > stopped;
    if (!resumed) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  run_command("scancel " + ids[1]);
  EXPECT_TRUE(resumed) << "the chain's second job did not resume from step " << stopped << ":\n"
                       << po::test::read_file(out2);
  wait_for_job(ids[1], 60);
}

// One job, no chain: told to stop (the time limit's signal), it checkpoints,
// exits 75 and requeues itself; the requeued job (SLURM_RESTART_COUNT = 1)
// resumes and finishes bit-identical. Slurm lets a requeued job start again
// AuthInfo's cred_expire seconds after it ended: 120 by default, 10 on the
// test cluster (tests/slurm/local_cluster.sh), so this runs in ~30 s.
TEST_F(SlurmLong, StoppedJobRequeuesItselfAndResumesBitIdentical) {
  const std::string ref = reference();
  const std::string run = dir_ / "requeue";
  const std::string script = dir_ / "requeue.sh";
  auto r = run_command(kBin + " sbatch -c " + config_ + " --nodes 1 --ntasks-per-node 2" + long_args("requeue") +
                       " > " + script);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_command("cd " + (dir_ / "") + " && sbatch --parsable --output=" + (dir_ / "requeue.out") + " " + script);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string id = r.output.substr(0, r.output.find_first_of(";\n"));
  bool training = false;
  for (int i = 0; i < 1500 && !training; ++i) {
    training = trained_steps(run) >= 100;
    if (!training) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(training) << po::test::read_file(dir_ / "requeue.out");
  run_command("scancel --signal=USR1 " + id);
  ASSERT_EQ(wait_for_job(id, 400), "COMPLETED") << po::test::read_file(dir_ / "requeue.out");
  const std::string out = po::test::read_file(dir_ / "requeue.out");
  EXPECT_NE(out.find("requeueing job " + id), std::string::npos) << out;
  EXPECT_NE(out.find("resuming from"), std::string::npos) << out;
  po::test::expect_same_checkpoint(ref, run, kSteps, "a job stopped, requeued and resumed");
}

// A rank killed inside the job: the step fails, and the script (--max-restarts)
// runs it again from the newest checkpoint; the run ends bit-identical.
TEST_F(SlurmLong, SrunStepKilledRestartsInsideTheJobBitIdentical) {
  const std::string ref = reference();
  const std::string run = dir_ / "restart";
  const std::string script = dir_ / "restart.sh";
  auto r = run_command(kBin + " sbatch -c " + config_ + " --nodes 1 --ntasks-per-node 2 --max-restarts 2" +
                       long_args("restart") + " --set train.checkpoint_interval=25 > " + script);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_command("cd " + (dir_ / "") + " && sbatch --parsable --output=" + (dir_ / "restart.out") + " " + script);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string id = r.output.substr(0, r.output.find_first_of(";\n"));
  int victim = -1;
  for (int i = 0; i < 1500 && victim < 0; ++i) {
    if (trained_steps(run) >= 200) victim = srun_rank_pid(1, run);
    if (victim < 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_GT(victim, 0) << "rank 1 never trained:\n" << po::test::read_file(dir_ / "restart.out");
  kill(victim, SIGKILL);
  ASSERT_EQ(wait_for_job(id, 240), "COMPLETED") << po::test::read_file(dir_ / "restart.out");
  const std::string out = po::test::read_file(dir_ / "restart.out");
  EXPECT_NE(out.find("restart 1 of 2 from the newest checkpoint"), std::string::npos) << out;
  po::test::expect_same_checkpoint(ref, run, kSteps, "srun step killed after step 200 and restarted");
}

// `sweep --slurm`: a 2 x 2 grid as one array job (throttled to 2 tasks at
// once); all four points train, and --status shows them complete.
TEST_F(Slurm, SweepAsAnArrayJobCompletesFourRuns) {
  const std::string sw = dir_ / "sweep";
  auto r = run_command("cd " + (dir_ / "") + " && " + kBin + " sweep -c " + config_ + " --dir " + sw +
                       " --slurm --throttle 2 --time 0:10:00 --set train.steps=4 --set train.peak_gflops=100" +
                       " --grid train.lr=1e-3,3e-4 --grid train.warmup_steps=0,1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto at = r.output.find("as array job ");
  ASSERT_NE(at, std::string::npos) << r.output;
  const std::string id = r.output.substr(at + 13, r.output.find(' ', at + 13) - at - 13);
  const std::string script = po::test::read_file(sw + "/sweep.sh");
  EXPECT_NE(script.find("#SBATCH --array=0-3%2\n"), std::string::npos) << script;
  std::string status;
  for (int i = 0; i < 900; ++i) {  // the array's tasks have their own ids: wait on the sweep itself
    status = run_command(kBin + " sweep --status " + sw).output;
    size_t complete = 0;
    for (auto p = status.find("complete"); p != std::string::npos; p = status.find("complete", p + 1)) ++complete;
    if (complete == 4 || status.find("failed") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  std::string outs;
  for (const auto& e : fs::directory_iterator(sw))
    if (e.path().filename().string().starts_with("slurm-")) outs += po::test::read_file(e.path().string());
  for (const char* name : {"p000_lr=1e-3_warmup_steps=0", "p001_lr=1e-3_warmup_steps=1",
                           "p002_lr=3e-4_warmup_steps=0", "p003_lr=3e-4_warmup_steps=1"}) {
    const auto line_at = status.find(name);
    ASSERT_NE(line_at, std::string::npos) << status;
    const std::string line = status.substr(line_at, status.find('\n', line_at) - line_at);
    EXPECT_NE(line.find("complete"), std::string::npos) << line << "\njob " << id << " output:\n" << outs;
    EXPECT_NE(line.find("4/4"), std::string::npos) << line;
  }
}

}  // namespace
