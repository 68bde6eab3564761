// The planner against the literature (ZeRO's example, Korthikanti et al.'s
// activation formula, published parameter counts), its constraints, its
// search and its cluster files. What it predicts for the engine's own runs
// is held to measurements in plan_vs_engine_launch_test.
#include <gtest/gtest.h>

#include <map>

#include <cmath>

#include "../test_util.h"
#include "model/layout.h"
#include "plan/planner.h"

namespace po::test {
namespace {

plan::ClusterSpec h100(int nodes) { return plan::cluster_preset("h100-80gb-ib400", nodes); }

// ZeRO (Rajbhandari et al. 2020), section 5: Ψ = 7.5B, N = 64, mixed-precision
// Adam: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per GPU at stages 0-3.
TEST(Planner, ZeroPaperExample) {
  const double paper[] = {120, 31.4, 16.6, 1.9};
  for (int stage = 0; stage <= 3; ++stage) {
    const double gb = plan::zero_model_state_bytes(7.5e9, 64, stage) / 1e9;
    EXPECT_DOUBLE_EQ(std::round(gb * 10) / 10, paper[stage]) << "stage " << stage << ": " << gb << " GB";
  }
  EXPECT_DOUBLE_EQ(plan::zero_model_state_bytes(7.5e9, 64, 1), 31.40625e9);
  EXPECT_DOUBLE_EQ(plan::zero_model_state_bytes(7.5e9, 64, 2), 16.640625e9);
  EXPECT_DOUBLE_EQ(plan::zero_model_state_bytes(7.5e9, 64, 3), 1.875e9);
}

// The planner's own model-state items for a 64-way data-parallel bf16 run
// add up to the same ledger (a Llama-shaped model: the analytic path).
TEST(Planner, ModelStatesFollowTheZeroLedger) {
  const plan::ModelSpec m = plan::model_preset("llama2-7b");
  const double psi = static_cast<double>(m.num_params());
  for (int stage = 0; stage <= 3; ++stage) {
    plan::Layout l;
    l.dp = 64;
    l.zero_stage = stage;
    l.bf16 = true;
    l.batch = 64;
    l.micro = 1;
    l.seq = m.seq_len;
    const plan::Plan p = plan::make_plan(m, h100(8), l);
    double states = 0;
    for (const auto& item : p.memory)
      if (item.name == "parameters" || item.name == "gradients" || item.name == "fp32 master weights" ||
          item.name == "Adam m, v")
        states += item.bytes;
    EXPECT_NEAR(states / plan::zero_model_state_bytes(psi, 64, stage), 1.0, 1e-12) << "stage " << stage;
  }
}

// Korthikanti et al. 2022 for GPT-3 175B (s 2048, b 1, h 12288, a 96) at
// tensor parallel 8, by the formula: sbh = 25,165,824.
TEST(Planner, KorthikantiActivationsGpt3) {
  const double s = 2048, b = 1, h = 12288, a = 96;
  EXPECT_DOUBLE_EQ(plan::korthikanti_layer_bytes(s, b, h, a, 1, false, false), 2868903936.0);  // ·(34 + 80)
  EXPECT_DOUBLE_EQ(plan::korthikanti_layer_bytes(s, b, h, a, 8, false, false), 578813952.0);   // ·(10 + 3 + 10)
  EXPECT_DOUBLE_EQ(plan::korthikanti_layer_bytes(s, b, h, a, 8, true, false), 358612992.0);    // /8 · 114
  EXPECT_DOUBLE_EQ(plan::korthikanti_layer_bytes(s, b, h, a, 8, true, true), 50331648.0);     // 2sbh
  EXPECT_DOUBLE_EQ(plan::korthikanti_layer_bytes(s, b, h, a, 8, true, false, true), 25165824.0 / 8 * 34);

  // The planner uses it: 96 layers at tp 8 with sequence parallel, one
  // micro-batch in flight, bf16, scores kept (Megatron as published).
  plan::Layout l;
  l.dp = 1;
  l.tp = 8;
  l.bf16 = true;
  l.batch = 1;
  l.micro = 1;
  l.seq = 2048;
  l.flash_attention = false;
  const plan::Plan p = plan::make_plan(plan::model_preset("gpt3-175b"), h100(1), l);
  EXPECT_DOUBLE_EQ(p.activations_no_ckpt, 96 * 358612992.0);
  EXPECT_FALSE(p.engine_exact);
  EXPECT_FALSE(p.not_trainable.empty()) << "the engine's attention keeps no scores";
}

// With pp > 1 the plan times the engine's own action lists: its bubble is
// the schedule's (1f1b (p-1)/(m+p-1), interleaved (p-1)/(vm+p-1); at the
// stages' costs zb-h1 under 1f1b's and zbv under a quarter of it), its
// activations in flight are the busiest rank's, and its sends are the
// schedule's.
TEST(Planner, PipelineSchedulesSetTheBubbleAndTheActivationsInFlight) {
  namespace pl = po::parallel::pipeline;
  plan::Layout l;
  l.pp = 4;
  l.batch = 16;
  l.micro = 2;
  l.seq = 1024;
  const plan::ModelSpec m = plan::model_preset("llama2-7b");
  std::map<pl::ScheduleKind, plan::Plan> plans;
  for (pl::ScheduleKind k : {pl::ScheduleKind::kGPipe, pl::ScheduleKind::k1F1B,
                             pl::ScheduleKind::kInterleaved, pl::ScheduleKind::kZbH1,
                             pl::ScheduleKind::kZbV}) {
    l.schedule = k;
    plans[k] = plan::make_plan(m, h100(1), l);
  }
  const int mb = 8;  // 16 / 2 micro-batches
  for (const auto& [k, p] : plans) {
    std::printf("%s: bubble %.4f, at the stages' costs %.4f\n", pl::schedule_name(k), p.bubble, p.bubble_stages);
    // The lists are the engine's (ordered at the stages' costs), never
    // slower there than the unit-cost orders the published bubbles hold for.
    const pl::Pipeline engine = plan::pipeline_schedule(m, p.layout);
    EXPECT_NEAR(p.bubble, pl::simulate(engine.schedule).bubble(), 1e-12) << pl::schedule_name(k);
    const pl::Schedule unit = pl::make_schedule(k, l.pp, mb, l.virtual_stages);
    po::model::TransformerConfig c = m.engine;
    c.seq_len = l.seq;
    EXPECT_LE(p.bubble_stages, pl::simulate(unit, pl::stage_costs(c, l.seq, engine.stages)).bubble() + 1e-12)
        << pl::schedule_name(k);
  }
  EXPECT_NEAR(plans[pl::ScheduleKind::k1F1B].bubble, 3.0 / (mb + 3), 1e-12);
  EXPECT_NEAR(plans[pl::ScheduleKind::kInterleaved].bubble, 3.0 / (2 * mb + 3), 1e-12);
  EXPECT_LT(plans[pl::ScheduleKind::kZbH1].bubble_stages, plans[pl::ScheduleKind::k1F1B].bubble_stages);
  EXPECT_LT(plans[pl::ScheduleKind::kZbV].bubble_stages, plans[pl::ScheduleKind::k1F1B].bubble_stages / 4);
  // GPipe holds all 8 micro-batches on the first stage, 1F1B 4.
  EXPECT_NEAR(plans[pl::ScheduleKind::kGPipe].activations_no_ckpt /
                  plans[pl::ScheduleKind::k1F1B].activations_no_ckpt, 2.0, 1e-12);
  EXPECT_NE(plans[pl::ScheduleKind::kZbV].layout.describe().find("pp 4 × cp 1, ZeRO-0, fp32, micro 2, zbv"),
            std::string::npos) << plans[pl::ScheduleKind::kZbV].layout.describe();
  // Interleaved sends v = 2 times 1F1B's messages.
  auto sends = [](const plan::Plan& p) {
    uint64_t n = 0;
    for (const auto& c : p.comm) n += c.dim == "pp" ? c.calls : 0;
    return n;
  };
  EXPECT_EQ(sends(plans[pl::ScheduleKind::kInterleaved]), 2 * sends(plans[pl::ScheduleKind::k1F1B]));
}

// parallel.vocab_parallel in the plan: the engine's pipeline with the head's
// pieces over the ranks (the schedule's head messages among the sends, the
// stages' costs with each rank's share of the head), trainable in fp32 at
// tp 1 and named as missing otherwise, and offered by the search. On
// bench-small (the head outweighs the six blocks) it is what lets zbv reach
// a quarter of 1f1b's bubble.
TEST(Planner, VocabularyParallelLayouts) {
  namespace pl = po::parallel::pipeline;
  const plan::ModelSpec m = plan::model_preset("bench-small");
  plan::Layout l;
  l.pp = 2;
  l.batch = 8;
  l.micro = 1;
  l.seq = 256;
  auto sends = [](const plan::Plan& p) {
    uint64_t n = 0;
    for (const auto& c : p.comm) n += c.dim == "pp" ? c.calls : 0;
    return n;
  };
  std::map<std::pair<pl::ScheduleKind, bool>, plan::Plan> plans;
  for (pl::ScheduleKind k : {pl::ScheduleKind::k1F1B, pl::ScheduleKind::kZbH1, pl::ScheduleKind::kZbV}) {
    for (bool vocab : {false, true}) {
      l.schedule = k;
      l.vocab_parallel = vocab;
      plan::Plan p = plan::make_plan(m, h100(1), l);
      EXPECT_TRUE(p.not_trainable.empty()) << p.layout.describe();
      EXPECT_EQ(p.layout.describe().find("vocab parallel") != std::string::npos, vocab) << p.layout.describe();
      const pl::Pipeline engine = plan::pipeline_schedule(m, p.layout);
      EXPECT_EQ(engine.schedule.vocab, vocab) << p.layout.describe();
      std::printf("%s: bubble at the stages' costs %.4f, %llu sends\n", p.layout.describe().c_str(),
                  p.bubble_stages, static_cast<unsigned long long>(sends(p)));
      plans[std::make_pair(k, vocab)] = std::move(p);
    }
  }
  auto at = [&](pl::ScheduleKind k, bool vocab) -> const plan::Plan& { return plans.at(std::make_pair(k, vocab)); };
  for (pl::ScheduleKind k : {pl::ScheduleKind::k1F1B, pl::ScheduleKind::kZbH1, pl::ScheduleKind::kZbV}) {
    // The head's statistics and gradients travel too; its share off the last stage shrinks the bubble.
    EXPECT_GT(sends(at(k, true)), sends(at(k, false))) << pl::schedule_name(k);
    EXPECT_LT(at(k, true).bubble_stages, at(k, false).bubble_stages / 2) << pl::schedule_name(k);
  }
  EXPECT_LE(at(pl::ScheduleKind::kZbV, true).bubble_stages, at(pl::ScheduleKind::k1F1B, true).bubble_stages / 4);
  EXPECT_GT(at(pl::ScheduleKind::kZbV, false).bubble_stages, 0.25) << "the head alone on a stage";

  // What the engine refuses is named; a pp past the 8 pieces is an error.
  l.vocab_parallel = true;
  l.schedule = pl::ScheduleKind::k1F1B;
  l.bf16 = true;
  EXPECT_EQ(plan::make_plan(m, h100(1), l).not_trainable,
            std::vector<std::string>{"pipeline parallel with vocabulary parallel in bf16"});
  l.bf16 = false;
  l.pp = 4;
  l.tp = 2;
  EXPECT_EQ(plan::make_plan(m, h100(1), l).not_trainable,
            std::vector<std::string>{"pipeline parallel with vocabulary parallel with tp > 1"});
  l.tp = 1;
  l.pp = 16;
  l.batch = 16;
  try {
    plan::check_layout(plan::model_preset("llama2-7b"), l);
    ADD_FAILURE() << "pp 16 with the head's 8 pieces was accepted";
  } catch (const po::core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.vocab_parallel spreads the head's 8 vocabulary pieces over "
                                         "at most 8 pipeline ranks, not parallel.pp = 16"),
              std::string::npos) << e.what();
  }

