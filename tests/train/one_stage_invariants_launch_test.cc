// What must not change the bits of a pp = 1 run, now that the pipeline
// executor's one-stage schedule is the only engine (issue 35): paging the
// state (ZeRO-3's shards too) to NVMe, updating pages in the backward,
// overlapping the data group's sums and reduce-scatters with it, running
// ZeRO-3's gathers ahead, and cutting the model into pipeline stages: each
// variant's losses, gradient norms (clipping on), validation losses and
// checkpoint (its whole state, and its files byte for byte where both runs'
// writers cut it alike) against the plain run's, at one thread per rank.
//
// Until the switch (commit 0508ecb and before) this file held the executor
// to DataParallel's bits at every layout here and more (gpt2 and llama,
// fp32, bf16, 8-bit moments, LoRA with dropout, activation checkpointing,
// dp 2 at ZeRO 0-3, tp 2, cp 2, paged): the fresh-clone CI of 75e370f
// passed it, and the whole suite passed with pp = 1 through the executor
// before DataParallel's trainer was removed (docs/design-notes.md).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "../test_util.h"

namespace {

using po::test::metric;

class OneStageInvariants : public po::test::TinyTraining {
 protected:
  int steps() const override { return 6; }
  // `pagedoptim train` on `np` ranks (parallel.dp = np unless `extra` says otherwise).
  std::string train(const std::string& name, int np, const std::string& extra) {
    const auto r = po::test::run_command(po::test::pagedoptim_command(
        np, "train -c " + config_ + " --set run.dir=" + (dir_ / name) + " --set parallel.dp=" + std::to_string(np) +
                " --set model.n_layer=4 --set train.batch_size=8 --set train.grad_clip=0.05"
                " --set train.eval_interval=3 --set train.checkpoint_interval=3 " +
                extra));
    EXPECT_EQ(r.exit_code, 0) << name << ": " << extra << "\n" << r.output;
    return dir_ / name;
  }
  // The run of `extra` against the run of `reference` (both on `np` ranks);
  // returns their directories (the reference's, the variant's).
  std::pair<std::string, std::string> expect_same(int np, const std::string& reference, const std::string& extra,
                                                  const std::string& what) {
    const std::string tag = "r" + std::to_string(runs_++);
    const std::string ref = train(tag + "_ref", np, reference), got = train(tag + "_var", np, extra);
    po::test::expect_same_metrics(ref, got, {{"loss", 6}, {"grad_norm", 6}, {"val_loss", 2}},
                                  what + " (against " + (reference.empty() ? "the plain run" : reference) + ")");
    po::test::expect_same_checkpoint(ref, got, 6, what);
    return {ref, got};
  }
  // `extra` with the state paged to NVMe behind a one-page host tier, the
  // compute tier the smallest the engine accepts on `np` ranks (the minimum
  // it names for 1 byte).
  std::string on_nvme(int np, const std::string& extra) {
    const std::string paging = extra + " --set memory.nvme_dir=" + std::string(dir_ / "swap") +
                               " --set memory.page_size=4096 --set memory.host_budget=4096 --set memory.compute_budget=";
    int64_t least = 0;
    const auto probe = po::test::run_command(po::test::pagedoptim_command(
        np, "train -c " + config_ + " --set run.dir=" + (dir_ / "probe") + " --set parallel.dp=" +
                std::to_string(np) + " --set model.n_layer=4 --set train.batch_size=8 " + paging + "1"));
    least = po::test::named_minimum_budget(probe.output);
    std::filesystem::remove_all(dir_ / "probe");
    EXPECT_GT(least, 0) << "no minimum compute budget named for " << extra;
    return paging + std::to_string(least);
  }
  int runs_ = 0;
};

// Adam's pages on NVMe behind a one-page host tier: the in-memory run's bits,
// pages read back and read into the lent activations.
TEST_F(OneStageInvariants, PagingToNvmeKeepsTheBits) {
  const std::string got = expect_same(1, "", on_nvme(1, ""), "gpt2 Adam state paged to NVMe").second;
  double read = 0, lent = 0;
  for (const auto& r : po::test::last_metric(got, "paging_per_rank")) {
    read += r["nvme_read_bytes"].get<double>();
    lent += r["lent_read_bytes"].get<double>();
  }
  EXPECT_GT(read, 0) << "the paged run read no page back from NVMe at its last step";
  // The dead activations lent to the pager (memory.lend_activations), filled with pages.
  EXPECT_GT(lent, 0) << "the paged run read no page into lent activations at its last step";
}

// ZeRO-3 paged (ZeRO-Infinity): the stored parameter and gradient shards in
// the pages beside Adam's state and the master, on NVMe, fp32 and bf16, over
// two data ranks and on one (a model larger than the compute tier on one
// device): the gathers copy a shard out of its pages, the reductions add
// into them, and the rank holds no parameter or gradient byte outside
// them; the in-memory ZeRO-3 run's bits and files.
TEST_F(OneStageInvariants, ZeroThreeShardsPagedKeepTheBits) {
  for (const int np : {2, 1})
    for (const std::string precision : {"fp32", "bf16"}) {
      const std::string extra = "--set parallel.zero_stage=3 --set train.precision=" + precision;
      const std::string what = "dp " + std::to_string(np) + " ZeRO-3 " + precision + ", shards paged";
      const std::string got = expect_same(np, extra, on_nvme(np, extra), what).second;
      for (const auto& r : po::test::last_metric(got, "memory_per_rank")) {
        EXPECT_EQ(r["params"].get<double>(), 0) << what << ": parameter bytes held outside the pages";
        EXPECT_EQ(r["grads"].get<double>(), 0) << what << ": gradient bytes held outside the pages";
      }
      double read = 0;
      for (const auto& r : po::test::last_metric(got, "paging_per_rank")) read += r["nvme_read_bytes"].get<double>();
      EXPECT_GT(read, 0) << what << ": the paged run read no page back from NVMe at its last step";
    }
}

// Updates in the backward (memory.update_in_backward, no clipping): each
// page goes as soon as its units' gradients are final, paged to NVMe; the
// bits of the in-memory run that updates at the step, at ZeRO 0 on one
// rank, 1, 2 (bf16) and 3 (shards paged) over two, and over a pipeline of
// two stages against dp 2; pages go early wherever that cannot depend on
// timing (one rank, ZeRO 2-3).
TEST_F(OneStageInvariants, UpdatesInTheBackwardKeepTheBits) {
  const std::string early = "--set train.grad_clip=0 --set memory.update_in_backward=true ";
  auto pages_early = [](const std::string& run) {
    double n = 0;
    for (const auto& r : po::test::last_metric(run, "paging_per_rank")) n += r["pages_updated_in_backward"].get<double>();
    return n;
  };
  struct Case {
    int np;
    std::string extra;
  };
  for (const Case& c : {Case{1, ""}, Case{2, "--set parallel.zero_stage=2 --set train.precision=bf16"},
                        Case{2, "--set parallel.zero_stage=3"}, Case{2, "--set parallel.zero_stage=1"}}) {
    const std::string what = "dp " + std::to_string(c.np) + " " + c.extra + ", updates in the backward";
    const std::string got =
        expect_same(c.np, "--set train.grad_clip=0 " + c.extra, on_nvme(c.np, early + c.extra), what).second;
    std::printf("[ %s ] %.0f pages updated in the backward at the last step\n", what.c_str(), pages_early(got));
    if (c.np == 1 || c.extra.find("zero_stage=1") == std::string::npos) {
      EXPECT_GT(pages_early(got), 0) << what << ": no page was updated in the backward";
    }
  }
  // Two pipeline stages (1f1b, ZeRO-2) against dp 2 in memory with clipping off.
  const std::string z2 = "--set train.grad_clip=0 --set parallel.zero_stage=2";
  const std::string ref = train("early_ref", 2, z2);
  const std::string pp = train("early_pp2", 4,
                               on_nvme(2, early + "--set parallel.zero_stage=2") +
                                   " --set parallel.dp=2 --set parallel.pp=2 --set parallel.schedule=1f1b");
  for (const char* key : {"loss", "grad_norm"})
    EXPECT_EQ(metric(ref, key, 6), metric(pp, key, 6)) << "ZeRO-2 dp 2 × pp 2 paged, updates in the backward: " << key;
  EXPECT_GT(pages_early(pp), 0) << "ZeRO-2 dp 2 × pp 2: no page was updated in the backward";
}

// The data group's sums in buckets, started while the backward runs
// (parallel.overlap_comm, small buckets so there are several), in fp32 and
// with bf16 gradients summed in f32 (one staged unit at a time): every
// bucket started by the backward, unit 0's too (its lookup rows deferred to
// the step, it is final right after the head), none without overlap. (With
// overlap the embedding's lookup rows are deferred, without it they are
// not, so the two settings' sums differ in order.) A zero-bubble pipeline
// of two stages (units finished by the weight half) gives dp 2's bits.
TEST_F(OneStageInvariants, BucketSumsOverlapTheBackward) {
  const std::string small = " --set parallel.zero_stage=1 --set parallel.bucket_size=8KiB";
  auto sums = [](const std::string& run) {
    const nlohmann::json j = po::test::last_metric(run, "dp_sums");
    return std::pair<int, int>{j.value("overlapped", -1), j.value("all", -1)};
  };
  for (const std::string precision : {"fp32", "bf16"}) {
    const std::string extra = small + " --set train.precision=" + precision;
    const std::string on = train("on_" + precision, 2, extra);
    const std::string off = train("off_" + precision, 2, extra + " --set parallel.overlap_comm=false");
    const auto [early, all] = sums(on);
    EXPECT_GT(all, 4) << precision << ": too few buckets to show an overlap";
    EXPECT_EQ(early, all) << precision << ": the backward started " << early << " of " << all << " sums";
    EXPECT_EQ(sums(off).first, 0) << precision << ": sums started in the backward without overlap_comm";
    EXPECT_EQ(sums(off).second, all) << precision;
  }
  // dp 2 × pp 2, zero-bubble (split backward): against dp 2's one stage.
  const std::string zb = train("zb_ref", 2, small);
  const std::string pp = train("zb_pp2", 4, small + " --set parallel.dp=2 --set parallel.pp=2 --set parallel.schedule=zb-h1");
  for (const char* key : {"loss", "grad_norm"})
    EXPECT_EQ(metric(zb, key, 6), metric(pp, key, 6)) << "dp 2 × pp 2 zb-h1: " << key;
  EXPECT_GT(sums(pp).first, 0) << "dp 2 × pp 2 zb-h1: no sum started in the backward";
}

// ZeRO 2-3: each micro-batch's reduce-scatters run while the backward goes
// on (parallel.overlap_comm: a ring of accumulators, two in flight), and
// complete in the order they were posted, so overlap does not change the
// bits (fp32, and bf16 with bf16 on the wire) nor the collectives; with
// overlap every reduction is posted to run beside the backward, without it
// none.
TEST_F(OneStageInvariants, ReduceScattersOverlapTheBackwardWithTheSameBits) {
  auto sums = [](const std::string& run) {
    const nlohmann::json j = po::test::last_metric(run, "dp_sums");
    return std::pair<int, int>{j.value("overlapped", -1), j.value("all", -1)};
  };
  for (const std::string& extra : {std::string("--set parallel.zero_stage=2"),
                                   std::string("--set parallel.zero_stage=3 --set train.precision=bf16"
                                               " --set parallel.reduce_dtype=bf16")}) {
    const auto [off, on] =
        expect_same(2, extra + " --set parallel.overlap_comm=false", extra, "dp 2 " + extra + ", overlapped");
    const nlohmann::json off_comm = po::test::last_metric(off, "comm"), on_comm = po::test::last_metric(on, "comm");
    for (const char* op : {"reduce_scatter", "all_gather"})
      EXPECT_EQ(off_comm.value(op, nlohmann::json()), on_comm.value(op, nlohmann::json()))
          << extra << ": the data group's " << op << "s with and without overlap";
    const auto [early, all] = sums(on);
    EXPECT_GE(all, 6) << extra << ": a reduce-scatter per unit and micro-batch";
    EXPECT_EQ(early, all) << extra << ": " << early << " of " << all << " reduce-scatters beside the backward";
    EXPECT_EQ(sums(off), std::make_pair(0, all)) << extra << ": without overlap_comm";
  }
  // GPipe's one stage forwards both micro-batches before either backward:
  // the head's part of the tied table is summed at its forward, apart, to
  // the same bits.
  expect_same(2, "--set parallel.zero_stage=2", "--set parallel.zero_stage=2 --set parallel.schedule=gpipe",
              "dp 2 ZeRO-2, gpipe");
}

// ZeRO-3: the parameter gathers issued ahead of their use along the order
// the first step's requests took (parallel.prefetch units ahead): the bits
// of gathers at their use (prefetch 0) at every depth, fp32 and bf16, with
// all gathers of a step but its first issued ahead.
TEST_F(OneStageInvariants, ZeroThreeGathersRunAheadWithTheSameBits) {
  auto gathers = [](const std::string& run) {
    const nlohmann::json j = po::test::last_metric(run, "param_gathers");
    return std::pair<int, int>{j.value("prefetched", -1), j.value("all", -1)};
  };
  for (const std::string precision : {"fp32", "bf16"}) {
    const std::string base = "--set parallel.zero_stage=3 --set train.precision=" + precision;
    for (int prefetch : {1, 2}) {
      const std::string extra = base + " --set parallel.prefetch=" + std::to_string(prefetch);
      const auto [ref, got] = expect_same(2, base + " --set parallel.prefetch=0", extra, "dp 2 " + extra);
      EXPECT_EQ(gathers(ref).first, 0) << base << ": gathers issued ahead without prefetch";
      const auto [ahead, all] = gathers(got);
      // Per micro-batch (2 a rank): the forward's units 0-4, the tied head's
      // unit 0 and unit 5, the backward's blocks 4-1.
      EXPECT_EQ(all, 22) << extra << ": the gathers of a step";
      std::printf("[ %s ] %d of %d gathers issued ahead\n", extra.c_str(), ahead, all);
      // (the step's first is asked for before anything is in flight)
      EXPECT_EQ(ahead, all - 1) << extra << ": " << ahead << " of " << all << " gathers issued ahead";
    }
  }
  // dp 2 × pp 2, zbv (two chunks a rank, split backward): against dp 2's one stage.
  const std::string z3 = " --set parallel.zero_stage=3";
  const std::string ref = train("z3_ref", 2, z3);
  const std::string pp = train("z3_pp2", 4, z3 + " --set parallel.dp=2 --set parallel.pp=2 --set parallel.schedule=zbv");
  for (const char* key : {"loss", "grad_norm"})
    EXPECT_EQ(metric(ref, key, 6), metric(pp, key, 6)) << "ZeRO-3 dp 2 × pp 2 zbv: " << key;
  const auto [ahead, all] = gathers(pp);
  EXPECT_GT(all, 0) << "ZeRO-3 dp 2 × pp 2 zbv: no gathers reported";
  std::printf("[ ZeRO-3 dp 2 x pp 2 zbv ] %d of %d gathers issued ahead (pipeline rank 0)\n", ahead, all);
  EXPECT_EQ(ahead, all - 1) << "ZeRO-3 dp 2 × pp 2 zbv: " << ahead << " of " << all << " gathers issued ahead";
}

}  // namespace
