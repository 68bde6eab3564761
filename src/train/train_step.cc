// What every step shares (train_step.h).
#include "train/train_step.h"

#include <algorithm>

#include "backend/ops.h"
#include "core/error.h"
#include "train/metrics.h"

namespace po::train {

static_assert(data::kIgnoreTarget == backend::cpu::kIgnoreTarget, "the data and the kernels ignore the same target");

void cut_context_rows(const model::ContextSplit& cp, int64_t micro, int64_t T,
                      const int32_t* seq, int32_t* local) {
  const int64_t Tl = T / cp.size, n = cp.local_chunks(), S = Tl / n;
  for (int64_t b = 0; b < micro; b++)
    for (int64_t i = 0; i < n; i++)
      std::copy_n(seq + b * T + cp.chunk(static_cast<int>(i)) * S, S, local + b * Tl + i * S);
}

double step_targets(const data::BatchSampler& sampler, const Plan& p, int64_t step, int64_t first) {
  if (sampler.sft() == nullptr) return static_cast<double>(p.batch * p.T);
  const double counted = static_cast<double>(sampler.counted_targets(step, first, p.batch));
  PO_CHECK(counted > 0, "step ", step, ": the batch's ", p.batch, " SFT rows hold no target the loss counts");
  return counted;
}

double counted_mean(double sum, double counted, comm::Communicator* context, int64_t batches) {
  float sc[2] = {static_cast<float>(sum), static_cast<float>(counted)};
  if (context != nullptr) context->allreduce(sc, 2, tensor::DType::kF32, comm::ReduceOp::kSum);
  PO_CHECK(sc[1] > 0, "data.val: its first ", batches, " batches hold no target the loss counts");
  return static_cast<double>(sc[0]) / static_cast<double>(sc[1]);
}

double gemm_peak_gflops(const core::Config& cfg) {
  const double configured = cfg.get_float("train.peak_gflops");
  return configured > 0 ? configured : backend::cpu::measure_gemm_peak_gflops(backend::cpu::gemm_precision());
}

std::string gemm_peak_note(const core::Config& cfg, double peak_gflops) {
  return core::str_cat(backend::cpu::gemm_precision() == backend::cpu::GemmPrecision::kBF16 ? "bf16 GEMM" : "sgemm",
                       " peak ", static_cast<int>(peak_gflops), " GFLOP/s",
                       cfg.get_float("train.peak_gflops") > 0 ? ", as configured" : "", ": mfu's denominator");
}

CommSplit comm_split(const comm::Communicator* world, int64_t wait_end_ns, const std::vector<RankRecord>& records,
                     double comm_wait_s) {
  // Waiting for a slower rank is imbalance, not communication; the steady
  // clock is shared on one node, so this is exact there.
  CommSplit out{comm_wait_s * 1000, 0};
  if (world == nullptr) return out;
  const auto [lo, hi] = std::minmax_element(
      records.begin(), records.end(), [](const RankRecord& a, const RankRecord& b) {
        return a.backward_end_ns < b.backward_end_ns;
      });
  out.exposed_ms =
      std::max<double>(0, static_cast<double>(wait_end_ns - hi->backward_end_ns) / 1e6);
  out.imbalance_ms = static_cast<double>(hi->backward_end_ns - lo->backward_end_ns) / 1e6;
  return out;
}

nlohmann::json step_metrics(const Plan& p, const model::TransformerConfig& mcfg, double peak_gflops,
                            const StepStats& s, const TrainState& state, const CommSplit& split, size_t predicted,
                            const std::vector<RankRecord>& records) {
  const double tps = tokens_per_step(p) / s.seconds;
  // Each rank measured the peak of its own share of the cores.
  const double mfu = model_flops_utilisation(p, mcfg, tps, peak_gflops);
  nlohmann::json m = {{"step", state.step},
          {"loss", s.loss},
          {"lr", s.lr},
          {"grad_norm", s.grad_norm},
          {"tokens_per_s", tps},
          {"mfu", mfu},
          {"step_ms", s.seconds * 1000},
          {"comm_wait_ms", s.comm_wait_s * 1000},
          {"exposed_comm_ms", split.exposed_ms},
          {"imbalance_ms", split.imbalance_ms},
          {"tokens", state.tokens},
          {"peak_rss_bytes", peak_rss_bytes()},
          {"predicted_bytes", predicted},
          {"comm", traffic_json(s.traffic)},
          {"tp_comm", traffic_json(s.tp_traffic)},
          {"tp_comm_ms", s.tp_seconds * 1000},
          {"memory_per_rank", memory_json(records)}};
  if (p.cp > 1) {  // per rank: the balance of the attention, and what the ring left exposed
    nlohmann::json att = nlohmann::json::array(), wait = nlohmann::json::array();
    for (const RankRecord& r : records) {
      att.push_back(r.cp_attention_ms);
      wait.push_back(r.cp_wait_ms);
    }
    m["cp_comm"] = traffic_json(s.cp_traffic);
    m["cp_attention_ms"] = att;
    m["cp_exposed_ms"] = wait;
  }
  return m;
}

}  // namespace po::train
