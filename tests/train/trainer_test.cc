// The trainer end to end in-process: loss falls, metrics.jsonl has the
// contract's fields, and a resumed run is bit-identical to an uninterrupted one.
#include "train/trainer.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "../test_util.h"
#include "backend/ops.h"
#include "checkpoint/sharded.h"
#include "core/config.h"
#include "core/error.h"
#include "train/launch.h"
#include "train/run_state.h"

namespace fs = std::filesystem;
using po::core::Config;

namespace {

using po::test::read_metrics;

struct Data : po::test::TinyData {
  Config config(const std::string& run, int steps) const {
    return Config::parse(config_text(run, steps), "test");
  }
};

TEST(Trainer, LossFallsAndMetricsHaveTheContractFields) {
  Data d;
  Config cfg = d.config("run", 30);
  cfg.set_override("train.lr=1e-2");
  auto r = po::train::train(cfg);
  EXPECT_EQ(r.steps, 30);
  auto m = read_metrics(r.run_dir);
  double first = -1, last = -1;
  int vals = 0;
  for (const auto& rec : m) {
    if (rec.contains("val_loss")) {
      ++vals;
      continue;
    }
    for (const char* k : {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu",
                          "peak_rss_bytes"})
      ASSERT_TRUE(rec.contains(k)) << "metrics record lacks '" << k << "': " << rec.dump();
    if (first < 0) first = rec["loss"];
    last = rec["loss"];
  }
  EXPECT_EQ(vals, 15) << "eval_interval = 2 over 30 steps";
  EXPECT_LT(last, first - 0.5) << "loss did not fall: first " << first << ", last " << last;
  EXPECT_TRUE(fs::exists(r.run_dir + "/config.toml"));
  EXPECT_EQ(po::train::list_checkpoints(r.run_dir + "/checkpoints").size(), 10u);
}

TEST(Trainer, ResumeIsBitIdentical) {
  Data d;
  auto full = po::train::train(d.config("full", 6));
  // Simulate a run interrupted after step 3: only its step-3 checkpoint exists.
  const std::string resumed = d.dir / "resumed";
  fs::create_directories(resumed + "/checkpoints");
  fs::copy(po::train::checkpoint_path(full.run_dir, 3), po::train::checkpoint_path(resumed, 3),
           fs::copy_options::recursive);
  Config cfg = d.config("resumed", 6);
  cfg.set_override("train.resume=true");
  auto r = po::train::train(cfg);
  EXPECT_EQ(r.steps, 6);
  // The step-6 shard files hold the same bytes (params, adam_m, adam_v, the
  // header with the step), and the manifests the same step, tokens and adam_t.
  const std::string a = po::train::checkpoint_path(full.run_dir, 6);
  const std::string b = po::train::checkpoint_path(resumed, 6);
  const std::string shard_a = po::test::read_file(a + "/rank_00000.bin");
  ASSERT_FALSE(shard_a.empty()) << a;
  EXPECT_TRUE(shard_a == po::test::read_file(b + "/rank_00000.bin"))
      << "the step-6 checkpoints differ between the uninterrupted and the resumed run";
  const auto ca = po::checkpoint::read_sharded_meta(a), cb = po::checkpoint::read_sharded_meta(b);
  EXPECT_EQ(ca.step, cb.step);
  EXPECT_EQ(ca.tokens, cb.tokens);
  EXPECT_EQ(ca.adam_t, cb.adam_t);
  // The losses of steps 4..6 are the same numbers too.
  auto ma = read_metrics(full.run_dir), mb = read_metrics(resumed);
  std::vector<double> la, lb;
  for (auto& x : ma) if (x.contains("loss") && x["step"] > 3) la.push_back(x["loss"]);
  for (auto& x : mb) if (x.contains("loss")) lb.push_back(x["loss"]);
  EXPECT_EQ(la, lb);
}

// The threads per rank are recorded (metrics, manifest), and a resume at
// another count says it will not give the uninterrupted run's bits.
TEST(Trainer, ResumeAtAnotherThreadCountWarns) {
  Data d;
  auto full = po::train::train(d.config("threads1", 3));  // tiny_config: train.threads = 1
  for (const auto& rec : read_metrics(full.run_dir)) {
    if (rec.contains("loss")) {
      EXPECT_EQ(rec.value("threads_per_rank", -1), 1) << "metrics record: " << rec.dump();
    }
  }
  EXPECT_EQ(po::checkpoint::read_sharded_meta(po::train::checkpoint_path(full.run_dir, 3)).threads, 1)
      << "the manifest does not record the writer's threads per rank";
  for (int threads : {1, 2}) {
    const std::string run = d.dir / ("resumed" + std::to_string(threads));
    fs::create_directories(run + "/checkpoints");
    fs::copy(po::train::checkpoint_path(full.run_dir, 3), po::train::checkpoint_path(run, 3),
             fs::copy_options::recursive);
    Config cfg = d.config("resumed" + std::to_string(threads), 4);
    cfg.set_override("train.resume=true");
    cfg.set_override("train.threads=" + std::to_string(threads));
    testing::internal::CaptureStderr();
    po::train::train(cfg);
    const std::string err = testing::internal::GetCapturedStderr();
    const bool warned = err.find("from a checkpoint written at 1") != std::string::npos;
    EXPECT_EQ(warned, threads != 1) << "resumed at " << threads << " threads per rank:\n" << err;
    EXPECT_EQ(po::checkpoint::read_sharded_meta(po::train::checkpoint_path(run, 4)).threads, threads);
  }
  po::backend::cpu::set_num_threads(1);
}

TEST(Trainer, GradientAccumulationMatchesOneBigMicroBatch) {
  Data d;
  Config a = d.config("accum", 3);
  Config b = d.config("whole", 3);
  b.set_override("train.micro_batch_size=4");
  auto ra = po::train::train(a);
  auto rb = po::train::train(b);
  EXPECT_NEAR(ra.last_loss, rb.last_loss, 1e-5 * rb.last_loss);
}

TEST(Trainer, RefusesToOverwriteAnExistingRun) {
  Data d;
  auto r = po::train::train(d.config("run", 3));
  const std::string before = po::test::read_file(r.run_dir + "/metrics.jsonl");
  EXPECT_THROW(po::train::train(d.config("run", 3)), po::core::InvalidArgument);
  EXPECT_EQ(before, po::test::read_file(r.run_dir + "/metrics.jsonl"));
}

}  // namespace

