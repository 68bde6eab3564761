// checkpoint.async (train/async_checkpoint.h):
// - the checkpoints written in the background are byte for byte those of a
//   synchronous save, with one process and with two ranks under ZeRO-1, and
//   a run resumed from one ends bit-identical; also with Adam state paged to
//   disk, under tensor parallel (tp rank 0 writes) and pipeline parallel
//   (one writer holds the whole state);
// - SIGKILL while a background write is in flight leaves its staging
//   directory unlisted and the previous checkpoint loading, checksummed, and
//   resuming to the same end.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <thread>

#include "../test_util.h"
#include "train/run_state.h"

namespace {

namespace fs = std::filesystem;
using po::test::read_file;

class AsyncCheckpoint : public po::test::TinyTraining {
 protected:
  int steps() const override { return 12; }
  const std::string common_ = " --set train.checkpoint_interval=4 --set train.eval_interval=0 --set train.peak_gflops=100";
};

TEST_F(AsyncCheckpoint, BackgroundCheckpointsAreTheSynchronousOnesByteForByte) {
  for (int dp : {1, 2}) {
    const std::string tag = "dp" + std::to_string(dp);
    const std::string zero = dp > 1 ? " --set parallel.zero_stage=1" : "";
    const std::string sync = train_ok("sync" + tag, dp, common_ + zero);
    const std::string async = train_ok("async" + tag, dp, common_ + zero + " --set checkpoint.async=true");
    for (int step : {4, 8, 12}) po::test::expect_same_checkpoint(sync, async, step, tag + " async vs sync");
    const auto records = po::test::read_metrics(async);
    bool reported = false;
    for (const auto& r : records) reported = reported || r.contains("checkpoint_ms");
    EXPECT_TRUE(reported) << tag << ": no checkpoint_ms in metrics.jsonl";
    // Resumed from the background checkpoint of step 4: the same end.
    const std::string resumed = copy_checkpoint(async, 4, "resumed" + tag);
    train_ok("resumed" + tag, dp, common_ + zero + " --set checkpoint.async=true --resume");
    po::test::expect_same_checkpoint(sync, resumed, 12, tag + " resumed from an async checkpoint");
  }
}

// Tensor parallel (tp 2; dp 2 × tp 2): tp rank 0 of each data group gathers
// the whole model's slices at the step boundary and writes them in the
// background. Pipeline parallel (pp 2): world rank 0 gathers the whole state.
// The files are the synchronous save's, and a resumed run ends the same.
TEST_F(AsyncCheckpoint, TensorAndPipelineParallelWriteTheSynchronousFiles) {
  struct Case {
    std::string tag;
    int nproc;
    std::string layout;
  };
  for (const Case& k : {Case{"tp2", 2, " --set parallel.dp=1 --set parallel.tp=2"},
                        Case{"dp2tp2", 4, " --set parallel.dp=2 --set parallel.tp=2 --set parallel.zero_stage=1"},
                        Case{"dp2pp2", 4, " --set parallel.dp=2 --set parallel.pp=2 --set parallel.zero_stage=1"}}) {
    auto train = [&](const std::string& name, const std::string& extra) {
      const auto r = po::test::run_command(po::test::pagedoptim_command(
          k.nproc, "train -c " + config_ + " --set run.dir=" + (dir_ / name) + k.layout + common_ + extra));
      EXPECT_EQ(r.exit_code, 0) << k.tag << " " << name << ":\n" << r.output;
      return r.output;
    };
    const std::string sync = dir_ / ("sync" + k.tag), async = dir_ / ("async" + k.tag);
    train("sync" + k.tag, "");
    const std::string out = train("async" + k.tag, " --set checkpoint.async=true");
    EXPECT_NE(out.find("writing in the background"), std::string::npos) << k.tag << ": not async:\n" << out;
    for (int step : {4, 8, 12}) po::test::expect_same_checkpoint(sync, async, step, k.tag + " async vs sync");
    bool reported = false;
    for (const auto& r : po::test::read_metrics(async)) reported = reported || r.value("checkpoint_ms", 0.0) > 0;
    EXPECT_TRUE(reported) << k.tag << ": no checkpoint_ms in metrics.jsonl";
    copy_checkpoint(async, 4, "resumed" + k.tag);
    train("resumed" + k.tag, " --set checkpoint.async=true --resume");
    po::test::expect_same_checkpoint(sync, dir_ / ("resumed" + k.tag), 12, k.tag + " resumed from an async checkpoint");
  }
}

// Paged Adam state on disk: the copy reads the pages out of their tiers (one
// slice at a time through the pager), and the files are still the
// synchronous save's.
TEST_F(AsyncCheckpoint, PagedStateIsCopiedOutOfItsTiers) {
  const std::string swap = dir_ / "swap";
  const std::string paged = common_ + " --set memory.page_size=16KiB --set memory.nvme_dir=" + swap;
  auto probe = run_train("probe", 1, paged + " --set memory.compute_budget=1");
  const int64_t minimum = po::test::named_minimum_budget(probe.output);
  ASSERT_GT(minimum, 0) << probe.output;
  const std::string budget = " --set memory.compute_budget=" + std::to_string(minimum + 2 * 16384);
  const std::string sync = train_ok("paged_sync", 1, paged + budget);
  const std::string async = train_ok("paged_async", 1, paged + budget + " --set checkpoint.async=true");
  for (int step : {4, 8, 12}) po::test::expect_same_checkpoint(sync, async, step, "paged: async vs sync");
  bool paged_run = false;
  for (const auto& r : po::test::read_metrics(async)) paged_run = paged_run || r.contains("paging");
  EXPECT_TRUE(paged_run) << "the run did not page";
}

// A model of 6.5M parameters (78 MB of checkpoint per save) so that a
// background write lasts long enough to be caught.
TEST_F(AsyncCheckpoint, KillDuringABackgroundWriteLeavesThePreviousCheckpointGood) {
  const std::string big = " --set model.vocab_size=50257 --set model.n_embd=128 --set model.n_head=4"
                          " --set train.checkpoint_interval=2 --set checkpoint.keep=3 --set train.eval_interval=0"
                          " --set train.peak_gflops=100 --set checkpoint.async=true";
  const std::string run = dir_ / "killed";
  const std::string cmd = std::string("exec ") + PO_BINARY + " train -c " + config_ + " --set run.dir=" + run +
                          big + " --set train.steps=400 > " + run + ".log 2>&1";
  const pid_t pid = fork();
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  // Wait for a committed checkpoint and, after it, a staging directory.
  std::string staging;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (staging.empty() && std::chrono::steady_clock::now() < end && waitpid(pid, nullptr, WNOHANG) == 0) {
    std::error_code ec;
    if (!po::train::list_checkpoints(run + "/checkpoints").empty())
      for (const auto& e : fs::directory_iterator(run + "/checkpoints", ec))
        if (e.path().filename().string().ends_with(".tmp")) staging = e.path().string();
    if (staging.empty()) std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  ASSERT_FALSE(staging.empty()) << "never saw a background write in flight:\n" << read_file(run + ".log");
  const auto listed = po::train::list_checkpoints(run + "/checkpoints");
  ASSERT_FALSE(listed.empty());
  for (const auto& ck : listed)
    EXPECT_NE(ck + ".tmp", staging) << "the checkpoint being written is listed as complete";
  // The previous one loads and verifies its checksums; the run resumes from it.
  const std::string newest = listed.back();
  auto r = po::test::run_command(std::string(PO_BINARY) + " export " + newest + " --out " + (dir_ / "w.safetensors"));
  EXPECT_EQ(r.exit_code, 0) << newest << " after a kill during the next write:\n" << r.output;
  const int64_t step = std::stoll(fs::path(newest).filename().string().substr(5));
  r = po::test::run_command(std::string(PO_BINARY) + " train -c " + config_ + " --set run.dir=" + run + big +
                            " --set train.steps=" + std::to_string(step + 2) + " --resume");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resuming from " + newest), std::string::npos) << r.output;
}

}  // namespace
