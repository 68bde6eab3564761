// Pipeline parallel through `pagedoptim train` under mpirun. At the same
// micro-batching (batch 8 = 4 micro-batches of 2) every schedule at pp 2,
// and 1f1b and zbv at pp 4, give the losses, gradient norms (clipping on),
// validation losses and final checkpoint of pp = 1 bit for bit, for GPT-2
// with its tied embedding and for Llama. Checkpoints are the whole model's:
// pp 2 resumes at pp 1 and pp 1 at pp 2 (and pp 2 at pp 2) on the
// uninterrupted curve, bit for bit; dp 2 × pp 2 gives dp 2's bits and
// resumes there. The run
// reports its measured bubble beside the formula, and --trace writes every
// rank's step as Chrome trace JSON. Faults: a stage that sends the wrong
// shape ends the run with an error naming both ranks and both shapes; a
// killed stage ends it within 10 s naming the rank. Unsupported layouts are
// one-line errors naming the keys.
#include <gtest/gtest.h>

#include <signal.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "../background_run.h"
#include "../test_util.h"

namespace {

using po::test::metric;
using po::test::read_metrics;

class PipelineRuns : public po::test::TinyTraining {
 protected:
  int steps() const override { return 6; }
  // 4 layers, batch 8 of micro-batches 2 (m = 4 per data rank at dp 1), clipping on.
  std::string base(const std::string& extra) const {
    return "--set model.n_layer=4 --set train.batch_size=8 --set train.grad_clip=0.05"
           " --set train.eval_interval=3 --set train.checkpoint_interval=3 " + extra;
  }
  po::test::CommandResult run(const std::string& name, int dp, int pp, const std::string& extra,
                              int tp = 1) {
    return po::test::run_command(po::test::pagedoptim_command(
        dp * tp * pp, "train -c " + config_ + " --set run.dir=" + (dir_ / name) +
                          " --set parallel.dp=" + std::to_string(dp) + " --set parallel.tp=" +
                          std::to_string(tp) + " --set parallel.pp=" + std::to_string(pp) + " " +
                          base(extra)));
  }
  std::string train(const std::string& name, int dp, int pp, const std::string& extra, int tp = 1) {
    const auto r = run(name, dp, pp, extra, tp);
    EXPECT_EQ(r.exit_code, 0) << name << " (dp " << dp << " × tp " << tp << " × pp " << pp << ") "
                              << extra << "\n" << r.output;
    return dir_ / name;
  }
  // `extra` with each stage's Adam state in 4 KiB pages on NVMe behind a
  // one-page host tier and the smallest compute tier the run accepts (the
  // minimum it names for a 1-byte budget), so pages come back from the disk
  // every step.
  std::string on_nvme(int dp, int pp, const std::string& extra, int tp = 1) {
    const std::string paging = extra + " --set memory.nvme_dir=" + (dir_ / "swap") +
                               " --set memory.page_size=4096 --set memory.host_budget=4096 --set memory.compute_budget=";
    const auto probe = run("nvme_probe", dp, pp, paging + "1", tp);
    const int64_t least = po::test::named_minimum_budget(probe.output);
    EXPECT_GT(least, 0) << "no minimum compute budget named:\n" << probe.output;
    std::filesystem::remove_all(dir_ / "nvme_probe");
    return paging + std::to_string(least);
  }
  // The bytes a paged run's ranks read back from NVMe at its last step.
  static double nvme_read(const std::string& run) {
    double read = 0;
    for (const auto& r : po::test::last_metric(run, "pp_paging_per_rank")) read += r["nvme_read_bytes"].get<double>();
    return read;
  }
  // ZeRO-3 over dp > 1, paged: no pipeline rank holds a parameter or
  // gradient byte outside its pages (and its gathers' buffers).
  static void expect_shards_paged(const std::string& run, const std::string& what) {
    for (const auto& r : po::test::last_metric(run, "pp_memory_per_rank")) {
      EXPECT_EQ(r["params"].get<double>(), 0) << what << ": parameter bytes held outside the pages";
      EXPECT_EQ(r["grads"].get<double>(), 0) << what << ": gradient bytes held outside the pages";
    }
  }
  // Every loss, gradient norm and validation loss, exactly; the checkpoints'
  // bytes (`files`), or the weights they export (runs whose rank files split
  // the state differently).
  void expect_bits(const std::string& ref, const std::string& run, const std::string& what,
                   bool files = true) {
    po::test::expect_same_metrics(ref, run, {{"loss", 6}, {"grad_norm", 6}, {"val_loss", 2}}, what);
    for (int step : {3, 6}) {
      if (files) {
        po::test::expect_same_checkpoint(ref, run, step, what);
        continue;
      }
      std::string exported[2];
      for (int k = 0; k < 2; ++k) {
        const std::string src = po::train::checkpoint_path(k == 0 ? ref : run, step);
        exported[k] = src + ".safetensors";
        const auto r = po::test::run_command(po::test::pagedoptim_command(1, "export " + src + " --out " + exported[k]));
        ASSERT_EQ(r.exit_code, 0) << what << ": export of " << src << "\n" << r.output;
      }
      EXPECT_TRUE(po::test::read_file(exported[0]) == po::test::read_file(exported[1]))
          << what << ": the weights of step " << step << "'s checkpoint differ from the reference run's";
    }
  }
};

const std::string kLlama =
    "--set model.preset=llama-tiny --set model.n_embd=32 --set model.n_head=4 "
    "--set model.n_kv_head=2 --set model.vocab_size=64 --set model.seq_len=16";

// The losses of steps 4-6 (after a resume from step 3's checkpoint).
std::vector<double> tail(const std::string& run) {
  std::vector<double> out;
  for (const auto& j : read_metrics(run))
    if (j.contains("loss") && j["step"].get<int>() > 3) out.push_back(j["loss"].get<double>());
  return out;
}

TEST_F(PipelineRuns, EveryScheduleAtPp2IsBitIdenticalToOneStageGpt2) {
  const std::string ref = train("pp1", 1, 1, "");
  for (const char* s : {"gpipe", "1f1b", "interleaved", "zb-h1", "zbv"})
    expect_bits(ref, train(std::string("pp2_") + s, 1, 2, std::string("--set parallel.schedule=") + s),
                std::string("gpt2 pp 2 ") + s);
}

TEST_F(PipelineRuns, Pp4AndLlamaAreBitIdenticalToOneStage) {
  const std::string eight = "--set model.n_layer=8 ";  // zbv at pp 4: 8 stages of a block
  const std::string ref = train("pp1", 1, 1, eight);
  for (const char* s : {"1f1b", "zbv"})
    expect_bits(ref, train(std::string("pp4_") + s, 1, 4, eight + "--set parallel.schedule=" + s),
                std::string("gpt2 pp 4 ") + s);
  const std::string lref = train("llama_pp1", 1, 1, kLlama);
  for (const char* s : {"1f1b", "zb-h1", "zbv"})
    expect_bits(lref, train(std::string("llama_pp2_") + s, 1, 2, kLlama + " --set parallel.schedule=" + s),
                std::string("llama pp 2 ") + s);
}

// dp 2 × pp 2 gives dp 2's bits: the tied table's parts are added before
// the data group's sum and the last micro-batch's lookup rows after it, in
// rank order, as data parallel adds them (with parallel.overlap_comm, and
// without it all rows before the sum); GPT-2 with its tied table on two
// ranks (1f1b, ZeRO-1 too, vocabulary parallel) and on one (zbv), Llama;
// dp 2 × tp 2 × pp 2 against dp 2 × tp 2; and cp 2 × pp 2 against cp 2
// (the cp ranks' sum).
TEST_F(PipelineRuns, DataParallelPipelinesAreBitIdenticalToDataParallel) {
  const std::string dp2 = train("dp2", 2, 1, "");
  expect_bits(dp2, train("dp2pp2_1f1b", 2, 2, "--set parallel.schedule=1f1b"), "dp 2 × pp 2 1f1b", false);
  expect_bits(dp2, train("dp2pp2_zbv", 2, 2, "--set parallel.schedule=zbv"), "dp 2 × pp 2 zbv", false);
  expect_bits(dp2, train("dp2pp2_vocab", 2, 2, "--set parallel.schedule=1f1b --set parallel.vocab_parallel=true"),
              "dp 2 × pp 2 1f1b, vocabulary parallel", false);
  expect_bits(dp2, train("dp2pp2_z1", 2, 2, "--set parallel.schedule=zb-h1 --set parallel.zero_stage=1"),
              "dp 2 × pp 2 zb-h1, ZeRO-1", false);
  const std::string plain = "--set parallel.overlap_comm=false ";
  expect_bits(train("dp2_plain", 2, 1, plain), train("dp2pp2_plain", 2, 2, plain + "--set parallel.schedule=zb-h1"),
              "dp 2 × pp 2 zb-h1 without overlap_comm", false);
  expect_bits(train("llama_dp2", 2, 1, kLlama),
              train("llama_dp2pp2", 2, 2, kLlama + " --set parallel.schedule=zbv"), "llama dp 2 × pp 2 zbv", false);
  expect_bits(train("dp2tp2", 2, 1, "", 2), train("dp2tp2pp2", 2, 2, "--set parallel.schedule=zbv", 2),
              "dp 2 × tp 2 × pp 2 zbv", false);
  const std::string cp2 = "--set parallel.dp=1 --set parallel.cp=2 --set model.seq_len=16 ";
  expect_bits(train("cp2", 2, 1, cp2), train("cp2pp2", 2, 2, cp2 + "--set parallel.schedule=1f1b"),
              "cp 2 × pp 2 1f1b", false);
  bool context = false;  // (the reference's records say it ran context parallel)
  for (const auto& j : read_metrics(dir_ / "cp2")) context = context || j.contains("cp_comm");
  EXPECT_TRUE(context) << "the cp 2 reference has no cp_comm record: not context parallel";
}

// bf16 stages (parameters and gradients stored in bf16, the fp32 master and
// Adam beside them): every schedule at pp 2 gives pp 1's bf16 bits, GPT-2
// with its tied table (wte = bf16(H + E) on both copies) and Llama, with
// activation checkpointing too; and ZeRO-1 paged to NVMe at dp 2 × pp 2
// gives the in-memory ZeRO-0 bits, and dp 2's (GPT-2 zb-h1, Llama 1f1b).
TEST_F(PipelineRuns, Bf16StagesAreBitIdenticalToOneStage) {
  const std::string bf16 = "--set train.precision=bf16 ";
  const std::string ref = train("bf16_pp1", 1, 1, bf16);
  for (const char* s : {"gpipe", "1f1b", "interleaved", "zb-h1", "zbv"})
    expect_bits(ref, train(std::string("bf16_pp2_") + s, 1, 2, bf16 + "--set parallel.schedule=" + s),
                std::string("bf16 gpt2 pp 2 ") + s);
  const std::string ckpt = bf16 + "--set model.activation_checkpointing=true ";
  const std::string cref = train("bf16_ckpt_pp1", 1, 1, ckpt);
  expect_bits(cref, train("bf16_ckpt_pp2", 1, 2, ckpt + "--set parallel.schedule=zb-h1"),
              "bf16 gpt2 pp 2 zb-h1 with activation checkpointing");
  const std::string lref = train("bf16_llama_pp1", 1, 1, bf16 + kLlama);
  for (const char* s : {"1f1b", "zbv"})
    expect_bits(lref, train(std::string("bf16_llama_pp2_") + s, 1, 2, bf16 + kLlama + " --set parallel.schedule=" + s),
                std::string("bf16 llama pp 2 ") + s);
  const std::string z0 = train("bf16_z0", 2, 2, bf16 + "--set parallel.schedule=zb-h1");
  const std::string paged =
      train("bf16_z1_paged", 2, 2, on_nvme(2, 2, bf16 + "--set parallel.schedule=zb-h1 --set parallel.zero_stage=1"));
  expect_bits(z0, paged, "bf16 dp 2 × pp 2, ZeRO-1 paged against ZeRO-0 in memory");
  EXPECT_GT(nvme_read(paged), 0) << "bf16 dp 2 × pp 2 ZeRO-1: no page came back from NVMe";
  // ... and dp 2's bits: the tied table's lookup part and the last
  // micro-batch's position rows go in at the step on both layouts.
  expect_bits(train("bf16_dp2", 2, 1, bf16), z0, "bf16 dp 2 × pp 2 zb-h1 against dp 2", false);
  expect_bits(train("bf16_dp2_llama", 2, 1, bf16 + kLlama),
              train("bf16_dp2pp2_llama", 2, 2, bf16 + kLlama + " --set parallel.schedule=1f1b"),
              "bf16 llama dp 2 × pp 2 1f1b against dp 2", false);
  // Data parallel sums bf16 gradients (rounded after the sum): near pp 1, not its bits.
  const auto a = metric(ref, "loss", 6), b = metric(z0, "loss", 6);
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(a[i], b[i], 1e-4 * a[i]) << "bf16 dp 2 × pp 2 against pp 1: step " << i + 1;
}

// ZeRO-2 at pp > 1: each micro-batch's part of a unit's gradient is
// reduce-scattered into the stage's shard as it completes, in pp = 1's
// order, so Llama with an untied head gives pp = 1's ZeRO-2 bits: pp 2 in
// fp32 (1f1b, zb-h1, zbv), in bf16, with Adam paged to NVMe; dp 2 × pp 2 in
// fp32 and in bf16 with bf16 on the wire; dp 2 × tp 2 × pp 2 against dp 2 ×
// tp 2; and a pp 2 checkpoint resumes at pp 1 on its curve. GPT-2's tied
// table, on two stages (1f1b) or one (zbv), gives the same bits at pp 2 and
// at dp 2 × pp 2, in fp32 and bf16: its lookup part is added once, at the
// step, from every micro-batch's rows, on every layout (tied_pair.h).
TEST_F(PipelineRuns, ZeroTwoStagesGiveOneStagesBits) {
  const std::string z2 = kLlama + " --set model.tie_embeddings=false --set parallel.zero_stage=2 ";
  const std::string ref = train("z2_pp1", 1, 1, z2);
  for (const char* s : {"1f1b", "zb-h1", "zbv"})
    expect_bits(ref, train(std::string("z2_pp2_") + s, 1, 2, z2 + "--set parallel.schedule=" + s),
                std::string("llama ZeRO-2 pp 2 ") + s);
  const std::string bf16 = z2 + "--set train.precision=bf16 ";
  const std::string bref = train("z2_bf16_pp1", 1, 1, bf16);
  expect_bits(bref, train("z2_bf16_pp2", 1, 2, bf16 + "--set parallel.schedule=zb-h1"), "llama ZeRO-2 bf16 pp 2 zb-h1");
  const std::string z2_paged = train("z2_bf16_pp2_paged", 1, 2, on_nvme(1, 2, bf16 + "--set parallel.schedule=1f1b"));
  expect_bits(bref, z2_paged, "llama ZeRO-2 bf16 pp 2, Adam and the master paged to NVMe", false);
  EXPECT_GT(nvme_read(z2_paged), 0) << "llama ZeRO-2 bf16 pp 2: no page came back from NVMe";
  expect_bits(train("z2_dp2", 2, 1, z2), train("z2_dp2pp2", 2, 2, z2 + "--set parallel.schedule=zbv"),
              "llama ZeRO-2 dp 2 × pp 2 zbv", false);
  const std::string wire16 = bf16 + "--set parallel.reduce_dtype=bf16 ";
  expect_bits(train("z2_dp2_bf16", 2, 1, wire16), train("z2_dp2pp2_bf16", 2, 2, wire16 + "--set parallel.schedule=1f1b"),
              "llama ZeRO-2 bf16 (bf16 on the wire) dp 2 × pp 2 1f1b", false);
  expect_bits(train("z2_dp2tp2", 2, 1, z2, 2), train("z2_dp2tp2pp2", 2, 2, z2 + "--set parallel.schedule=1f1b", 2),
              "llama ZeRO-2 dp 2 × tp 2 × pp 2 1f1b", false);
  copy_checkpoint(dir_ / "z2_pp2_zbv", 3, "z2_pp2_at_pp1");
  const auto r = run("z2_pp2_at_pp1", 1, 1, z2 + "--resume");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(tail(ref), tail(dir_ / "z2_pp2_at_pp1")) << "ZeRO-2 pp 2 resumed at pp 1";
  // GPT-2: the tied table on two stages (1f1b) and on one (zbv).
  const std::string g2 = "--set parallel.zero_stage=2 ";
  const std::string gref = train("z2_gpt2_pp1", 1, 1, g2);
  for (const char* s : {"1f1b", "zbv"})
    expect_bits(gref, train(std::string("z2_gpt2_pp2_") + s, 1, 2, g2 + "--set parallel.schedule=" + s),
                std::string("gpt2 ZeRO-2 pp 2 ") + s);
  expect_bits(train("z2_gpt2_dp2", 2, 1, g2), train("z2_gpt2_dp2pp2", 2, 2, g2 + "--set parallel.schedule=1f1b"),
              "gpt2 ZeRO-2 dp 2 × pp 2 1f1b", false);
  const std::string gb = g2 + "--set train.precision=bf16 ";
  expect_bits(train("z2_gpt2_bf16_dp2", 2, 1, gb), train("z2_gpt2_bf16_dp2pp2", 2, 2, gb + "--set parallel.schedule=zbv"),
              "gpt2 ZeRO-2 bf16 dp 2 × pp 2 zbv", false);
}

// ZeRO-3 at pp 2: each chunk stores only its data rank's shard of the
// parameters and gathers a unit for each use. At dp 2 × pp 2 the runs give
// dp 2's bits (fp32 under 1f1b and zbv, bf16 under zb-h1, bf16 on the wire,
// paged to NVMe: Adam, the master and the parameter and gradient shards,
// GPT-2's tied table on two stages and on one, in memory and paged, dp 2 ×
// tp 2 × pp 2 on 8 ranks), pp 2 alone gives pp 1's (in memory, and paged:
// one data rank's whole units in the pages), and a dp 2 × pp 2 checkpoint
// resumes at dp 2 on its curve. Every run is at one thread per
// rank (the bits compared are at equal threads per rank).
TEST_F(PipelineRuns, ZeroThreeStagesGiveOneStagesBits) {
  const std::string z3 = kLlama + " --set model.tie_embeddings=false --set parallel.zero_stage=3 ";
  const std::string dp2 = train("z3_dp2", 2, 1, z3);
  for (const char* s : {"1f1b", "zbv"})
    expect_bits(dp2, train(std::string("z3_dp2pp2_") + s, 2, 2, z3 + "--set parallel.schedule=" + s),
                std::string("llama ZeRO-3 dp 2 × pp 2 ") + s, false);
  const std::string pp1 = train("z3_pp1", 1, 1, z3);
  expect_bits(pp1, train("z3_pp2", 1, 2, z3 + "--set parallel.schedule=zb-h1"), "llama ZeRO-3 pp 2 zb-h1");
  // One data rank, paged: each stage's whole units live in its pages, copied out for each use.
  const std::string pp2_paged = train("z3_pp2_paged", 1, 2, on_nvme(1, 2, z3 + "--set parallel.schedule=zb-h1"));
  expect_bits(pp1, pp2_paged, "llama ZeRO-3 pp 2 zb-h1, the state and the parameters paged to NVMe");
  expect_shards_paged(pp2_paged, "llama ZeRO-3 pp 2 paged");
  const std::string bf16 = z3 + "--set train.precision=bf16 ";
  const std::string bref = train("z3_bf16_dp2", 2, 1, bf16);
  expect_bits(bref, train("z3_bf16_dp2pp2", 2, 2, bf16 + "--set parallel.schedule=zb-h1"),
              "llama ZeRO-3 bf16 dp 2 × pp 2 zb-h1", false);
  const std::string z3_paged =
      train("z3_bf16_dp2pp2_paged", 2, 2, on_nvme(2, 2, bf16 + "--set parallel.schedule=1f1b"));
  expect_bits(bref, z3_paged, "llama ZeRO-3 bf16 dp 2 × pp 2, the state and the shards paged to NVMe", false);
  EXPECT_GT(nvme_read(z3_paged), 0) << "llama ZeRO-3 bf16 dp 2 × pp 2: no page came back from NVMe";
  expect_shards_paged(z3_paged, "llama ZeRO-3 bf16 dp 2 × pp 2 paged");
  const std::string wire16 = bf16 + "--set parallel.reduce_dtype=bf16 ";
  expect_bits(train("z3_dp2_wire16", 2, 1, wire16),
              train("z3_dp2pp2_wire16", 2, 2, wire16 + "--set parallel.schedule=zbv"),
              "llama ZeRO-3 bf16 (bf16 on the wire) dp 2 × pp 2 zbv", false);
  expect_bits(train("z3_dp2tp2", 2, 1, z3, 2), train("z3_dp2tp2pp2", 2, 2, z3 + "--set parallel.schedule=1f1b", 2),
              "llama ZeRO-3 dp 2 × tp 2 × pp 2 1f1b", false);
  copy_checkpoint(dir_ / "z3_dp2pp2_zbv", 3, "z3_dp2pp2_at_dp2");
  const auto r = run("z3_dp2pp2_at_dp2", 2, 1, z3 + "--resume");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(tail(dp2), tail(dir_ / "z3_dp2pp2_at_dp2")) << "ZeRO-3 dp 2 × pp 2 resumed at dp 2";
  // GPT-2: the tied table on two stages (1f1b) and on one (zbv).
  const std::string g3 = "--set parallel.zero_stage=3 ";
  const std::string gref = train("z3_gpt2_dp2", 2, 1, g3);
  for (const char* s : {"1f1b", "zbv"})
    expect_bits(gref, train(std::string("z3_gpt2_dp2pp2_") + s, 2, 2, g3 + "--set parallel.schedule=" + s),
                std::string("gpt2 ZeRO-3 dp 2 × pp 2 ") + s, false);
  const std::string gb = g3 + "--set train.precision=bf16 ";
  expect_bits(train("z3_gpt2_bf16_dp2", 2, 1, gb), train("z3_gpt2_bf16_dp2pp2", 2, 2, gb + "--set parallel.schedule=1f1b"),
              "gpt2 ZeRO-3 bf16 dp 2 × pp 2 1f1b", false);
  // The tied table's two copies (the head's replica on the other stage) in pages.
  const std::string g3_paged = train("z3_gpt2_dp2pp2_paged", 2, 2, on_nvme(2, 2, g3 + "--set parallel.schedule=1f1b"));
  expect_bits(gref, g3_paged, "gpt2 ZeRO-3 dp 2 × pp 2 1f1b, the state and the shards paged to NVMe", false);
  expect_shards_paged(g3_paged, "gpt2 ZeRO-3 dp 2 × pp 2 paged");
}

// 8- and 4-bit Adam state (optim.state_bits) in a pipeline: each chunk's
// AdamW keeps its tensors' moments quantized on their unit's grid of blocks
// (a ZeRO cut lies on it too), so a pipeline gives the one-stage run's bits,
// in memory and paged, and its checkpoint resumes at pp 1 with the codes
// recovered.
TEST_F(PipelineRuns, QuantizedStateGivesOneStagesBits) {
  const std::string all = "--set 'optim.state_bits_exclude=\"\"' ";
  // GPT-2 at 8 bits, the tied table on two stages (1f1b) and on one (zbv).
  const std::string q8 = all + "--set model.n_embd=64 --set optim.state_bits=8 ";
  const std::string ref8 = train("q8_pp1", 1, 1, q8);
  for (const char* s : {"1f1b", "zbv"})
    expect_bits(ref8, train(std::string("q8_pp2_") + s, 1, 2, q8 + "--set parallel.schedule=" + s),
                std::string("gpt2 8-bit pp 2 ") + s);
  // Llama at 4 bits in bf16: dp 2 × pp 2 against dp 2, at ZeRO-1 and ZeRO-3.
  for (int z : {1, 3}) {
    const std::string q4 = kLlama + " " + all + "--set optim.state_bits=4 --set train.precision=bf16" +
                           " --set model.tie_embeddings=false --set parallel.zero_stage=" + std::to_string(z) + " ";
    const std::string tag = "q4_z" + std::to_string(z);
    expect_bits(train(tag + "_dp2", 2, 1, q4), train(tag + "_dp2pp2", 2, 2, q4 + "--set parallel.schedule=zb-h1"),
                "llama 4-bit bf16 ZeRO-" + std::to_string(z) + " dp 2 × pp 2 zb-h1", false);
  }
  // tp 2 × pp 2: each tp rank's pieces quantized on its units' grid, as at tp 2 alone.
  expect_bits(train("q8_tp2", 1, 1, q8, 2), train("q8_tp2pp2", 1, 2, q8 + "--set parallel.schedule=1f1b", 2),
              "gpt2 8-bit tp 2 × pp 2 1f1b vs tp 2", false);
  // Paged to NVMe (pages read back from the disk every step): the in-memory bits.
  const std::string q8_paged = train("q8_pp2_paged", 1, 2, on_nvme(1, 2, q8 + "--set parallel.schedule=1f1b"));
  expect_bits(ref8, q8_paged, "gpt2 8-bit pp 2 1f1b, Adam paged to NVMe");
  EXPECT_GT(nvme_read(q8_paged), 0) << "8-bit pp 2: no page came back from NVMe";
  copy_checkpoint(dir_ / "q8_pp2_1f1b", 3, "q8_pp2_at_pp1");
  const auto r = run("q8_pp2_at_pp1", 1, 1, q8 + "--resume");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("blocks of Adam's moments"), std::string::npos)
      << "the moments were re-quantized, not recovered:\n" << r.output;
  EXPECT_EQ(tail(ref8), tail(dir_ / "q8_pp2_at_pp1")) << "8-bit pp 2 resumed at pp 1";
}

