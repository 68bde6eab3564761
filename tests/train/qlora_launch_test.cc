// QLoRA (model.quant = nf4 | int8) through the binary: the tiny GPT-2's base
// is quantized at load, its adapters train and resume bit for bit (the base
// quantized again from model.init), data parallel gives the one-process
// weights bit for bit, the merged export is the decoded base plus the
// adapters, and bad keys get one-line errors naming them. The math against
// PyTorch is tests/model/lora_reference_test.cc's (the _nf4 and _int8 cases).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "checkpoint/gpt2_io.h"
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
const std::string kNf4 = kLora + " --set model.quant=nf4";

class QloraTraining : public po::test::TinyTraining {
 protected:
  int steps() const override { return kSteps; }
};

TEST_F(QloraTraining, Nf4AdaptersLearnResumeBitForBitAndDifferFromTheF32Base) {
  const std::string full = train_ok("full", 1, kNf4);
  const std::vector<double> l = losses(full, kSteps);
  EXPECT_LT(l.back(), l.front()) << "QLoRA's adapters did not learn: loss " << l.front() << " -> " << l.back();
  // The quantized base is another model than the f32 one: the first loss differs, a little.
  const std::vector<double> f = losses(train_ok("f32", 1, kLora), kSteps);
  EXPECT_NE(l.front(), f.front()) << "model.quant = nf4 left the base in f32";
  EXPECT_NEAR(l.front(), f.front(), 2e-2 * f.front()) << "NF4 moved the first loss too far";
  const std::string resumed = copy_checkpoint(full, 6, "resumed");
  const auto r = run_train("resumed", 1, kNf4 + " --set train.resume=true");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  po::test::expect_same_checkpoint(full, resumed, kSteps, "QLoRA resumed from step 6");
}

TEST_F(QloraTraining, DataParallelGivesTheOneProcessBits) {
  const std::string one = train_ok("one", 1, kNf4);
  const std::string two = train_ok("dp2", 2, kNf4 + " --set parallel.zero_stage=1");
  po::test::expect_same_curve(losses(two, kSteps), losses(one, kSteps), "QLoRA dp 2");
  po::test::expect_close_weights(one, two, kSteps, 0.0, "QLoRA dp 2 ZeRO-1");
}

TEST_F(QloraTraining, Int8AndBf16Train) {
  for (const std::string& args : {kLora + " --set model.quant=int8", kNf4 + " --set train.precision=bf16"}) {
    const std::vector<double> l = losses(train_ok(args.find("int8") != std::string::npos ? "int8" : "bf16", 1, args), kSteps);
    EXPECT_LT(l.back(), l.front()) << args << ": loss " << l.front() << " -> " << l.back();
  }
}

// `export` of a QLoRA run merges into the decoded base (dequant(W4) + s·B·A):
// its logits are those of the quantized base with the exported adapters.
TEST_F(QloraTraining, TheMergedExportIsTheDecodedBaseWithTheAdapters) {
  const std::string run = train_ok("run", 1, kNf4);
  const std::string peft = dir_ / "peft", merged = dir_ / "merged.safetensors";
  po::test::export_adapter_and_merged(run, peft, merged);
  po::test::expect_merged_export_logits(peft, merged, po::model::WeightQuant::kNf4,
                                        "the merged QLoRA export's logits");
}

// `merge BASE ADAPTER --quant nf4` folds a QLoRA adapter offline into the
// decoded base: the run's own merged export, bit for bit.
TEST_F(QloraTraining, OfflineMergeWithQuantIsTheRunsMergedExport) {
  const std::string base = std::string(PO_SOURCE_DIR) + "/tests/golden/gpt2_ref.safetensors";
  const std::string run = train_ok(
      "run", 1,
      kNf4 + " --set model.init=" + base +
          " --set model.n_embd=64 --set model.n_head=4 --set model.vocab_size=512 --set model.seq_len=32"
          " --set train.steps=4 --set train.checkpoint_interval=4");
  const std::string peft = dir_ / "peft", exported = dir_ / "exported.safetensors",
                    merged = dir_ / "merged.safetensors";
  for (const std::string& cmd : {"export " + run + " --adapter --out " + peft, "export " + run + " --out " + exported,
                                 "merge " + base + " " + peft + " --quant nf4 --out " + merged}) {
    const auto r = po::test::run_command(std::string(PO_BINARY) + " " + cmd);
    ASSERT_EQ(r.exit_code, 0) << cmd << "\n" << r.output;
  }
  const auto a = po::checkpoint::SafetensorsReader::open(exported);
  const auto b = po::checkpoint::SafetensorsReader::open(merged);
  ASSERT_EQ(a.names(), b.names());
  for (const std::string& n : a.names())
    EXPECT_EQ(a.read_f32(n, a.get(n).shape), b.read_f32(n, b.get(n).shape)) << n << " differs";
}

TEST_F(QloraTraining, BadKeysAreOneLineErrorsNamingThem) {
  struct Case {
    std::string args, want;
  };
  const Case cases[] = {
      {" --set model.quant=nf4", "model.quant = nf4 quantizes a frozen base: it needs adapters (lora.r > 0"},
      {kLora + " --set model.quant=fp3", "model.quant = 'fp3': expected 'nf4', 'int8' or 'none'"},
  };
  for (const Case& c : cases) {
    const auto r = run_train("refused", 1, c.args);
    EXPECT_NE(r.exit_code, 0) << c.args << " was accepted";
    EXPECT_NE(r.output.find(c.want), std::string::npos) << c.args << ": " << r.output;
  }
}

}  // namespace
