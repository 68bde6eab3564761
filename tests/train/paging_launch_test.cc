// Paged optimizer state in real training runs (memory.*): with a compute
// budget that keeps only a few pages resident (every page evicted to the NVMe
// swap file every step), training is bit for bit the in-memory run — losses
// and every byte of the checkpoint (parameters, Adam m, v) — at dp 1 and 2,
// ZeRO stages 0, 1 and 3, in bf16 at stages 3, 1 and 0 (the fp32 master paged
// too, sharded and whole), with the backward's activations lent to the pager
// (and once without), through the
// thread-pool I/O fallback and with a host tier. Swap files are gone after a
// normal exit and after SIGTERM; a paged run's checkpoint resumes unpaged
// with the same curve; a budget below the working set is refused with the
// minimum.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "../test_util.h"
#include "train/run_state.h"

namespace fs = std::filesystem;

namespace {

using po::test::losses;
using po::test::run_command;

constexpr const char* kPage = "16KiB";

class Paging : public po::test::TinyTraining {
 protected:
  int steps() const override { return 10; }
  // The flags every run here takes, after run.dir and parallel.dp.
  static std::string args(int stage, const std::string& extra) {
    return "--set parallel.zero_stage=" + std::to_string(stage) +
           " --set model.n_embd=36 --set model.n_layer=4 --set train.grad_clip=0.5" +
           " --set train.checkpoint_interval=5 --set train.eval_interval=0" +
           " --set train.batch_size=8 --set train.micro_batch_size=2 --set train.threads=1" +
           " --set train.peak_gflops=1 " + extra;
  }
  po::test::CommandResult run(const std::string& name, int dp, int stage, const std::string& extra) {
    return run_train(name, dp, args(stage, extra));
  }
  std::string train(const std::string& name, int dp, int stage, const std::string& extra = "") {
    return train_ok(name, dp, args(stage, extra));
  }
  // The compute budget that leaves `pages` frames: the minimum the engine
  // names for a budget of 1 byte (its 4 minimum frames included), plus the rest.
  std::string budget(int dp, int stage, const std::string& extra, int pages) {
    auto r = run("probe", dp, stage, extra + " --set memory.compute_budget=1");
    EXPECT_NE(r.exit_code, 0) << "a 1-byte compute budget was accepted";
    const int64_t minimum = po::test::named_minimum_budget(r.output);
    EXPECT_GT(minimum, 0) << "no minimum named:\n" << r.output;
    fs::remove_all(dir_ / "probe");
    return std::to_string(minimum + (pages - 4) * 16384);
  }
  std::string paged(const std::string& swap) const {
    return std::string(" --set memory.page_size=") + kPage + " --set memory.nvme_dir=" + swap;
  }
};

std::vector<nlohmann::json> paging_records(const std::string& run) {
  std::vector<nlohmann::json> out;
  for (const auto& j : po::test::read_metrics(run))
    if (j.contains("paging")) out.push_back(j["paging"]);
  return out;
}


TEST_F(Paging, BitIdenticalToInMemoryWhenEveryPageIsEvictedEveryStep) {
  struct Case {
    int dp, stage;
    std::string extra;
  };
  // Every case without memory.lend_activations=false lends the backward's
  // dead activations to the pager (reads during the backward, writes behind
  // the next forward): stages 0, 1 and 3, fp32 and bf16, below.
  const std::vector<Case> cases = {
      {1, 0, ""},
      {1, 1, ""},
      {1, 3, ""},
      {2, 1, "--set train.precision=bf16"},
      {2, 1, "--set memory.lend_activations=false"},
      {2, 1, ""},
      {2, 3, ""},
      {2, 3, "--set train.precision=bf16"},
      {2, 0, "--set train.precision=bf16"},
      {1, 1, "--set memory.io=fallback"},
      {2, 1, "--set memory.host_budget=160KiB"},
      // Pages updated during the backward, as their units' gradients land
      // (bit for bit the sweep; at stages 0-1 with several ranks a bucket's
      // pages go early only if its all-reduce is seen landed in time, so the
      // count is checked where it cannot depend on timing):
      {2, 3, "--set train.grad_clip=0 --set memory.update_in_backward=true"},
      {1, 0, "--set train.grad_clip=0 --set memory.update_in_backward=true"},
      {2, 1, "--set train.grad_clip=0 --set memory.update_in_backward=true"},
      {2, 2, "--set train.grad_clip=0 --set memory.update_in_backward=true --set train.precision=bf16"},
      {2, 0, "--set train.grad_clip=0 --set memory.update_in_backward=true --set train.precision=bf16"},
  };
  for (const Case& c : cases) {
    const std::string what = "dp " + std::to_string(c.dp) + " stage " + std::to_string(c.stage) +
                             " " + c.extra;
    // The memory.io / host settings do not change the in-memory reference.
    std::string ref_extra;  // c.extra without its memory.* settings
    {
      std::istringstream in(c.extra);
      for (std::string flag, kv; in >> flag >> kv;)
        if (!kv.starts_with("memory.")) ref_extra += " " + flag + " " + kv;
    }
    const std::string tag = std::to_string(c.dp) + std::to_string(c.stage) +
                            std::to_string(&c - cases.data());
    const std::string ref = train("ref" + tag, c.dp, c.stage, ref_extra);
    const std::string swap = dir_ / ("swap" + tag);
    const std::string extra = c.extra + paged(swap);
    const std::string run = train("paged" + tag, c.dp, c.stage,
                                  extra + " --set memory.compute_budget=" +
                                      budget(c.dp, c.stage, extra, 6));
    const auto a = losses(ref, 10), b = losses(run, 10);
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_EQ(a[i], b[i]) << what << ": loss at step " << i + 1 << " paged vs in memory";
    po::test::expect_same_checkpoint(ref, run, 10, what + " paged");
    const auto rec = paging_records(run);
    ASSERT_EQ(rec.size(), 10u) << what << ": paging metrics per step";
    const bool early = c.extra.find("update_in_backward") != std::string::npos;
    const bool lends = c.extra.find("lend_activations=false") == std::string::npos;
    for (size_t i = 1; i < rec.size(); ++i) {
      EXPECT_EQ(rec[i]["lent_frames"].get<double>() > 0, lends) << what << ": step " << i + 1;
      if (lends && !early && c.extra.find("host_budget") == std::string::npos) {
        EXPECT_GT(rec[i]["lent_read_bytes"].get<double>(), 0)
            << what << ": step " << i + 1 << ": no page was read into lent frames during the backward";
      }
      if (c.extra.find("host_budget") != std::string::npos) {
        EXPECT_GT(rec[i]["host_read_bytes"].get<double>(), 0) << what << ": step " << i + 1;
      } else {
        EXPECT_GT(rec[i]["nvme_read_bytes"].get<double>(), 0) << what << ": step " << i + 1;
        EXPECT_GT(rec[i]["nvme_written_bytes"].get<double>(), 0) << what << ": step " << i + 1;
      }
    }
    const auto per_rank = po::test::last_metric(run, "paging_per_rank");
    ASSERT_EQ(per_rank.size(), static_cast<size_t>(c.dp)) << what << ": paging_per_rank";
    for (size_t r = 0; r < per_rank.size(); ++r) {
      const char* key = c.extra.find("host_budget") != std::string::npos ? "host_read_bytes"
                                                                         : "nvme_read_bytes";
      EXPECT_GT(per_rank[r][key].get<double>(), 0) << what << ": rank " << r << " " << key;
      if (c.extra.find("grad_clip=0") != std::string::npos && (c.dp == 1 || c.stage >= 2)) {
        EXPECT_GT(per_rank[r]["pages_updated_in_backward"].get<double>(), 0)
            << what << ": rank " << r << ": no page was updated during the backward";
      }
    }
    EXPECT_TRUE(fs::is_empty(swap)) << what << ": swap files left in " << swap;
  }
}

// Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention, untied head) goes
// where GPT-2 goes: dp 2, ZeRO-3, paged to NVMe is bit-identical to in
// memory; it resumes bit-identically; its checkpoint reshards to dp 1.
TEST_F(Paging, LlamaPagedZero3IsBitIdenticalResumesAndReshards) {
  const std::string llama = " --set model.arch=llama --set model.n_head=6 --set model.n_kv_head=2";
  const std::string ref = train("llama_ref", 2, 3, llama);
  const std::string swap = dir_ / "llama_swap";
  const std::string extra = llama + paged(swap);
  const std::string run =
      train("llama_paged", 2, 3, extra + " --set memory.compute_budget=" + budget(2, 3, extra, 6));
  const auto a = losses(ref, 10), b = losses(run, 10);
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(a[i], b[i]) << "Llama dp 2 ZeRO-3: loss at step " << i + 1 << " paged vs in memory";
  po::test::expect_same_checkpoint(ref, run, 10, "Llama dp 2 ZeRO-3 paged");
  EXPECT_GT(paging_records(run).back()["nvme_read_bytes"].get<double>(), 0)
      << "Llama: no page came from NVMe";
  // Resume the paged run from step 5, paged again: the uninterrupted curve, bit for bit.
  const std::string resumed = copy_checkpoint(run, 5, "llama_resumed");
  train("llama_resumed", 2, 3,
        "--resume" + extra + " --set memory.compute_budget=" + budget(2, 3, extra, 6));
  const auto tail = losses(resumed, 5);
  for (size_t i = 0; i < tail.size(); ++i)
    EXPECT_EQ(tail[i], b[5 + i]) << "Llama step " << i + 6 << ": resumed vs uninterrupted";
  // Reshard: dp 1 stage 0 from the dp 2 ZeRO-3 checkpoint follows the curve
  // (fp32, another reduction order).
  const std::string one = copy_checkpoint(ref, 5, "llama_dp1");
  train("llama_dp1", 1, 0, "--resume" + llama);
  const auto tail1 = losses(one, 5);
  for (size_t i = 0; i < tail1.size(); ++i)
    EXPECT_NEAR(tail1[i], a[5 + i], 1e-5 * a[5 + i])
        << "Llama step " << i + 6 << ": resharded to dp 1 vs dp 2 ZeRO-3";
}

// 8- and 4-bit Adam state (optim.state_bits) in pages: codes with their
// blocks' scales, the units moved onto the blocks' grid at ZeRO-0, the
// 32-bit tensors' moments (the token table, c_attn: under 4096 elements) in
// side pages (and, with no master or shards in the pages, nowhere else). Every page evicted to NVMe every step, the run is bit for bit
// the in-memory run at the same width, sweep and early updates alike, and a
// paged run resumes paged on its own curve with nothing re-quantized.
TEST_F(Paging, QuantizedStatePagesBitIdenticalToInMemory) {
  struct Case {
    int dp, stage, bits;
    std::string extra;
  };
  const std::vector<Case> cases = {
      {1, 0, 8, ""},
      {1, 0, 4, "--set train.precision=bf16"},
      {2, 1, 8, "--set train.precision=bf16"},
      {2, 3, 4, ""},
      {2, 3, 8, "--set train.precision=bf16"},
      {1, 0, 8, "--set train.grad_clip=0 --set memory.update_in_backward=true"},
      {2, 2, 4, "--set train.grad_clip=0 --set memory.update_in_backward=true --set train.precision=bf16"},
      // fp32 at ZeRO 0-2 (nothing else per element in the pages): the 32-bit
      // tensors take no place in the state pages, only in the side pages.
      {2, 2, 4, ""},
      {2, 1, 8, "--set train.grad_clip=0 --set memory.update_in_backward=true"},
  };
  for (const Case& c : cases) {
    const std::string bits = " --set optim.state_bits=" + std::to_string(c.bits);
    const std::string what = "dp " + std::to_string(c.dp) + " stage " + std::to_string(c.stage) + " " +
                             std::to_string(c.bits) + "-bit " + c.extra;
    std::string ref_extra;  // c.extra without its memory.* settings
    {
      std::istringstream in(c.extra);
      for (std::string flag, kv; in >> flag >> kv;)
        if (!kv.starts_with("memory.")) ref_extra += " " + flag + " " + kv;
    }
    const std::string tag = "q" + std::to_string(&c - cases.data());
    const std::string ref = train(tag + "ref", c.dp, c.stage, ref_extra + bits);
    const std::string extra = c.extra + bits + paged(dir_ / (tag + "swap"));
    const std::string run = train(tag + "paged", c.dp, c.stage,
                                  extra + " --set memory.compute_budget=" + budget(c.dp, c.stage, extra, 6));
    const auto a = losses(ref, 10), b = losses(run, 10);
    ASSERT_EQ(a.size(), 10u) << what;
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_EQ(a[i], b[i]) << what << ": loss at step " << i + 1 << " paged vs in memory";
    po::test::expect_same_checkpoint(ref, run, 10, what + " paged");
    const auto rec = paging_records(run);
    ASSERT_EQ(rec.size(), 10u) << what;
    EXPECT_GT(rec.back()["nvme_read_bytes"].get<double>(), 0) << what << ": no page came from NVMe";
    // (At stages 0-1 with several ranks a page goes early only if its bucket's
    // all-reduce is seen landed in time: checked where timing cannot matter.)
    if (c.extra.find("update_in_backward") != std::string::npos && (c.dp == 1 || c.stage >= 2)) {
      EXPECT_GT(po::test::last_metric(run, "paging_per_rank")[0]["pages_updated_in_backward"].get<double>(), 0)
          << what << ": no page was updated during the backward";
    }
    if (&c - cases.data() > 2) continue;
    // Resumed paged from step 5: the uninterrupted curve and checkpoint.
    const std::string resumed = copy_checkpoint(run, 5, tag + "resumed");
    const auto r = run_train(tag + "resumed", c.dp,
                             args(c.stage, "--resume " + extra + " --set memory.compute_budget=" +
                                               budget(c.dp, c.stage, extra, 6)));
    ASSERT_EQ(r.exit_code, 0) << what << " resumed:\n" << r.output;
    EXPECT_EQ(r.output.find("blocks of Adam's moments"), std::string::npos) << what << ": moments re-quantized on resume:\n"
                                                             << r.output;
    const auto tail = losses(resumed, 5);
    ASSERT_EQ(tail.size(), 5u) << what;
    for (size_t i = 0; i < tail.size(); ++i)
      EXPECT_EQ(tail[i], b[5 + i]) << what << ": step " << i + 6 << " resumed vs uninterrupted";
    po::test::expect_same_checkpoint(run, resumed, 10, what + " resumed");
  }
}

// The checkpoint of a paged run (the pages copied out) resumes in memory,
// and an in-memory run's checkpoint resumes paged: the continued curves are
// the uninterrupted runs'.
TEST_F(Paging, CheckpointsMoveBetweenPagedAndUnpagedRuns) {
  const std::string swap = dir_ / "swap";
  const std::string extra = paged(swap);
  const std::string src =
      train("src", 2, 3, extra + " --set memory.compute_budget=" + budget(2, 3, extra, 6));
  const auto full = losses(src, 10);
  const std::string run = copy_checkpoint(src, 5, "resumed");
  train("resumed", 2, 1, "--resume");
  const auto tail = losses(run, 5);
  for (size_t i = 0; i < tail.size(); ++i)
    EXPECT_NEAR(tail[i], full[5 + i], 1e-5 * full[5 + i])
        << "step " << i + 6 << ": resumed unpaged (dp 2 stage 1) vs the paged run (dp 2 stage 3)";
  // And back: an unpaged checkpoint resumes paged (stage 1, Adam state loaded into the pages).
  const std::string plain = train("plain", 1, 1);
  const auto want = losses(plain, 10);
  const std::string again = copy_checkpoint(plain, 5, "repaged");
  const std::string extra1 = paged(dir_ / "swap1");
  train("repaged", 1, 1,
        "--resume" + extra1 + " --set memory.compute_budget=" + budget(1, 1, extra1, 6));
  const auto tail2 = losses(again, 5);
  for (size_t i = 0; i < tail2.size(); ++i)
    EXPECT_EQ(tail2[i], want[5 + i]) << "step " << i + 6 << ": unpaged checkpoint resumed paged";
  // At ZeRO-0 every rank pages all of Adam's state: a dp 2 checkpoint resumed
  // paged loads whole units into the pages (it once staged a shard's worth:
  // a heap overflow, and the other rank's half left at zero).
  const std::string plain2 = train("plain2", 2, 0);
  const auto want2 = losses(plain2, 10);
  const std::string again2 = copy_checkpoint(plain2, 5, "repaged2");
  const std::string extra2 = paged(dir_ / "swap2");
  train("repaged2", 2, 0, "--resume" + extra2 + " --set memory.compute_budget=" + budget(2, 0, extra2, 6));
  const auto tail3 = losses(again2, 5);
  ASSERT_EQ(tail3.size(), 5u);
  for (size_t i = 0; i < tail3.size(); ++i)
    EXPECT_EQ(tail3[i], want2[5 + i]) << "step " << i + 6 << ": dp 2 ZeRO-0 checkpoint resumed paged";
}

// SIGTERM (to the process, and to the --nproc launcher, which passes it on)
// removes the swap files before the process ends.
TEST_F(Paging, SwapFilesAreRemovedOnSigterm) {
  for (int dp : {1, 2}) {
    const std::string swap = dir_ / ("sigswap" + std::to_string(dp));
    const std::string log = dir_ / ("sig" + std::to_string(dp) + ".log");
    const std::string extra =
        paged(swap) + " --set train.steps=100000 --set train.checkpoint_interval=0";
    const std::string cmd = std::string(PO_BINARY) + " train -c " + config_ +
                            " --set run.dir=" + (dir_ / ("sig" + std::to_string(dp))) +
                            " --set parallel.dp=" + std::to_string(dp) + " " +
                            args(1, extra + " --set memory.compute_budget=" +
                                        budget(dp, 1, extra, 6)) +
                            (dp > 1 ? " --nproc 2" : "") + " > " + log + " 2>&1 & echo $!";
    auto r = run_command(cmd);
    const int pid = std::stoi(r.output);
    bool seen = false;
    for (int i = 0; i < 300 && !seen; ++i) {
      usleep(100000);
      std::error_code ec;
      seen = fs::exists(swap, ec) && !fs::is_empty(swap, ec);
    }
    ASSERT_TRUE(seen) << "dp " << dp << ": no swap file appeared:\n" << po::test::read_file(log);
    kill(pid, SIGTERM);
    bool gone = false;
    for (int i = 0; i < 150 && !gone; ++i) {
      usleep(100000);
      gone = kill(pid, 0) != 0;
    }
    if (!gone) kill(pid, SIGKILL);
    EXPECT_TRUE(gone) << "dp " << dp << ": still running 15 s after SIGTERM";
    // The launcher returns only once every worker has exited and cleaned up:
    // at that moment no worker runs and no swap file is left (no grace period).
    const auto workers = run_command("pgrep -f -- '[r]un.dir=" + std::string(dir_ / ("sig" + std::to_string(dp))) + "' || true");
    std::string left;
    for (const auto& e : fs::directory_iterator(swap)) left += " " + e.path().filename().string();
    EXPECT_EQ(workers.output, "") << "dp " << dp << ": workers still running when the launcher returned";
    EXPECT_TRUE(left.empty()) << "dp " << dp << ": swap files left after SIGTERM in " << swap << ":" << left;
  }
}

TEST_F(Paging, ABudgetBelowTheWorkingSetNamesTheMinimum) {
  auto r = run("small", 1, 1, paged(dir_ / "s") + " --set memory.compute_budget=256KiB");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("memory.compute_budget = 262144 bytes is too small"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("at least"), std::string::npos) << r.output;
  // Pages beyond the compute and host tiers need a swap directory.
  const std::string extra = " --set memory.page_size=16KiB --set memory.host_budget=64KiB";
  r = run("nodir", 1, 1, extra + " --set memory.compute_budget=" + budget(1, 1, extra, 6));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("memory.nvme_dir"), std::string::npos) << r.output;
}

}  // namespace
