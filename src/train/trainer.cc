// train(): the wiring. Launch (train/launch), data, model and DataParallel,
// paging (train/paging_setup), start from random, weights or the newest
// checkpoint, then the steps (train/train_step) with evaluation, checkpoints
// and reporting (train/rank_records). Every input is validated before
// run.dir is touched.
#include "train/trainer.h"

#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "backend/isa.h"
#include "backend/ops.h"
#include "checkpoint/atomic_file.h"
#include "comm/env.h"
#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"
#include "data/loader.h"
#include "data/token_file.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "optim/schedule.h"
#include "parallel/data_parallel.h"
#include "parallel/pipeline_executor.h"
#include "parallel/tensor_parallel.h"
#include "train/async_checkpoint.h"
#include "train/launch.h"
#include "train/live_metrics.h"
#include "train/metrics.h"
#include "train/paging_setup.h"
#include "train/pipeline_train.h"
#include "train/run_inputs.h"
#include "train/rank_records.h"
#include "train/run_state.h"
#include "train/stop.h"
#include "train/tp_checkpoint.h"
#include "train/train_loop.h"
#include "train/train_step.h"

namespace po::train {
namespace fs = std::filesystem;
namespace ops = po::backend::cpu;
namespace {

// data.train, data.val and model.init name files that exist.
void check_inputs(const core::Config& cfg) {
  PO_CHECK(!cfg.get_string("data.train").empty(), "data.train is not set (a token file from ",
           "`pagedoptim prepare`)");
  for (const char* key : {"data.train", "data.val"}) {
    const std::string& path = cfg.get_string(key);
    std::error_code ec;
    PO_CHECK(path.empty() || fs::is_regular_file(path, ec), key, " = '", path,
             "': no such file (make token files with `pagedoptim prepare`)");
  }
  const std::string& init = cfg.get_string("model.init");
  std::error_code ec;
  PO_CHECK(init == "random" || fs::is_regular_file(init, ec) || fs::is_directory(init, ec),
           "model.init = '", init,
           "': no such file (give \"random\", a .safetensors file, a Hugging Face model "
           "directory or a llama2.c .bin)");
}

// data.val, when set (null otherwise).
std::unique_ptr<data::TokenFile> open_val(const core::Config& cfg,
                                          const model::TransformerConfig& mcfg) {
  if (cfg.get_string("data.val").empty()) return nullptr;
  return std::make_unique<data::TokenFile>(cfg.get_string("data.val"),
                                           static_cast<int32_t>(mcfg.vocab_size));
}

// SFT data: the examples of a token file with a loss mask beside it (data/sft.h), else null.
std::unique_ptr<data::SftExamples> open_sft(const data::TokenFile& file, const Plan& p, bool pack,
                                            const char* key) {
  const std::string mask = data::mask_path(file.path());
  if (!fs::exists(mask)) return nullptr;
  auto sft = std::make_unique<data::SftExamples>(file, data::read_mask_file(mask, file.size()), p.T, pack);
  PO_LOG_INFO(key, ": SFT data, ", sft->examples(), " examples in ", sft->rows(), pack ? " packed" : "",
              " rows of ", p.T, " tokens (the loss counts the replies' tokens, ", mask, ")",
              sft->truncated() > 0 ? core::str_cat("; ", sft->truncated(), " examples cut to ", p.T, " tokens") : "");
  return sft;
}

// Fail now, not at the first evaluation.
void check_val_batch(const data::TokenFile& val, const Plan& p, const data::SftExamples* sft) {
  data::EvalSampler windows(val, p.T, sft);
  PO_CHECK(windows.num_sequences() >= p.micro, "data.val = '", val.path(), "' has ", val.size(),
           " tokens: too few for one validation batch of ", p.micro, " x ", p.T + 1);
}

optim::LrSchedule lr_schedule(const core::Config& cfg, const Plan& p) {
  optim::LrSchedule sched;
  sched.kind = cfg.get_string("train.schedule");
  sched.lr = cfg.get_float("train.lr");
  sched.min_lr = cfg.get_float("train.min_lr");
  sched.warmup_steps = cfg.get_int("train.warmup_steps");
  sched.total_steps = p.steps;
  sched.validate();
  return sched;
}

parallel::DataParallelOptions dp_options(const core::Config& cfg) {
  const bool bf16 = cfg.get_string("train.precision") == "bf16";
  parallel::DataParallelOptions o;
  o.zero_stage = static_cast<int>(cfg.get_int("parallel.zero_stage"));
  o.overlap = cfg.get_bool("parallel.overlap_comm");
  o.packed_rows = cfg.get_bool("data.pack");
  o.bucket_bytes = cfg.get_size("parallel.bucket_size");
  o.prefetch = static_cast<int>(cfg.get_int("parallel.prefetch"));
  o.update_in_backward = cfg.get_bool("memory.update_in_backward");
  o.lend_activations = cfg.get_bool("memory.lend_activations");
  o.param_dtype = bf16 ? tensor::DType::kBF16 : tensor::DType::kF32;
  o.reduce_dtype = cfg.get_string("parallel.reduce_dtype") == "bf16" ? tensor::DType::kBF16
                                                                       : tensor::DType::kF32;
  return o;
}

// This rank's shards under `layout` of `kinds` from checkpoint `path`; at
// tp > 1 through the whole model's layout (train/tp_checkpoint.h).
TrainState load_state(const std::string& path, StepContext& c, const parallel::ShardLayout& layout,
                      const checkpoint::ShardDest& dest,
                      const std::vector<checkpoint::StateKind>& kinds) {
  if (c.tp != nullptr)
    return load_tensor_parallel_checkpoint(path, c.model, layout, dest, c.world, kinds);
  return load_checkpoint_sharded(path, c.model, layout, dest, c.world, kinds);
}

// model.init's weights into this rank's shards: the whole model is read on
// each rank and its shard kept (train/tp_checkpoint.h's shard_unit).
void load_weights_into_shard(const std::string& init, model::Transformer& model) {
  model::Transformer whole(model.config().weights_only(), 1, 1);
  load_model_weights(init, whole);
  float* held = model.params();
  for (int u = 0; u < model.num_units(); ++u)
    shard_unit(model.layout(), whole.layout(), u, whole.params() + whole.unit_offset(u),
               held + model.unit_offset(u));
}

// This rank's Adam state from checkpoint `path` (stage 0: all of it).
// Paged state is not addressable: each unit's shard is loaded into a
// staging buffer and copied into the pages when the next one is asked for.
void load_adam_state(const std::string& path, StepContext& c, int zero_stage) {
  parallel::DataParallel& dp = c.dp;
  optim::AdamW& opt = dp.adam();
  const bool full = zero_stage == 0;  // stage 0 keeps all of m and v on every rank
  const parallel::ShardLayout whole(dp.layout().unit_numels(), 1, 0);
  const parallel::ShardLayout& into = full ? whole : dp.layout();
  std::vector<float> staged;
  std::optional<std::pair<checkpoint::StateKind, int>> pending;
  auto flush = [&] {
    if (!pending) return;
    if (full)
      dp.write_whole_moment(pending->first, pending->second, staged.data());
    else
      dp.write_shard(pending->first, pending->second, staged.data());
    pending.reset();
  };
  load_state(
      path, c, into,
      [&](checkpoint::StateKind k, int u) -> float* {
        if (c.paging || opt.quantized()) {  // into the pages, or recovered (quantized) codes
          flush();
          staged.assign(static_cast<size_t>(into.owned(u)), 0.0f);
          pending = std::make_pair(k, u);
          return staged.data();
        }
        if (full)
          return (k == checkpoint::StateKind::kAdamM ? opt.m() : opt.v()) + c.model.unit_offset(u);
        return k == checkpoint::StateKind::kAdamM ? dp.adam_m_shard(u) : dp.adam_v_shard(u);
      },
      {checkpoint::StateKind::kAdamM, checkpoint::StateKind::kAdamV});
  flush();
  if (dp.quantized_on_load() > 0)
    PO_LOG_INFO(path, ": quantized ", dp.quantized_on_load(), " blocks of Adam's moments to ",
                opt.config().state_bits, " bits (optim.state_bits; the checkpoint holds moments that no ",
                opt.config().state_bits, "-bit codes decode to, as a 32-bit run's do)");
}

// The starting state: the newest checkpoint in `ckpt_dir` when resuming (and
// one is there), otherwise model.init (random or a weights file). Checkpoints
// load into any layout: full parameters first (every stage starts from them;
// ZeRO-3 keeps its shard at shard_params()), then this rank's Adam state.
TrainState start_state(const core::Config& cfg, StepContext& c, const std::string& ckpt_dir,
                       bool resume, uint64_t seed, int zero_stage) {
  TrainState state;
  state.seed = seed;
  const std::string& init = cfg.get_string("model.init");
  const auto existing = list_checkpoints(ckpt_dir);
  const parallel::ShardLayout whole(c.dp.layout().unit_numels(), 1, 0);
  const bool resuming = resume && !existing.empty();
  const bool adapters = c.model.layout().adapters();
  if (adapters) load_base_and_adapters(cfg, c.model, seed);  // also on resume
  if (c.model.base_quantized())
    PO_LOG_INFO("model.quant = ", model::weight_quant_name(c.model.config().quant), ": the base's block linears hold ",
                c.model.quantized_bytes() >> 20, " MiB quantized; ", c.model.released_base_bytes() >> 20,
                " MiB of their f32 values given back");
  if (resuming) {
    state = load_state(
        existing.back(), c, whole,
        [&](checkpoint::StateKind, int u) { return c.model.params() + c.model.unit_offset(u); },
        {checkpoint::StateKind::kParams});
    PO_CHECK(state.seed == seed, existing.back(), ": written with train.seed = ", state.seed,
             ", but the config says ", seed, " (batches would differ)");
    PO_LOG_INFO("resuming from ", existing.back(), " at step ", state.step);
  }
  if (!resuming && init == "random" && zero_stage == 3 && !adapters) {
    // Unit by unit into the shards: the whole fp32 model never exists.
    c.dp.shard_params_from([&](int u, float* dst) { c.model.init_random_unit(seed, u, dst); });
  } else if (!resuming && !adapters) {
    if (init == "random")
      c.model.init_random(seed);
    else if (c.tp != nullptr)
      load_weights_into_shard(init, c.model);
    else
      load_model_weights(init, c.model);
  }
  c.dp.shard_params();  // ZeRO-3: from here on each rank holds only its shard
  if (resuming) {
    load_adam_state(existing.back(), c, zero_stage);
    c.dp.adam().set_steps_taken(state.adam_t);
  }
  return state;
}

// pp = 1's steps for the one loop (train/train_loop.h): the model and
// DataParallel through StepContext.
class OneStageSteps : public LayoutSteps {
 public:
  OneStageSteps(StepContext& c, const std::string& config_toml, size_t predicted, bool leader,
                bool everywhere)
      : c_(c), config_toml_(config_toml), predicted_(predicted), leader_(leader),
        everywhere_(everywhere) {
    size_batch_buffers(c_);
  }