// Adapters on a frozen base (lora.r > 0): each stage keeps its units' base
// once (its slots read it) and trains the adapters as parameters, so a
// pipeline gives the one-stage run's bits: LoRA on GPT-2 (its frozen tied
// table on two stages under 1f1b, on one under zbv), paged to NVMe; DoRA on
// Llama in bf16 at dp 2 × pp 2 under ZeRO-3 against dp 2; QLoRA (NF4 base)
// on Llama; adapter dropout (with activation checkpointing at dp 2 × pp 2);
// and a pp 2 checkpoint (the adapters) resumes at pp 1.
TEST_F(PipelineRuns, AdaptersGiveOneStagesBits) {
  const std::string lora = "--set lora.r=4 --set lora.alpha=8 --set 'lora.targets=\"c_attn attn.c_proj c_fc\"' ";
  const std::string ref = train("lora_pp1", 1, 1, lora);
  for (const char* s : {"1f1b", "zbv"})
    expect_bits(ref, train(std::string("lora_pp2_") + s, 1, 2, lora + "--set parallel.schedule=" + s),
                std::string("gpt2 LoRA pp 2 ") + s);
  const std::string paged = train("lora_pp2_paged", 1, 2, on_nvme(1, 2, lora + "--set parallel.schedule=1f1b"));
  expect_bits(ref, paged, "gpt2 LoRA pp 2 1f1b, adapters' Adam state paged to NVMe");
  EXPECT_GT(nvme_read(paged), 0) << "LoRA pp 2: no page came back from NVMe";
  for (const auto& r : po::test::last_metric(dir_ / "lora_pp2_1f1b", "pp_memory_per_rank"))
    EXPECT_GT(r["frozen"].get<double>(), 0) << "a stage reports no frozen base:\n" << r.dump();
  copy_checkpoint(dir_ / "lora_pp2_1f1b", 3, "lora_pp2_at_pp1");
  const auto resumed = run("lora_pp2_at_pp1", 1, 1, lora + "--resume");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(tail(ref), tail(dir_ / "lora_pp2_at_pp1")) << "LoRA pp 2 resumed at pp 1";

  // Adapter dropout: the masks follow (step, sequence, position), so each
  // stage drops what one stage drops, in its backward's recompute too.
  const std::string drop = lora + "--set lora.dropout=0.1 ";
  const std::string dref = train("drop_pp1", 1, 1, drop);
  for (const char* s : {"1f1b", "zbv"})
    expect_bits(dref, train(std::string("drop_pp2_") + s, 1, 2, drop + "--set parallel.schedule=" + s),
                std::string("gpt2 LoRA dropout 0.1 pp 2 ") + s);
  const std::string ckpt = drop + "--set model.activation_checkpointing=true ";
  expect_bits(train("drop_dp2", 2, 1, ckpt), train("drop_dp2pp2", 2, 2, ckpt + "--set parallel.schedule=zb-h1"),
              "gpt2 LoRA dropout 0.1, activation checkpointing, dp 2 × pp 2 zb-h1", false);

  const std::string dora = kLlama + " --set model.tie_embeddings=false --set lora.r=4 --set lora.alpha=8 " +
                           "--set lora.dora=true --set train.precision=bf16 --set parallel.zero_stage=3 ";
  expect_bits(train("dora_dp2", 2, 1, dora), train("dora_dp2pp2", 2, 2, dora + "--set parallel.schedule=zb-h1"),
              "llama DoRA bf16 ZeRO-3 dp 2 × pp 2 zb-h1", false);
  const std::string qlora = kLlama + " --set model.tie_embeddings=false --set lora.r=4 --set lora.alpha=8 " +
                            "--set model.quant=nf4 ";
  expect_bits(train("qlora_pp1", 1, 1, qlora), train("qlora_pp2", 1, 2, qlora + "--set parallel.schedule=1f1b"),
              "llama QLoRA (nf4 base) pp 2 1f1b");
}

