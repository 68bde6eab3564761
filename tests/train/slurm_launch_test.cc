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

#include "../test_util.h"

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
    auto r = run_command("bash " + kClusterScript + " start " + (*cluster_ / "slurm"));
    started_ = r.exit_code == 0;
    start_output_ = r.output;
    setenv("SLURM_CONF", (*cluster_ / "slurm/slurm.conf").c_str(), 1);
  }
  static void TearDownTestSuite() {
    run_command("bash " + kClusterScript + " stop " + (*cluster_ / "slurm"));
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
    auto r = run_command(kBin + args("nproc2") + " --nproc 2");
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
      "timeout 120 srun --mpi=pmix -n 2 " + kBin + args("srun") + " --set parallel.dp=2";
  auto r = srun(cmd);
  ASSERT_EQ(r.exit_code, 0) << cmd << "\n" << r.output;
  expect_same_curve(ref, losses(dir_ / "srun", 8), "srun -n 2 vs --nproc 2");
  EXPECT_EQ(r.output.find("trained 8 steps"), r.output.rfind("trained 8 steps"))
      << "only rank 0 reports:\n" << r.output;
}

TEST_F(Slurm, SrunWithoutPmixIsAClearError) {
  auto r = srun("timeout 60 srun --mpi=none -n 2 " + kBin + args("nopmix") +
                       " --set parallel.dp=2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("srun --mpi=pmix"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "nopmix")) << "the run directory was created anyway";
}

TEST_F(Slurm, SrunWithTheWrongTaskCountIsAClearError) {
  auto r = srun("timeout 60 srun --mpi=pmix -n 3 " + kBin + args("three") +
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
}

}  // namespace
