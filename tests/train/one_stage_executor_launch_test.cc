// Issue 35's migration: pp = 1 through the pipeline executor as its
// one-stage schedule (PAGEDOPTIM_ONE_STAGE_EXECUTOR=1, train/trainer.cc)
// gives DataParallel's bits: every loss, gradient norm (clipping on) and
// validation loss, and the checkpoint: its whole state, and its files byte
// for byte (both engines' data ranks write the same ZeRO cut), at one thread
// per rank. Each layout here is one
// the switch to a single engine must keep; a layout missing from this list
// is not yet shown to keep its bits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "../test_util.h"

namespace {

using po::test::metric;

class OneStageExecutor : public po::test::TinyTraining {
 protected:
  int steps() const override { return 6; }
  // `pagedoptim train` on `np` ranks (parallel.dp = np unless `extra` says
  // otherwise), through DataParallel or the executor.
  std::string train(const std::string& name, int np, const std::string& extra, bool executor) {
    const std::string env = executor ? "env PAGEDOPTIM_ONE_STAGE_EXECUTOR=1 " : "";
    const auto r = po::test::run_command(
        env + po::test::pagedoptim_command(
                  np, "train -c " + config_ + " --set run.dir=" + (dir_ / name) + " --set parallel.dp=" +
                          std::to_string(np) +
                          " --set model.n_layer=4 --set train.batch_size=8 --set train.grad_clip=0.05"
                          " --set train.eval_interval=3 --set train.checkpoint_interval=3 " +
                          extra));
    EXPECT_EQ(r.exit_code, 0) << name << ": " << extra << "\n" << r.output;
    if (executor) {
      EXPECT_NE(r.output.find("pipeline: "), std::string::npos) << name << ": not run by the executor\n" << r.output;
    }
    return dir_ / name;
  }
  // Returns the two runs' directories (DataParallel's, the executor's).
  std::pair<std::string, std::string> expect_same(int np, const std::string& extra, const std::string& what) {
    const std::string tag = "r" + std::to_string(runs_++);
    const std::string ref = train(tag + "_dp", np, extra, false), got = train(tag + "_ex", np, extra, true);
    po::test::expect_same_metrics(ref, got, {{"loss", 6}, {"grad_norm", 6}, {"val_loss", 2}},
                                  what + " (the executor against DataParallel)");
    po::test::expect_same_checkpoint(ref, got, 6, what);
    return {ref, got};
  }
  // `extra` with the state paged to NVMe behind a one-page host tier, the
  // compute tier the smallest both engines accept on `np` ranks (the
  // minimum each names for 1 byte).
  std::string on_nvme(int np, const std::string& extra) {
    const std::string paging = extra + " --set memory.nvme_dir=" + std::string(dir_ / "swap") +
                               " --set memory.page_size=4096 --set memory.host_budget=4096 --set memory.compute_budget=";
    int64_t least = 0;
    for (const bool executor : {false, true}) {
      const auto probe = po::test::run_command(
          std::string(executor ? "env PAGEDOPTIM_ONE_STAGE_EXECUTOR=1 " : "") +
          po::test::pagedoptim_command(np, "train -c " + config_ + " --set run.dir=" + (dir_ / "probe") +
                                               " --set parallel.dp=" + std::to_string(np) +
                                               " --set model.n_layer=4 --set train.batch_size=8 " + paging + "1"));
      least = std::max(least, po::test::named_minimum_budget(probe.output));
      std::filesystem::remove_all(dir_ / "probe");
    }
    EXPECT_GT(least, 0) << "no minimum compute budget named for " << extra;
    return paging + std::to_string(least);
  }
  int runs_ = 0;
};

const std::string kLlama =
    " --set model.preset=llama-tiny --set model.n_embd=32 --set model.n_head=4 --set model.n_kv_head=2"
    " --set model.vocab_size=64 --set model.seq_len=16";

TEST_F(OneStageExecutor, OneProcessGivesDataParallelsBits) {
  expect_same(1, "", "gpt2 fp32");
  expect_same(1, "--set train.precision=bf16", "gpt2 bf16");
  expect_same(1, kLlama + " --set model.tie_embeddings=false", "llama fp32");
  expect_same(1, "--set model.activation_checkpointing=true", "gpt2 activation checkpointing");
  expect_same(1, "--set optim.state_bits=8 --set 'optim.state_bits_exclude=\"\"' --set model.n_embd=64",
              "gpt2 8-bit Adam state");
  expect_same(1, "--set lora.r=4 --set lora.alpha=8 --set lora.dropout=0.1", "gpt2 LoRA with dropout");
}

TEST_F(OneStageExecutor, DataParallelLayoutsGiveDataParallelsBits) {
  for (int z : {0, 1, 2, 3})
    expect_same(2, "--set parallel.zero_stage=" + std::to_string(z), "gpt2 dp 2 ZeRO-" + std::to_string(z));
  expect_same(2, "--set train.precision=bf16 --set parallel.zero_stage=1", "gpt2 bf16 dp 2 ZeRO-1");
}

TEST_F(OneStageExecutor, SplitAndPagedLayoutsGiveDataParallelsBits) {
  expect_same(2, "--set parallel.dp=1 --set parallel.tp=2", "gpt2 tp 2");
  expect_same(2, "--set parallel.dp=1 --set parallel.cp=2", "gpt2 cp 2");
  // Adam's pages on NVMe behind a one-page host tier.
  const auto [ref, got] = expect_same(1, on_nvme(1, ""), "gpt2 Adam state paged to NVMe");
  double read[2] = {0, 0}, lent[2] = {0, 0};
  for (const auto& j : po::test::read_metrics(ref))
    if (j.contains("paging")) {
      read[0] += j["paging"].value("nvme_read_bytes", 0.0);
      lent[0] += j["paging"].value("lent_read_bytes", 0.0);
    }
  for (const auto& r : po::test::last_metric(got, "pp_paging_per_rank")) {
    read[1] += r["nvme_read_bytes"].get<double>();
    lent[1] += r["lent_read_bytes"].get<double>();
  }
  EXPECT_GT(read[0], 0) << "DataParallel's run read no page back from NVMe";
  EXPECT_GT(read[1], 0) << "the executor's run read no page back from NVMe at its last step";
  // The dead activations lent to the pager (memory.lend_activations), filled with pages.
  EXPECT_GT(lent[0], 0) << "DataParallel's run read no page into lent activations";
  EXPECT_GT(lent[1], 0) << "the executor's run read no page into lent activations at its last step";
}

// ZeRO-3 paged (ZeRO-Infinity): the stored parameter and gradient shards in
// the pages beside Adam's state and the master, on NVMe, fp32 and bf16, over
// two data ranks and on one (a model larger than the compute tier on one
// device): the executor's gathers copy a shard out of its pages, its
// reductions add into them, and it holds no parameter or gradient byte
// outside them; the bits and files of DataParallel's paged shards.
TEST_F(OneStageExecutor, ZeroThreeShardsPagedGiveDataParallelsBits) {
  for (const int np : {2, 1})
    for (const std::string precision : {"fp32", "bf16"}) {
      const std::string extra = "--set parallel.zero_stage=3 --set train.precision=" + precision;
      const std::string what = "dp " + std::to_string(np) + " ZeRO-3 " + precision + ", shards paged";
      const std::string got = expect_same(np, on_nvme(np, extra), what).second;
      for (const auto& r : po::test::last_metric(got, "pp_memory_per_rank")) {
        EXPECT_EQ(r["params"].get<double>(), 0) << what << ": parameter bytes held outside the pages";
        EXPECT_EQ(r["grads"].get<double>(), 0) << what << ": gradient bytes held outside the pages";
      }
      double read = 0;
      for (const auto& r : po::test::last_metric(got, "pp_paging_per_rank")) read += r["nvme_read_bytes"].get<double>();
      EXPECT_GT(read, 0) << what << ": the executor's run read no page back from NVMe at its last step";
    }
}

// Updates in the backward (memory.update_in_backward, no clipping): each
// page goes as soon as its units' gradients are final. DataParallel's bits
// (the sweep's) at ZeRO 0 on one rank, 2 (bf16) and 3 (shards paged) over
// two, and over a pipeline of two stages against dp 2; pages go early
// wherever that cannot depend on timing (one rank, ZeRO 2-3).
TEST_F(OneStageExecutor, UpdatesInTheBackwardGiveDataParallelsBits) {
  const std::string early = "--set train.grad_clip=0 --set memory.update_in_backward=true ";
  auto pages_early = [](const std::string& run) {
    double n = 0;
    for (const auto& r : po::test::last_metric(run, "pp_paging_per_rank"))
      n += r["pages_updated_in_backward"].get<double>();
    return n;
  };
  struct Case {
    int np;
    std::string extra;
  };
  for (const Case& c : {Case{1, ""}, Case{2, "--set parallel.zero_stage=2 --set train.precision=bf16"},
                        Case{2, "--set parallel.zero_stage=3"}, Case{2, "--set parallel.zero_stage=1"}}) {
    const std::string what = "dp " + std::to_string(c.np) + " " + c.extra + ", updates in the backward";
    const std::string got = expect_same(c.np, on_nvme(c.np, early + c.extra), what).second;
    std::printf("[ %s ] %.0f pages updated in the backward at the last step\n", what.c_str(), pages_early(got));
    if (c.np == 1 || c.extra.find("zero_stage=1") == std::string::npos) {
      EXPECT_GT(pages_early(got), 0) << what << ": no page was updated in the backward";
    }
  }
  // Two pipeline stages (1f1b, ZeRO-2) against dp 2 in memory with clipping off.
  const std::string z2 = "--set train.grad_clip=0 --set parallel.zero_stage=2";
  const std::string ref = train("early_ref", 2, z2, false);
  const std::string pp = train("early_pp2", 4,
                               on_nvme(2, early + "--set parallel.zero_stage=2") +
                                   " --set parallel.dp=2 --set parallel.pp=2 --set parallel.schedule=1f1b",
                               false);
  for (const char* key : {"loss", "grad_norm"})
    EXPECT_EQ(metric(ref, key, 6), metric(pp, key, 6)) << "ZeRO-2 dp 2 × pp 2 paged, updates in the backward: " << key;
  EXPECT_GT(pages_early(pp), 0) << "ZeRO-2 dp 2 × pp 2: no page was updated in the backward";
}

// The data group's sums in buckets, started while the backward runs
// (parallel.overlap_comm, small buckets so there are several): the bits of
// DataParallel's overlapped buckets and of the executor's own sums at the
// step, with most buckets started by the backward and none without overlap;
// bf16 gradients summed in f32 (one staged unit at a time) and a
// zero-bubble pipeline (units finished by the weight half) too.
TEST_F(OneStageExecutor, BucketSumsOverlapTheBackwardWithTheSameBits) {
  const std::string small = " --set parallel.zero_stage=1 --set parallel.bucket_size=8KiB";
  auto sums = [](const std::string& run) {
    const nlohmann::json j = po::test::last_metric(run, "dp_sums");
    return std::pair<int, int>{j.value("overlapped", -1), j.value("all", -1)};
  };
  for (const std::string& precision : {"fp32", "bf16"}) {
    const std::string extra = small + " --set train.precision=" + precision;
    // (Without overlap DataParallel adds the lookup rows in the backward,
    // not deferred, so the two settings differ from each other: each is
    // held to DataParallel's.)
    const std::string on = expect_same(2, extra, "dp 2 " + precision + " overlapped buckets").second;
    const std::string off =
        expect_same(2, extra + " --set parallel.overlap_comm=false", "dp 2 " + precision + " buckets at the step")
            .second;
    const auto [early, all] = sums(on);
    EXPECT_GT(all, 4) << precision << ": too few buckets to show an overlap";
    EXPECT_GE(early, all - 2) << precision << ": the backward started " << early << " of " << all << " sums";
    EXPECT_EQ(sums(off).first, 0) << precision << ": sums started in the backward without overlap_comm";
    EXPECT_EQ(sums(off).second, all) << precision;
  }
  // dp 2 × pp 2, zero-bubble (split backward): against dp 2's DataParallel run.
  const std::string zb = train("zb_ref", 2, small, false);
  const std::string pp = train("zb_pp2", 4, small + " --set parallel.dp=2 --set parallel.pp=2 --set parallel.schedule=zb-h1",
                               false);
  for (const char* key : {"loss", "grad_norm"})
    EXPECT_EQ(metric(zb, key, 6), metric(pp, key, 6)) << "dp 2 × pp 2 zb-h1: " << key;
  EXPECT_GT(sums(pp).first, 0) << "dp 2 × pp 2 zb-h1: no sum started in the backward";
}

// ZeRO 2-3: each micro-batch's reduce-scatters run while the backward goes
// on (parallel.overlap_comm: a ring of accumulators, two in flight), and
// complete in the order they were posted: DataParallel's bits with and
// without overlap, in fp32 and in bf16 with bf16 on the wire; with overlap
// every reduction is posted to run beside the backward, without it none.
TEST_F(OneStageExecutor, ReduceScattersOverlapTheBackwardWithTheSameBits) {
  auto sums = [](const std::string& run) {
    const nlohmann::json j = po::test::last_metric(run, "dp_sums");
    return std::pair<int, int>{j.value("overlapped", -1), j.value("all", -1)};
  };
  for (const std::string& extra : {std::string("--set parallel.zero_stage=2"),
                                   std::string("--set parallel.zero_stage=3 --set train.precision=bf16"
                                               " --set parallel.reduce_dtype=bf16")}) {
    const auto [ref, on] = expect_same(2, extra, "dp 2 " + extra + ", overlapped");
    // The same collectives on the data group as DataParallel's, calls and
    // bytes (the tied table's accumulator is summed once a micro-batch).
    const nlohmann::json dp_comm = po::test::last_metric(ref, "comm");
    const nlohmann::json ex_comm = po::test::last_metric(on, "pp_comm_per_rank")[0];
    for (const char* op : {"reduce_scatter", "all_gather"})
      EXPECT_EQ(dp_comm.value(op, nlohmann::json()), ex_comm.value(op, nlohmann::json()))
          << extra << ": the data group's " << op << "s, DataParallel's against the executor's";
    const std::string off =
        expect_same(2, extra + " --set parallel.overlap_comm=false", "dp 2 " + extra + ", at each post").second;
    const auto [early, all] = sums(on);
    EXPECT_GE(all, 6) << extra << ": a reduce-scatter per unit and micro-batch";
    EXPECT_EQ(early, all) << extra << ": " << early << " of " << all << " reduce-scatters beside the backward";
    EXPECT_EQ(sums(off), std::make_pair(0, all)) << extra << ": without overlap_comm";
  }
  // GPipe's one stage forwards both micro-batches before either backward:
  // the head's part of the tied table is summed at its forward, apart.
  expect_same(2, "--set parallel.zero_stage=2 --set parallel.schedule=gpipe", "dp 2 ZeRO-2, gpipe");
}

// ZeRO-3: the parameter gathers issued ahead of their use along the order
// the first step's requests took (parallel.prefetch units ahead): the bits
// of DataParallel's prefetched gathers at every depth, fp32 and bf16, with
// most gathers of a step issued ahead of their use, none at prefetch 0.
TEST_F(OneStageExecutor, ZeroThreeGathersRunAheadWithTheSameBits) {
  auto gathers = [](const std::string& run) {
    const nlohmann::json j = po::test::last_metric(run, "param_gathers");
    return std::pair<int, int>{j.value("prefetched", -1), j.value("all", -1)};
  };
  for (const std::string& precision : {"fp32", "bf16"})
    for (int prefetch : {0, 1, 2}) {
      const std::string extra = "--set parallel.zero_stage=3 --set train.precision=" + precision +
                                " --set parallel.prefetch=" + std::to_string(prefetch);
      const std::string got = expect_same(2, extra, "dp 2 " + extra).second;
      const auto [ahead, all] = gathers(got);
      // Per micro-batch (2 a rank): the forward's units 0-4, the tied head's
      // unit 0 and unit 5, the backward's blocks 4-1.
      EXPECT_EQ(all, 22) << extra << ": the gathers of a step";
      std::printf("[ %s ] %d of %d gathers issued ahead\n", extra.c_str(), ahead, all);
      if (prefetch == 0)
        EXPECT_EQ(ahead, 0) << extra << ": gathers issued ahead without prefetch";
      else  // (the step's first is asked for before anything is in flight)
        EXPECT_EQ(ahead, all - 1) << extra << ": " << ahead << " of " << all << " gathers issued ahead";
    }
  // dp 2 × pp 2, zbv (two chunks a rank, split backward): against dp 2's DataParallel run.
  const std::string z3 = " --set parallel.zero_stage=3";
  const std::string ref = train("z3_ref", 2, z3, false);
  const std::string pp =
      train("z3_pp2", 4, z3 + " --set parallel.dp=2 --set parallel.pp=2 --set parallel.schedule=zbv", false);
  for (const char* key : {"loss", "grad_norm"})
    EXPECT_EQ(metric(ref, key, 6), metric(pp, key, 6)) << "ZeRO-3 dp 2 × pp 2 zbv: " << key;
  const auto [ahead, all] = gathers(pp);
  EXPECT_GT(all, 0) << "ZeRO-3 dp 2 × pp 2 zbv: no gathers reported";
  std::printf("[ ZeRO-3 dp 2 x pp 2 zbv ] %d of %d gathers issued ahead (pipeline rank 0)\n", ahead, all);
  EXPECT_EQ(ahead, all - 1) << "ZeRO-3 dp 2 × pp 2 zbv: " << ahead << " of " << all << " gathers issued ahead";
}

}  // namespace