TEST_F(PipelineRuns, CheckpointsReshardAcrossPp) {
  const std::string pp1 = train("pp1", 1, 1, "");
  const std::string pp2 = train("pp2", 1, 2, "--set parallel.schedule=zbv");
  // pp 2 -> pp 1, pp 1 -> pp 2, pp 2 -> pp 2 (1f1b): the uninterrupted curve, bit for bit.
  struct Case {
    std::string src;
    int pp;
    const char* name;
    const char* schedule;
  };
  for (const Case& c : {Case{pp2, 1, "from_pp2_at_pp1", "1f1b"}, Case{pp1, 2, "from_pp1_at_pp2", "zb-h1"},
                        Case{pp2, 2, "from_pp2_at_pp2", "1f1b"}}) {
    copy_checkpoint(c.src, 3, c.name);
    const auto r = run(c.name, 1, c.pp, std::string("--resume --set parallel.schedule=") + c.schedule);
    ASSERT_EQ(r.exit_code, 0) << c.name << "\n" << r.output;
    const auto a = tail(pp1), b = tail(dir_ / c.name);
    ASSERT_EQ(a.size(), 3u);
    ASSERT_EQ(a.size(), b.size()) << c.name;
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << c.name << ": step " << i + 4;
    po::test::expect_same_checkpoint(pp1, dir_ / c.name, 6, c.name);
  }
  // dp 2 × pp 2 -> dp 2: on dp 2's curve, bit for bit.
  const std::string dp2 = train("dp2", 2, 1, "");
  const std::string dp2pp2 = train("dp2pp2", 2, 2, "");
  copy_checkpoint(dp2pp2, 3, "dp2pp2_at_dp2");
  const auto r = run("dp2pp2_at_dp2", 2, 1, "--resume");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto a = tail(dp2), b = tail(dir_ / "dp2pp2_at_dp2");
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "dp2×pp2 resumed at dp2: step " << i + 4;
}