  Outcome step(int64_t step, double lr, const TrainState& after) override {
    const StepStats s = train_step(c_, step, lr);
    RankReport mine = rank_report(c_.dp);
    mine.cp_attention_ms = s.cp_attention_s * 1e3;
    mine.cp_wait_ms = s.cp_wait_s * 1e3;
    const auto records = gather_records(c_.world, mine, s.paging);
    const CommSplit split = comm_split(c_.world, c_.dp.wait_end_ns(), records, s.comm_wait_s);
    Outcome o{s.loss, s.grad_norm, s.seconds, {}};
    if (!leader_) return o;
    o.records.push_back(step_metrics(c_.p, c_.mcfg, c_.peak_gflops, s, after, split, predicted_, records));
    if (c_.paging) o.records.push_back(paging_json(after.step, records));
    return o;
  }

  // ZeRO-3 gathers parameters from every rank, and tensor and context
  // parallel's layers need every rank of their group: then all ranks evaluate.
  bool evaluates_everywhere() const override { return everywhere_; }
  double evaluate(const data::TokenFile& val) override { return train::evaluate(c_, val); }

  // Every rank writes what it owns, in parallel (stage 0: a 1/N slice of the
  // replicated state), and rank 0 commits the manifest.
  double save(const std::string& path, const TrainState& state, AsyncCheckpointer* async) override {
    core::Timer t;
    parallel::DataParallel& dp = c_.dp;
    TrainState st = state;
    st.adam_t = dp.adam().steps_taken();
    std::vector<float> staged;
    const bool staged_moments = c_.paging || dp.adam().quantized();
    const checkpoint::ShardSource source = [&](checkpoint::StateKind k, int u) -> const float* {
      // Copied out of the pages, or decoded from quantized moments, one slice at a time.
      if (staged_moments && (c_.paging || k != checkpoint::StateKind::kParams)) {
        staged.resize(static_cast<size_t>(dp.layout().owned(u)));
        dp.read_shard(k, u, staged.data());
        return staged.data();
      }
      switch (k) {
        case checkpoint::StateKind::kParams: return dp.param_shard(u);
        case checkpoint::StateKind::kAdamM: return dp.adam_m_shard(u);
        case checkpoint::StateKind::kAdamV: return dp.adam_v_shard(u);
      }
      return nullptr;
    };
    const std::vector<checkpoint::StateKind> kinds(checkpoint::kAllStateKinds.begin(),
                                                   checkpoint::kAllStateKinds.end());
    const TensorParallelGroups groups = {c_.tp != nullptr ? &c_.tp->group() : nullptr, c_.data, c_.world};
    if (async != nullptr) {  // copied now, written while training goes on, committed later
      if (c_.tp != nullptr) {  // the whole model's slices, gathered now (the step waits for it)
        const WholeSlices mine = gather_whole_slices(c_.model, dp.layout(), source, groups, kinds);
        const double gathered = t.seconds();
        return gathered + async->start(path,
                                       checkpoint_meta(path, model::Layout(c_.model.config()),
                                                       mine.layout, st, config_toml_),
                                       mine.source());
      }
      return async->start(path, checkpoint_meta(path, c_.model.layout(), dp.layout(), st, config_toml_),
                          source);
    }
    if (c_.tp != nullptr)  // in the whole model's layout, written by tp rank 0 of each data group
      save_tensor_parallel_checkpoint(path, c_.model, dp.layout(), source, st, config_toml_, groups,
                                      kinds);
    else
      save_checkpoint_sharded(path, c_.model, dp.layout(), source, st, config_toml_, c_.world, kinds);
    return t.seconds();
  }

