// A mixture of experts trains through the one training path (docs/moe.md):
// moe-tiny (4 SwiGLU experts, top 2, in every block) at the tiny config's
// shapes, with the balance and z losses on, real processes, one thread per
// rank (bit-identity holds at equal threads per rank). The layer's math is
// held to PyTorch in tests/model/moe_reference_test.cc; here:
//   - it learns, and dp 2 (ZeRO-1) and pp 2 (1F1B) write the checkpoint of
//     dp 1 bit for bit, every expert's tensors included, and ZeRO-3 that of
//     ZeRO-2 (the same reduction order);
//   - a run stopped at step 3 and resumed ends in the uninterrupted run's bits;
//   - what is not built is refused in one line naming the keys.
#include <gtest/gtest.h>

#include <string>

#include "../test_util.h"

namespace {

using po::test::losses;

class MoeRuns : public po::test::TinyTraining {
 protected:
  int steps() const override { return 6; }
};

const std::string kMoe =
    " --set model.preset=moe-tiny --set model.arch=llama --set train.precision=fp32"
    " --set train.moe_aux_loss=0.01 --set train.moe_z_loss=0.001 --set train.eval_interval=0";

TEST_F(MoeRuns, LearnsAndLayoutsWriteTheSameBits) {
  const std::string one = train_ok("one", 1, kMoe);
  const auto l = losses(one, 6);
  ASSERT_EQ(l.size(), 6u);
  EXPECT_LT(l.back(), l.front()) << "the mixture did not learn in 6 steps";
  const auto manifest = po::checkpoint::read_manifest(po::train::checkpoint_path(one, 6));
  bool expert3 = false;
  for (const auto& t : manifest.meta.tensors) expert3 |= t.name == "model.layers.1.block_sparse_moe.experts.3.w2.weight";
  EXPECT_TRUE(expert3) << "the checkpoint holds no model.layers.1.block_sparse_moe.experts.3.w2.weight";
  po::test::expect_same_checkpoint(one, train_ok("dp2_z1", 2, kMoe + " --set parallel.zero_stage=1"), 6,
                                   "dp 2 ZeRO-1 vs dp 1", false);
  // (ZeRO 2-3 sum the norm shard by shard, another order: ZeRO-3, each unit
  // gathered for each use, against ZeRO-2.)
  po::test::expect_same_checkpoint(train_ok("dp2_z2", 2, kMoe + " --set parallel.zero_stage=2"),
                                   train_ok("dp2_z3", 2, kMoe + " --set parallel.zero_stage=3"), 6,
                                   "dp 2 ZeRO-3 vs ZeRO-2");
  const auto pp = po::test::run_command(po::test::pagedoptim_command(
      2, "train -c " + config_ + " --set run.dir=" + (dir_ / "pp2") + kMoe +
             " --set parallel.pp=2 --set parallel.schedule=1f1b"));
  ASSERT_EQ(pp.exit_code, 0) << pp.output;
  po::test::expect_same_checkpoint(one, dir_ / "pp2", 6, "pp 2 (1F1B) vs pp 1", false);
}

TEST_F(MoeRuns, ResumesBitIdentical) {
  const std::string whole = train_ok("whole", 1, kMoe);
  const std::string resumed = copy_checkpoint(whole, 3, "resumed");
  train_ok("resumed", 1, kMoe + " --resume");
  po::test::expect_same_checkpoint(whole, resumed, 6, "resumed at step 3 vs uninterrupted");
}

TEST_F(MoeRuns, WhatIsNotBuiltIsRefusedNamingTheKeys) {
  struct Case {
    std::string args, key;
    int ranks = 1;
  };
  const Case cases[] = {
      {" --set model.moe_top_k=5", "model.moe_top_k = 5"},
      {" --set model.moe_router=sigmoid", "model.moe_router = 'sigmoid'"},
      {" --set train.precision=bf16", "train.precision = bf16"},
      {" --set parallel.tp=2", "parallel.tp = 2 with model.moe_experts", 2},
      {" --set parallel.cp=2", "model.moe_experts = 4 with parallel.cp = 2", 2},
      {" --set parallel.pp=2 --set parallel.schedule=zb-h1", "parallel.schedule = zb-h1", 2},
  };
  for (const Case& c : cases) {
    const auto r = run_train("refused", 1, kMoe + c.args + (c.ranks > 1 ? " --nproc " + std::to_string(c.ranks) : ""));
    EXPECT_NE(r.exit_code, 0) << c.args << " was accepted:\n" << r.output;
    EXPECT_NE(r.output.find(c.key), std::string::npos) << c.args << ": the error does not name \"" << c.key
                                                       << "\":\n" << r.output;
  }
}

}  // namespace