// parallel.vocab_parallel (the head's pieces on both ranks) through the
// trainer: 1f1b, zb-h1 and zbv at pp 2 give pp 1's bits for GPT-2 and 1f1b
// for Llama; a checkpoint of pp 1 resumes there on pp 1's curve; at dp 2 ×
// pp 2 with ZeRO-1 and Adam paged to NVMe it gives dp 2 × pp 2's bits with
// the head on the last stage, and activation checkpointing composes.
TEST_F(PipelineRuns, VocabularyParallelRunsAreBitIdentical) {
  const std::string vp = "--set parallel.vocab_parallel=true ";
  const std::string ref = train("pp1", 1, 1, "");
  for (const char* s : {"1f1b", "zb-h1", "zbv"})
    expect_bits(ref, train(std::string("vp2_") + s, 1, 2, vp + "--set parallel.schedule=" + s),
                std::string("gpt2 pp 2 vocabulary parallel ") + s);
  const std::string lref = train("llama_pp1", 1, 1, kLlama);
  expect_bits(lref, train("llama_vp2", 1, 2, vp + kLlama + " --set parallel.schedule=1f1b"),
              "llama pp 2 vocabulary parallel 1f1b");
  copy_checkpoint(ref, 3, "vp_from_pp1");
  const auto r = run("vp_from_pp1", 1, 2, vp + "--resume --set parallel.schedule=zbv");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto a = tail(ref), b = tail(dir_ / "vp_from_pp1");
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "resumed at pp 2 vocabulary parallel: step " << i + 4;
  const std::string ck = "--set model.activation_checkpointing=true ";
  expect_bits(train("ckpt_pp1", 1, 1, ck), train("ckpt_vp2", 1, 2, vp + ck + "--set parallel.schedule=zb-h1"),
              "vocabulary parallel with activation checkpointing");
  const std::string z0 = train("z0", 2, 2, "--set parallel.schedule=1f1b");
  const std::string paged =
      train("vp_z1_paged", 2, 2, on_nvme(2, 2, vp + "--set parallel.schedule=1f1b --set parallel.zero_stage=1"));
  expect_bits(z0, paged, "dp 2 × pp 2 vocabulary parallel, ZeRO-1 paged, against the head on the last stage");
  EXPECT_GT(nvme_read(paged), 0) << "vocabulary parallel dp 2 × pp 2 ZeRO-1: no page came back from NVMe";
}