 private:
  StepContext& c_;
  const std::string& config_toml_;
  size_t predicted_;
  bool leader_, everywhere_;
};

// parallel.pp = 1: the model and DataParallel (ZeRO 0-3), tensor and
// context parallel through the model's ParallelOps. Returns with this rank's
// state freed.
TrainResult train_one_stage(const RunInputs& r) {
  const core::Config& cfg = r.cfg;
  const model::TransformerConfig& mcfg = r.mcfg;
  const Plan& p = r.p;
  const Launch& launch = r.launch;
  const std::string& run_dir = r.run_dir;
  const int threads = r.threads;
  PO_CHECK(cfg.get_string("train.trace").empty(), "train.trace (--trace) draws a pipeline's ",
           "step: it needs parallel.pp > 1");
  // At parallel.tp > 1 the model is this rank's shard of every layer.
  // At parallel.cp > 1 it holds T / cp rows of each sequence (ContextSplit).
  const int64_t T_local = p.T / p.cp;
  model::Transformer model(mcfg, p.micro, T_local, {},
                           {static_cast<int>(p.tp), launch.tp_rank});
  std::optional<parallel::TensorParallelOps> tp_ops;
  if (launch.tp_group() != nullptr) model.set_parallel_ops(tp_ops.emplace(*launch.tp_group()));
  std::optional<parallel::ContextParallelOps> cp_ops;
  if (launch.cp_group() != nullptr) {
    model::ParallelOps& inner = tp_ops ? static_cast<model::ParallelOps&>(*tp_ops)
                                       : model::NullParallelOps::instance();
    model.set_parallel_ops(cp_ops.emplace(*launch.cp_group(),
                                          parallel::parse_cp_mode(cfg.get_string("parallel.cp_mode")),
                                          cfg.get_string("parallel.cp_balance") == "zigzag", inner));
  }
  model.set_tp_overlap(cfg.get_bool("parallel.tp_overlap"));
  parallel::DataParallelOptions dpo = dp_options(cfg);
  dpo.micro_batches = p.accum;
  parallel::DataParallel dp(model, r.adam, launch.dp_group(), dpo);
  StepContext c{p, mcfg, model, dp, launch.world.get(), r.sampler, launch.dp_rank};
  c.val_sft = r.val_sft;
  c.seed = r.seed;
  c.data = launch.dp_group();
  c.tp = tp_ops ? &*tp_ops : nullptr;
  if (cp_ops) {
    c.cp = cp_ops->cp_split();
    c.context = launch.cp_group();
    c.cpo = &*cp_ops;
  }
  c.paging = setup_paging(cfg, dp, mcfg, p, launch.rank);
  dp.set_tensor_group(launch.tp_group());
  TrainState state = start_state(cfg, c, (fs::path(run_dir) / "checkpoints").string(), r.resume,
                                 r.seed, dpo.zero_stage);
  keep_threads(state, r.threads, launch.leader);
  LoopSetup l = loop_setup(r);
  std::optional<AsyncCheckpointer> async;
  if (cfg.get_bool("checkpoint.async")) {
    // Tensor parallel: tp rank 0 of each data group writes the whole model's
    // slices over the data group (tp_checkpoint.h); every rank agrees.
    std::optional<parallel::ShardLayout> file;
    // The data group is dp × cp ranks at context parallel.
    const int data_ranks = static_cast<int>(p.dp * p.cp);
    if (p.tp == 1)
      file.emplace(dp.layout());
    else if (launch.tp_rank == 0)
      file.emplace(mcfg.unit_numels(), data_ranks, launch.dp_group() ? launch.dp_group()->rank() : 0);
    l.async = &async.emplace(c.world, file ? &*file : nullptr, data_ranks,
                             std::vector<checkpoint::StateKind>(checkpoint::kAllStateKinds.begin(),
                                                                checkpoint::kAllStateKinds.end()),
                             c.paging && p.tp == 1);
    PO_LOG_INFO("checkpoint.async: ", l.async->host_bytes() >> 20, " MiB of host memory hold a checkpoint's copy");
  }
  if (l.leader) {
    prepare_run_dir(run_dir, r.resume);
    checkpoint::write_file_atomic((fs::path(run_dir) / "config.toml").string(),
                                  r.config_toml.data(), r.config_toml.size());
  }

  // MFU is against the GEMM peak of the precision the step runs in (the bf16
  // GEMM's on bf16 operands in a bf16 run), measured here unless configured.
  c.peak_gflops = gemm_peak_gflops(cfg);
  // The compute budget holds from here on (set up is done: the whole fp32
  // model has given way to shards, the GEMM probe's matrices are freed).
  if (c.paging)
    tensor::set_pool_budget(tensor::Pool::kCompute, cfg.get_size("memory.compute_budget"));
  // The memory ledger: this rank's model states (DESIGN.md's formulas for the
  // stage and precision) + activations. Working buffers (gathers,
  // accumulators, buckets) are not predicted here; the planner does that.
  size_t predicted = dp.predicted_model_state_bytes() +
                model::Transformer::predicted_activation_bytes(mcfg, p.micro, T_local, p.tp);
  if (cp_ops) {  // the ring's buffers, in the compute pool from the first forward
    const model::TransformerConfig& local = model.local_config();
    predicted += parallel::ContextParallelOps::predicted_buffer_bytes(
        parallel::parse_cp_mode(cfg.get_string("parallel.cp_mode")), static_cast<int>(p.cp),
        p.micro, T_local, local.n_kv_head * local.head_dim());
  }
  PO_LOG_INFO("model ", mcfg.n_layer, "L/", mcfg.n_embd, "C/", mcfg.n_head, "H vocab ",
              mcfg.vocab_size, " seq ", p.T, ": ", mcfg.num_params(), " parameters",
              p.tp > 1 ? core::str_cat(" (", model.num_params(), " per tensor-parallel rank of ",
                                       p.tp, ")")
                       : std::string(),
              p.cp > 1 ? core::str_cat("; context parallel: ", T_local, " positions per rank of ",
                                       p.cp, " (", cfg.get_string("parallel.cp_balance"), ", ",
                                       cfg.get_string("parallel.cp_mode"), ")")
                       : std::string(),
              "; batch ", p.batch, " = ", p.accum, " x ", p.micro, "; ", threads, " threads per rank, kernels ",
              ops::isa_description(), ", BLAS ", ops::blas_name(), " (", gemm_peak_note(cfg, c.peak_gflops), ")");
  if (l.leader && cp_ops) {
    const model::TransformerConfig& local = model.local_config();
    PO_LOG_INFO("context parallel: ", T_local, " of ", p.T, " positions per rank; the ",
                cfg.get_string("parallel.cp_mode"), "'s buffers ",
                parallel::ContextParallelOps::predicted_buffer_bytes(
                    parallel::parse_cp_mode(cfg.get_string("parallel.cp_mode")),
                    static_cast<int>(p.cp), p.micro, T_local, local.n_kv_head * local.head_dim()),
                " bytes per rank (besides the table)");
  }
  if (l.leader && p.tp > 1)
    PO_LOG_INFO("activations saved per layer: ",
                model::Transformer::predicted_layer_bytes(mcfg, p.micro, T_local, p.tp),
                " bytes per rank (parallel.tp = ", p.tp, ", sequence parallel ",
                model.sequence_shards() > 1 ? "on" : "off", ")");
  {
    // Gradients as the steps will hold them (allocated at their first use).
    const auto rows = gather_setup_records(launch.world.get(), dp);
    if (l.leader)
      PO_LOG_INFO(memory_table(rows, "(grads and total: as the steps will hold them; gradients "
                                     "are allocated at their first use)"));
  }
  // From here "peak" is the training steps' own (the planner's prediction).
  tensor::reset_pool_peak(tensor::Pool::kCompute);
  OneStageSteps steps(c, r.config_toml, predicted, launch.leader,
                      dpo.zero_stage == 3 || p.tp > 1 || p.cp > 1);
  return run_steps(steps, l, state);
}

}  // namespace

void check_config(const core::Config& cfg) { (void)make_plan(cfg, resolve_model_config(cfg)); }

TrainResult train(const core::Config& cfg) {
  const model::TransformerConfig mcfg = resolve_model_config(cfg);
  const Plan p = make_plan(cfg, mcfg);
  const std::string run_dir = cfg.get_string("run.dir");
  const bool resume = cfg.get_bool("train.resume");
  const uint64_t seed = static_cast<uint64_t>(cfg.get_int("train.seed"));
  // From here a stop request is a checkpoint after the current step (train/stop.h).
  // Under mpirun a SIGTERM is mpirun aborting the job (a rank died): it ends
  // the process at once; mpirun forwards the stop signal.
  const StopRequests stop_requests(
      stop_signal_number(cfg.get_string("train.stop_signal"), "train.stop_signal"), cfg.get_float("train.stop_timeout"),
      comm::detect_launch_env().source != comm::LaunchSource::kOpenMpi);
  // One that came while the process started: a stop after the first step.
  if (const int early = release_early_signals()) raise(early);
  const Launch launch(cfg, p);
  // train.metrics_port: rank 0 serves the run's latest metrics.
  std::optional<LiveMetrics> live;
  if (launch.leader && cfg.get_int("train.metrics_port") > 0) {
    live.emplace(cfg.get_string("train.metrics_host"), static_cast<int>(cfg.get_int("train.metrics_port")));
    PO_LOG_INFO("metrics: http://", cfg.get_string("train.metrics_host"), ":", live->port(), "/metrics");
  }
  const int threads = setup_compute(cfg, launch.local_ranks);

  // Validate every input before touching run.dir.
  check_inputs(cfg);
  data::TokenFile train_data(cfg.get_string("data.train"), static_cast<int32_t>(mcfg.vocab_size));
  const std::unique_ptr<data::TokenFile> val_data = open_val(cfg, mcfg);
  const bool pack = cfg.get_bool("data.pack");
  const std::unique_ptr<data::SftExamples> train_sft = open_sft(train_data, p, pack, "data.train");
  const std::unique_ptr<data::SftExamples> val_sft = val_data ? open_sft(*val_data, p, pack, "data.val") : nullptr;
  PO_CHECK(!pack || train_sft, "data.pack = true packs SFT examples, but data.train = '", train_data.path(),
           "' has no loss mask beside it (", data::mask_path(train_data.path()),
           "; write both with pagedoptim prepare --sft)");
  PO_CHECK(!val_data || !train_sft == !val_sft, "data.val = '", cfg.get_string("data.val"), "' ",
           val_sft ? "has" : "has no", " loss mask beside it but data.train ", train_sft ? "has" : "has none",
           ": validate SFT data on SFT data (both from pagedoptim prepare --sft)");
  data::BatchSampler sampler(train_data, p.T, seed, train_sft.get());
  if (val_data) check_val_batch(*val_data, p, val_sft.get());
  const optim::LrSchedule sched = lr_schedule(cfg, p);

  core::Config stored = cfg;
  store_resolved_model(stored, mcfg);
  const RunInputs run{cfg, mcfg, p, launch, sampler, sched, val_data.get(), val_sft.get(),
                      optim::adamw_config(cfg), run_dir, stored.to_toml(), seed, resume, threads};
  // parallel::one_stage_executor(): pp = 1 through the pipeline executor as
  // its one-stage schedule, the migration's switch (issue 35: one gradient
  // engine), which holds the layouts it covers to DataParallel's bits
  // (tests/train/one_stage_executor_launch_test.cc) until it is the only path.
  TrainResult result = p.pp > 1 || parallel::one_stage_executor() ? train_pipeline(run) : train_one_stage(run);
  // Stopped on request: every rank leaves together, once rank 0 has reported
  // and every rank has freed its state (its swap files removed): mpirun ends
  // the job when the first rank exits non-zero, killing the others wherever
  // they are, and the --nproc launcher returns when mpirun does.
  if (result.stopped_by != 0) {
    if (result.leader)  // before the barrier: once another rank exits, mpirun may end this one
      std::fprintf(stderr,
                   "pagedoptim: stopped on request after step %lld; checkpoint written; exit %d "
                   "(resume with --resume)\n",
                   static_cast<long long>(result.steps), kExitResume);
    if (launch.world != nullptr) launch.world->ibarrier().wait();
  }
  return result;
}

}  // namespace po::train
