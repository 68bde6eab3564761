// SFT data through the binary: a token file with a loss mask beside it
// (data/sft.h) trains on the counted targets alone; the loss is normalised
// by the global batch's counted targets, so a batch of 8 gives the weights
// of 8 micro-batches of 1 accumulated and of 2 data-parallel ranks (examples
// of 2 to 24 tokens, some cut to seq_len 16); tensor, context and pipeline
// parallel train as one process; packed rows train and validate, in
// pipelines too; what is not built yet is refused with a one-line error.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "data/token_file.h"

#include "../test_util.h"

namespace {

using po::test::losses;

constexpr int kSteps = 6;

// Examples of random tokens (vocabulary 64), each a prompt then a reply the
// mask counts: 60 61 62 60 ..., which the model learns fast, while the
// random prompts (not counted) teach it nothing.
void write_sft(const std::string& path, int examples, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  for (int e = 0; e < examples; ++e) {
    const int prompt = 1 + static_cast<int>(rng() % 12), reply = 1 + static_cast<int>(rng() % 12);
    std::vector<int32_t> p;
    for (int k = 0; k < prompt; ++k) p.push_back(static_cast<int32_t>(rng() % 60));
    for (int k = 0; k < prompt + reply; ++k) {
      tokens.push_back(k < prompt ? p[k] : 60 + (k - prompt) % 3);
      mask.push_back(static_cast<uint8_t>(k == 0 ? po::data::kMaskStart : k >= prompt ? po::data::kMaskLoss : 0));
    }
  }
  po::data::write_token_file(path, tokens);
  po::data::write_mask_file(po::data::mask_path(path), mask);
}

class SftTraining : public po::test::TinyTraining {
 protected:
  int steps() const override { return kSteps; }
  void SetUp() override {
    TinyTraining::SetUp();
    write_sft(train_, 400, 1);
    write_sft(val_, 60, 2);
  }
};

const std::string kBatch8 = " --set train.batch_size=8";

TEST_F(SftTraining, ABatchOf8IsMicroBatchesOf1AndTwoRanksAccumulated) {
  for (const std::string pack : {"false", "true"}) {
    const std::string p = " --set data.pack=" + pack;
    const std::string whole = train_ok("whole_" + pack, 1, kBatch8 + " --set train.micro_batch_size=8" + p);
    const std::string ones = train_ok("ones_" + pack, 1, kBatch8 + " --set train.micro_batch_size=1" + p);
    const std::string what = "pack " + pack;
    po::test::expect_same_curve(losses(ones, kSteps), losses(whole, kSteps), what + ": 8 micro-batches of 1");
    po::test::expect_close_weights(whole, ones, kSteps, 1e-5, what + ": 8 micro-batches of 1");
    const std::vector<double> g8 = po::test::metric(whole, "grad_norm", kSteps),
                              g1 = po::test::metric(ones, "grad_norm", kSteps);
    for (int s = 0; s < kSteps; ++s)
      EXPECT_NEAR(g1[s], g8[s], 1e-5 * g8[s]) << what << ": gradient norm at step " << s + 1;
    const std::string dp2 = train_ok("dp2_" + pack, 2, kBatch8 + " --set train.micro_batch_size=2" + p);
    po::test::expect_same_curve(losses(dp2, kSteps), losses(whole, kSteps), what + ": dp 2");
    po::test::expect_close_weights(whole, dp2, kSteps, 1e-5, what + ": dp 2");
  }
}

TEST_F(SftTraining, TensorContextAndPipelineParallelTrainAsOneProcess) {
  const std::string one = train_ok("one", 1, "");
  const std::string tp = dir_ / "tp2";
  const auto r = run_train("tp2", 1, "", 2);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  po::test::expect_same_curve(losses(tp, kSteps), losses(one, kSteps), "tp 2");
  po::test::expect_close_weights(one, tp, kSteps, 1e-5, "tp 2");
  const auto c = po::test::run_command(po::test::pagedoptim_command(
      2, "train -c " + config_ + " --set run.dir=" + (dir_ / "cp2") + " --set parallel.dp=1 --set parallel.cp=2"));
  ASSERT_EQ(c.exit_code, 0) << c.output;
  po::test::expect_same_curve(losses(dir_ / "cp2", kSteps), losses(one, kSteps), "cp 2");
  po::test::expect_close_weights(one, dir_ / "cp2", kSteps, 1e-5, "cp 2");
  // A pipeline of 2 stages (1F1B over 2 micro-batches): the loss over the
  // counted targets, validation included.
  const auto pp = po::test::run_command(po::test::pagedoptim_command(
      2, "train -c " + config_ + " --set run.dir=" + (dir_ / "pp2") + " --set parallel.dp=1 --set parallel.pp=2"));
  ASSERT_EQ(pp.exit_code, 0) << pp.output;
  po::test::expect_same_curve(losses(dir_ / "pp2", kSteps), losses(one, kSteps), "pp 2");
  po::test::expect_close_weights(one, dir_ / "pp2", kSteps, 1e-5, "pp 2");
  EXPECT_NEAR(po::test::metric(dir_ / "pp2", "val_loss", kSteps / 2).back(),
              po::test::metric(one, "val_loss", kSteps / 2).back(), 1e-5)
      << "pp 2's validation loss";
}

// Packed rows in a pipeline: every stage's slot takes its micro-batch's
// positions before its forward (block-diagonal attention on every stage,
// the position table's rows on the first), so pp 2 gives pp 1's losses,
// validation losses and weights bit for bit at the same micro-batches, for
// GPT-2 (learned positions) and Llama (RoPE); dp 2 × pp 2 gives dp 2's (the
// embedding's lookup rows are not deferred with packed learned positions,
// one rule for both engines: parallel::defers_lookup).
TEST_F(SftTraining, PackedRowsInAPipelineGiveOneStagesBits) {
  const std::string llama =
      " --set model.preset=llama-tiny --set model.n_embd=32 --set model.n_head=4 --set model.n_kv_head=2"
      " --set model.vocab_size=64 --set model.seq_len=16 --set model.tie_embeddings=false";
  const auto run = [&](const std::string& name, int dp, int pp, const std::string& args) {
    const auto r = po::test::run_command(po::test::pagedoptim_command(
        dp * pp, "train -c " + config_ + " --set run.dir=" + (dir_ / name) + " --set parallel.dp=" +
                     std::to_string(dp) + " --set parallel.pp=" + std::to_string(pp) + " " + args));
    EXPECT_EQ(r.exit_code, 0) << name << ": " << args << "\n" << r.output;
    return std::string(dir_ / name);
  };
  const auto same = [&](const std::string& ref, const std::string& got, const std::string& what,
                        bool files = true) {
    po::test::expect_same_metrics(ref, got, {{"loss", kSteps}, {"grad_norm", kSteps}, {"val_loss", kSteps / 3}},
                                  what);
    po::test::expect_same_checkpoint(ref, got, kSteps, what, files);
  };
  const std::string packed =
      kBatch8 + " --set model.n_layer=4 --set train.micro_batch_size=2 --set data.pack=true --set train.eval_interval=3";
  for (const auto& [model, name] : {std::pair{std::string(), "gpt2"}, {llama, "llama"}}) {
    const std::string args = packed + model;
    const std::string ref = run(std::string(name) + "_pp1", 1, 1, args);
    for (const char* s : {"1f1b", "zbv"})
      same(ref, run(std::string(name) + "_pp2_" + s, 1, 2, args + " --set parallel.schedule=" + s),
           std::string(name) + " packed pp 2 " + s);
  }
  same(run("dp2", 2, 1, packed), run("dp2pp2", 2, 2, packed + " --set parallel.schedule=zb-h1"),
       "gpt2 packed dp 2 × pp 2 zb-h1", false);  // (the same state, cut into other files)
}

// Packed rows under tensor parallel: each rank's heads attend within the
// examples and the position table's rows follow each rank's rows (under
// sequence parallel its chunk of them), so tp 2 follows one process within
// 1e-5 (the tensor group's sums) for GPT-2 (learned positions) and Llama
// (RoPE), with and without sequence parallel; tp 2 × pp 2 gives tp 2's bits.
TEST_F(SftTraining, PackedRowsUnderTensorParallelFollowOneProcess) {
  const std::string llama =
      " --set model.preset=llama-tiny --set model.n_embd=32 --set model.n_head=4 --set model.n_kv_head=2"
      " --set model.vocab_size=64 --set model.seq_len=16 --set model.tie_embeddings=false";
  const std::string packed = kBatch8 + " --set train.micro_batch_size=2 --set data.pack=true --set train.eval_interval=3";
  const auto tp2 = [&](const std::string& name, int pp, const std::string& args) {
    const auto r = po::test::run_command(po::test::pagedoptim_command(
        2 * pp, "train -c " + config_ + " --set run.dir=" + (dir_ / name) +
                    " --set parallel.dp=1 --set parallel.tp=2 --set parallel.pp=" + std::to_string(pp) + args));
    EXPECT_EQ(r.exit_code, 0) << name << ": " << args << "\n" << r.output;
    return std::string(dir_ / name);
  };
  for (const auto& [model, name] : {std::pair{std::string(), std::string("gpt2")}, {llama, std::string("llama")}}) {
    const std::string one = train_ok(name + "_one", 1, packed + model);
    for (const bool sp : {false, true}) {
      const std::string what = name + " packed tp 2" + (sp ? " with sequence parallel" : "");
      const std::string tp = tp2(name + (sp ? "_tp2_sp" : "_tp2"), 1,
                                 packed + model + (sp ? " --set parallel.sequence_parallel=true" : ""));
      po::test::expect_same_curve(losses(tp, kSteps), losses(one, kSteps), what);
      po::test::expect_close_weights(one, tp, kSteps, 1e-5, what);
      EXPECT_NEAR(po::test::metric(tp, "val_loss", kSteps / 3).back(),
                  po::test::metric(one, "val_loss", kSteps / 3).back(), 1e-5)
          << what << ": the validation loss";
    }
  }
  po::test::expect_same_metrics(dir_ / "gpt2_tp2", tp2("gpt2_tp2pp2", 2, packed + " --set model.n_layer=2"),
                                {{"loss", kSteps}, {"grad_norm", kSteps}, {"val_loss", kSteps / 3}},
                                "gpt2 packed tp 2 × pp 2 against tp 2");
}

TEST_F(SftTraining, PackedRowsLearnTheRepliesAndValidate) {
  const std::string run = train_ok("packed", 1, " --set data.pack=true --set train.steps=30 --set train.lr=1e-2");
  const std::vector<double> l = losses(run, 30);
  EXPECT_LT(l.back(), l.front() - 1.0) << "the replies were not learnt: loss " << l.front() << " -> " << l.back();
  std::vector<double> v;
  for (const auto& j : po::test::read_metrics(run))
    if (j.contains("val_loss")) v.push_back(j["val_loss"]);
  ASSERT_GE(v.size(), 2u) << "no validation records";
  EXPECT_LT(v.back(), v.front()) << "validation loss " << v.front() << " -> " << v.back();
}

TEST_F(SftTraining, WhatIsNotBuiltIsRefusedNamingItsKeys) {
  const auto expect_refused = [&](const std::string& name, int np, const std::string& args, const std::string& msg) {
    const auto r = po::test::run_command(po::test::pagedoptim_command(
        np, "train -c " + config_ + " --set run.dir=" + (dir_ / name) + " " + args));
    EXPECT_NE(r.exit_code, 0) << name;
    EXPECT_NE(r.output.find(msg), std::string::npos) << name << ": expected '" << msg << "' in\n" << r.output;
  };
  expect_refused("cp", 2, "--set parallel.dp=1 --set parallel.cp=2 --set data.pack=true",
                 "data.pack with parallel.cp = 2 is not built yet");
  std::filesystem::remove(po::data::mask_path(val_));
  expect_refused("val", 1, "", "has no loss mask beside it but data.train has");
  std::filesystem::remove(po::data::mask_path(train_));
  expect_refused("pack", 1, "--set data.pack=true --set 'data.val=\"\"'", "data.pack = true packs SFT examples, but data.train");
}

}  // namespace