// ZeRO-1 over the data group and each stage's Adam state in pages (NVMe
// behind a one-page host tier and the smallest compute tier the run
// accepts) give ZeRO-0's in-memory bits: losses, norms, validation losses
// and the checkpoints' bytes.
TEST_F(PipelineRuns, ZeroOneAndPagedStagesGiveTheInMemoryBits) {
  const std::string zbv = "--set parallel.schedule=zbv ";
  const std::string z0 = train("z0", 2, 2, zbv);
  const std::string z1 = train("z1", 2, 2, zbv + "--set parallel.zero_stage=1");
  expect_bits(z0, z1, "dp 2 × pp 2, ZeRO-1 against ZeRO-0");
  for (auto [x, y] : {std::pair{0, 0}, {1, 1}})
    EXPECT_LT(po::test::last_metric(z1, "pp_memory_per_rank")[x]["adam"].get<double>(),
              po::test::last_metric(z0, "pp_memory_per_rank")[y]["adam"].get<double>())
        << "ZeRO-1's Adam state on pipeline rank " << x << " is not smaller than ZeRO-0's";
  const std::string paged = train("paged", 2, 2, on_nvme(2, 2, zbv + "--set parallel.zero_stage=1"));
  expect_bits(z0, paged, "dp 2 × pp 2, ZeRO-1 paged to NVMe against ZeRO-0 in memory");
  EXPECT_GT(nvme_read(paged), 0) << "the paged run read nothing back from NVMe";
}

