// The planner against the engine: each layout is trained for a few steps by
// the real binary (dp × cp × tp ranks under mpirun), and the planner's prediction
// for the same config is held to what the run measured:
//   * the compute-tier peak per rank (the compute pool's high-water mark over
//     the training steps, `memory_per_rank[r].peak`) equal to the byte: every
//     layout here is engine-exact (src/plan/planner.h), whose sizes come from
//     the engine's own rules, so any difference is a bug. The ±10% that
//     docs/planning.md states is for what the planner does not claim exact
//     (the analytic model: layouts the engine does not train), so no layout
//     here is held to it; PlanVsPipeline holds pipeline layouts (context
//     parallel among them) to the executor's accounting the same way;
//   * the step's collectives on the data group (`comm` in metrics) and on the
//     tensor group (`tp_comm`): calls and payload bytes per operation
//     (comm::Traffic), equal to the byte.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <sstream>

#include "cli/plan_layout.h"
#include "optim/adamw.h"
#include "train/optim_keys.h"
#include "parallel/quantized_state.h"
#include "plan/planner.h"
#include "train/model_setup.h"
#include "../test_util.h"

namespace po::test {
namespace {

struct Case {
  const char* name;
  int dp;
  const char* sets;  // --set overrides beyond parallel.dp (parallel.tp among them)
  bool paged_budget = false;  // memory.compute_budget = the planner's minimum + 2 pages
};

// fp32/bf16, ZeRO 0-3, dp 1/2/4, checkpointing on/off, paging on/off.
const Case kCases[] = {
    {"dp1_s0_fp32", 1, ""},
    {"dp1_s0_bf16_ckpt", 1, "train.precision=bf16 model.activation_checkpointing=true"},
    {"dp1_s3_fp32_paged_host", 1,
     "parallel.zero_stage=3 memory.page_size=16KiB memory.host_budget=256KiB", true},
    {"dp2_s0_fp32", 2, ""},
    {"dp2_s1_fp32_ckpt", 2, "parallel.zero_stage=1 model.activation_checkpointing=true"},
    {"dp2_s2_bf16", 2, "parallel.zero_stage=2 train.precision=bf16"},
    {"dp2_s3_fp32", 2, "parallel.zero_stage=3"},
    {"dp2_s3_bf16_paged_nvme", 2, "parallel.zero_stage=3 train.precision=bf16 memory.page_size=16KiB", true},
    {"dp2_s1_fp32_paged_nvme", 2, "parallel.zero_stage=1 memory.page_size=16KiB", true},
    {"dp4_s0_bf16", 4, "train.precision=bf16"},
    {"dp4_s1_bf16_wire16", 4, "parallel.zero_stage=1 train.precision=bf16 parallel.reduce_dtype=bf16"},
    {"dp4_s2_fp32_ckpt", 4, "parallel.zero_stage=2 model.activation_checkpointing=true"},
    {"dp4_s3_bf16_no_overlap", 4, "parallel.zero_stage=3 train.precision=bf16 parallel.overlap_comm=false"},
    // 8- and 4-bit Adam moments, sharded on their blocks' grid.
    {"dp2_s2_bf16_8bit", 2, "parallel.zero_stage=2 train.precision=bf16 optim.state_bits=8"},
    {"dp2_s3_fp32_4bit", 2, "parallel.zero_stage=3 optim.state_bits=4"},
    // ... paged: codes and scales in pages, the 32-bit tensors' moments in side pages.
    {"dp1_s0_fp32_8bit_paged_nvme", 1, "optim.state_bits=8 memory.page_size=16KiB", true},
    {"dp2_s3_bf16_4bit_paged_nvme", 2,
     "parallel.zero_stage=3 train.precision=bf16 optim.state_bits=4 memory.page_size=16KiB", true},
    // ... each tensor-parallel rank's pieces quantized on its own units' grid.
    {"dp2_tp2_s1_fp32_8bit", 2, "parallel.tp=2 parallel.zero_stage=1 optim.state_bits=8"},
    // Llama (RMSNorm, RoPE, SwiGLU, GQA, untied head) on the same shapes.
    {"llama_dp1_s0_fp32", 1, "model.arch=llama model.n_kv_head=1"},
    {"llama_dp1_s0_bf16_ckpt", 1, "model.arch=llama train.precision=bf16 model.activation_checkpointing=true"},
    {"llama_dp2_s1_fp32", 2, "model.arch=llama parallel.zero_stage=1"},
    {"llama_dp2_s2_bf16_ckpt", 2, "model.arch=llama parallel.zero_stage=2 train.precision=bf16 model.activation_checkpointing=true"},
    {"llama_dp2_s3_fp32", 2, "model.arch=llama parallel.zero_stage=3 model.n_kv_head=1"},
    {"llama_dp2_s3_bf16_paged_nvme", 2, "model.arch=llama parallel.zero_stage=3 train.precision=bf16 memory.page_size=16KiB", true},
    // Tensor parallel (dp × tp ranks): GPT-2, and Llama with 4 heads sharing
    // 2 kv heads (one per tp rank).
    {"tp2_s0_fp32", 1, "parallel.tp=2"},
    {"dp2_tp2_s1_bf16_ckpt", 2, "parallel.tp=2 parallel.zero_stage=1 train.precision=bf16 model.activation_checkpointing=true"},
    {"dp2_tp2_s3_fp32", 2, "parallel.tp=2 parallel.zero_stage=3"},
    {"llama_tp2_s0_bf16", 1, "parallel.tp=2 model.arch=llama model.n_head=4 model.n_kv_head=2 train.precision=bf16"},
    {"llama_dp2_tp2_s1_fp32_ckpt", 2, "parallel.tp=2 model.arch=llama model.n_head=4 model.n_kv_head=2 parallel.zero_stage=1 model.activation_checkpointing=true"},
    {"llama_dp2_tp2_s3_bf16", 2, "parallel.tp=2 model.arch=llama model.n_head=4 model.n_kv_head=2 parallel.zero_stage=3 train.precision=bf16"},
    // [B·T, C] f32 = 1 MiB: the tensor group's all-reduces take the ring and keep its scratch.
    {"tp2_s0_fp32_ring", 1, "parallel.tp=2 model.n_layer=1 model.n_embd=256 model.n_head=4 model.seq_len=256 train.batch_size=4 train.micro_batch_size=4"},
    // Sequence parallel (reduce-scatters and all-gathers in place of the all-reduces), and each rank paging its own shards.
    {"tp2_s0_fp32_sp", 1, "parallel.tp=2 parallel.sequence_parallel=true"},
    {"llama_dp2_tp2_s3_bf16_sp_ckpt", 2, "parallel.tp=2 model.arch=llama model.n_head=4 model.n_kv_head=2 parallel.zero_stage=3 train.precision=bf16 parallel.sequence_parallel=true model.activation_checkpointing=true"},
    {"dp2_tp2_s3_fp32_paged_nvme", 2, "parallel.tp=2 parallel.zero_stage=3 memory.page_size=16KiB", true},
    {"tp2_s0_fp32_sp_ring", 1, "parallel.tp=2 parallel.sequence_parallel=true model.n_layer=1 model.n_embd=256 model.n_head=4 model.seq_len=256 train.batch_size=4 train.micro_batch_size=4"},
    // Context parallel (dp × cp × tp ranks): the data group is dp × cp, the
    // context group carries the ring's blocks (or the gathers).
    {"cp2_s0_fp32", 1, "parallel.cp=2"},
    {"dp2_cp2_s1_fp32_ckpt", 2, "parallel.cp=2 parallel.zero_stage=1 model.activation_checkpointing=true"},
    {"llama_cp2_s3_bf16", 1, "parallel.cp=2 model.arch=llama model.n_head=4 model.n_kv_head=2 parallel.zero_stage=3 train.precision=bf16"},
    {"cp2_allgather_s2_fp32_contiguous", 1, "parallel.cp=2 parallel.cp_mode=allgather parallel.cp_balance=contiguous parallel.zero_stage=2"},
    {"cp2_tp2_s0_fp32_sp", 1, "parallel.cp=2 parallel.tp=2 parallel.sequence_parallel=true"},
    {"cp2_s1_fp32_paged_nvme", 1, "parallel.cp=2 parallel.zero_stage=1 memory.page_size=16KiB", true},
    // A mixture of experts (moe-tiny at these shapes: 4 SwiGLU experts, top 2, in every block):
    // its saved tensors and its scratch are in the activation layout, its tensors in the units.
    {"moe_dp1_s0_fp32", 1, "model.preset=moe-tiny model.arch=llama train.moe_aux_loss=0.01"},
    {"moe_dp2_s3_fp32_ckpt_paged_nvme", 2, "model.preset=moe-tiny model.arch=llama parallel.zero_stage=3 model.activation_checkpointing=true memory.page_size=16KiB", true},
};

std::vector<std::string> split_sets(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// A cluster for memory and collectives only (times are not compared here).
plan::ClusterSpec test_cluster() {
  plan::ClusterSpec c;
  c.name = "test";
  c.devices_per_node = 8;
  c.device_memory = 1e12;
  c.host_memory = 1e12;
  c.peak_flops_bf16 = c.peak_flops_fp32 = 1e11;
  c.intra_bw = c.inter_bw = c.host_bw = 1e9;
  c.nvme_read_bw = c.nvme_write_bw = 1e9;
  return c;
}

class PlanVsEngine : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    write_tokens(train_, 20000, 512);
    write_file(config_,
               "[model]\npreset = \"gpt2-tiny\"\nn_layer = 2\nn_embd = 64\nn_head = 2\n"
               "vocab_size = 512\nseq_len = 32\n"
               "[train]\nbatch_size = 8\nmicro_batch_size = 2\nsteps = 3\nlr = 1e-3\nthreads = 1\n"
               "[data]\ntrain = \"" + train_ + "\"\n[run]\ndir = \"" + (dir_ / "unused") + "\"\n");
  }
  // The case's --set overrides (paged: the smallest budget the engine
  // accepts, + 2 pages, so pages move every step) and the plan of them.
  std::vector<std::string> case_sets(const Case& c) const;
  plan::Plan plan_of(const std::vector<std::string>& sets) const {
    const core::Config cfg = core::Config::load(config_, sets);
    const plan::ModelSpec model = plan::model_spec(train::resolve_model_config(cfg), "test");
    return plan::make_plan(model, test_cluster(), po::cli::plan_layout(cfg, model));
  }
  // Quantized Adam moments are stored for what a rank owns of the data
  // group's cut, so a rank owning less (the last shards are short) holds
  // fewer of their bytes than rank 0, the rank the plan is for: by how many
  // (none at 32 bits, whose shards are padded to their stride, at ZeRO-0,
  // or paged: the compute tier then holds the budget's frames).
  double moments_below_rank0(const std::vector<std::string>& sets, int rank) const {
    const core::Config cfg = core::Config::load(config_, sets);
    const optim::AdamWConfig a = train::adamw_config(cfg);
    const int stage = static_cast<int>(cfg.get_int("parallel.zero_stage"));
    if (a.state_bits >= 32 || stage == 0 || !cfg.get_string("memory.nvme_dir").empty()) return 0;
    // (Megatron's rank order: tensor-parallel ranks fastest.)
    const int tp = static_cast<int>(cfg.get_int("parallel.tp"));
    const model::Layout layout(train::resolve_model_config(cfg), model::TensorSplit{tp, rank % tp});
    const int group = static_cast<int>(cfg.get_int("parallel.dp") * cfg.get_int("parallel.cp"));
    auto bytes = [&](int r) {
      const parallel::ShardLayout shard(layout.unit_numels(), group, r, a.block_size);
      return static_cast<double>(parallel::moment_bytes(layout, a, &shard));
    };
    return bytes(0) - bytes((rank / tp) % group);
  }
  // `pagedoptim train` with the overrides on `world` ranks, into dir_/run.
  CommandResult train_run(const std::vector<std::string>& sets, int world) const {
    std::string args = "train -c " + config_ + " --set run.dir=" + (dir_ / "run");
    for (const auto& s : sets) args += " --set " + s;
    CommandResult r = run_command(pagedoptim_command(world, args));
    r.output = args + "\n" + r.output;
    return r;
  }
  TempDir dir_;
  std::string train_ = dir_ / "train.bin", config_ = dir_ / "c.toml";
};

std::vector<std::string> PlanVsEngine::case_sets(const Case& c) const {
  std::vector<std::string> sets = split_sets(c.sets);
  sets.push_back("parallel.dp=" + std::to_string(c.dp));
  if (c.paged_budget) {
    sets.push_back("memory.nvme_dir=" + dir_.path().string());
    const plan::Plan p = plan_of(sets);
    EXPECT_GT(p.min_compute_budget, 0) << c.name;
    sets.push_back("memory.compute_budget=" +
                   std::to_string(static_cast<uint64_t>(p.min_compute_budget) + 2 * 16384));
  }
  return sets;
}

using OpTotals = std::map<std::string, std::pair<uint64_t, double>>;  // op -> (calls, bytes)

// The plan's collectives on one group ("dp", "tp"), summed per operation.
OpTotals predicted_comm(const plan::Plan& plan, const std::string& dim) {
  OpTotals out;
  for (const plan::CommItem& item : plan.comm) {
    if (item.dim != dim) continue;
    out[item.op].first += item.calls;
    out[item.op].second += item.bytes;
  }
  return out;
}

// A step record's counters of one group (`comm`, `tp_comm`: traffic_json).
OpTotals measured_comm(const nlohmann::json& traffic) {
  OpTotals out;
  for (const auto& [op, v] : traffic.items())
    out[op] = {v.at("calls").get<uint64_t>(), v.at("bytes").get<double>()};
  return out;
}

// Every operation either side has, calls and payload bytes equal.
void expect_same_comm(const OpTotals& predicted, const OpTotals& measured, const std::string& what) {
  for (const auto& [op, v] : measured)
    std::printf("[ %-26s ] %s: %llu calls, %.0f bytes per step\n", what.c_str(), op.c_str(),
                static_cast<unsigned long long>(v.first), v.second);
  OpTotals all = predicted;
  all.insert(measured.begin(), measured.end());
  for (const auto& [op, unused] : all) {
    const auto p = predicted.count(op) ? predicted.at(op) : std::pair<uint64_t, double>{};
    const auto m = measured.count(op) ? measured.at(op) : std::pair<uint64_t, double>{};
    EXPECT_EQ(p.first, m.first) << what << " " << op << ": predicted " << p.first
                                << " calls per step, the run made " << m.first;
    EXPECT_EQ(p.second, m.second) << what << " " << op << ": predicted " << p.second
                                  << " payload bytes per step, the run moved " << m.second;
  }
}

TEST_P(PlanVsEngine, PeakMemoryAndCollectives) {
  const Case& c = GetParam();
  const std::vector<std::string> sets = case_sets(c);
  const plan::Plan plan = plan_of(sets);
  ASSERT_TRUE(plan.engine_exact) << c.name << ": planned as not trainable ("
                                 << (plan.not_trainable.empty() ? "" : plan.not_trainable.front()) << ")";
  const int world = plan.layout.devices();
  const CommandResult r = train_run(sets, world);
  ASSERT_EQ(r.exit_code, 0) << c.name << ": " << r.output;
  if (c.paged_budget) {  // the budget did force pages out of the compute tier
    EXPECT_GT(plan.nvme_bytes + plan.host_bytes, 0) << c.name;
    EXPECT_NE(r.output.find("nvme tier:"), std::string::npos) << r.output;
  }

  const auto records = read_metrics(dir_ / "run");
  ASSERT_FALSE(records.empty()) << c.name << ": no metrics";
  // The last step's record (a paged run writes its `paging` record after it).
  auto step_record = std::find_if(records.rbegin(), records.rend(),
                                  [](const nlohmann::json& j) { return j.contains("memory_per_rank"); });
  ASSERT_NE(step_record, records.rend()) << c.name << ": no step record";
  const nlohmann::json& last = *step_record;
  const nlohmann::json& ranks = last.at("memory_per_rank");
  if (c.paged_budget) {
    // The activations lent to the pager during the backward: the planner's
    // frame count is every rank's, and lending them did not move the peak
    // (checked below, to the byte).
    auto paging = std::find_if(records.rbegin(), records.rend(),
                               [](const nlohmann::json& j) { return j.contains("paging_per_rank"); });
    ASSERT_NE(paging, records.rend()) << c.name << ": no paging record";
    for (const auto& rank : paging->at("paging_per_rank")) {
      EXPECT_EQ(plan.lent_frames, rank.at("lent_frames").get<double>())
          << c.name << ": predicted lent frames vs the engine's";
      EXPECT_GT(rank.at("lent_frames").get<double>(), 0) << c.name << ": nothing was lent";
    }
  }
  ASSERT_EQ(ranks.size(), static_cast<size_t>(world)) << c.name << ": memory_per_rank rows";
  for (size_t r = 0; r < ranks.size(); ++r) {
    const double measured = ranks[r].at("peak").get<double>();
    ASSERT_GT(measured, 0) << c.name << " rank " << r << ": no compute-tier peak measured";
    std::string rows;  // what each side counted, for a failure's message
    for (const auto& m : plan.memory) rows += core::str_cat(" ", m.name, " ", m.bytes, ";");
    const double expected = plan.compute_peak - moments_below_rank0(sets, static_cast<int>(r));
    EXPECT_EQ(expected, measured)
        << c.name << " rank " << r << ": predicted peak " << expected
        << " bytes, measured " << measured << " (" << expected - measured
        << " bytes off)\n  planned:" << rows << "\n  measured: " << ranks[r].dump();
    std::printf("[ %-26s ] rank %zu compute-tier peak: predicted %.0f, measured %.0f bytes\n",
                c.name, r, expected, measured);

  }

  // The whole process: `pagedoptim plan` on this machine (cluster local, its
  // fixed overhead measured by the plan process itself) against the busiest
  // rank's peak RSS, within 10% (the plan above it by at most 25% where the
  // compute tier is over 30 MiB: see below), and no rank more than 10%
  // above the plan. The plan counts the start-up's GEMM probe beside the
  // steps' compute tier; the one engine (2026-12-07) runs the probe before
  // its activation slots exist, so a rank's peak is the larger of the two,
  // 17-20% below the plan on the two 33 MiB ring layouts here (DataParallel
  // held its activations during the probe: 118 against the plan's 118.4
  // MiB). Modelling the probe apart is docs/planning.md's open item.
  // (The plan is for the rank that must fit. A lighter rank's peak RSS
  // swings by up to 10 MiB from run to run on the same binary: rank 1 of
  // these 2-rank tp and cp runs reads 80 or 87-90 MiB against the busiest
  // rank's 87-91, on a Zen 4, 2026-12-05; the compute tier above is exact.)
  {
    std::string plan_args = "plan -c " + config_ + " --json";
    for (const auto& s : sets) plan_args += " --set " + s;
    const CommandResult pr = run_command(std::string(PO_BINARY) + " " + plan_args);
    ASSERT_EQ(pr.exit_code, 0) << c.name << ": " << plan_args << "\n" << pr.output;
    const double device_peak =
        nlohmann::json::parse(pr.output.substr(pr.output.find('{'))).at("device_peak_bytes");
    double busiest = 0;
    for (size_t r = 0; r < ranks.size(); ++r) {
      const double rss = ranks[r].at("peak_rss").get<double>();
      busiest = std::max(busiest, rss);
      EXPECT_LE(rss, 1.10 * device_peak)
          << c.name << " rank " << r << ": `pagedoptim plan` predicts a process peak of "
          << device_peak << " bytes, the rank's peak RSS was " << rss;
      std::printf("[ %-26s ] rank %zu process peak: predicted %.1f MiB, peak RSS %.1f MiB\n",
                  c.name, r, device_peak / 1048576.0, rss / 1048576.0);
    }
    const double above = plan.compute_peak > 30.0 * (1 << 20) ? 0.25 : 0.10;
    EXPECT_LE(device_peak, (1 + above) * busiest)
        << c.name << ": `pagedoptim plan` predicts a process peak of " << device_peak
        << " bytes, the busiest rank's peak RSS was " << busiest;
  }

  // Collectives: the plan's items summed per operation = the step's
  // counters, on each group.
  const OpTotals dp_measured = measured_comm(last.at("comm"));
  const OpTotals tp_measured = measured_comm(last.at("tp_comm"));
  const OpTotals cp_measured =
      last.contains("cp_comm") ? measured_comm(last.at("cp_comm")) : OpTotals{};
  expect_same_comm(predicted_comm(plan, "dp"), dp_measured, std::string(c.name) + " dp");
  expect_same_comm(predicted_comm(plan, "tp"), tp_measured, std::string(c.name) + " tp");
  expect_same_comm(predicted_comm(plan, "cp"), cp_measured, std::string(c.name) + " cp");
  const int data_ranks = c.dp * plan.layout.cp;  // the data group spans dp × cp
  EXPECT_EQ(dp_measured.empty(), data_ranks == 1)
      << c.name << ": collectives on the data group at dp × cp " << data_ranks;
  EXPECT_EQ(tp_measured.empty(), plan.layout.tp == 1)
      << c.name << ": collectives on the tensor group at tp " << plan.layout.tp;
  EXPECT_EQ(cp_measured.empty(), plan.layout.cp == 1)
      << c.name << ": transfers on the context group at cp " << plan.layout.cp;
  for (const plan::CommItem& item : plan.comm)
    EXPECT_TRUE(item.dim == "dp" || item.dim == "tp" || item.dim == "cp")
        << c.name << ": a collective on " << item.dim;
}

INSTANTIATE_TEST_SUITE_P(Layouts, PlanVsEngine, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// Pipeline layouts: the plan's memory is the executor's own accounting on
// the busiest pipeline rank (PipelineExecutor::predict) and its messages the
// schedule's sends, so both equal the run's to the byte: the largest
// `pp_memory_per_rank` total (the executor's memory()) and the busiest
// rank's p2p sends and payload bytes. What this holds is the path from the
// configuration to the pipeline (stages, schedule, micro-batches, the head's
// pieces), the same in `plan` and in `train`. The bubble is the schedule
// simulated at the stages' FLOP costs (a time: bench/pp_bubble.sh prints it
// beside the measured one). The data and tensor groups' collectives are the
// executor's own (PipelineExecutor::predict_collectives), held to the run's
// counters on the pipeline rank that moves the most, per operation.
const Case kPipelineCases[] = {
    {"pp2_1f1b", 1, "parallel.pp=2"},
    {"pp2_zbv_vocab", 1, "model.n_layer=4 parallel.pp=2 parallel.schedule=zbv parallel.vocab_parallel=true"},
    {"pp4_interleaved", 1, "model.n_layer=8 parallel.pp=4 parallel.schedule=interleaved"},
    {"dp2_pp2_zbh1_s1_ckpt", 2, "parallel.pp=2 parallel.schedule=zb-h1 parallel.zero_stage=1 model.activation_checkpointing=true"},
    {"dp2_pp2_zbv_s0_bf16_buckets", 2, "model.n_layer=4 parallel.pp=2 parallel.schedule=zbv parallel.zero_stage=0 train.precision=bf16 parallel.bucket_size=8KiB"},
    {"dp2_pp2_1f1b_s1_fp32_buckets", 2, "parallel.pp=2 parallel.zero_stage=1 parallel.bucket_size=8KiB"},
    {"pp2_cp2_1f1b_s1", 1, "parallel.pp=2 parallel.cp=2 parallel.zero_stage=1"},
    {"llama_pp2_cp2_zbv_allgather", 1, "model.n_layer=4 model.arch=llama model.n_head=4 model.n_kv_head=2 parallel.pp=2 parallel.cp=2 parallel.cp_mode=allgather parallel.schedule=zbv"},
    {"pp2_tp2_gpipe_bf16_sp", 1, "parallel.pp=2 parallel.tp=2 parallel.schedule=gpipe train.precision=bf16 parallel.sequence_parallel=true"},
    {"llama_pp2_zbv_vocab_m3", 1, "model.n_layer=4 model.arch=llama model.n_head=4 model.n_kv_head=2 parallel.pp=2 parallel.schedule=zbv parallel.vocab_parallel=true train.batch_size=6"},
    {"pp2_1f1b_s1_paged_nvme", 1, "parallel.pp=2 parallel.zero_stage=1 memory.page_size=16KiB", true},
    {"dp2_pp2_zbh1_s2_bf16_wire16", 2, "parallel.pp=2 parallel.schedule=zb-h1 parallel.zero_stage=2 train.precision=bf16 parallel.reduce_dtype=bf16"},
    {"dp2_pp2_zbv_s2_fp32_paged_nvme", 2, "model.n_layer=4 parallel.pp=2 parallel.schedule=zbv parallel.zero_stage=2 memory.page_size=16KiB", true},
    {"dp2_pp2_1f1b_s3_bf16", 2, "parallel.pp=2 parallel.zero_stage=3 train.precision=bf16"},
    {"pp2_1f1b_8bit", 1, "parallel.pp=2 optim.state_bits=8"},
    {"pp2_1f1b_s1_8bit_paged_nvme", 1, "parallel.pp=2 parallel.zero_stage=1 optim.state_bits=8 memory.page_size=16KiB", true},
    {"dp2_pp2_zbv_s3_bf16_4bit", 2, "model.n_layer=4 parallel.pp=2 parallel.schedule=zbv parallel.zero_stage=3 train.precision=bf16 optim.state_bits=4"},
    {"dp2_pp2_zbv_s3_fp32_paged_nvme", 2, "model.n_layer=4 parallel.pp=2 parallel.schedule=zbv parallel.zero_stage=3 memory.page_size=16KiB", true},
    {"pp2_zbh1_s3_bf16_paged_nvme", 1, "parallel.pp=2 parallel.schedule=zb-h1 parallel.zero_stage=3 train.precision=bf16 memory.page_size=16KiB", true},
    {"moe_dp2_pp2_1f1b_s1", 2, "model.preset=moe-tiny model.arch=llama parallel.pp=2 parallel.schedule=1f1b parallel.zero_stage=1"},
};

class PlanVsPipeline : public PlanVsEngine {};

TEST_P(PlanVsPipeline, MemoryAndMessages) {
  const Case& c = GetParam();
  const std::vector<std::string> sets = case_sets(c);
  const plan::Plan plan = plan_of(sets);
  ASSERT_TRUE(plan.not_trainable.empty()) << c.name << ": planned as not trainable ("
                                          << plan.not_trainable.front() << ")";
  ASSERT_GT(plan.layout.pp, 1) << c.name;
  const CommandResult r = train_run(sets, plan.layout.devices());
  ASSERT_EQ(r.exit_code, 0) << c.name << ": " << r.output;
  const auto records = read_metrics(dir_ / "run");
  auto step_record = std::find_if(records.rbegin(), records.rend(),
                                  [](const nlohmann::json& j) { return j.contains("pp_memory_per_rank"); });
  ASSERT_NE(step_record, records.rend()) << c.name << ": no pipeline step record";
  const nlohmann::json& last = *step_record;

  double busiest = 0;
  for (const auto& rank : last.at("pp_memory_per_rank")) busiest = std::max(busiest, rank.at("total").get<double>());
  EXPECT_EQ(plan.compute_peak, busiest) << c.name << ": predicted " << plan.compute_peak
                                        << " bytes on the busiest pipeline rank, the run's executor held "
                                        << busiest << " (" << plan.compute_peak - busiest << " bytes off)";
  std::printf("[ %-26s ] busiest pipeline rank: predicted %.0f, measured %.0f bytes\n", c.name,
              plan.compute_peak, busiest);
  if (c.paged_budget) {
    EXPECT_GT(plan.nvme_bytes, 0) << c.name << ": the budget moved no page to NVMe";
  }

  const OpTotals predicted = predicted_comm(plan, "pp");
  ASSERT_EQ(predicted.size(), 1u) << c.name << ": the plan's pipeline messages";
  double sends = 0, bytes = 0;
  const auto& per_sends = last.at("pp_p2p_sends_per_rank");
  const auto& per_bytes = last.at("pp_p2p_bytes_per_rank");
  for (size_t k = 0; k < per_sends.size(); ++k) {
    sends = std::max(sends, per_sends[k].get<double>());
    bytes = std::max(bytes, per_bytes[k].get<double>());
  }
  const auto [calls, payload] = predicted.begin()->second;
  EXPECT_EQ(static_cast<double>(calls), sends)
      << c.name << ": predicted " << calls << " sends on the busiest rank, the run's busiest made " << sends;
  EXPECT_EQ(payload, bytes) << c.name << ": predicted " << payload
                            << " payload bytes from the busiest rank, the run's busiest sent " << bytes;
  std::printf("[ %-26s ] busiest sender: predicted %llu sends, %.0f bytes; measured %.0f, %.0f\n", c.name,
              static_cast<unsigned long long>(calls), payload, sends, bytes);

  // The data and tensor groups' collectives of the pipeline rank that moves
  // the most (the plan's choice, made the same way on the run's counters):
  // per operation, calls and payload bytes.
  const auto& dp_ranks = last.at("pp_comm_per_rank");
  const auto& tp_ranks = last.at("pp_tp_comm_per_rank");
  ASSERT_EQ(dp_ranks.size(), static_cast<size_t>(plan.layout.pp)) << c.name;
  size_t most = 0;
  double moved = -1;
  for (size_t k = 0; k < dp_ranks.size(); ++k) {
    double b = 0;
    for (const auto* group : {&dp_ranks[k], &tp_ranks[k]})
      for (const auto& [op, v] : group->items()) b += v.at("bytes").get<double>();
    if (b > moved) {
      moved = b;
      most = k;
    }
  }
  const std::string where = std::string(c.name) + " pipeline rank " + std::to_string(most);
  expect_same_comm(predicted_comm(plan, "dp"), measured_comm(dp_ranks[most]), where + " dp");
  expect_same_comm(predicted_comm(plan, "tp"), measured_comm(tp_ranks[most]), where + " tp");
  const int data_group = plan.layout.dp * plan.layout.cp;  // (context parallel: dp × cp)
  EXPECT_EQ(measured_comm(dp_ranks[most]).empty(), data_group == 1)
      << where << ": data-group collectives over " << data_group << " ranks";
  EXPECT_EQ(measured_comm(tp_ranks[most]).empty(), plan.layout.tp == 1)
      << where << ": tensor-group collectives at tp " << plan.layout.tp;
}

INSTANTIATE_TEST_SUITE_P(Layouts, PlanVsPipeline, ::testing::ValuesIn(kPipelineCases),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace po::test