  // The search offers it where the engine trains it, fastest first on bench-small.
  plan::Layout base;
  base.batch = 8;
  base.micro = 1;
  base.seq = 256;
  const plan::SearchResult r = plan::search(m, h100(1), base, 2, /*trainable_only=*/true);
  bool offered = false;
  for (const plan::Plan& p : r.fitting) {
    if (!p.layout.vocab_parallel) continue;
    offered = true;
    EXPECT_TRUE(p.layout.pp > 1 && p.layout.tp == 1 && !p.layout.bf16) << p.layout.describe();
  }
  EXPECT_TRUE(offered) << "no vocabulary-parallel layout among the trainable ones";
}

TEST(Planner, PresetParameterCounts) {
  EXPECT_EQ(plan::model_preset("gpt2-124M").num_params(), 124439808);
  EXPECT_EQ(plan::model_preset("llama2-7b").num_params(), 6738415616);
  EXPECT_EQ(plan::model_preset("llama2-70b").num_params(), 68976648192);
  EXPECT_EQ(plan::model_preset("llama3-8b").num_params(), 8030261248);
  EXPECT_EQ(plan::model_preset("llama3-70b").num_params(), 70553706496);
  EXPECT_NEAR(static_cast<double>(plan::model_preset("gpt3-175b").num_params()) / 175e9, 1.0, 0.01);
  EXPECT_EQ(plan::model_preset("stories15M").num_params(), 15191712);  // llama2.c's 15M, tied
  EXPECT_EQ(plan::model_preset("llama-124M").num_params(), po::model::TransformerConfig::preset("llama-124M").num_params());
  const std::string e = error_of([] { plan::model_preset("llama9"); });
  EXPECT_NE(e.find("unknown preset 'llama9'"), std::string::npos) << e;
  EXPECT_NE(e.find("llama2-70b"), std::string::npos) << e;
}