// dp 2 × tp 2 × pp 2 with ZeRO-1 (8 processes): follows dp 2 within 1e-5;
// its checkpoint resumes at dp 2 and dp 2's resumes at 3-D, each on the
// other's curve within 1e-5 (other reduction orders); 3-D resumes at 3-D on
// its own curve bit for bit, with the same final checkpoint. In bf16, with
// activation checkpointing and paged stage state, 3-D follows dp 2 in bf16.
TEST_F(PipelineRuns, ThreeDimensionalCheckpointsReshardToDataParallelAndBack) {
  const std::string z1 = "--set parallel.zero_stage=1 --set parallel.schedule=1f1b";
  const std::string dp2 = train("dp2", 2, 1, z1);
  const std::string d3 = train("d3", 2, 2, z1, 2);
  po::test::expect_same_curve(metric(dp2, "loss", 6), metric(d3, "loss", 6), "dp2×tp2×pp2 vs dp2");
  copy_checkpoint(d3, 3, "d3_at_dp2");
  auto r = run("d3_at_dp2", 2, 1, z1 + " --resume");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  po::test::expect_same_curve(tail(d3), tail(dir_ / "d3_at_dp2"), "dp2×tp2×pp2 resumed at dp 2");
  copy_checkpoint(dp2, 3, "dp2_at_d3");
  r = run("dp2_at_d3", 2, 2, z1 + " --resume", 2);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  po::test::expect_same_curve(tail(dp2), tail(dir_ / "dp2_at_d3"), "dp 2 resumed at dp2×tp2×pp2");
  // The same 3-D layout in bf16 with activation checkpointing and its stages'
  // state paged to NVMe, against dp 2 in bf16 (bf16 sums: 1e-4).
  const std::string b16 = " --set train.precision=bf16";
  const std::string dp2b = train("dp2_bf16", 2, 1, z1 + b16);
  const std::string d3b =
      train("d3_bf16", 2, 2, on_nvme(2, 2, z1 + b16 + " --set model.activation_checkpointing=true", 2), 2);
  EXPECT_GT(nvme_read(d3b), 0) << "bf16 dp2×tp2×pp2: no page came back from NVMe";
  const auto a = metric(dp2b, "loss", 6), b = metric(d3b, "loss", 6);
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(a[i], b[i], 1e-4 * a[i]) << "bf16 dp2×tp2×pp2 (checkpointing, paged) vs dp 2: step " << i + 1;
  // Against dp 2 × tp 2 (the same tensor-parallel sums): its bits.
  expect_bits(train("dp2tp2_bf16", 2, 1, z1 + b16 + " --set model.activation_checkpointing=true", 2), d3b,
              "bf16 dp2×tp2×pp2 (checkpointing, paged) against dp2×tp2", false);
  copy_checkpoint(d3, 3, "d3_at_d3");
  r = run("d3_at_d3", 2, 2, z1 + " --resume", 2);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(tail(d3), tail(dir_ / "d3_at_d3")) << "dp2×tp2×pp2 resumed in its own layout";
  po::test::expect_same_checkpoint(d3, dir_ / "d3_at_d3", 6, "dp2×tp2×pp2 resumed in its own layout");
  // Every rank wrote its cut (every tp rank too, since 2026-12-07): no funnel.
  EXPECT_EQ(po::checkpoint::read_manifest(po::train::checkpoint_path(d3, 6)).writers, 8)
      << "dp2×tp2×pp2: a checkpoint is written by all dp 2 × tp 2 × pp 2 ranks";
}

