// The pipelined trainer (pipeline_train.h).
#include "train/pipeline_train.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <filesystem>
#include <memory>
#include <numeric>
#include <optional>
#include <vector>

#include "backend/isa.h"
#include "backend/ops.h"
#include "checkpoint/model_io.h"
#include "checkpoint/atomic_file.h"
#include "checkpoint/outer_file.h"
#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"
#include "parallel/pipeline_executor.h"
#include "parallel/pipeline_stages.h"
#include "parallel/shard_layout.h"
#include "parallel/tensor_parallel.h"
#include "train/async_checkpoint.h"
#include "train/metrics.h"
#include "train/outer_sync.h"
#include "train/model_setup.h"
#include "train/paging_setup.h"
#include "train/rank_records.h"
#include "train/run_state.h"
#include "train/stop.h"
#include "train/tp_checkpoint.h"
#include "train/train_loop.h"
#include "train/train_step.h"

namespace po::train {
namespace fs = std::filesystem;
namespace pl = parallel::pipeline;
using tensor::DType;

namespace {

parallel::PipelineSetup pipeline_setup(const RunInputs& r, model::ParallelOps* tp_ops) {
  const core::Config& cfg = r.cfg;
  parallel::PipelineSetup s;
  const pl::ScheduleKind kind = pl::parse_schedule(cfg.get_string("parallel.schedule"));
  const int v = pl::chunks_per_rank(kind, static_cast<int>(cfg.get_int("parallel.virtual_stages")));
  pl::Pipeline pipe = pl::make_pipeline(r.mcfg, r.p.T, kind, static_cast<int>(r.p.pp),
                                        static_cast<int>(r.p.accum), v,
                                        cfg.get_bool("parallel.vocab_parallel"),
                                        cfg.get_string("parallel.stage_layers"));
  s.schedule = std::move(pipe.schedule);
  s.stage_units = std::move(pipe.stages);
  s.micro = r.p.micro;
  s.T = r.p.T / r.p.cp;  // context parallel: this rank's rows of each sequence
  s.pipe = r.launch.pp_group();
  s.data = r.launch.dp_group();
  s.tensor = r.launch.tp_group();
  s.tp_ops = tp_ops;
  s.split = {static_cast<int>(r.p.tp), r.launch.tp_rank};
  s.tp_overlap = cfg.get_bool("parallel.tp_overlap");
  s.zero_stage = static_cast<int>(cfg.get_int("parallel.zero_stage"));
  s.bf16 = cfg.get_string("train.precision") == "bf16";
  s.reduce_bf16 = cfg.get_string("parallel.reduce_dtype") == "bf16";
  s.defer_lookup = parallel::defers_lookup(r.mcfg, static_cast<int>(r.p.dp), cfg.get_bool("parallel.overlap_comm"),
                                           static_cast<int>(r.p.cp), s.zero_stage, cfg.get_bool("data.pack"));
  s.dp = static_cast<int>(r.p.dp * r.p.cp);  // the data group spans dp × cp (the executor takes its size)
  s.overlap_comm = cfg.get_bool("parallel.overlap_comm");
  s.prefetch = static_cast<int>(cfg.get_int("parallel.prefetch"));
  s.lend_activations = cfg.get_bool("memory.lend_activations");
  s.paged = pages_state(cfg);
  s.update_in_backward = cfg.get_bool("memory.update_in_backward");
  s.bucket_bytes = cfg.get_size("parallel.bucket_size");
  s.adam = r.adam;
  return s;
}

// This rank's place in the pipeline group (0 at pp = 1, which has none).
int pipe_rank(const comm::Communicator* pipe) { return pipe != nullptr ? pipe->rank() : 0; }

// An all-gather over the pipeline group of `words` 4-byte words a rank (bits
// as they are); at pp = 1 this rank's own.
void gather_pipe(comm::Communicator* pipe, const void* mine, void* all, size_t words) {
  if (pipe != nullptr) return pipe->all_gather(mine, all, words, DType::kI32);
  std::memcpy(all, mine, words * 4);
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

// A checkpoint's writers: every rank, each writing its cut of its stage's
// units over the stage's data × tensor ranks (ShardLayout::stage_units), at
// every pp and tp: nothing is funnelled to one rank. Writer g·W + d·TP + t
// is data rank d, tensor rank t of pipeline rank g (W = D × TP ranks a
// stage, D a data group); `group` holds them in that order. (Until
// 2026-12-07 each tensor group's rank 0 wrote the group's part.)
struct Writers {
  std::unique_ptr<comm::Communicator> group;  // null in one process
  parallel::ShardLayout file;                 // this rank's cut
  int count = 1;
  int per_stage = 1;  // W
  int index = 0;      // this rank's, g·W + d·TP + t
};

// The checkpoint files' cut (above); collective over the world.
Writers checkpoint_writers(const RunInputs& r, const parallel::PipelineExecutor& ex,
                           const parallel::PipelineSetup& s) {
  const model::Layout& held = ex.layout();
  const int D = s.data != nullptr ? s.data->size() : 1, TP = static_cast<int>(r.p.tp);
  const int W = D * TP;
  const int index = pipe_rank(s.pipe) * W + (s.data ? s.data->rank() : 0) * TP + r.launch.tp_rank;
  std::vector<int> owner;
  for (int u = 0; u < held.num_units(); ++u) owner.push_back(owner_of(s, held, u));
  return {r.launch.world ? r.launch.world->split(0, index, "writers") : nullptr,
          parallel::ShardLayout::stage_units(model::Layout(ex.config()).unit_numels(), std::move(owner),
                                             s.schedule.ranks, W, index),
          s.schedule.ranks * W, W, index};
}

// This writer's slices of its stage's units (a collective over the world):
// per unit and kind, the stage that holds the unit makes it whole on its
// ranks: its ZeRO shards all-gathered over each data group (read_unit), its
// tensor-parallel shards over the tensor group, assembled on every tensor
// rank (gather_whole_unit), each keeping its cut. Nothing crosses the
// pipeline. At tp = 1 with the ZeRO cut the file's (local_parts), each
// writer reads its slice where it lies, and nothing is gathered at all.
struct StageState {
  model::Layout whole;
  const parallel::ShardLayout* file;  // the writer's cut
  std::vector<float> all[3];                    // kAllStateKinds' order, at file->local_offset
  checkpoint::ShardSource source() const {
    return [this](checkpoint::StateKind k, int u) -> const float* {
      return all[static_cast<size_t>(k)].data() + file->local_offset(u);
    };
  }
};

StageState gather_stage(const RunInputs& r, parallel::PipelineExecutor& ex, const parallel::PipelineSetup& s,
                        const Writers& writers, int kinds = 3, const std::function<bool(int)>& wanted = {}) {
  const model::Layout& held = ex.layout();
  StageState out{model::Layout(ex.config()), &writers.file, {}};
  const model::Layout& whole = out.whole;
  const int U = held.num_units(), tp = static_cast<int>(r.p.tp);
  const int prank = pipe_rank(s.pipe);
  comm::Communicator* tensor = r.launch.tp_group();
  for (int k = 0; k < kinds; ++k) out.all[k].resize(static_cast<size_t>(out.file->local_numel()));
  // Every tp rank's held layout, for the assembly.
  const std::vector<model::Layout> tp_layouts =
      tp > 1 ? tp_rank_layouts(ex.config(), tp) : std::vector<model::Layout>{};
  // Each writer's slice is within its own ZeRO cut: read there, nothing gathered.
  const bool own = tp == 1 && ex.local_parts();
  std::vector<float> unit, assembled;
  for (int u = 0; u < U; ++u) {
    if (owner_of(s, held, u) != prank || (wanted && !wanted(u))) continue;
    const auto n = static_cast<size_t>(held.unit_numel(u));
    for (int k = 0; k < kinds; ++k) {
      const checkpoint::StateKind kind = checkpoint::kAllStateKinds[static_cast<size_t>(k)];
      if (own) {
        ex.read_unit_part(kind, u, out.file->begin(u), out.file->end(u), out.all[k].data() + out.file->local_offset(u));
        continue;
      }
      unit.resize(n);
      ex.read_unit(kind, u, unit.data());
      if (tp > 1)
        gather_whole_unit(*tensor, tp_layouts, whole, u, unit.data(), static_cast<int64_t>(n), assembled);
      else
        assembled = unit;
      std::copy(assembled.begin() + out.file->begin(u), assembled.begin() + out.file->end(u),
                out.all[k].data() + out.file->local_offset(u));
    }
  }
  return out;
}

// The whole model's checkpoint, in the layout-independent format (a
// collective over the world): gather_stage, then every writer writes its
// slices, in parallel, and writer 0 commits the manifest. With `async`, the
// writers' copies are written in the background (train/async_checkpoint.h)
// and committed later; returns the seconds the step was held.
double save_pipeline(const RunInputs& r, parallel::PipelineExecutor& ex, const parallel::PipelineSetup& s,
                     const Writers& writers, TrainState st, const std::string& path, AsyncCheckpointer* async) {
  core::Timer t;
  st.adam_t = ex.adam_steps();
  const StageState w = gather_stage(r, ex, s, writers);
  const std::vector<checkpoint::StateKind> kinds(checkpoint::kAllStateKinds.begin(), checkpoint::kAllStateKinds.end());
  if (async != nullptr) {
    const double gathered = t.seconds();
    return gathered + async->start(path, checkpoint_meta(path, w.whole, *w.file, st, r.config_toml), w.source());
  }
  std::exception_ptr error;
  try {
    save_checkpoint_sharded(path, w.whole, *w.file, w.source(), st, r.config_toml, writers.group.get(), kinds);
  } catch (...) {
    error = std::current_exception();
  }
  checkpoint::agree_on_success(r.launch.world.get(), error, path + ": saving");
  return t.seconds();
}

// Every rank reads the whole model's units and keeps its tensor-parallel
// shard of the ones it holds (write_unit keeps its ZeRO-1 shard of m and v).
TrainState load_pipeline(parallel::PipelineExecutor& ex, const std::string& path,
                         comm::Communicator* world) {
  const model::Layout& held = ex.layout();
  const model::Layout whole(ex.config());
  const parallel::ShardLayout one(whole.unit_numels(), 1, 0);
  // The loader fills one whole unit at a time; the previous one is complete
  // when the next is asked for (and at the end).
  std::vector<float> staged, unit;
  std::optional<std::pair<checkpoint::StateKind, int>> pending;
  auto flush = [&] {
    if (!pending) return;
    const auto [k, u] = *pending;
    pending.reset();
    if (!ex.holds(u)) return;
    unit.resize(static_cast<size_t>(held.unit_numel(u)));
    shard_unit(held, whole, u, staged.data(), unit.data());  // a copy at tp = 1
    ex.write_unit(k, u, unit.data());
  };
  const TrainState st = load_checkpoint_sharded(
      path, whole, one,
      [&](checkpoint::StateKind k, int u) -> float* {
        flush();
        staged.assign(static_cast<size_t>(whole.unit_numel(u)), 0.0f);
        pending = std::make_pair(k, u);
        return staged.data();
      },
      world, {checkpoint::kAllStateKinds.begin(), checkpoint::kAllStateKinds.end()});
  flush();
  ex.set_adam_steps(st.adam_t);
  ex.sync_replica();
  if (ex.quantized_on_load() > 0)
    PO_LOG_INFO(path, ": quantized ", ex.quantized_on_load(), " blocks of Adam's moments to ",
                ex.adam_config().state_bits, " bits (optim.state_bits; the checkpoint holds moments that no ",
                ex.adam_config().state_bits, "-bit codes decode to, as a 32-bit run's do)");
  return st;
}

// model.init's weights: the whole model read on every rank, the tensor
// shards of its units kept.
void load_init(parallel::PipelineExecutor& ex, const model::TransformerConfig& mcfg,
               const std::string& init) {
  model::Transformer whole(mcfg.weights_only(), 1, 1);
  checkpoint::load_model_weights(init, whole);
  std::vector<float> unit;
  for (int u = 0; u < whole.num_units(); ++u) {
    if (!ex.holds(u)) continue;
    unit.resize(static_cast<size_t>(ex.layout().unit_numel(u)));
    shard_unit(ex.layout(), whole.layout(), u, whole.params() + whole.unit_offset(u), unit.data());
    ex.write_unit(parallel::PipelineExecutor::State::kParams, u, unit.data());
  }
  ex.sync_replica();
}

// The outer step's way back (train/outer_sync.h): every writer's slice of
// the units `wanted` of its stage, gathered over the stage's writers into
// whole units, each rank keeping its tensor shard as a checkpoint load does
// (write_unit: its ZeRO shard, a bf16 stage's rounded copy).
void scatter_stage(parallel::PipelineExecutor& ex, const parallel::PipelineSetup& s, const Writers& writers,
                   comm::Communicator* stage, const float* slice, const std::function<bool(int)>& wanted,
                   parallel::PipelineExecutor::State kind = parallel::PipelineExecutor::State::kParams) {
  const model::Layout& held = ex.layout();
  const model::Layout whole(ex.config());
  const int prank = pipe_rank(s.pipe);
  const parallel::ShardLayout& file = writers.file;
  std::vector<float> send, all, unit;
  for (int u = 0; u < held.num_units(); ++u) {
    if (owner_of(s, held, u) != prank || !wanted(u)) continue;
    const int64_t n = whole.unit_numel(u);
    if (stage != nullptr) {  // the writers' slices lie at W strides of the unit, in writer order
      const int64_t S = file.stride(u);
      send.assign(static_cast<size_t>(S), 0.0f);
      std::copy_n(slice + file.local_offset(u), file.owned(u), send.begin());
      all.resize(static_cast<size_t>(S * stage->size()));
      stage->all_gather(send.data(), all.data(), static_cast<size_t>(S), DType::kF32);
    } else {
      all.assign(slice + file.local_offset(u), slice + file.local_offset(u) + n);
    }
    unit.resize(static_cast<size_t>(held.unit_numel(u)));
    shard_unit(held, whole, u, all.data(), unit.data());
    ex.write_unit(kind, u, unit.data());
  }
  ex.sync_replica();
}

// DiLoCo inside the job (train.local_steps; train/outer_sync.h): the outer
// state of this rank's checkpoint slice, and its stage's writers.
struct Outer {
  std::unique_ptr<comm::Communicator> stage;  // the stage's W writers in writer order (null: W = 1)
  std::unique_ptr<OuterSync> sync;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> ranges;  // per fragment: (offset, count) in the slice
  int fragments = 1;
  bool wanted(int u, int f) const { return u % fragments == f; }
};

std::unique_ptr<Outer> make_outer(const RunInputs& r, parallel::PipelineExecutor& ex, const parallel::PipelineSetup& s,
                                  const Writers& writers) {
  auto o = std::make_unique<Outer>();
  const OuterOptions opts = outer_options(r.cfg, r.launch.job() ? r.launch.job()->rank() : 0);
  o->fragments = opts.fragments;
  if (r.launch.world && writers.per_stage > 1)
    o->stage = r.launch.world->split(pipe_rank(s.pipe), writers.index % writers.per_stage,
                                     core::str_cat("stage", pipe_rank(s.pipe), "-writers"));
  const StageState w = gather_stage(r, ex, s, writers, 1);
  const parallel::ShardLayout& file = writers.file;
  o->ranges.resize(static_cast<size_t>(opts.fragments));
  for (int u = 0; u < file.num_units(); ++u)
    if (file.owned(u) > 0)
      o->ranges[static_cast<size_t>(u % opts.fragments)].emplace_back(file.local_offset(u), file.owned(u));
  o->sync = std::make_unique<OuterSync>(opts, r.launch.across.get(), file.local_numel(), w.all[0].data());
  if (r.launch.leader)
    PO_LOG_INFO("outer step every ", opts.local_steps, " steps over ", r.p.replicas, " replica",
                r.p.replicas > 1 ? "s" : "", ": ", optim::outer_kind_name(opts.outer.kind), " at lr ", opts.outer.lr,
                ", momentum ", opts.outer.momentum, ", exchanged in ", r.cfg.get_string("outer.exchange_dtype"),
                opts.fragments > 1 ? core::str_cat(", ", opts.fragments, " fragments") : std::string(),
                "; its state ", o->sync->paged() ? "in pages on memory.nvme_dir" : "in memory");
  return o;
}

// A DiLoCo checkpoint's side files (checkpoint/outer_file.h): beside
// checkpoints/step_N, diloco/step_N/replica<ρ>-writer<k>.bin, one per rank:
// replica 0's hold the outer state of the writer's slice (the same on every
// replica), the others' their replica's parameters, m and v of the slice
// (replica 0's are the checkpoint itself).
std::string side_file(const std::string& ckpt, int replica, int writer) {
  const fs::path c(ckpt);
  return (c.parent_path().parent_path() / "diloco" / c.filename() /
          core::str_cat("replica", replica, "-writer", writer, ".bin")).string();
}
constexpr const char* kSideKinds[3] = {"params", "adam_m", "adam_v"};

void load_outer(const RunInputs& r, parallel::PipelineExecutor& ex, const parallel::PipelineSetup& s,
                const Writers& writers, Outer& outer, const std::string& ckpt) {
  const std::string mine = side_file(ckpt, 0, writers.index);
  PO_CHECK(fs::exists(mine), ckpt, ": a checkpoint of a run with train.local_steps, but its DiLoCo state ", mine,
           " is missing (resume with the parallel layout that wrote it: parallel.replicas, dp, tp, pp, cp)");
  outer.sync->load(checkpoint::read_outer_file(mine), mine);
  if (r.launch.replica == 0) return;
  const std::string path = side_file(ckpt, r.launch.replica, writers.index);
  const checkpoint::OuterFile f = checkpoint::read_outer_file(path);
  for (int k = 0; k < 3; ++k) {
    const std::vector<float>& a = f.array(kSideKinds[k], path);
    PO_CHECK(static_cast<int64_t>(a.size()) == writers.file.local_numel(), path, ": ", kSideKinds[k], " of ", a.size(),
             " elements where this rank's slice is ", writers.file.local_numel(),
             " (resume with the parallel layout that wrote it)");
    scatter_stage(ex, s, writers, outer.stage.get(), a.data(), [](int) { return true; },
                  checkpoint::kAllStateKinds[static_cast<size_t>(k)]);
  }
}

// Adapters (lora.r > 0): the frozen base and the adapters on it, made on
// every rank as a one-stage run makes them (load_base_and_adapters: model.init's
// weights or the random base, quantized with model.quant, then the adapters
// from train.seed or lora.init), so every layout starts from the same bits.
// Each rank keeps its chunks' part of the base; the adapters are written as
// parameters unless a checkpoint's follow (`params`).
void load_base(parallel::PipelineExecutor& ex, const core::Config& cfg, const model::TransformerConfig& mcfg,
               uint64_t seed, bool params) {
  model::TransformerConfig wc = mcfg.weights_only();
  wc.inference = true;  // it never runs
  model::Transformer whole(wc, 1, 1);
  load_base_and_adapters(cfg, whole, seed);
  ex.set_base(whole);
  if (!params) return;
  for (int u = 0; u < whole.num_units(); ++u)
    if (ex.holds(u)) ex.write_unit(parallel::PipelineExecutor::State::kParams, u, whole.params() + whole.unit_offset(u));
  ex.sync_replica();
}

double mean_of(const std::vector<double>& v) {
  return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

// Context parallel's ring buffers on a rank (allocated at the first
// forward; 0 at parallel.cp = 1).
size_t context_bytes(const core::Config& cfg, const model::TransformerConfig& mcfg,
                     const parallel::PipelineSetup& setup) {
  if (cfg.get_int("parallel.cp") <= 1) return 0;
  const model::TransformerConfig local = mcfg.shard(setup.split.size);
  return parallel::ContextParallelOps::predicted_buffer_bytes(
      parallel::parse_cp_mode(cfg.get_string("parallel.cp_mode")), static_cast<int>(cfg.get_int("parallel.cp")),
      setup.micro, setup.T, local.n_kv_head * local.head_dim());
}

// The set-up's memory table, for the log: what each pipeline rank will hold
// after a step (PipelineExecutor::predict, at data rank 0; the step records'
// pp_memory_per_rank measure the same kinds). Paged state's frames are
// counted where the pages are set up, not here.
std::string predicted_memory_table(const core::Config& cfg, const model::TransformerConfig& mcfg,
                                   const parallel::PipelineSetup& setup) {
  const size_t context = context_bytes(cfg, mcfg, setup);
  std::vector<std::vector<uint64_t>> rows;
  for (int r = 0; r < setup.schedule.ranks; ++r) {
    const parallel::PipelineExecutor::Memory m = parallel::PipelineExecutor::predict(mcfg, setup, r);
    rows.push_back({m.params, m.grads, m.master, m.adam, m.activations, m.w_queue, m.buffers, m.frozen, context,
                    m.total() + context});
  }
  return memory_table("memory per pipeline rank (MiB), predicted after a step:",
                      {"params", "grads", "master", "adam", "activations", "w_queue", "buffers", "frozen", "context",
                       "total"},
                      rows);
}

// The pipeline's steps for the one loop (train/train_loop.h).
class PipelineSteps : public LayoutSteps {
 public:
  PipelineSteps(const RunInputs& r, parallel::PipelineExecutor& ex, const parallel::PipelineSetup& setup,
                const model::ContextSplit& cp, parallel::TensorParallelOps* tp_ops,
                parallel::ContextParallelOps* cp_ops, bool paged, const Writers& writers, double peak_gflops,
                Outer* outer)
      : r_(r), p_(r.p), ex_(ex), setup_(setup), writers_(writers), cp_(cp), tp_ops_(tp_ops), cp_ops_(cp_ops),
        paged_(paged), peak_gflops_(peak_gflops), outer_(outer),
        pipe_(r.launch.pp_group()), trace_(r.cfg.get_string("train.trace")),
        in_(static_cast<size_t>(p_.micro * p_.T)), tg_(in_.size()) {
    const pl::Schedule& sch = setup.schedule;
    // The ledger's prediction for this rank (the step records' predicted_bytes):
    // its model states and activations, the context ring's buffers.
    const parallel::PipelineExecutor::Memory m = parallel::PipelineExecutor::predict(r.mcfg, setup, ex.rank());
    predicted_ = m.params + m.grads + m.master + m.adam + m.frozen + m.activations + m.w_queue +
                 context_bytes(r.cfg, r.mcfg, setup);
    formula_ = pl::formula_bubble(sch.kind, sch.ranks, sch.micro_batches, sch.chunks);
    planned_ = pl::simulate(sch).bubble();
    // The same with each stage's FLOP costs: what the stages' imbalance leaves.
    costed_ = pl::simulate(sch, pl::stage_costs(r.mcfg, p_.T, setup.stage_units, sch.vocab ? sch.ranks : 0))
                  .bubble();
    PO_LOG_INFO("pipeline: ", pl::schedule_name(sch.kind), " over ", p_.pp, " stages",
                sch.chunks > 1 ? core::str_cat(" × ", sch.chunks, " chunks") : std::string(), ", ",
                p_.accum, " micro-batches of ", p_.micro, "; bubble by formula ", formula_,
                ", as planned ", planned_, "; ", r.threads, " threads per rank, kernels ",
                backend::cpu::isa_description(), " (", gemm_peak_note(r.cfg, peak_gflops), ")");
    if (cp_.size > 1) {  // whole sequences, cut into this rank's rows
      seq_in_.resize(in_.size());
      seq_tg_.resize(in_.size());
    }
    if (r.cfg.get_bool("data.pack")) {  // (cp 1: packing is refused at cp > 1)
      pin_.resize(in_.size());
      ptg_.resize(in_.size());
      pos_.resize(in_.size());
    }
  }

  Outcome step(int64_t step, double lr, const TrainState& after) override {
    core::Timer step_timer;
    const pl::Schedule& sch = setup_.schedule;
    const int rank = r_.launch.dp_rank;
    const bool sft = r_.sampler.sft() != nullptr;
    const int64_t base = r_.launch.replica * p_.batch;  // this replica's batch in the step's
    const double counted = step_targets(r_.sampler, p_, step, base);  // (train_step.h)
    const float grad_scale = static_cast<float>(1.0 / counted);
    // The executor's collectives on its data and tensor groups, this step.
    comm::Communicator* groups[2] = {setup_.data, setup_.tensor};
    comm::Traffic traffic[2];
    for (int g = 0; g < 2; ++g)
      if (groups[g] != nullptr) traffic[g] = groups[g]->traffic();
    comm::Traffic cp_before;
    if (cp_ops_ != nullptr) cp_before = r_.launch.cp_group()->traffic();
    ex_.begin_step(lr);  // (memory.update_in_backward updates pages at it during the backward)
    const parallel::PipelineStepStats st = ex_.forward_backward(
        [&](int micro, int32_t* inputs, int32_t* targets) {
          fill_rows(inputs, targets, [&](int32_t* i, int32_t* t) {
            r_.sampler.fill(step, base + (rank * p_.accum + micro) * p_.micro, p_.micro, i, t);
          });
        },
        grad_scale,
        [&](int micro, model::Transformer& m) {
          const int64_t first = base + (rank * p_.accum + micro) * p_.micro;
          m.set_dropout(r_.seed, step, first);  // (no-op without lora.dropout)
          if (pos_.empty()) return;
          // Packed rows: every stage's positions (its attention and, on the first, the position table's)
          r_.sampler.fill(step, first, p_.micro, pin_.data(), ptg_.data(), pos_.data());
          m.set_positions(pos_.data());
        });
    const double norm = ex_.step(lr);
    for (int g = 0; g < 2; ++g)
      if (groups[g] != nullptr) traffic[g] = groups[g]->traffic().since(traffic[g]);
    // The loss: the last stage's, then summed over the replicas as pp = 1 does.
    double loss = 0;
    {
      std::vector<double> sums(static_cast<size_t>(p_.pp));
      gather_pipe(pipe_, &st.loss_sum, sums.data(), 2);  // doubles, bit-exact
      loss = sums[static_cast<size_t>(sch.rank_of(sch.stages() - 1))];
    }
    if (comm::Communicator* data = r_.launch.dp_group(); data != nullptr) {
      float l = static_cast<float>(loss);
      data->allreduce(&l, 1, DType::kF32, comm::ReduceOp::kSum);
      loss = l;
    }
    // cp ranks: means over their own tokens; SFT: each a micro-batch's sum over its rows.
    loss = sft ? loss * static_cast<double>(p_.micro * p_.T / p_.cp) / counted
               : loss / static_cast<double>(p_.accum * p_.dp * p_.cp);
    if (comm::Communicator* across = r_.launch.across.get(); across != nullptr) {  // the replicas' mean
      float l = static_cast<float>(loss);
      across->allreduce(&l, 1, DType::kF32, comm::ReduceOp::kSum);
      loss = static_cast<double>(l) / static_cast<double>(p_.replicas);
    }
    const nlohmann::json outer = outer_ ? outer_step(step) : nlohmann::json();
    StepStats s;
    s.loss = loss;
    s.lr = lr;
    s.grad_norm = norm;
    s.seconds = step_timer.seconds();
    s.comm_wait_s = ex_.comm_wait_seconds();
    s.traffic = traffic[0];
    s.tp_traffic = traffic[1];
    if (tp_ops_ != nullptr) s.tp_seconds = tp_ops_->take_seconds();
    if (cp_ops_ != nullptr) {
      s.cp_traffic = r_.launch.cp_group()->traffic().since(cp_before);
      s.cp_attention_s = cp_ops_->take_attention_seconds();
      s.cp_wait_s = cp_ops_->take_wait_seconds();
    }
    if (paged_) s.paging = ex_.take_paging_stats();
    Outcome o{loss, norm, s.seconds, {}};
    // Every rank's memory and paging (a collective over the world), then
    // the pipeline's own record.
    RankReport mine{ex_.memory_report(), ex_.paging_report(), ex_.backward_end_ns(), s.cp_attention_s * 1e3,
                    s.cp_wait_s * 1e3};
    const std::vector<RankRecord> records = gather_records(r_.launch.world.get(), mine, s.paging);
    const CommSplit split = comm_split(r_.launch.world.get(), ex_.wait_end_ns(), records, s.comm_wait_s);
    const nlohmann::json pipeline = report(st, s.seconds, traffic, s.paging);
    if (!trace_.empty() && after.step == p_.end()) {
      const std::string json = ex_.gather_trace();
      if (pipe_rank(pipe_) == 0 && r_.launch.dp_rank == 0 && r_.launch.tp_rank == 0)
        checkpoint::write_file_atomic(trace_, json.data(), json.size());
    }
    if (!r_.launch.leader) return o;
    nlohmann::json record = step_metrics(p_, r_.mcfg, peak_gflops_, s, after, split, predicted_, records);
    record.update(pipeline);
    if (const auto [early, all] = ex_.overlapped_sums(); all > 0)
      record["dp_sums"] = {{"overlapped", early}, {"all", all}};
    if (st.param_gathers > 0)  // (this rank's: ZeRO-3)
      record["param_gathers"] = {{"prefetched", st.prefetched}, {"all", st.param_gathers}};
    if (!outer.is_null()) record["outer"] = outer;
    o.records.push_back(std::move(record));
    if (paged_) {
      nlohmann::json pages = paging_json(after.step, records);
      pages["pp_paging_per_rank"] = paging_;
      o.records.push_back(std::move(pages));
    }
    return o;
  }

  bool evaluates_everywhere() const override { return true; }  // every stage takes part

  double evaluate(const data::TokenFile& val) override {
    data::EvalSampler windows(val, p_.T, r_.val_sft);
    const int64_t batches = std::min(p_.eval_batches, windows.num_sequences() / p_.micro);
    double vl = 0, counted = 0;
    for (int64_t b = 0; b < batches; ++b) {
      int32_t* pos = pos_.empty() ? nullptr : pos_.data();
      fill_rows(in_.data(), tg_.data(),
                [&](int32_t* i, int32_t* t) { windows.fill(b * p_.micro, p_.micro, i, t, pos); });
      const double mean = ex_.evaluate(in_.data(), tg_.data(), pos);
      if (r_.val_sft == nullptr) {
        vl += mean;
        continue;
      }
      vl += mean * static_cast<double>(p_.micro * p_.T / p_.cp);  // SFT: the mean over counted targets
      counted += static_cast<double>(data::counted_targets(tg_));
    }
    if (r_.val_sft != nullptr) return counted_mean(vl, counted, r_.launch.cp_group(), batches);
    vl /= static_cast<double>(batches);
    if (r_.launch.cp_group() != nullptr) {  // each cp rank's mean is over its own tokens
      float l = static_cast<float>(vl);
      r_.launch.cp_group()->allreduce(&l, 1, DType::kF32, comm::ReduceOp::kSum);
      vl = static_cast<double>(l) / static_cast<double>(p_.cp);
    }
    return vl;
  }

  double save(const std::string& path, const TrainState& state, AsyncCheckpointer* async) override {
    core::Timer t;
    if (outer_) save_outer(path);  // every replica's side files first: the checkpoint commits after them
    if (r_.launch.replica != 0) return t.seconds();  // replica 0 writes the checkpoint
    return t.seconds() + save_pipeline(r_, ex_, setup_, writers_, state, path, async);
  }

 private:
  // The DiLoCo side files of checkpoint `path` (side_file), a collective over
  // the job; the leader then removes the side files of checkpoints gone.
  void save_outer(const std::string& path) {
    std::exception_ptr error;
    const std::string file = side_file(path, r_.launch.replica, writers_.index);
    try {
      checkpoint::OuterFile f;
      if (r_.launch.replica == 0) {
        f = outer_->sync->save();
      } else {
        StageState w = gather_stage(r_, ex_, setup_, writers_, 3);
        for (int k = 0; k < 3; ++k) {
          f.names.emplace_back(kSideKinds[k]);
          f.arrays.push_back(std::move(w.all[k]));
        }
      }
      fs::create_directories(fs::path(file).parent_path());
      checkpoint::write_outer_file(file, f);
    } catch (...) {
      error = std::current_exception();
    }
    checkpoint::agree_on_success(r_.launch.job(), error, file + ": saving the DiLoCo state");
    if (!r_.launch.leader) return;
    std::error_code ec;
    const fs::path side = fs::path(file).parent_path().parent_path(), ckpts = fs::path(path).parent_path();
    for (const auto& e : fs::directory_iterator(side, ec))
      if (e.path().filename() != fs::path(path).filename() && !fs::exists(ckpts / e.path().filename(), ec))
        fs::remove_all(e.path(), ec);
  }

  // The outer steps due after inner step `step` (every fragment's after the
  // run's last): this writer's slice gathered, stepped over the replicas,
  // scattered back. Its record (the leader's): the fragments stepped, the
  // payload bytes the replica's ranks exchanged with the other replicas, the
  // pseudo-gradient's norm ‖Δ̄‖, the seconds.
  nlohmann::json outer_step(int64_t step) {
    OuterSync& sync = *outer_->sync;
    const bool last = step + 1 == p_.end();
    double mine[4] = {0, 0, 0, static_cast<double>(sync.resident_bytes())};  // bytes, Σ Δ̄², seconds, state in memory
    nlohmann::json fragments = nlohmann::json::array();
    for (int f = 0; f < sync.fragments(); ++f) {
      if (sync.due(step) != f && !last) continue;
      core::Timer t;
      const auto wanted = [this, f](int u) { return outer_->wanted(u, f); };
      StageState w = gather_stage(r_, ex_, setup_, writers_, 1, wanted);
      const OuterSync::Stats st = sync.step(f, w.all[0].data(), outer_->ranges[static_cast<size_t>(f)]);
      scatter_stage(ex_, setup_, writers_, outer_->stage.get(), w.all[0].data(), wanted);
      mine[0] += static_cast<double>(st.bytes);
      mine[1] += st.delta_sq;
      mine[2] += t.seconds();
      fragments.push_back(f);
    }
    if (fragments.empty()) return {};
    comm::Communicator* world = r_.launch.world.get();
    const int ranks = world ? world->size() : 1;
    std::vector<double> all(4 * static_cast<size_t>(ranks));
    if (world) world->all_gather(mine, all.data(), 8, DType::kI32);  // doubles, bit-exact
    else std::copy_n(mine, 4, all.begin());
    double bytes = 0, sq = 0, seconds = 0, state = 0;
    for (int k = 0; k < ranks; ++k) {
      bytes += all[4 * static_cast<size_t>(k)];
      sq += all[4 * static_cast<size_t>(k) + 1];
      seconds = std::max(seconds, all[4 * static_cast<size_t>(k) + 2]);
      state = std::max(state, all[4 * static_cast<size_t>(k) + 3]);
    }
    // state_bytes: the largest rank's outer state in memory (0: paged), not
    // in memory_per_rank (the executor's ledger) yet.
    return {{"fragments", fragments}, {"outer_steps", sync.outer_steps(fragments.back().get<int>())},
            {"bytes", bytes}, {"delta_norm", std::sqrt(sq)}, {"ms", seconds * 1000}, {"state_bytes", state}};
  }

  // `micro` whole sequences from fill(in, tg), as this rank's rows.
  template <typename Fill>
  void fill_rows(int32_t* inputs, int32_t* targets, const Fill& fill) {
    if (cp_.size == 1) return fill(inputs, targets);
    fill(seq_in_.data(), seq_tg_.data());
    cut_context_rows(cp_, p_.micro, p_.T, seq_in_.data(), inputs);
    cut_context_rows(cp_, p_.micro, p_.T, seq_tg_.data(), targets);
  }

  // The step's pipeline record (collectives over the pipeline group): the
  // measured bubble (1 - mean compute / the slowest stage's step), the p2p
  // traffic, every rank's memory and paging traffic, the micro-batches held.
  nlohmann::json report(const parallel::PipelineStepStats& st, double seconds, const comm::Traffic (&traffic)[2],
                        const memory::PagerStats& ps) {
    const double mine[5] = {st.busy_s, st.seconds, st.wait_s, static_cast<double>(st.sent_bytes),
                            static_cast<double>(st.sends)};
    std::vector<double> all(5 * static_cast<size_t>(p_.pp));
    gather_pipe(pipe_, mine, all.data(), 10);  // doubles, bit-exact
    std::vector<double> busy, secs, sent_per_rank, sends_per_rank;
    double wait_max = 0, sent = 0;
    for (int64_t k = 0; k < p_.pp; ++k) {
      busy.push_back(all[5 * k]);
      secs.push_back(all[5 * k + 1]);
      wait_max = std::max(wait_max, all[5 * k + 2]);
      sent += all[5 * k + 3];
      sent_per_rank.push_back(all[5 * k + 3]);
      sends_per_rank.push_back(all[5 * k + 4]);
    }
    const double bubble = 1 - mean_of(busy) / *std::max_element(secs.begin(), secs.end());
    // Every pipeline rank's bytes (the executor's accounting), for the report.
    const parallel::PipelineExecutor::Memory mem = ex_.memory();
    constexpr size_t kMem = 16;
    const double mine_mem[kMem] = {
        static_cast<double>(mem.params), static_cast<double>(mem.grads),
        static_cast<double>(mem.adam), static_cast<double>(mem.activations),
        static_cast<double>(mem.w_queue), static_cast<double>(mem.buffers),
        static_cast<double>(mem.pages), static_cast<double>(ps.nvme_read_bytes),
        static_cast<double>(ps.nvme_written_bytes), static_cast<double>(ps.host_read_bytes + ps.host_written_bytes),
        ps.hit_rate(), static_cast<double>(mem.master), static_cast<double>(mem.frozen),
        cp_ops_ != nullptr ? static_cast<double>(cp_ops_->buffer_bytes()) : 0.0,  // (the ring's, as allocated)
        static_cast<double>(ps.lent_read_bytes), static_cast<double>(ex_.pages_updated_in_backward())};
    std::vector<double> mems(kMem * static_cast<size_t>(p_.pp));
    gather_pipe(pipe_, mine_mem, mems.data(), 2 * kMem);  // doubles, bit-exact
    int peak = st.peak_in_flight;
    std::vector<int> peaks(static_cast<size_t>(p_.pp));
    gather_pipe(pipe_, &peak, peaks.data(), 1);
    nlohmann::json per_rank = nlohmann::json::array();
    paging_ = nlohmann::json::array();
    for (int64_t k = 0; k < p_.pp; ++k) {
      const double* v = mems.data() + kMem * k;
      per_rank.push_back({{"params", v[0]}, {"grads", v[1]}, {"master", v[11]}, {"adam", v[2]},
                          {"activations", v[3]}, {"w_queue", v[4]}, {"buffers", v[5]}, {"pages", v[6]},
                          {"frozen", v[12]}, {"context", v[13]},
                          {"total", v[0] + v[1] + v[11] + v[2] + v[3] + v[4] + v[5] + v[6] + v[12] + v[13]}});
      paging_.push_back({{"nvme_read_bytes", v[7]}, {"nvme_written_bytes", v[8]},
                         {"host_copy_bytes", v[9]}, {"hit_rate", v[10]}, {"lent_read_bytes", v[14]},
                         {"pages_updated_in_backward", v[15]}});
    }
    // Every pipeline rank's collectives on its data and tensor groups.
    constexpr size_t kOps = comm::kNumCommOps;
    std::vector<uint64_t> mine_comm;
    for (const comm::Traffic& t : traffic) {
      mine_comm.insert(mine_comm.end(), t.calls, t.calls + kOps);
      mine_comm.insert(mine_comm.end(), t.bytes, t.bytes + kOps);
    }
    std::vector<uint64_t> comms(mine_comm.size() * static_cast<size_t>(p_.pp));
    gather_pipe(pipe_, mine_comm.data(), comms.data(), 2 * mine_comm.size());  // uint64s, bit-exact
    nlohmann::json comm_per_rank[2] = {nlohmann::json::array(), nlohmann::json::array()};
    for (int64_t k = 0; k < p_.pp; ++k)
      for (size_t g = 0; g < 2; ++g) {
        comm::Traffic t;
        const uint64_t* v = comms.data() + static_cast<size_t>(k) * mine_comm.size() + g * 2 * kOps;
        std::copy(v, v + kOps, t.calls);
        std::copy(v + kOps, v + 2 * kOps, t.bytes);
        comm_per_rank[g].push_back(traffic_json(t));
      }
    return {{"tokens_per_s", tokens_per_step(p_) / seconds},
            {"pp_comm_per_rank", comm_per_rank[0]},
            {"pp_tp_comm_per_rank", comm_per_rank[1]},
            {"step_ms", seconds * 1000},
            {"pp_bubble", bubble},
            {"pp_bubble_formula", formula_},
            {"pp_bubble_planned", planned_},
            {"pp_bubble_stages", costed_},
            {"pp_wait_ms", wait_max * 1000},
            {"pp_p2p_bytes", sent},
            {"pp_p2p_bytes_per_rank", sent_per_rank},
            {"pp_p2p_sends_per_rank", sends_per_rank},
            {"pp_peak_in_flight", peaks},
            {"pp_schedule", pl::schedule_name(setup_.schedule.kind)},
            {"peak_rss_bytes", peak_rss_bytes()},
            {"pp_memory_per_rank", per_rank}};
  }

  const RunInputs& r_;
  const Plan& p_;
  parallel::PipelineExecutor& ex_;
  const parallel::PipelineSetup& setup_;
  const Writers& writers_;
  model::ContextSplit cp_;
  parallel::TensorParallelOps* tp_ops_;   // null at tp = 1
  parallel::ContextParallelOps* cp_ops_;  // null at cp = 1
  bool paged_;
  double peak_gflops_;        // mfu's denominator (gemm_peak_gflops)
  Outer* outer_;              // null without train.local_steps
  size_t predicted_ = 0;
  comm::Communicator* pipe_;  // null at pp = 1
  std::string trace_;
  double formula_ = 0, planned_ = 0, costed_ = 0;
  std::vector<int32_t> in_, tg_, seq_in_, seq_tg_;
  std::vector<int32_t> pin_, ptg_, pos_;  // packed rows: a micro-batch's positions (every stage)
  nlohmann::json paging_;
};

}  // namespace

TrainResult train_pipeline(const RunInputs& r) {
  const Plan& p = r.p;
  const core::Config& cfg = r.cfg;
  const Launch& launch = r.launch;
  PO_CHECK(p.pp == 1 || launch.pp_group() != nullptr, "parallel.pp = ", p.pp, " needs its pipeline group");
  std::optional<parallel::TensorParallelOps> tp_ops;
  if (launch.tp_group() != nullptr) tp_ops.emplace(*launch.tp_group());
  // Context parallel: every stage's models run their attention over the
  // context group (its ops hand the tensor group's calls on).
  std::optional<parallel::ContextParallelOps> cp_ops;
  if (launch.cp_group() != nullptr)
    cp_ops.emplace(*launch.cp_group(), parallel::parse_cp_mode(cfg.get_string("parallel.cp_mode")),
                   cfg.get_string("parallel.cp_balance") == "zigzag",
                   tp_ops ? static_cast<model::ParallelOps&>(*tp_ops) : model::NullParallelOps::instance());
  model::ParallelOps* stage_ops = cp_ops ? static_cast<model::ParallelOps*>(&*cp_ops)
                                  : tp_ops ? static_cast<model::ParallelOps*>(&*tp_ops)
                                           : nullptr;
  const model::ContextSplit cp = cp_ops ? cp_ops->cp_split() : model::ContextSplit{};
  const parallel::PipelineSetup setup = pipeline_setup(r, stage_ops);
  parallel::PipelineExecutor ex(r.mcfg, r.adam, setup);
  const bool paged = setup_paging(cfg, ex, r.mcfg, setup, launch.world.get(), context_bytes(cfg, r.mcfg, setup));

  const std::string ckpt_dir = (fs::path(r.run_dir) / "checkpoints").string();
  const auto existing = list_checkpoints(ckpt_dir);
  TrainState state;
  state.seed = r.seed;
  const bool resuming = r.resume && !existing.empty();
  if (ex.layout().adapters()) load_base(ex, cfg, r.mcfg, r.seed, !resuming);  // (also on resume)
  if (resuming) {
    state = load_pipeline(ex, existing.back(), launch.world.get());
    PO_CHECK(state.seed == r.seed, existing.back(), ": written with train.seed = ", state.seed,
             ", but the config says ", r.seed, " (batches would differ)");
    PO_LOG_INFO("resuming from ", existing.back(), " at step ", state.step);
  } else if (ex.layout().adapters()) {
    // load_base made the base and the adapters
  } else if (cfg.get_string("model.init") == "random") {
    ex.init_random(r.seed);
  } else {
    load_init(ex, r.mcfg, cfg.get_string("model.init"));
  }
  keep_threads(state, r.threads, launch.leader);
  if (launch.leader) {
    prepare_run_dir(r.run_dir, r.resume);
    checkpoint::write_file_atomic((fs::path(r.run_dir) / "config.toml").string(),
                                  r.config_toml.data(), r.config_toml.size());
  }
  LoopSetup l = loop_setup(r);
  // checkpoint.async: each writer holds its cut's copy.
  const Writers writers = checkpoint_writers(r, ex, setup);
  std::optional<AsyncCheckpointer> async;
  if (cfg.get_bool("checkpoint.async")) {
    l.async = &async.emplace(launch.world.get(), &writers.file, writers.count,
                             std::vector<checkpoint::StateKind>(checkpoint::kAllStateKinds.begin(),
                                                                checkpoint::kAllStateKinds.end()),
                             false);
    PO_LOG_INFO("checkpoint.async: ", async->host_bytes() >> 20, " MiB of host memory on each ",
                "writer hold its checkpoint copy");
  }
  const double peak_gflops = gemm_peak_gflops(cfg);
  if (launch.leader) PO_LOG_INFO(predicted_memory_table(cfg, r.mcfg, setup));
  // The compute budget holds from here on (set-up is done: whole models
  // read for the weights have given way to this rank's part).
  if (const size_t budget = cfg.get_size("memory.compute_budget"); budget > 0)
    tensor::set_pool_budget(tensor::Pool::kCompute, budget);
  // From here "peak" is the training steps' own (memory_per_rank's).
  tensor::reset_pool_peak(tensor::Pool::kCompute);
  // train.local_steps: the outer state starts from the parameters as they are now.
  const std::unique_ptr<Outer> outer = p.local_steps > 0 ? make_outer(r, ex, setup, writers) : nullptr;
  if (outer && resuming) load_outer(r, ex, setup, writers, *outer, existing.back());
  PipelineSteps steps(r, ex, setup, cp, tp_ops ? &*tp_ops : nullptr, cp_ops ? &*cp_ops : nullptr, paged, writers,
                      peak_gflops, outer.get());
  return run_steps(steps, l, state);
}

}  // namespace po::train
