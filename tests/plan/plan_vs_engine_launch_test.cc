// The planner against the engine: each layout is trained for a few steps by
// the real binary (dp ranks under mpirun), and the planner's prediction for
// the same config is held to what the run measured:
//   * the compute-tier peak per rank (the compute pool's high-water mark over
//     the training steps, `memory_per_rank[r].peak`) within ±10% — it is
//     expected to be exact, and the test prints both;
//   * the step's collectives (`comm` in metrics: calls and payload bytes per
//     operation, comm::Traffic) equal to the byte.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <sstream>

#include "plan/planner.h"
#include "../test_util.h"

namespace po::test {
namespace {

struct Case {
  const char* name;
  int dp;
  const char* sets;  // --set overrides beyond parallel.dp
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
};

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
  TempDir dir_;
  std::string train_ = dir_ / "train.bin", config_ = dir_ / "c.toml";
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

TEST_P(PlanVsEngine, PeakMemoryAndCollectives) {
  const Case& c = GetParam();
  std::vector<std::string> sets = split_sets(c.sets);
  sets.push_back("parallel.dp=" + std::to_string(c.dp));
  if (c.paged_budget) {
    sets.push_back("memory.nvme_dir=" + dir_.path().string());
    // The smallest budget the engine accepts, + 2 pages: pages move every step.
    core::Config probe = core::Config::load(config_, sets);
    const plan::ModelSpec m = plan::model_from_config(probe);
    const plan::Plan p = plan::make_plan(m, test_cluster(), plan::layout_from_config(probe, m));
    ASSERT_GT(p.min_compute_budget, 0) << c.name;
    sets.push_back("memory.compute_budget=" +
                   std::to_string(static_cast<uint64_t>(p.min_compute_budget) + 2 * 16384));
  }
  const core::Config cfg = core::Config::load(config_, sets);
  const plan::ModelSpec model = plan::model_from_config(cfg);
  const plan::Plan plan = plan::make_plan(model, test_cluster(), plan::layout_from_config(cfg, model));
  ASSERT_TRUE(plan.engine_exact) << c.name;

  std::string args = "train -c " + config_ + " --set run.dir=" + (dir_ / "run");
  for (const auto& s : sets) args += " --set " + s;
  const CommandResult r = run_command(pagedoptim_command(c.dp, args));
  ASSERT_EQ(r.exit_code, 0) << c.name << ": " << args << "\n" << r.output;
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
  for (const auto& rank : last.at("memory_per_rank")) {
    const double measured = rank.at("peak").get<double>();
    EXPECT_NEAR(plan.compute_peak / measured, 1.0, 0.10)
        << c.name << ": predicted peak " << plan.compute_peak << " bytes, measured " << measured;
    std::printf("[ %-26s ] compute-tier peak: predicted %.0f, measured %.0f bytes (%.4f)\n", c.name,
                plan.compute_peak, measured, plan.compute_peak / measured);
  }

  // Collectives: the plan's items summed per operation = the step's counters.
  std::map<std::string, std::pair<uint64_t, double>> predicted;
  for (const plan::CommItem& item : plan.comm) {
    predicted[item.op].first += item.calls;
    predicted[item.op].second += item.bytes;
  }
  std::map<std::string, std::pair<uint64_t, double>> measured;
  for (const auto& [op, v] : last.at("comm").items())
    measured[op] = {v.at("calls").get<uint64_t>(), v.at("bytes").get<double>()};
  EXPECT_EQ(predicted.size(), measured.size()) << c.name << ": operations predicted vs run";
  for (const auto& [op, v] : measured) {
    EXPECT_EQ(predicted[op].first, v.first) << c.name << ": " << op << " calls per step";
    EXPECT_EQ(predicted[op].second, v.second) << c.name << ": " << op << " payload bytes per step";
  }
  if (c.dp == 1) EXPECT_TRUE(measured.empty()) << c.name << ": one rank communicates nothing";
}

INSTANTIATE_TEST_SUITE_P(Layouts, PlanVsEngine, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace po::test