// Sequence parallel inside each stage: tp 2 × pp 2 (4 processes) gives
// the bits of tp 2 at pp 1, both with the tensor group's rows split.
TEST_F(PipelineRuns, SequenceParallelStagesAreBitIdenticalToOneStage) {
  const std::string sp = "--set parallel.sequence_parallel=true --set parallel.schedule=zb-h1";
  const std::string one = train("tp2_sp", 1, 1, sp, 2);
  const std::string two = train("tp2_sp_pp2", 1, 2, sp, 2);
  expect_bits(one, two, "tp 2 × pp 2 with sequence parallel vs tp 2");
}

// dp 2 × tp 2 × pp 2 (8 processes, ZeRO-1, zbv) over 20 steps follows one
// process at the same global batch within 1e-5 (other reduction orders).
TEST_F(PipelineRuns, ThreeDimensionalFollowsOneProcessOverTwentySteps) {
  const std::string x = "--set parallel.zero_stage=1 --set parallel.schedule=zbv --set train.steps=20"
                        " --set train.checkpoint_interval=0 --set train.eval_interval=10";
  const std::string one = train("one_20", 1, 1, x);
  const std::string d3 = train("d3_20", 2, 2, x, 2);
  po::test::expect_same_curve(metric(one, "loss", 20), metric(d3, "loss", 20),
                              "dp2×tp2×pp2 (zbv, ZeRO-1) vs one process, 20 steps");
}

// Each step's record has the bubble, the MFU against the GEMM peak the run
// measured at start, and every rank's memory, which the start-up table in the
// log predicted (to its 0.1 MiB).
TEST_F(PipelineRuns, ReportsTheBubbleAndWritesATrace) {
  const std::string trace = dir_ / "zbv.json";
  const auto out = this->run("zbv", 1, 2, "--set parallel.schedule=zbv --trace " + trace);
  ASSERT_EQ(out.exit_code, 0) << out.output;
  const std::string run = dir_ / "zbv";
  const auto records = read_metrics(run);
  const std::string head = "memory per pipeline rank (MiB), predicted after a step:";
  const size_t table = out.output.find(head);
  ASSERT_NE(table, std::string::npos) << "no start-up memory table\n" << out.output;
  std::vector<double> predicted;  // each row's total, its last column
  std::istringstream rows(out.output.substr(table + head.size()));
  std::string line;
  std::getline(rows, line);  // the rest of the heading line
  std::getline(rows, line);  // the kinds
  EXPECT_NE(line.find("total"), std::string::npos) << line;
  while (predicted.size() < 2 && std::getline(rows, line)) predicted.push_back(std::stod(line.substr(line.rfind(' '))));
  int seen = 0;
  for (const auto& j : records) {
    if (!j.contains("pp_bubble")) continue;
    ++seen;
    const double mfu = j["mfu"].get<double>();
    EXPECT_TRUE(mfu > 0 && mfu < 1.5) << "step " << j["step"] << ": mfu " << mfu;
    ASSERT_EQ(predicted.size(), j["pp_memory_per_rank"].size());
    for (size_t r = 0; r < predicted.size(); ++r)
      EXPECT_NEAR(predicted[r], j["pp_memory_per_rank"][r]["total"].get<double>() / 1048576.0, 0.05)
          << "rank " << r << ": the start-up table against step " << j["step"];
    const double b = j["pp_bubble"].get<double>();
    EXPECT_GE(b, 0.0);
    EXPECT_LT(b, 1.0);
    EXPECT_EQ(j["pp_bubble_formula"].get<double>(), 0.0) << "zbv's formula bubble";
    const double costed = j["pp_bubble_stages"].get<double>();
    EXPECT_TRUE(costed >= 0 && costed < 1) << "the bubble with the stages' costs: " << costed;
    for (const auto& peak : j["pp_peak_in_flight"]) EXPECT_GE(peak.get<int>(), 1);
  }
  EXPECT_EQ(seen, 6) << "every step reports its bubble";
  const nlohmann::json doc = nlohmann::json::parse(po::test::read_file(trace));
  std::set<int> ranks;
  std::set<std::string> kinds;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] != "X") continue;
    ranks.insert(e["tid"].get<int>());
    kinds.insert(e["cat"].get<std::string>());
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1})) << "one track per rank";
  for (const char* k : {"forward", "backward-input", "backward-weight", "send", "recv"})
    EXPECT_TRUE(kinds.count(k)) << "the trace has no '" << k << "' events";
}

