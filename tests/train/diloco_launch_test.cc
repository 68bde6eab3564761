// DiLoCo inside one job (parallel.replicas, train.local_steps; docs/diloco.md),
// real processes, one thread per rank (bit-identity holds at equal threads
// per rank). The outer optimizer's math is held to PyTorch in
// tests/optim/outer_test.cc; here the whole run:
//   - H = 1, inner SGD, outer SGD at lr 1 without momentum follows
//     synchronous data parallel over the same sequences within a few ulps
//     (θ − (θ − θ_k) is not θ_k in floating point, so not bit for bit);
//     with inner AdamW it must differ (a mean of Adam steps is not the Adam
//     step of the mean gradient);
//   - the replicas' inner layout does not change the bits (dp 1 against
//     dp 2 ZeRO-1 inside each replica);
//   - an outer state paged to NVMe ends in the in-memory run's bits;
//   - a run stopped between outer steps and resumed ends in the
//     uninterrupted run's bits (checkpoint and DiLoCo side files);
//   - bf16 and int8 exchanges move half and about a quarter of fp32's bytes
//     and still learn; fragments step in turn;
//   - what is not built is refused in one line naming the keys.
#include <gtest/gtest.h>

#include <string>

#include "../test_util.h"

namespace {

using po::test::losses;
using po::test::read_metrics;

class DilocoRuns : public po::test::TinyTraining {
 protected:
  int steps() const override { return 6; }
  // `pagedoptim train` over `ranks` processes, expected to succeed.
  std::string run(const std::string& name, int ranks, const std::string& args) const {
    const auto r = po::test::run_command(po::test::pagedoptim_command(
        ranks, "train -c " + config_ + " --set run.dir=" + (dir_ / name) + " --set train.checkpoint_interval=0" +
                   " --set train.eval_interval=0 " + args));
    EXPECT_EQ(r.exit_code, 0) << name << ": train " << args << "\n" << r.output;
    return dir_ / name;
  }
  // The outer records of a run's metrics, in step order.
  static std::vector<nlohmann::json> outer_records(const std::string& dir) {
    std::vector<nlohmann::json> out;
    for (const auto& j : read_metrics(dir))
      if (j.contains("outer")) out.push_back(j["outer"]);
    return out;
  }
};

// Plain SGD inside (no clipping, no decay, a constant rate), so that an
// averaged step is the step of the averaged gradient.
const std::string kSgd =
    " --set optim.name=sgd --set train.weight_decay=0 --set train.grad_clip=0 --set train.lr=0.5"
    " --set train.schedule=constant --set train.warmup_steps=0";
const std::string kFedAvg =
    " --set parallel.replicas=2 --set train.local_steps=1 --set outer.optimizer=sgd --set outer.lr=1"
    " --set outer.momentum=0";

TEST_F(DilocoRuns, OneLocalStepOfSgdFollowsDataParallelAndAdamWDoesNot) {
  // Data parallel over 8 sequences a step, against 2 replicas of 4: the same
  // sequences (replica ρ takes the step's sequences [4ρ, 4ρ + 4)).
  const std::string dp = run("dp", 2, kSgd + " --set parallel.dp=2 --set train.batch_size=8");
  const std::string dl = run("diloco", 2, kSgd + kFedAvg + " --set parallel.dp=1 --set train.batch_size=4");
  // 8 ulps of each unit's largest magnitude (4 measured, AMX Xeon, 2026-12-07).
  po::test::expect_close_weights(dp, dl, 6, 8.0 / (1 << 23), "DiLoCo H=1 inner SGD vs data parallel");
  po::test::expect_same_curve(losses(dp, 6), losses(dl, 6), "DiLoCo H=1 inner SGD vs data parallel");
  // Inner AdamW: the mean of two Adam steps is not one Adam step on the mean gradient.
  const std::string adam = " --set train.grad_clip=0 --set train.weight_decay=0";
  const std::string dp_a = run("dp_adam", 2, adam + " --set parallel.dp=2 --set train.batch_size=8");
  const std::string dl_a = run("diloco_adam", 2, adam + kFedAvg + " --set parallel.dp=1 --set train.batch_size=4");
  const auto a = po::test::checkpoint_state(po::train::checkpoint_path(dp_a, 6),
                                            po::checkpoint::read_manifest(po::train::checkpoint_path(dp_a, 6)));
  const auto b = po::test::checkpoint_state(po::train::checkpoint_path(dl_a, 6),
                                            po::checkpoint::read_manifest(po::train::checkpoint_path(dl_a, 6)));
  double worst = 0, scale = 0;
  for (size_t u = 0; u < a[0].size(); ++u)
    for (size_t i = 0; i < a[0][u].size(); ++i) {
      worst = std::max(worst, static_cast<double>(std::fabs(a[0][u][i] - b[0][u][i])));
      scale = std::max(scale, static_cast<double>(std::fabs(a[0][u][i])));
    }
  EXPECT_GT(worst, 1e-4 * scale) << "DiLoCo H=1 with inner AdamW matched data parallel (largest difference "
                                 << worst << "): the outer step is not averaging the replicas' own Adam steps";
}

TEST_F(DilocoRuns, ReplicasInnerLayoutKeepsTheBits) {
  // Layouts whose inner steps are bit-identical (pp 2 against pp 1; ZeRO-3
  // against ZeRO-2, the same reduction order) stay so through the outer
  // steps: each rank's slice is gathered, stepped and scattered back by
  // stage and by ZeRO shard. (No clipping: a gradient norm summed shard by
  // shard is another order than one rank's.)
  const std::string args =
      " --set train.grad_clip=0 --set parallel.replicas=2 --set train.local_steps=2 --set outer.optimizer=nesterov"
      " --set outer.lr=0.7 --set outer.momentum=0.9";
  const std::string one = run("pp1", 2, args);
  const auto l = losses(one, 6);
  EXPECT_LT(l.back(), l.front()) << "2 replicas with Nesterov's outer step did not learn in 6 steps";
  const auto outer = outer_records(one);
  ASSERT_EQ(outer.size(), 3u) << "an outer step every 2 of 6 steps";
  for (const auto& o : outer) EXPECT_GT(o["delta_norm"].get<double>(), 0.0) << o.dump();
  po::test::expect_same_checkpoint(one, run("pp2", 4, args + " --set parallel.pp=2 --set parallel.schedule=1f1b"), 6,
                                   "2 replicas of pp 2 (1F1B) vs of pp 1", false);
  po::test::expect_same_checkpoint(run("z2", 4, args + " --set parallel.dp=2 --set parallel.zero_stage=2"),
                                   run("z3", 4, args + " --set parallel.dp=2 --set parallel.zero_stage=3"), 6,
                                   "2 replicas of dp 2 ZeRO-3 vs ZeRO-2");
}

TEST_F(DilocoRuns, PagedOuterStateEndsInTheInMemoryBits) {
  const std::string args =
      " --set parallel.replicas=2 --set train.local_steps=2 --set outer.optimizer=adam --set outer.lr=0.1"
      " --set memory.page_size=64KiB --set memory.nvme_dir=" + (dir_ / "nvme");
  std::filesystem::create_directories(dir_ / "nvme");
  const std::string mem = run("in_memory", 2, args + " --set outer.paged=false");
  const std::string paged = run("paged", 2, args + " --set outer.paged=true");
  po::test::expect_same_checkpoint(mem, paged, 6, "outer state paged to NVMe vs in memory");
  // Adam's outer state: θ, m and v, 12 bytes an element of the slice, in memory; none when paged.
  EXPECT_GT(outer_records(mem).at(0)["state_bytes"].get<double>(), 0.0) << "the in-memory run holds no outer state";
  EXPECT_EQ(outer_records(paged).at(0)["state_bytes"].get<double>(), 0.0) << "the paged run holds its outer state in memory";
}

TEST_F(DilocoRuns, ExchangesInBf16AndInt8MoveLessAndLearn) {
  const std::string args = " --set parallel.replicas=2 --set train.local_steps=2";
  const std::string f32 = run("fp32", 2, args);
  const double bytes = outer_records(f32).at(0)["bytes"].get<double>();
  for (const std::string dtype : {"bf16", "int8"}) {
    const std::string d = run(dtype, 2, args + " --set outer.exchange_dtype=" + dtype);
    const auto l = losses(d, 6);
    EXPECT_LT(l.back(), l.front()) << dtype << " exchange: did not learn in 6 steps";
    const double b = outer_records(d).at(0)["bytes"].get<double>();
    // bf16: half of fp32's all-reduce; int8: every replica's codes (1 byte
    // an element) and a scale per 256, gathered: at 2 replicas about 2/4.
    const double want = dtype == "bf16" ? 0.5 : 2.0 * (1.0 + 4.0 / 256) / 4.0;
    EXPECT_NEAR(b / bytes, want, 0.01) << dtype << " exchange moved " << b << " bytes, fp32 " << bytes;
  }
}

TEST_F(DilocoRuns, FragmentsStepInTurn) {
  const std::string d = run("fragments", 2, " --set parallel.replicas=2 --set train.local_steps=2 --set outer.fragments=2");
  const auto outer = outer_records(d);
  std::string got;
  for (const auto& o : outer) got += o["fragments"].dump() + " ";
  // Fragment 1 after steps 1, 3, 5; fragment 0 after 2, 4, 6; both after the last.
  EXPECT_EQ(got, "[1] [0] [1] [0] [1] [0,1] ") << "the fragments' outer steps";
}

TEST_F(DilocoRuns, ResumesBitIdenticalBetweenOuterSteps) {
  // Checkpoints at steps 3 and 6 with an outer step every 2: step 3's holds
  // replicas that have drifted apart since step 2 (each replica's parameters
  // and moments) and the outer state (θ, Nesterov's buffer).
  const std::string args =
      " --set parallel.replicas=2 --set train.local_steps=2 --set train.checkpoint_interval=3";
  const std::string whole = run("whole", 2, args);
  const std::string resumed = copy_checkpoint(whole, 3, "resumed");
  std::filesystem::create_directories(resumed + "/diloco");
  std::filesystem::copy(whole + "/diloco/step_00000003", resumed + "/diloco/step_00000003",
                        std::filesystem::copy_options::recursive | std::filesystem::copy_options::create_hard_links);
  run("resumed", 2, args + " --resume");
  po::test::expect_same_checkpoint(whole, resumed, 6, "DiLoCo resumed at step 3 vs uninterrupted");
  for (const std::string f : {"replica0-writer0.bin", "replica1-writer0.bin"})
    EXPECT_EQ(po::test::read_file(whole + "/diloco/step_00000006/" + f), po::test::read_file(resumed + "/diloco/step_00000006/" + f))
        << f << ": the resumed run's DiLoCo state at step 6 differs";
  // Another layout cannot take that state.
  const auto r = po::test::run_command(po::test::pagedoptim_command(
      4, "train -c " + config_ + " --set run.dir=" + resumed + args + " --set parallel.dp=2 --resume"));
  EXPECT_NE(r.exit_code, 0) << "a DiLoCo checkpoint of dp 1 replicas resumed at dp 2:\n" << r.output;
  EXPECT_NE(r.output.find("resume with the parallel layout that wrote it"), std::string::npos) << r.output;
}

TEST_F(DilocoRuns, WhatIsNotBuiltIsRefusedNamingTheKeys) {
  struct Case {
    std::string args, key;
    int ranks = 1;
  };
  const Case cases[] = {
      {" --set parallel.replicas=2", "parallel.replicas = 2 trains replicas that meet every train.local_steps", 2},
      {" --set train.local_steps=2 --set checkpoint.async=true", "checkpoint.async with train.local_steps"},
      {" --set train.local_steps=2 --set outer.optimizer=lion", "outer.optimizer = \"lion\""},
      {" --set train.local_steps=2 --set outer.exchange_dtype=fp8", "outer.exchange_dtype = \"fp8\""},
      {" --set train.local_steps=4 --set outer.fragments=3", "outer.fragments = 3"},
      {" --set optim.name=lion", "optim.name = \"lion\""},
      {" --set optim.name=sgd --set optim.state_bits=8", "optim.name = \"sgd\" keeps no moments"},
  };
  for (const Case& c : cases) {
    const auto r = po::test::run_command(po::test::pagedoptim_command(
        1, "train -c " + config_ + " --set run.dir=" + (dir_ / "refused") + " --set train.checkpoint_interval=0" + c.args +
               (c.ranks > 1 ? " --nproc " + std::to_string(c.ranks) : "")));
    EXPECT_NE(r.exit_code, 0) << c.args << " was accepted:\n" << r.output;
    EXPECT_NE(r.output.find(c.key), std::string::npos) << c.args << ": the error does not name \"" << c.key
                                                       << "\":\n" << r.output;
  }
  const auto plan = po::test::run_command(po::test::pagedoptim_command(
      1, "plan -c " + config_ + " --set parallel.replicas=2 --set train.local_steps=2"));
  EXPECT_NE(plan.exit_code, 0) << "plan accepted parallel.replicas = 2:\n" << plan.output;
  EXPECT_NE(plan.output.find("parallel.replicas = 2 is not modelled yet"), std::string::npos) << plan.output;
}

}  // namespace