TEST(Planner, InvalidLayoutsNameTheConstraint) {
  const plan::ModelSpec m = plan::model_preset("llama2-7b");
  auto err = [&](auto edit, int devices = 0) {
    plan::Layout l;
    l.batch = 64;
    l.micro = 1;
    l.seq = m.seq_len;
    edit(l);
    return error_of([&] { plan::check_layout(m, l, devices); });
  };
  EXPECT_NE(err([](auto& l) { l.tp = 3; }).find("parallel.tp = 3 must divide the 32 attention heads"),
            std::string::npos);
  EXPECT_NE(err([](auto& l) { l.pp = 40; }).find("parallel.pp = 40 exceeds the 32 layers"), std::string::npos);
  EXPECT_NE(err([](auto& l) { l.cp = 3; }).find("parallel.cp = 3 must divide the sequence of 4096"),
            std::string::npos);
  EXPECT_NE(err([](auto& l) { l.dp = 2; l.tp = 2; }, 8).find("= 4 but the cluster has 8 devices"),
            std::string::npos);
  EXPECT_NE(err([](auto& l) { l.dp = 3; }).find("train.batch_size = 64 must be a multiple of parallel.dp"),
            std::string::npos);
  EXPECT_EQ(err([](auto& l) { l.dp = 4; l.tp = 2; }, 8), "");
}

