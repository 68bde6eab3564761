// Training with 8- and 4-bit Adam state (optim.state_bits) end to end in
// process: a resumed run is bit-identical to an uninterrupted one, a 32-bit
// checkpoint resumes at 8 bits by quantizing (and says so), the ledger
// counts the stored bytes, and what is not built yet is refused by name.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "../test_util.h"
#include "core/config.h"
#include "core/error.h"
#include "train/run_state.h"
#include "train/trainer.h"

namespace fs = std::filesystem;
using po::core::Config;

namespace {

struct Data : po::test::TinyData {
  Config config(const std::string& run, int steps, int bits) const {
    Config c = Config::parse(config_text(run, steps), "test");
    c.set_override("optim.state_bits=" + std::to_string(bits));
    return c;
  }
};

// Copies `from`'s step-`step` checkpoint into a new run directory `to`.
void seed_run(const std::string& from, const std::string& to, int step) {
  fs::create_directories(to + "/checkpoints");
  fs::copy(po::train::checkpoint_path(from, step), po::train::checkpoint_path(to, step),
           fs::copy_options::recursive);
}

std::vector<double> losses_after(const std::string& run, int step) {
  std::vector<double> out;
  for (auto& x : po::test::read_metrics(run))
    if (x.contains("loss") && x["step"] > step) out.push_back(x["loss"]);
  return out;
}

TEST(QuantizedState, ResumeIsBitIdentical) {
  for (int bits : {8, 4}) {
    Data d;
    auto full = po::train::train(d.config("full", 6, bits));
    const std::string resumed = d.dir / "resumed";
    seed_run(full.run_dir, resumed, 3);
    Config cfg = d.config("resumed", 6, bits);
    cfg.set_override("train.resume=true");
    testing::internal::CaptureStderr();
    auto r = po::train::train(cfg);
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_EQ(r.steps, 6);
    EXPECT_EQ(err.find("quantized"), std::string::npos) << bits << " bits: the moments were re-quantized:\n" << err;
    const std::string a = po::test::read_file(po::train::checkpoint_path(full.run_dir, 6) + "/rank_00000.bin");
    ASSERT_FALSE(a.empty());
    EXPECT_TRUE(a == po::test::read_file(po::train::checkpoint_path(resumed, 6) + "/rank_00000.bin"))
        << bits << " bits: the step-6 checkpoints differ between the uninterrupted and the resumed run";
    EXPECT_EQ(losses_after(full.run_dir, 3), losses_after(resumed, 0)) << bits << " bits";
  }
}

TEST(QuantizedState, A32BitCheckpointResumesQuantized) {
  Data d;
  auto full = po::train::train(d.config("full32", 6, 32));
  const std::string resumed = d.dir / "at8";
  seed_run(full.run_dir, resumed, 3);
  Config cfg = d.config("at8", 6, 8);
  cfg.set_override("train.resume=true");
  testing::internal::CaptureStderr();
  auto r = po::train::train(cfg);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(r.steps, 6);
  EXPECT_NE(err.find("blocks of Adam's moments to 8 bits"), std::string::npos)
      << "the log does not say the 32-bit moments were quantized:\n" << err;
  // Quantized moments move the steps after it a little, not far.
  const auto a = losses_after(full.run_dir, 3), b = losses_after(resumed, 0);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-2 * a[i]) << "step " << 4 + i;
}

TEST(QuantizedState, LedgerCountsTheStoredMoments) {
  // The trainer's predicted bytes (metrics.jsonl) follow the state's width:
  // 8 and 4 bits hold less than 32 by their moments' bytes.
  Data d;
  double predicted[3] = {0, 0, 0};
  int i = 0;
  for (int bits : {32, 8, 4}) {
    Config cfg = d.config("ledger" + std::to_string(bits), 1, bits);
    cfg.set_override("optim.state_bits_exclude=\"\"");  // every tensor of >= 4096 elements
    auto r = po::train::train(cfg);
    for (const auto& rec : po::test::read_metrics(r.run_dir))
      if (rec.contains("predicted_bytes")) predicted[i] = rec["predicted_bytes"].get<double>();
    ++i;
  }
  EXPECT_GT(predicted[0], predicted[1]);
  EXPECT_GT(predicted[1], predicted[2]);
}

void expect_refused(Config cfg, const std::vector<std::string>& needles) {
  try {
    (void)po::train::train(cfg);
    ADD_FAILURE() << "trained; expected a refusal naming " << needles.front();
  } catch (const po::core::Error& e) {
    for (const auto& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << "'" << n << "' not in: " << e.what();
  }
}

TEST(QuantizedState, RefusesWhatIsNotBuiltAndBadKeys) {
  Data d;
  expect_refused(d.config("b", 2, 16), {"optim.state_bits = 16", "32, 8, 4"});
  Config block = d.config("k", 2, 8);
  block.set_override("optim.block_size=100");
  expect_refused(block, {"optim.block_size = 100", "power of two"});
  Config exclude = d.config("e", 2, 8);
  exclude.set_override("optim.state_bits_exclude=\"wte.weight lm_hed\"");
  expect_refused(exclude, {"optim.state_bits_exclude", "'lm_hed'"});
}

}  // namespace