// The planner's memory of a pipeline layout is the executor's own, to the
// byte, on the busiest rank (every schedule, with and without activation
// checkpointing; GPT-2's tied table and Llama's untied head; ZeRO-1 at dp 2,
// in memory and paged, fp32 and bf16: the compute tier's bytes, page frames
// included), and so is its p2p volume.
TEST_F(PipelineRuns, ThePlannerPredictsEachScheduleMemoryToTheByte) {
  struct Case {
    std::string model;
    const char* s;
    const char* ckpt;
    int dp = 1;
    std::string extra;
  };
  const std::string z1 = "--set parallel.zero_stage=1 ";
  const std::string paged = z1 + "--set memory.page_size=4096 --set memory.host_budget=8192 "
                                 "--set memory.nvme_dir=" + (dir_ / "swap") +
                            " --set memory.compute_budget=1200000";
  const std::string lora = "--set lora.r=4 --set lora.alpha=8 ";
  const std::vector<Case> cases = {
      {"", "gpipe", "false", 1, ""},     {"", "1f1b", "false", 1, ""},
      {"", "interleaved", "false", 1, ""}, {"", "zb-h1", "false", 1, ""},
      {"", "zbv", "false", 1, ""},       {"", "1f1b", "true", 1, ""},
      {"", "zbv", "true", 1, ""},        {kLlama, "1f1b", "false", 1, ""},
      {kLlama, "zb-h1", "true", 1, ""},  {"", "1f1b", "false", 2, z1},
      {"", "zbv", "false", 2, paged},    {"", "zb-h1", "false", 2, z1 + "--set train.precision=bf16"},
      // adapters: the frozen base (f32 with GPT-2's table copied to the head; NF4 codes on Llama)
      {"", "1f1b", "false", 1, lora},    {kLlama + " --set model.tie_embeddings=false", "zb-h1", "false", 1,
                                          lora + "--set model.quant=nf4"}};
  for (const auto& [model, s, ckpt, dp, extra] : cases) {
    const std::string args = model + " --set parallel.schedule=" + s +
                             " --set model.activation_checkpointing=" + ckpt + " " + extra;
    const std::string what = std::string(s) + (model.empty() ? " gpt2" : " llama") +
                             (std::string(ckpt) == "true" ? " ckpt" : "") + " dp " +
                             std::to_string(dp) + " " + extra;
    const std::string run = train(std::string("plan_") + s + ckpt + (model.empty() ? "" : "_l") +
                                      std::to_string(dp) + (extra.empty() ? "" : "_z") +
                                      (extra.size() > z1.size() ? "p" : ""),
                                  dp, 2, args + " --set train.steps=1");
    double engine = 0;
    for (const auto& r : po::test::last_metric(run, "pp_memory_per_rank"))
      engine = std::max(engine, r["total"].get<double>());
    const auto plan = po::test::run_command(std::string(PO_BINARY) + " plan --json -c " + config_ +
                                            " --set parallel.pp=2 --set parallel.dp=" +
                                            std::to_string(dp) + " " + base(args));
    ASSERT_EQ(plan.exit_code, 0) << plan.output;
    const nlohmann::json j = nlohmann::json::parse(plan.output);
    double predicted = 0;
    for (const auto& m : j["memory"])
      if (m["tier"] == "compute") predicted += m["bytes"].get<double>();
    EXPECT_EQ(predicted, engine) << what << ": the planner's bytes on the busiest rank vs the "
                                 << "executor's\n" << j["memory"].dump(1);
    // The p2p volume: the busiest rank's sends, to the byte.
    double sent = 0, planned_sent = -1;
    for (const auto& r : po::test::last_metric(run, "pp_p2p_bytes_per_rank"))
      sent = std::max(sent, r.get<double>());
    for (const auto& c : j["comm"])
      if (c["dim"] == "pp") planned_sent = c["bytes"].get<double>();
    EXPECT_EQ(planned_sent, sent) << what << ": the planner's p2p bytes of the busiest rank vs the "
                                  << "executor's";
  }
}

TEST_F(PipelineRuns, AShapeMismatchNamesBothRanksAndShapes) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = po::test::run_command(
      "PAGEDOPTIM_TEST_PP_SKEW_RANK=0 " +
      po::test::pagedoptim_command(2, "train -c " + config_ + " --set run.dir=" + (dir_ / "skew") +
                                          " --set parallel.pp=2 --set parallel.timeout=5 " +
                                          base("--set train.micro_batch_size=1")));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_LT(secs, 30.0) << r.output;
  EXPECT_NE(r.output.find("rank 1 expected [16, 32] from rank 0, which sent [32, 16]"),
            std::string::npos)
      << "the shape check did not name the ranks and shapes:\n" << r.output;
}

TEST_F(PipelineRuns, AKilledStageEndsTheRunNamingItsRank) {
  po::test::BackgroundRun job(config_, dir_ / "victim",
                              "--set parallel.pp=2 --set model.n_layer=4 --set train.batch_size=8");
  const int victim = job.rank_pid(1);
  ASSERT_GT(victim, 0) << "rank 1 never started:\n" << job.output();
  const auto t0 = std::chrono::steady_clock::now();
  kill(victim, SIGKILL);
  const double secs = job.finish(t0);
  const std::string out = job.output();
  EXPECT_LT(secs, 10.0) << "the run took " << secs << " s to stop after stage 1 was killed";
  EXPECT_FALSE(job.exited_zero()) << out;
  EXPECT_NE(out.find("rank 1"), std::string::npos) << "output does not name rank 1:\n" << out;
}

TEST_F(PipelineRuns, UnsupportedLayoutsAreOneLineErrors) {
  struct Case {
    std::string args, expect;
  };
  for (const Case& c : {
           Case{"--set parallel.zero_stage=3 --set parallel.vocab_parallel=true",
                "parallel.zero_stage = 3 with parallel.vocab_parallel"},
           Case{"--set parallel.zero_stage=2 --set parallel.vocab_parallel=true",
                "parallel.zero_stage = 2 with parallel.vocab_parallel"},
           Case{"--set parallel.micro_batches=3", "parallel.micro_batches = 3 but"},
           Case{"--set parallel.schedule=zbv --set model.n_layer=3", "stages"},
           Case{"--set parallel.vocab_parallel=true --set train.precision=bf16",
                "parallel.vocab_parallel with train.precision = \"bf16\" is not built yet"},
       }) {
    const auto r = run("bad", 1, 2, c.args);
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.args << ":\n" << r.output;
  }
}

}  // namespace