// Llama-2 7B on one H100 node: the fitting layouts come ranked by tokens/s
// and fit; the rejected ones say by how much they do not.
TEST(Planner, SearchRanksFittingLayouts) {
  plan::Layout base;
  base.bf16 = true;
  base.batch = 64;
  base.micro = 1;
  base.seq = 4096;
  const plan::SearchResult r = plan::search(plan::model_preset("llama2-7b"), h100(1), base, 8);
  ASSERT_FALSE(r.fitting.empty());
  ASSERT_FALSE(r.rejected.empty());
  EXPECT_GT(r.invalid, 0u);
  for (size_t i = 0; i < r.fitting.size(); ++i) {
    EXPECT_LE(r.fitting[i].device_peak, 80.0 * (1 << 30)) << r.fitting[i].layout.describe();
    EXPECT_EQ(r.fitting[i].layout.devices(), 8);
    if (i > 0) {
      EXPECT_GE(r.fitting[i - 1].tokens_per_s, r.fitting[i].tokens_per_s);
    }
  }
  for (const plan::Plan& p : r.rejected) {
    ASSERT_FALSE(p.rejections.empty()) << p.layout.describe();
  }
  // Plain DDP of a 7B model in bf16 needs 16 bytes per parameter: ~100 GiB.
  bool ddp_rejected = false;
  for (const plan::Plan& p : r.rejected)
    if (p.layout.dp == 8 && p.layout.zero_stage == 0 && !p.layout.paging) {
      ddp_rejected = true;
      EXPECT_NE(p.rejections.front().find("over by"), std::string::npos) << p.rejections.front();
    }
  EXPECT_TRUE(ddp_rejected);
  const std::string table = plan::format_search(r);
  EXPECT_NE(table.find("tokens/s"), std::string::npos) << table;
}