// train.precision = "auto" is bf16 exactly where the bf16 GEMM is native
// (here: forbidden and allowed in turn), and explicit values stay as given.
TEST(Trainer, PrecisionAutoFollowsTheNativeBf16Gemm) {
  namespace ops = po::backend::cpu;
  Data d;
  for (bool allow : {false, true}) {
    ops::allow_native_bf16_gemm(allow);
    Config cfg = d.config("auto", 1);
    cfg.set_override("train.precision=\"auto\"");
    const std::string want = ops::native_bf16_gemm() ? "bf16" : "fp32";
    EXPECT_EQ(po::train::resolve_precision(cfg), want) << "native bf16 GEMM allowed: " << allow;
    EXPECT_EQ(cfg.get_string("train.precision"), want);
    if (allow && !ops::native_bf16_gemm())
      std::printf("[ path     ] this CPU/BLAS has no native bf16 GEMM: auto is fp32 here\n");
  }
  Config cfg = d.config("fixed", 1);
  cfg.set_override("train.precision=\"fp32\"");
  EXPECT_EQ(po::train::resolve_precision(cfg), "fp32");
}

// MFU is against the GEMM peak of the precision the steps run in, and the
// start-up line says which.
TEST(Trainer, MfuNamesThePeakOfItsPrecision) {
  Data d;
  for (const char* precision : {"fp32", "bf16"}) {
    Config cfg = d.config(std::string("mfu_") + precision, 2);
    cfg.set_override(std::string("train.precision=\"") + precision + "\"");
    testing::internal::CaptureStderr();
    po::train::train(cfg);
    const std::string log = testing::internal::GetCapturedStderr();
    const std::string want = std::string(precision) == "bf16" ? "bf16 GEMM peak" : "sgemm peak";
    EXPECT_NE(log.find(want), std::string::npos)
        << precision << " run: the start-up line does not name the " << want << ":\n" << log;
  }
  po::backend::cpu::set_gemm_precision(po::backend::cpu::GemmPrecision::kF32);
}
