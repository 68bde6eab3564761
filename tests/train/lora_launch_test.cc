// Adapters ([lora]) through the binary: the tiny GPT-2 trains its adapters
// on a frozen base; checkpoints hold the adapters alone and resume bit for
// bit (the base comes from model.init again); data parallel at ZeRO 0-3 gives
// the one-process weights bit for bit (one thread per rank), context parallel
// within 1e-5; a base loaded from a weights
// file with fresh adapters (B = 0) gives that model's first loss bit for bit;
// what is not built yet is refused with a one-line error naming its keys.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "checkpoint/gpt2_io.h"
#include "checkpoint/manifest.h"
#include "checkpoint/peft.h"
#include "checkpoint/safetensors.h"
#include "model/transformer.h"
#include "train/run_state.h"

#include "../test_util.h"
#include "lora_export_check.h"

namespace {

using po::test::losses;

constexpr int kSteps = 12;
const std::string kLora =
    " --set lora.r=4 --set lora.alpha=8 --set 'lora.targets=\"c_attn attn.c_proj c_fc mlp.c_proj\"'"
    " --set train.lr=1e-2 --set train.min_lr=1e-3";

class LoraTraining : public po::test::TinyTraining {
 protected:
  int steps() const override { return kSteps; }
};

TEST_F(LoraTraining, AdaptersTrainOnAFrozenBaseAndResumeBitForBit) {
  const std::string full = train_ok("full", 1, kLora);
  const std::vector<double> l = losses(full, kSteps);
  EXPECT_LT(l.back(), l.front()) << "the adapters did not learn: loss " << l.front() << " -> " << l.back();
  // The checkpoint holds the adapters: nothing in the embedding and head units,
  // A [4, 32] and B [out, 4] of the four linears in each block.
  const po::checkpoint::Manifest m =
      po::checkpoint::read_manifest(po::train::checkpoint_path(full, kSteps));
  const int64_t C = 32, r = 4;
  const std::vector<int64_t> block_numel = {r * C + 3 * C * r + r * C + C * r + r * C + 4 * C * r +
                                            r * 4 * C + C * r};
  ASSERT_EQ(m.unit_numel.size(), 4u);
  EXPECT_EQ(m.unit_numel[0], 0);
  EXPECT_EQ(m.unit_numel[1], block_numel[0]);
  EXPECT_EQ(m.unit_numel[2], block_numel[0]);
  EXPECT_EQ(m.unit_numel[3], 0);
  // Resumed from step 6, with the base rebuilt from model.init.
  const std::string resumed = dir_ / "resumed";
  std::filesystem::create_directories(resumed + "/checkpoints");
  std::filesystem::copy(po::train::checkpoint_path(full, 6), po::train::checkpoint_path(resumed, 6),
                        std::filesystem::copy_options::recursive);
  const auto r2 = run_train("resumed", 1, kLora + " --set train.resume=true");
  ASSERT_EQ(r2.exit_code, 0) << r2.output;
  po::test::expect_same_checkpoint(full, resumed, kSteps, "resumed from step 6");
}

TEST_F(LoraTraining, DataParallelStagesGiveTheOneProcessBits) {
  const std::string one = train_ok("one", 1, kLora);
  for (int stage : {0, 1, 2, 3}) {
    const std::string run = train_ok("dp2_s" + std::to_string(stage), 2,
                                     kLora + " --set parallel.zero_stage=" + std::to_string(stage));
    const std::string what = "dp 2 ZeRO-" + std::to_string(stage);
    // (The logged loss is a mean over the ranks, in another order: close, the weights equal.)
    po::test::expect_same_curve(losses(run, kSteps), losses(one, kSteps), what);
    po::test::expect_close_weights(one, run, kSteps, 0.0, what);
  }
}

// Dropout's masks follow a token's place in the step's global batch: two
// ranks, or micro-batches of 1, draw the one process's masks (the weights
// bit for bit at dp 2 ZeRO-0, as without dropout); they differ from no
// dropout; validation does not drop.
TEST_F(LoraTraining, DropoutMasksFollowTheGlobalBatchNotTheLayout) {
  const std::string drop = kLora + " --set lora.dropout=0.3";
  const std::string one = train_ok("one", 1, drop);
  const std::string dp2 = train_ok("dp2", 2, drop);
  po::test::expect_same_curve(losses(dp2, kSteps), losses(one, kSteps), "dropout, dp 2");
  po::test::expect_close_weights(one, dp2, kSteps, 0.0, "dropout, dp 2");
  const std::string micro1 = train_ok("micro1", 1, drop + " --set train.micro_batch_size=1");
  po::test::expect_close_weights(one, micro1, kSteps, 1e-5, "dropout, micro-batches of 1");
  const std::string none = train_ok("none", 1, kLora);
  const std::vector<double> a = losses(one, kSteps), b = losses(none, kSteps);
  // (B = 0 at step 1: its loss is the base's either way; the masks change B's first update.)
  EXPECT_EQ(a[0], b[0]) << "fresh adapters (B = 0) add nothing, dropped or not";
  EXPECT_NE(a[1], b[1]) << "lora.dropout = 0.3 changed nothing";
}

TEST_F(LoraTraining, ContextParallelTrainsAsOneProcess) {
  const std::string one = train_ok("one", 1, kLora);
  const auto r = po::test::run_command(po::test::pagedoptim_command(
      2, "train -c " + config_ + " --set run.dir=" + (dir_ / "cp2") +
             " --set parallel.dp=1 --set parallel.cp=2" + kLora));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  po::test::expect_same_curve(losses(dir_ / "cp2", kSteps), losses(one, kSteps), "cp 2");
  // (Context parallel sums attention blocks and gradient rows in another
  // order: close, as for full training, docs/context-parallel.md.)
  po::test::expect_close_weights(one, dir_ / "cp2", kSteps, 1e-5, "cp 2");
}

TEST_F(LoraTraining, Bf16AndActivationCheckpointingTrain) {
  const std::string plain = train_ok("plain", 1, kLora);
  const std::string ckpt = train_ok("ckpt", 1, kLora + " --set model.activation_checkpointing=true");
  EXPECT_EQ(losses(ckpt, kSteps), losses(plain, kSteps)) << "activation checkpointing changed the losses";
  const std::string bf16 = train_ok("bf16", 1, kLora + " --set train.precision=bf16");
  const std::vector<double> l = losses(bf16, kSteps), f = losses(plain, kSteps);
  EXPECT_LT(l.back(), l.front()) << "bf16: loss " << l.front() << " -> " << l.back();
  for (int s = 0; s < kSteps; ++s)
    EXPECT_NEAR(l[static_cast<size_t>(s)], f[static_cast<size_t>(s)], 5e-3 * f[static_cast<size_t>(s)])
        << "bf16 against fp32, the loss at step " << s + 1;
}

// The golden GPT-2 (2 layers, 64 wide, vocabulary 512) as model.init: with
// fresh adapters (B = 0) the first loss is the plain model's, bit for bit.
TEST_F(LoraTraining, ABaseFromAWeightsFileGivesItsFirstLoss) {
  const std::string init = std::string(PO_SOURCE_DIR) + "/tests/golden/gpt2_ref.safetensors";
  const std::string shape = " --set model.init=" + init +
                            " --set model.n_embd=64 --set model.n_head=4 --set model.vocab_size=512"
                            " --set model.seq_len=32 --set train.steps=1 --set train.checkpoint_interval=0";
  const std::string plain = train_ok("plain_init", 1, shape);
  const std::string adapted = train_ok("lora_init", 1, shape + kLora);
  EXPECT_EQ(losses(adapted, 1), losses(plain, 1)) << "the base under fresh adapters is not the file's model";
}

// `export --adapter` writes what PEFT reads (checked by a stdlib reader,
// tests/train/peft_files.py); `export` writes the merged model, whose logits
// are those of the base (train.seed's init) with the exported adapters.
TEST_F(LoraTraining, ExportsAPeftAdapterAndTheMergedModel) {
  const std::string run = train_ok("run", 1, kLora);
  const std::string peft = dir_ / "peft", merged = dir_ / "merged.safetensors";
  po::test::export_adapter_and_merged(run, peft, merged);
  const auto check = po::test::run_command(
      "python3 " + std::string(PO_SOURCE_DIR) + "/tests/train/peft_files.py " + peft +
      " '{\"attn.c_attn\": [32, 96], \"attn.c_proj\": [32, 32], \"mlp.c_fc\": [32, 128], "
      "\"mlp.c_proj\": [128, 32]}'");
  EXPECT_EQ(check.exit_code, 0) << check.output;
  EXPECT_NE(check.output.find("ok: 8 modules"), std::string::npos) << check.output;
  po::test::expect_merged_export_logits(peft, merged, po::model::WeightQuant::kNone,
                                        "the merged export's logits");
}

// lora.init = a PEFT directory (tests/golden/peft_gpt2, written by numpy): the
// run starts from those adapters; exported again, they are the same values.
TEST_F(LoraTraining, APeftAdapterStartsTheRunAndExportsBackUnchanged) {
  const std::string golden = std::string(PO_SOURCE_DIR) + "/tests/golden/";
  const std::string run = train_ok(
      "from_peft", 1,
      " --set model.init=" + golden + "gpt2_ref.safetensors --set model.n_embd=64 --set model.n_head=4"
      " --set model.vocab_size=512 --set model.seq_len=32 --set train.steps=0"
      " --set lora.init=" + golden + "peft_gpt2");
  const std::string out = dir_ / "again";
  const auto r = po::test::run_command(std::string(PO_BINARY) + " export " + run + " --adapter --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto want = po::checkpoint::SafetensorsReader::open(golden + "peft_gpt2/adapter_model.safetensors");
  const auto got = po::checkpoint::SafetensorsReader::open(out + "/adapter_model.safetensors");
  ASSERT_EQ(got.names().size(), want.names().size());
  for (const std::string& n : want.names()) {
    ASSERT_TRUE(got.has(n)) << n;
    EXPECT_EQ(got.read_f32(n, want.get(n).shape), want.read_f32(n, want.get(n).shape)) << n;
  }
  // Another r than the adapter's is refused, naming both.
  const auto bad = run_train("bad_r", 1, " --set lora.r=8 --set lora.init=" + golden + "peft_gpt2");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("lora.r = 8 but lora.init"), std::string::npos) << bad.output;
}

// Paging (memory.compute_budget, memory.nvme_dir) pages what trains, the
// adapters with their gradients and Adam state; with 6 frames of 4 KiB the
// run is the in-memory one bit for bit, at ZeRO 1 on 2 ranks too.
TEST_F(LoraTraining, PagedAdaptersTrainAsInMemory) {
  for (int run_case : {1, 2, 3}) {
    const int dp = run_case == 2 ? 2 : 1;
    // r 16: 16,384 adapter parameters, whose state takes about 50 pages of 4 KiB;
    // case 3 on an NF4 base (QLoRA).
    const std::string base = kLora + " --set lora.r=16 --set parallel.zero_stage=1" +
                             (run_case == 3 ? " --set model.quant=nf4" : "");
    const std::string tag = std::to_string(run_case);
    const std::string ref = train_ok("ref" + tag, dp, base);
    const std::string paged = base + " --set memory.page_size=4KiB --set memory.nvme_dir=" +
                              (dir_ / ("swap" + tag));
    auto probe = run_train("probe", dp, paged + " --set memory.compute_budget=1");
    ASSERT_NE(probe.exit_code, 0) << "a 1-byte compute budget was accepted";
    const int64_t minimum = po::test::named_minimum_budget(probe.output);
    ASSERT_GT(minimum, 0) << probe.output;
    std::filesystem::remove_all(dir_ / "probe");
    const std::string run = train_ok("paged" + tag, dp,
                                     paged + " --set memory.compute_budget=" + std::to_string(minimum + 2 * 4096));
    const std::string what = "adapters paged, dp " + std::to_string(dp) + (run_case == 3 ? ", NF4 base" : "");
    EXPECT_EQ(losses(run, kSteps), losses(ref, kSteps)) << what;
    po::test::expect_same_checkpoint(ref, run, kSteps, what);
    double read = 0;
    std::string record;
    for (const auto& j : po::test::read_metrics(run))
      if (j.contains("paging")) {
        read += j["paging"].value("nvme_read_bytes", 0.0) + j["paging"].value("host_read_bytes", 0.0);
        record = j["paging"].dump();
      }
    EXPECT_GT(read, 0) << what << ": no page was read back; the last step's paging: " << record;
  }
}

TEST_F(LoraTraining, WhatIsNotBuiltIsRefusedNamingItsKeys) {
  struct Case {
    std::string args, want;
  };
  const Case cases[] = {
      {kLora + " --set parallel.pp=2 --set parallel.vocab_parallel=true",
       "lora.r = 4 with parallel.vocab_parallel is not built yet"},
      {kLora + " --set parallel.tp=2", "lora.r = 4 with parallel.tp = 2 is not built yet"},
      {kLora + " --set lora.dropout=0.1 --set lora.dora=true",
       "lora.dropout = 0.1 with lora.dora = true is not built yet"},
      {kLora + " --set lora.dropout=0.1 --set parallel.cp=2", "lora.dropout > 0 with parallel.cp = 2 is not built yet"},
      {kLora + " --set 'lora.targets=\"c_attn q_proj\"'", "lora.targets: 'q_proj' is not a linear layer"},
  };
  for (const Case& c : cases) {
    const int np = c.args.find("=2") != std::string::npos ? 2 : 1;
    const auto r = po::test::run_command(po::test::pagedoptim_command(
        np, "train -c " + config_ + " --set run.dir=" + (dir_ / "refused") + " --set parallel.dp=1" +
                c.args));
    EXPECT_NE(r.exit_code, 0) << c.args << " was accepted";
    EXPECT_NE(r.output.find(c.want), std::string::npos) << c.args << ": " << r.output;
  }
}

}  // namespace