// Tensor parallel as the engine trains it (sequence parallel and paging
// included) is planned by the engine's rules for one tp rank's shard; what
// it does not train yet stays analytic, marked with the reason.
TEST(Planner, TensorParallelIsEngineExactWhereTheEngineTrainsIt) {
  const plan::ModelSpec m = plan::model_preset("gpt2-124M");
  plan::Layout l;
  l.dp = 2;
  l.tp = 2;
  l.batch = 8;
  l.micro = 2;
  l.seq = 256;
  l.sequence_parallel = false;
  const plan::Plan p = plan::make_plan(m, h100(1), l);
  EXPECT_TRUE(p.engine_exact) << l.describe();
  EXPECT_TRUE(p.not_trainable.empty()) << p.not_trainable.front();
  const double held = static_cast<double>(po::model::Layout(m.engine, {2, 0}).num_params());
  double params = 0;
  for (const auto& item : p.memory)
    if (item.name == "parameters") params = item.bytes;
  EXPECT_EQ(params, 4 * held) << "ZeRO-0 fp32 holds one tp rank's shard, " << held << " parameters";

  // Checkpointing recomputes each block's forward: 2 more all-reduces per
  // block and micro-batch on the tensor group.
  plan::Layout ckpt = l;
  ckpt.checkpointing = true;
  auto tp_allreduces = [](const plan::Plan& plan) {
    uint64_t n = 0;
    for (const auto& c : plan.comm)
      if (c.dim == "tp" && c.op == "allreduce") n += c.calls;
    return n;
  };
  EXPECT_EQ(tp_allreduces(plan::make_plan(m, h100(1), ckpt)) - tp_allreduces(p),
            static_cast<uint64_t>(2 * m.n_layer * l.accum()));

  auto reasons = [&](auto edit, const plan::ModelSpec& model) {
    plan::Layout e = l;
    edit(e);
    const plan::Plan q = plan::make_plan(model, h100(1), e);
    EXPECT_FALSE(q.engine_exact) << e.describe();
    std::string why;
    for (const auto& w : q.not_trainable) why += w + ";";
    return why;
  };
  // Sequence parallel and paging train too: exact, the tensor group's sums
  // split into reduce-scatters and all-gathers.
  for (bool sp : {false, true}) {
    plan::Layout e = l;
    e.sequence_parallel = sp;
    e.paging = !sp;
    const plan::Plan q = plan::make_plan(m, h100(1), e);
    EXPECT_TRUE(q.engine_exact) << e.describe();
    uint64_t scatters = 0;
    for (const auto& c : q.comm)
      if (c.dim == "tp" && c.op == "reduce_scatter") scatters += c.calls;
    EXPECT_EQ(scatters, sp ? static_cast<uint64_t>((4 * m.n_layer + 2) * l.accum()) : 0u)
        << e.describe() << ": the tensor group's reduce-scatters per step";
  }
  po::model::TransformerConfig mqa = po::model::TransformerConfig::preset("llama-tiny");
  mqa.n_kv_head = 1;
  EXPECT_EQ(reasons([](auto&) {}, plan::model_spec(mqa, "mqa")),
            "tensor parallel replicating kv heads or splitting the MLP unevenly;");
}

