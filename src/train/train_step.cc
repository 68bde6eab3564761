// The step, as train() runs it each iteration, and what it reports.
#include "train/train_step.h"

#include <algorithm>
#include <functional>

#include "backend/ops.h"
#include "core/error.h"
#include "core/timer.h"
#include "train/metrics.h"

namespace po::train {

static_assert(data::kIgnoreTarget == backend::cpu::kIgnoreTarget, "the data and the kernels ignore the same target");

void size_batch_buffers(StepContext& c) {
  if (c.sampler.sft() != nullptr && c.sampler.sft()->packed())
    c.positions.resize(static_cast<size_t>(c.p.micro * c.p.T));
  c.inputs.resize(static_cast<size_t>(c.p.micro * c.p.T / c.cp.size));
  c.targets.resize(c.inputs.size());
  if (c.cp.size > 1) {
    c.seq_inputs.resize(static_cast<size_t>(c.p.micro * c.p.T));
    c.seq_targets.resize(c.seq_inputs.size());
  }
}

namespace {

// fill(inputs, targets, positions) writes p.micro whole sequences (and
// packed rows' positions, handed to the model); at cp > 1 this rank's
// chunks of each (model/parallel_ops.h's ContextSplit) are cut out of them
// into c.inputs and c.targets: the same tokens as at cp = 1.
template <class Fill>
void fill_batch(StepContext& c, Fill fill) {
  int32_t* pos = c.positions.empty() ? nullptr : c.positions.data();
  if (c.cp.size == 1) {
    fill(c.inputs.data(), c.targets.data(), pos);
    if (pos != nullptr) c.model.set_positions(pos);
    return;
  }
  fill(c.seq_inputs.data(), c.seq_targets.data(), pos);  // (packing is refused at cp > 1)
  cut_context_rows(c.cp, c.p.micro, c.p.T, c.seq_inputs.data(), c.inputs.data());
  cut_context_rows(c.cp, c.p.micro, c.p.T, c.seq_targets.data(), c.targets.data());
}

}  // namespace

void cut_context_rows(const model::ContextSplit& cp, int64_t micro, int64_t T,
                      const int32_t* seq, int32_t* local) {
  const int64_t Tl = T / cp.size, n = cp.local_chunks(), S = Tl / n;
  for (int64_t b = 0; b < micro; b++)
    for (int64_t i = 0; i < n; i++)
      std::copy_n(seq + b * T + cp.chunk(static_cast<int>(i)) * S, S, local + b * Tl + i * S);
}

double step_targets(const data::BatchSampler& sampler, const Plan& p, int64_t step) {
  if (sampler.sft() == nullptr) return tokens_per_step(p);
  const double counted = static_cast<double>(sampler.counted_targets(step, 0, p.batch));
  PO_CHECK(counted > 0, "step ", step, ": the batch's ", p.batch, " SFT rows hold no target the loss counts");
  return counted;
}

double counted_mean(double sum, double counted, comm::Communicator* context, int64_t batches) {
  float sc[2] = {static_cast<float>(sum), static_cast<float>(counted)};
  if (context != nullptr) context->allreduce(sc, 2, tensor::DType::kF32, comm::ReduceOp::kSum);
  PO_CHECK(sc[1] > 0, "data.val: its first ", batches, " batches hold no target the loss counts");
  return static_cast<double>(sc[0]) / static_cast<double>(sc[1]);
}

StepStats train_step(StepContext& c, int64_t step, double lr) {
  const Plan& p = c.p;
  core::Timer step_timer;
  // Data-parallel traffic is the data group's (the world's at tp = 1).
  comm::Communicator* dpc = c.data != nullptr ? c.data : c.world;
  const comm::Traffic traffic_before = dpc ? dpc->traffic() : comm::Traffic{};
  const comm::Traffic tp_before = c.tp ? c.tp->group().traffic() : comm::Traffic{};
  const comm::Traffic cp_before = c.context ? c.context->traffic() : comm::Traffic{};
  if (c.tp) (void)c.tp->take_seconds();  // (an evaluation's are not the step's)
  if (c.cpo) {
    (void)c.cpo->take_attention_seconds();
    (void)c.cpo->take_wait_seconds();
  }
  StepStats s;
  s.lr = lr;
  c.dp.begin_step(s.lr);
  const bool sft = c.sampler.sft() != nullptr;
  const double counted = step_targets(c.sampler, p, step);
  const float grad_scale = static_cast<float>(1.0 / counted);
  const double rows = static_cast<double>(p.micro * p.T / p.cp);  // a micro-batch's rows on this rank
  double loss = 0;
  for (int64_t micro = 0; micro < p.accum; ++micro) {
    // This rank's slice of the step's global batch: layout-independent data.
    const int64_t first = (c.rank * p.accum + micro) * p.micro;
    fill_batch(c, [&](int32_t* in, int32_t* tg, int32_t* pos) { c.sampler.fill(step, first, p.micro, in, tg, pos); });
    c.model.set_dropout(c.seed, step, first);  // (no-op without lora.dropout)
    // Gradients are final after the last micro-batch: reduce them as they come.
    const float mean = c.dp.micro_batch(c.inputs.data(), c.targets.data(), grad_scale, micro == p.accum - 1);
    loss += sft ? mean * rows : mean;  // SFT: the sum over its rows (ignored ones add 0)
  }
  s.grad_norm = c.dp.step(s.lr);
  s.traffic = dpc ? dpc->traffic().since(traffic_before) : comm::Traffic{};
  if (c.tp) {
    s.tp_traffic = c.tp->group().traffic().since(tp_before);
    s.tp_seconds = c.tp->take_seconds();
  }
  if (c.cpo) {
    s.cp_traffic = c.context->traffic().since(cp_before);
    s.cp_attention_s = c.cpo->take_attention_seconds();
    s.cp_wait_s = c.cpo->take_wait_seconds();
  }
  s.comm_wait_s = c.dp.comm_wait_seconds();
  if (c.paging) s.paging = c.dp.paged_state()->take_stats();
  if (c.data) {  // tensor-parallel ranks hold the same loss: summed over dp (× cp) only
    float l = static_cast<float>(loss);
    c.data->allreduce(&l, 1, tensor::DType::kF32, comm::ReduceOp::kSum);
    loss = l;
  }
  // Context-parallel ranks each hold the mean over their own (equally many) tokens.
  s.loss = sft ? loss / counted : loss / static_cast<double>(p.accum * p.dp * p.cp);
  s.seconds = step_timer.seconds();
  return s;
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

double evaluate(StepContext& c, const data::TokenFile& val) {
  const Plan& p = c.p;
  double sum = 0;
  data::EvalSampler windows(val, p.T, c.val_sft);
  // train() checked at start that data.val holds at least one batch.
  const int64_t batches = std::min(p.eval_batches, windows.num_sequences() / p.micro);
  PO_ASSERT(batches >= 1, "validation file shrank after start-up: ", val.path());
  // SFT data: the mean over the counted targets of every batch.
  const double rows = static_cast<double>(p.micro * p.T / p.cp);
  double counted = 0;
  for (int64_t b = 0; b < batches; ++b) {
    fill_batch(c, [&](int32_t* in, int32_t* tg, int32_t* pos) { windows.fill(b * p.micro, p.micro, in, tg, pos); });
    const float mean = c.model.evaluate(c.inputs.data(), c.targets.data());
    if (c.val_sft == nullptr) {
      sum += mean;
      continue;
    }
    sum += mean * rows;
    counted += static_cast<double>(data::counted_targets(c.targets));
  }
  if (c.val_sft != nullptr) return counted_mean(sum, counted, c.context, batches);
  if (c.context != nullptr) {  // each rank's mean is over its own share of the tokens
    float l = static_cast<float>(sum);
    c.context->allreduce(&l, 1, tensor::DType::kF32, comm::ReduceOp::kSum);
    sum = static_cast<double>(l) / c.context->size();
  }
  return sum / static_cast<double>(batches);
}

}  // namespace po::train
