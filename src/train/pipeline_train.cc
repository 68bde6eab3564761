// The pipelined trainer (pipeline_train.h).
#include "train/pipeline_train.h"

#include <algorithm>
#include <filesystem>
#include <memory>
#include <numeric>
#include <optional>
#include <vector>

#include "backend/ops.h"
#include "checkpoint/atomic_file.h"
#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"
#include "parallel/pipeline_executor.h"
#include "parallel/pipeline_stages.h"
#include "parallel/shard_layout.h"
#include "parallel/tensor_parallel.h"
#include "train/metrics.h"
#include "train/model_setup.h"
#include "train/rank_records.h"
#include "train/run_state.h"
#include "train/train_step.h"

namespace po::train {
namespace fs = std::filesystem;
namespace pl = parallel::pipeline;
using tensor::DType;

namespace {

parallel::PipelineSetup pipeline_setup(const PipelineRun& r, parallel::TensorParallelOps* tp_ops) {
  const core::Config& cfg = r.cfg;
  parallel::PipelineSetup s;
  const pl::ScheduleKind kind = pl::parse_schedule(cfg.get_string("parallel.schedule"));
  const int v = pl::chunks_per_rank(kind, static_cast<int>(cfg.get_int("parallel.virtual_stages")));
  s.schedule = pl::make_schedule(kind, static_cast<int>(r.p.pp), static_cast<int>(r.p.accum), v);
  s.stage_units = pl::partition_stages(r.mcfg, r.p.T, s.schedule.stages(),
                                       cfg.get_string("parallel.stage_layers"));
  s.micro = r.p.micro;
  s.T = r.p.T;
  s.pipe = r.launch.pp_group();
  s.data = r.launch.dp_group();
  s.tensor = r.launch.tp_group();
  s.tp_ops = tp_ops;
  s.split = {static_cast<int>(r.p.tp), r.launch.tp_rank};
  s.tp_overlap = cfg.get_bool("parallel.tp_overlap");
  return s;
}

std::vector<int64_t> unit_numels(const model::Layout& l) {
  std::vector<int64_t> n;
  for (int u = 0; u < l.num_units(); ++u) n.push_back(l.unit_numel(u));
  return n;
}

// The pipeline rank that holds unit u.
int owner_of(const parallel::PipelineSetup& s, const model::Layout& l, int u) {
  for (int st = 0; st < s.schedule.stages(); ++st) {
    const model::UnitRange r = s.stage_units[static_cast<size_t>(st)];
    const int last = r.last < 0 ? l.head_unit() : r.last;
    if (u >= r.first && u <= last) return s.schedule.rank_of(st);
  }
  PO_THROW(core::Internal, "pipeline: no stage holds unit ", u);
}

const checkpoint::StateKind kKinds[3] = {checkpoint::StateKind::kParams,
                                         checkpoint::StateKind::kAdamM,
                                         checkpoint::StateKind::kAdamV};

float* unit_state(parallel::PipelineExecutor& ex, checkpoint::StateKind k, int u) {
  switch (k) {
    case checkpoint::StateKind::kParams: return ex.unit_params(u);
    case checkpoint::StateKind::kAdamM: return ex.unit_adam_m(u);
    case checkpoint::StateKind::kAdamV: return ex.unit_adam_v(u);
  }
  return nullptr;
}

// The whole model's checkpoint: the first replica's stages send their units
// to its rank 0, which writes them (a collective over the world).
void save_pipeline(const PipelineRun& r, parallel::PipelineExecutor& ex,
                   const parallel::PipelineSetup& s, TrainState st, const std::string& path) {
  const model::Layout& l = ex.layout();
  const int U = l.num_units();
  st.adam_t = ex.adam_steps();
  if (r.launch.dp_rank == 0 && r.launch.tp_rank == 0) {
    comm::Communicator& pipe = *s.pipe;
    const bool writer = pipe.rank() == 0;
    std::vector<float> whole[3];
    if (writer)
      for (auto& w : whole) w.resize(static_cast<size_t>(l.num_params()));
    for (int u = 0; u < U; ++u) {
      const int owner = owner_of(s, l, u);
      const auto n = static_cast<size_t>(l.unit_numel(u));
      for (int k = 0; k < 3; ++k) {
        const int tag = 3 * u + k;
        if (writer && owner == 0)
          std::copy_n(unit_state(ex, kKinds[k], u), n, whole[k].data() + l.unit_offset(u));
        else if (writer)
          pipe.recv(whole[k].data() + l.unit_offset(u), n, DType::kF32, owner, tag);
        else if (pipe.rank() == owner)
          pipe.send(unit_state(ex, kKinds[k], u), n, DType::kF32, 0, tag);
      }
    }
    if (writer) {
      const parallel::ShardLayout one(unit_numels(l), 1, 0);
      save_checkpoint_sharded(
          path, l, one,
          [&](checkpoint::StateKind k, int u) -> const float* {
            const int i = k == checkpoint::StateKind::kParams ? 0 : k == checkpoint::StateKind::kAdamM ? 1 : 2;
            return whole[i].data() + l.unit_offset(u);
          },
          st, r.config_toml, nullptr,
          {checkpoint::kAllStateKinds.begin(), checkpoint::kAllStateKinds.end()});
    }
  }
  r.launch.world->barrier();
}

// Every rank reads the units it holds (the others into scratch).
TrainState load_pipeline(parallel::PipelineExecutor& ex, const std::string& path) {
  const model::Layout& l = ex.layout();
  std::vector<float> scratch;
  const parallel::ShardLayout one(unit_numels(l), 1, 0);
  const TrainState st = load_checkpoint_sharded(
      path, l, one,
      [&](checkpoint::StateKind k, int u) -> float* {
        if (ex.holds(u)) return unit_state(ex, k, u);
        scratch.resize(static_cast<size_t>(l.unit_numel(u)));
        return scratch.data();
      },
      nullptr, {checkpoint::kAllStateKinds.begin(), checkpoint::kAllStateKinds.end()});
  ex.set_adam_steps(st.adam_t);
  ex.sync_replica();
  return st;
}

// model.init's weights: the whole model read on every rank, its units kept.
void load_init(parallel::PipelineExecutor& ex, const model::TransformerConfig& mcfg,
               const std::string& init) {
  model::TransformerConfig wc = mcfg;
  wc.activation_checkpointing = false;
  model::Transformer whole(wc, 1, 1);
  load_model_weights(init, whole);
  for (int u = 0; u < whole.num_units(); ++u)
    if (ex.holds(u))
      std::copy_n(whole.params() + whole.unit_offset(u), whole.unit_numel(u), ex.unit_params(u));
  ex.sync_replica();
}

double mean_of(const std::vector<double>& v) {
  return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

}  // namespace

TrainResult train_pipeline(const PipelineRun& r) {
  const Plan& p = r.p;
  const core::Config& cfg = r.cfg;
  const Launch& launch = r.launch;
  PO_CHECK(launch.pp_group() != nullptr, "parallel.pp = ", p.pp, " needs its pipeline group");
  std::optional<parallel::TensorParallelOps> tp_ops;
  if (launch.tp_group() != nullptr) tp_ops.emplace(*launch.tp_group());
  const parallel::PipelineSetup setup = pipeline_setup(r, tp_ops ? &*tp_ops : nullptr);
  parallel::PipelineExecutor ex(r.mcfg, r.adam, setup);
  comm::Communicator& pipe = *launch.pp_group();
  comm::Communicator* data = launch.dp_group();

  const std::string ckpt_dir = (fs::path(r.run_dir) / "checkpoints").string();
  const auto existing = list_checkpoints(ckpt_dir);
  TrainState state;
  state.seed = r.seed;
  if (r.resume && !existing.empty()) {
    state = load_pipeline(ex, existing.back());
    PO_CHECK(state.seed == r.seed, existing.back(), ": written with train.seed = ", state.seed,
             ", but the config says ", r.seed, " (batches would differ)");
    PO_LOG_INFO("resuming from ", existing.back(), " at step ", state.step);
  } else if (cfg.get_string("model.init") == "random") {
    ex.init_random(r.seed);
  } else {
    PO_CHECK(p.tp == 1, "model.init from a file with parallel.tp × parallel.pp > 1 is not built yet");
    load_init(ex, r.mcfg, cfg.get_string("model.init"));
  }
  if (launch.leader) {
    prepare_run_dir(r.run_dir, r.resume);
    checkpoint::write_file_atomic((fs::path(r.run_dir) / "config.toml").string(),
                                  r.config_toml.data(), r.config_toml.size());
  }
  const pl::Schedule& sch = setup.schedule;
  const double formula = pl::formula_bubble(sch.kind, sch.ranks, sch.micro_batches, sch.chunks);
  const double planned = pl::simulate(sch).bubble();
  PO_LOG_INFO("pipeline: ", pl::schedule_name(sch.kind), " over ", p.pp, " stages", sch.chunks > 1 ? core::str_cat(" × ", sch.chunks, " chunks") : std::string(),
              ", ", p.accum, " micro-batches of ", p.micro, "; bubble by formula ", formula,
              ", as planned ", planned);

  std::optional<MetricsWriter> metrics;
  if (launch.leader) metrics.emplace((fs::path(r.run_dir) / "metrics.jsonl").string());
  Progress progress;
  TrainResult result;
  result.run_dir = r.run_dir;
  result.leader = launch.leader;
  const float grad_scale = static_cast<float>(1.0 / tokens_per_step(p));
  const std::string trace = cfg.get_string("train.trace");
  auto checkpoint_now = [&] {
    core::Timer t;
    save_pipeline(r, ex, setup, state, checkpoint_path(r.run_dir, state.step));
    if (!launch.leader) return;
    remove_old_checkpoints(ckpt_dir, p.keep);
    progress.line(core::str_cat("checkpoint step ", state.step, " saved in ",
                                static_cast<int>(t.seconds() * 1000), " ms"));
  };
  if (p.steps == 0 && state.step == 0) checkpoint_now();
  std::vector<int32_t> in(static_cast<size_t>(p.micro * p.T)), tg(in.size());
  for (int64_t step = state.step; step < p.steps; ++step) {
    core::Timer step_timer;
    const double lr = r.sched.at(step);
    const int rank = launch.dp_rank;
    const parallel::PipelineStepStats st = ex.forward_backward(
        [&](int micro, int32_t* inputs, int32_t* targets) {
          r.sampler.fill(step, (rank * p.accum + micro) * p.micro, p.micro, inputs, targets);
        },
        grad_scale);
    const double norm = ex.step(lr);
    // The loss: the last stage's, then summed over the replicas as pp = 1 does.
    double loss = 0;
    {
      std::vector<double> sums(static_cast<size_t>(p.pp));
      pipe.all_gather(&st.loss_sum, sums.data(), 2, DType::kI32);  // doubles, bit-exact
      loss = sums[static_cast<size_t>(sch.rank_of(sch.stages() - 1))];
    }
    if (data != nullptr) {
      float l = static_cast<float>(loss);
      data->allreduce(&l, 1, DType::kF32, comm::ReduceOp::kSum);
      loss = l;
    }
    loss /= static_cast<double>(p.accum * p.dp);
    const double seconds = step_timer.seconds();
    // The measured bubble: 1 - mean compute / the slowest stage's step.
    const double mine[4] = {st.busy_s, st.seconds, st.wait_s, static_cast<double>(st.sent_bytes)};
    std::vector<double> all(4 * static_cast<size_t>(p.pp));
    pipe.all_gather(mine, all.data(), 8, DType::kI32);  // doubles, bit-exact
    std::vector<double> busy, secs;
    double wait_max = 0, sent = 0;
    for (int64_t k = 0; k < p.pp; ++k) {
      busy.push_back(all[4 * k]);
      secs.push_back(all[4 * k + 1]);
      wait_max = std::max(wait_max, all[4 * k + 2]);
      sent += all[4 * k + 3];
    }
    const double bubble = 1 - mean_of(busy) / *std::max_element(secs.begin(), secs.end());
    // Every pipeline rank's bytes (the executor's accounting), for the report.
    const parallel::PipelineExecutor::Memory mem = ex.memory();
    const double mine_mem[6] = {static_cast<double>(mem.params), static_cast<double>(mem.grads),
                                static_cast<double>(mem.adam), static_cast<double>(mem.activations),
                                static_cast<double>(mem.w_queue), static_cast<double>(mem.buffers)};
    std::vector<double> mems(6 * static_cast<size_t>(p.pp));
    pipe.all_gather(mine_mem, mems.data(), 12, DType::kI32);  // doubles, bit-exact
    int peak = st.peak_in_flight;
    std::vector<int> peaks(static_cast<size_t>(p.pp));
    pipe.all_gather(&peak, peaks.data(), 1, DType::kI32);
    state.step = step + 1;
    state.tokens += static_cast<uint64_t>(tokens_per_step(p));
    result.last_loss = loss;
    if (!trace.empty() && state.step == p.steps) {
      const std::string json = ex.gather_trace();
      if (pipe.rank() == 0 && launch.dp_rank == 0 && launch.tp_rank == 0)
        checkpoint::write_file_atomic(trace, json.data(), json.size());
    }
    const bool eval_now = r.val && ((p.eval_interval > 0 && state.step % p.eval_interval == 0) ||
                                    state.step == p.steps);
    double vl = 0;
    if (eval_now) {
      data::EvalSampler windows(*r.val, p.T);
      const int64_t batches = std::min(p.eval_batches, windows.num_sequences() / p.micro);
      for (int64_t b = 0; b < batches; ++b) {
        windows.fill(b * p.micro, p.micro, in.data(), tg.data());
        vl += ex.evaluate(in.data(), tg.data());
      }
      vl /= static_cast<double>(batches);
    }
    if ((p.ckpt_interval > 0 && state.step % p.ckpt_interval == 0) || state.step == p.steps)
      checkpoint_now();
    if (!launch.leader) continue;
    nlohmann::json per_rank = nlohmann::json::array();
    for (int64_t k = 0; k < p.pp; ++k) {
      const double* v = mems.data() + 6 * k;
      per_rank.push_back({{"params", v[0]}, {"grads", v[1]}, {"adam", v[2]}, {"activations", v[3]},
                          {"w_queue", v[4]}, {"buffers", v[5]},
                          {"total", v[0] + v[1] + v[2] + v[3] + v[4] + v[5]}});
    }
    metrics->write({{"step", state.step},
                    {"loss", loss},
                    {"lr", lr},
                    {"grad_norm", norm},
                    {"tokens_per_s", tokens_per_step(p) / seconds},
                    {"step_ms", seconds * 1000},
                    {"tokens", state.tokens},
                    {"pp_bubble", bubble},
                    {"pp_bubble_formula", formula},
                    {"pp_bubble_planned", planned},
                    {"pp_wait_ms", wait_max * 1000},
                    {"pp_p2p_bytes", sent},
                    {"pp_peak_in_flight", peaks},
                    {"pp_schedule", pl::schedule_name(sch.kind)},
                    {"peak_rss_bytes", peak_rss_bytes()},
                    {"pp_memory_per_rank", per_rank}});
    if (state.step % cfg.get_int("train.log_interval") == 0 || state.step == p.steps)
      progress.step(state.step, p.steps, loss, lr, norm, tokens_per_step(p) / seconds,
                    seconds * static_cast<double>(p.steps - state.step));
    if (eval_now) {
      result.last_val_loss = vl;
      metrics->write({{"step", state.step}, {"val_loss", vl}});
      progress.line(core::str_cat("step ", state.step, " | val loss ", vl));
    }
  }
  progress.finish();
  result.steps = state.step;
  return result;
}

}  // namespace po::train