// --trainable keeps what the engine runs today: data parallel × tensor parallel,
// each planned by the engine-exact model.
// Paged to NVMe with a tight budget (gpt2-124M on the local preset, as
// bench/paging_nvme.sh runs it): lent frames move part of the page I/O under
// the backward and forward; the step is never below the disk's time for all
// of it, nor below the step without paging; without lending the whole I/O
// is the sweep's and waited for.
TEST(Planner, PagingIoHidesUnderTheBackwardAndForwardWithLentFrames) {
  const plan::ModelSpec m = plan::model_preset("gpt2-124M");
  plan::Layout l;
  l.batch = 4;
  l.micro = 4;
  l.seq = 256;
  l.paging = true;
  l.nvme = true;
  const plan::ClusterSpec local = plan::cluster_preset("local", 1);
  const double minimum = plan::make_plan(m, local, l).min_compute_budget;
  l.compute_budget = static_cast<uint64_t>(minimum) + 8 * l.page_bytes;
  const plan::Plan lent = plan::make_plan(m, local, l);
  plan::Layout no = l;
  no.lend_activations = false;
  const plan::Plan none = plan::make_plan(m, local, no);
  ASSERT_GT(lent.io_total_s, 0);
  // The blocks' saved activations and the head's buffers: 157 whole 4 MiB
  // pages, as the engine counts them (the start-up table of paging_nvme.sh).
  EXPECT_EQ(lent.lent_frames, 157) << "frames lent by gpt2-124M's activations at B4 x T256";
  EXPECT_EQ(none.lent_frames, 0);
  EXPECT_DOUBLE_EQ(lent.io_total_s, none.io_total_s) << "lending moves I/O, not bytes";
  EXPECT_GT(lent.io_under_backward_s, 0);
  EXPECT_GT(lent.io_under_forward_s, 0);
  EXPECT_DOUBLE_EQ(none.io_s, none.io_total_s) << "without lending the sweep holds all the I/O";
  EXPECT_LT(lent.io_s, none.io_s) << "the lent share should hide under compute";
  EXPECT_LT(lent.step_s, none.step_s);
  for (const plan::Plan* p : {&lent, &none}) {
    const double unpaged = p->compute_s + p->bubble_s + p->exposed_comm_s;
    EXPECT_GE(p->step_s, p->io_total_s) << "a step is never shorter than its I/O";
    EXPECT_GE(p->step_s, unpaged);
    EXPECT_DOUBLE_EQ(p->io_limit_s, std::max(unpaged, p->io_total_s));
  }
}

TEST(Planner, SearchTrainableOnly) {
  plan::Layout base;
  base.batch = 16;
  base.micro = 1;
  base.seq = 1024;
  const plan::SearchResult r =
      plan::search(plan::model_preset("gpt2-124M"), h100(1), base, 8, /*trainable_only=*/true);
  ASSERT_FALSE(r.fitting.empty());
  // dp × tp × cp layouts (engine-exact), or pipeline layouts the executor
  // trains (fp32, ZeRO 0-3, in memory or paged: their memory is its own,
  // their time analytic).
  bool context = false, pipeline_zero3 = false;
  for (const plan::Plan& p : r.fitting) {
    const plan::Layout& l = p.layout;
    EXPECT_TRUE(p.not_trainable.empty()) << l.describe();
    EXPECT_EQ(p.engine_exact, l.pp == 1) << l.describe();
    EXPECT_EQ(l.dp * l.tp * l.pp * l.cp, 8) << l.describe();
    context = context || l.cp > 1;
    if (l.pp > 1) {
      EXPECT_FALSE(l.bf16) << l.describe();
      pipeline_zero3 = pipeline_zero3 || l.zero_stage == 3;
    }
  }
  EXPECT_TRUE(context) << "no context-parallel layout among the trainable ones";
  EXPECT_TRUE(pipeline_zero3) << "no pipeline layout at ZeRO-3 among the trainable ones";
}

TEST(Planner, ClusterFile) {
  TempDir dir;
  write_file(dir / "c.toml",
             "[cluster]\nname = \"lab\"\nnodes = 2\ndevices_per_node = 4\ndevice_memory = \"24GiB\"\n"
             "peak_tflops_bf16 = 165\nintra_node_GBps = 25\ninter_node_GBps = 12.5\n");
  const plan::ClusterSpec c = plan::cluster_preset(dir / "c.toml");
  EXPECT_EQ(c.name, "lab");
  EXPECT_EQ(c.devices(), 8);
  EXPECT_DOUBLE_EQ(c.device_memory, 24.0 * (1 << 30));
  EXPECT_DOUBLE_EQ(c.peak_flops_bf16, 165e12);
  EXPECT_DOUBLE_EQ(c.inter_bw, 12.5e9);
  EXPECT_EQ(plan::cluster_preset(dir / "c.toml", 3).nodes, 3);

  write_file(dir / "bad.toml", "[cluster]\ndevices_per_node = 4\ndevice_memory = \"24GiB\"\nspeed = 1\n");
  std::string e = error_of([&] { plan::cluster_preset(dir / "bad.toml"); });
  EXPECT_NE(e.find("bad.toml: [cluster] unknown key 'speed'"), std::string::npos) << e;
  write_file(dir / "short.toml", "[cluster]\ndevices_per_node = 4\ndevice_memory = \"24GiB\"\n");
  e = error_of([&] { plan::cluster_preset(dir / "short.toml"); });
  EXPECT_NE(e.find("short.toml: [cluster] peak_tflops_bf16 is missing"), std::string::npos) << e;
  e = error_of([] { plan::parse_cluster("[cluster]\ndevices_per_node = 1e30\n", "huge.toml"); });
  EXPECT_NE(e.find("huge.toml: [cluster] devices_per_node = 1e+30 is out of range"), std::string::npos) << e;
  // A size of 2^64 bytes or more (found by fuzz/cluster_fuzz.cc, UBSan): one line naming the key.
  e = error_of([] {
    plan::parse_cluster("[cluster]\ndevices_per_node = 1\n"
                        "device_memory = \"1111111111111111111111111111111111124GiB\"\n",
                        "overflow.toml");
  });
  EXPECT_NE(e.find("overflow.toml: [cluster] device_memory: size '1111111111111111111111111111111111124GiB' "
                   "is too large"),
            std::string::npos)
      << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  e = error_of([] { plan::parse_cluster("[cluster\n", "broken.toml"); });
  EXPECT_NE(e.find("broken.toml:1:"), std::string::npos) << e;
  e = error_of([] { plan::cluster_preset("tpu-v5"); });
  EXPECT_NE(e.find("unknown preset 'tpu-v5'"), std::string::npos) << e;
}

// The command line: a plan for a layout the engine cannot train (pipeline
// parallel with the vocabulary-parallel head in bf16) is printed and marked,
// one it trains (pipeline parallel with ZeRO-3) is the executor's own
// accounting; an impossible layout is a one-line error.
TEST(Planner, Command) {
  TempDir dir;
  write_file(dir / "c.toml", "[model]\npreset = \"llama2-70b\"\nactivation_checkpointing = true\n"
                             "[train]\nbatch_size = 64\nmicro_batch_size = 1\nprecision = \"bf16\"\n"
                             "[parallel]\ndp = 4\ntp = 8\npp = 2\nzero_stage = 1\n");
  CommandResult r =
      run_command(std::string(PO_BINARY) + " plan -c " + (dir / "c.toml") +
                  " --cluster h100-80gb-ib400 --set parallel.vocab_parallel=true");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("NOT YET TRAINABLE by the engine: pipeline parallel with vocabulary parallel in bf16"),
            std::string::npos)
      << r.output;
  r = run_command(std::string(PO_BINARY) + " plan -c " + (dir / "c.toml") +
                  " --cluster h100-80gb-ib400 --set parallel.zero_stage=3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("NOT YET TRAINABLE"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("the pipeline executor's memory and messages (exact)"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("8 × 8 devices"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("tokens/s"), std::string::npos) << r.output;
  // dp × tp from a config is what the engine trains (no sequence parallel).
  r = run_command(std::string(PO_BINARY) + " plan -c " + (dir / "c.toml") +
                  " --cluster h100-80gb-ib400 --set parallel.dp=8 --set parallel.pp=1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("model: the engine's own layout (exact)"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("NOT YET TRAINABLE"), std::string::npos) << r.output;
  r = run_command(std::string(PO_BINARY) + " plan -c " + (dir / "c.toml") +
                  " --cluster h100-80gb-ib400 --set parallel.tp=3");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("parallel.tp = 3 must divide the 64 attention heads"), std::string::npos) << r.output;
  r = run_command(std::string(PO_BINARY) + " plan -c " + (dir / "c.toml") +
                  " --cluster h100-80gb-ib400 --nodes 4");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("but the cluster has 32 devices"), std::string::npos) << r.output;
  r = run_command(std::string(PO_BINARY) + " plan -c " + (dir / "c.toml") +
                  " --cluster h100-80gb-ib400 --nodes 1 --search --json --top 3");  // (8 nodes: 46 s)
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j.at("devices"), 8);
  EXPECT_EQ(j.at("best").size(), 3u);
}

}  // namespace
}  // namespace po::test
