// The analytic plan, for layouts the engine does not train yet (pipeline
// and context parallel, attention keeping the s×s scores): model states by the ZeRO
// ledger over the busiest pipeline stage, activations by Korthikanti et al.,
// and the collectives that Megatron-style layouts issue. Pipeline layouts
// the executor trains take their memory from its own accounting.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "parallel/pipeline_executor.h"
#include "parallel/pipeline_stages.h"
#include "plan/plan_parts.h"
#include "plan/planner.h"

namespace po::plan {
namespace {

// The engine's model at a layout's sequence length.
model::TransformerConfig engine_config(const ModelSpec& m, const Layout& l) {
  model::TransformerConfig c = m.engine;
  c.seq_len = std::max(c.seq_len, l.seq);
  return c;
}

}  // namespace

parallel::pipeline::Pipeline pipeline_schedule(const ModelSpec& model, const Layout& l) {
  namespace pl = parallel::pipeline;
  try {
    return pl::make_pipeline(engine_config(model, l), l.seq, l.schedule, l.pp,
                             static_cast<int>(l.accum()), l.virtual_stages, l.vocab_parallel,
                             l.stage_layers);
  } catch (const core::Error&) {
    return {pl::make_schedule(l.schedule, l.pp, static_cast<int>(l.accum()), l.virtual_stages,
                              l.vocab_parallel),
            {}};
  }
}

namespace detail {

// Layouts the executor trains (every schedule, pp = 1 its one-stage one: fp32
// or bf16, ZeRO 0-3, in memory or paged, tensor and context parallel too).
bool pipeline_trainable(const Plan& p) {
  const Layout& l = p.layout;
  const ModelSpec& m = p.model;
  return l.flash_attention &&
         m.n_kv_head % l.tp == 0 && m.ffn % l.tp == 0;
}

// The most transformer blocks a pipeline rank's stages hold (all of them at pp = 1).
uint64_t blocks_on_busiest_rank(const Plan& p) {
  const Layout& l = p.layout;
  const int L = static_cast<int>(p.model.n_layer);
  if (l.pp == 1) return static_cast<uint64_t>(L);
  const parallel::pipeline::Pipeline pipe = pipeline_schedule(p.model, l);
  if (pipe.stages.empty()) return static_cast<uint64_t>(L);  // (no pipeline: pipeline_engine_memory says why)
  std::vector<uint64_t> blocks(static_cast<size_t>(l.pp), 0);
  for (int st = 0; st < static_cast<int>(pipe.stages.size()); ++st) {
    const model::UnitRange r = pipe.stages[static_cast<size_t>(st)];
    const int last = r.last < 0 ? L + 1 : r.last;  // (units: the embedding, L blocks, the head)
    const int held = std::max(0, std::min(last, L) - std::max(r.first, 1) + 1);
    blocks[static_cast<size_t>(pipe.schedule.rank_of(st))] += static_cast<uint64_t>(held);
  }
  return *std::max_element(blocks.begin(), blocks.end());
}

// Their memory is the executor's own accounting (PipelineExecutor::predict)
// on the busiest pipeline rank, by item; their data and tensor groups'
// collectives are its own too (predict_collectives), those of the pipeline
// rank that moves the most. Context parallel: a rank's stages hold T / cp
// rows of each sequence, the data group is dp × cp (train/pipeline_train.cc),
// and the context group's buffers (ContextParallelOps) come on top.
namespace {

// The model as the executor trains it at layout l.
model::TransformerConfig executor_config(const Plan& p) {
  const Layout& l = p.layout;
  model::TransformerConfig cfg = p.model.engine;
  cfg.seq_len = std::max(cfg.seq_len, l.seq);
  cfg.activation_checkpointing = l.checkpointing;
  cfg.sequence_parallel = l.sequence_parallel && l.tp > 1;
  return cfg;
}

// The executor's set-up at layout l, as train/pipeline_train.cc makes it.
parallel::PipelineSetup executor_setup(const Plan& p, const model::TransformerConfig& cfg) {
  namespace pl = parallel::pipeline;
  const Layout& l = p.layout;
  parallel::PipelineSetup s;
  pl::Pipeline pipe = pipeline_schedule(p.model, l);
  if (pipe.stages.empty()) pipe.stages = pl::partition_stages(cfg, l.seq, pipe.schedule);  // (throws why)
  s.schedule = std::move(pipe.schedule);
  s.stage_units = std::move(pipe.stages);
  s.micro = l.micro;
  s.T = l.seq / l.cp;
  s.split = {l.tp, 0};
  s.zero_stage = l.zero_stage;
  s.dp = l.dp * l.cp;
  s.bf16 = l.bf16;
  s.reduce_bf16 = l.reduce_bf16;
  s.defer_lookup = parallel::defers_lookup(cfg, l.dp, l.overlap, l.cp, l.zero_stage, l.pack);
  s.overlap_comm = l.overlap;
  s.prefetch = l.prefetch;
  s.bucket_bytes = l.bucket_bytes;
  s.paged = l.paging;
  s.adam.state_bits = l.state_bits;
  s.adam.block_size = l.state_block;
  s.adam.state_bits_exclude = l.state_bits_exclude;
  return s;
}

// The executor's collectives of the pipeline rank that moves the most.
parallel::PipelineExecutor::Collectives busiest_collectives(const Plan& p, const model::TransformerConfig& cfg,
                                                            const parallel::PipelineSetup& s) {
  parallel::PipelineExecutor::Collectives most;
  double moved = -1;
  for (int r = 0; r < p.layout.pp; ++r) {
    const auto c = parallel::PipelineExecutor::predict_collectives(cfg, s, r);
    double bytes = 0;
    for (int op = 0; op < comm::kNumCommOps; ++op)
      bytes += static_cast<double>(c.data.bytes[op] + c.tensor.bytes[op]);
    if (bytes > moved) {
      moved = bytes;
      most = c;
    }
  }
  return most;
}

}  // namespace

parallel::PipelineExecutor::Collectives pipeline_engine_memory(Plan& p) {
  const Layout& l = p.layout;
  const model::TransformerConfig cfg = executor_config(p);
  const parallel::PipelineSetup s = executor_setup(p, cfg);
  // Each rank's memory, paged as the trainer pages it: the budget is checked
  // against the rank that needs the most; each rank's pages not in the
  // compute tier go to the host tier, then NVMe. The busiest rank is the one
  // holding the most, its compute-tier frames included.
  // (Beside each rank's accounting: the context group's buffers and the
  // ring collectives' scratch, as the trainer counts them for the budget.)
  parallel::PipelineExecutor::Memory busiest;
  memory::PagingPlan neediest, mine;
  int at = -1;
  const auto context = static_cast<size_t>(context_buffer_bytes(p.model, l));
  size_t ring = 0;
  for (int r = 0; r < l.pp; ++r) {
    parallel::PipelineExecutor::Memory m = parallel::PipelineExecutor::predict(cfg, s, r);
    const size_t scratch = parallel::PipelineExecutor::predict_ring_scratch(cfg, s, r);
    memory::PagingPlan plan;
    if (l.paging) {
      const auto [n, least] = parallel::PipelineExecutor::paging_pages(cfg, s, r, l.page_bytes, l.page_prefetch);
      plan = memory::plan_paging({n, least, m.total() + context + scratch},
                                 {l.page_bytes, l.compute_budget, l.host_budget, l.nvme});
      m.pages = plan.compute_frames * l.page_bytes;
      if (r == 0 || plan.min_compute_bytes > neediest.min_compute_bytes) neediest = plan;
    }
    if (at < 0 || m.total() + scratch > busiest.total() + ring) {
      busiest = m;
      mine = plan;
      at = r;
      ring = scratch;
    }
  }
  p.memory.clear();
  const std::string note = core::str_cat("pipeline rank ", at, ", the executor's accounting");
  const std::string shard = core::str_cat("this rank's ZeRO-", l.zero_stage, " shard");
  add_memory(p, "parameters", static_cast<double>(busiest.params), Tier::kCompute, note);
  add_memory(p, "gradients", static_cast<double>(busiest.grads), Tier::kCompute,
             "incl. the tied table's replica");
  if (!l.paging) {
    add_memory(p, "fp32 master weights", static_cast<double>(busiest.master), Tier::kCompute,
               l.zero_stage >= 1 ? shard : "");
    add_memory(p, "Adam m, v", static_cast<double>(busiest.adam), Tier::kCompute,
               l.zero_stage >= 1 ? shard : "");
  } else {
    // The budget is checked against the rank that needs the most, as the trainer does.
    mine.compute_fits = neediest.compute_fits;
    mine.min_compute_bytes = neediest.min_compute_bytes;
    add_paged_tiers(p, mine, l,
                    core::str_cat(" of Adam m, v", l.bf16 ? " and the fp32 master" : "",
                                  l.zero_stage == 3 ? ", the parameter and gradient shards" : "",  // (paged, ZeRO-3 pages them)
                                  l.zero_stage >= 1 ? core::str_cat(" (the ZeRO-", l.zero_stage, " shard)") : ""));
    // One stage holding the whole model lends its activations' frames (PipelineExecutor::enable_paging).
    model::TransformerConfig lender = cfg;
    lender.bf16_activations = l.bf16;
    add_paged_io(p, mine,
                 l.lend_activations && l.pp == 1
                     ? static_cast<double>(parallel::PipelineExecutor::lent_frames(lender, s, l.page_bytes))
                     : 0.0);
  }
  if (busiest.frozen > 0)
    add_memory(p, "frozen base", static_cast<double>(busiest.frozen), Tier::kCompute,
               "the adapters' base, once per stage: f32, or its quantized codes and scales");
  add_memory(p, "activations", static_cast<double>(busiest.activations), Tier::kCompute,
             "slots of the micro-batches in flight");
  add_memory(p, "weight-gradient queue", static_cast<double>(busiest.w_queue), Tier::kCompute,
             "zero-bubble W work");
  add_memory(p, "working buffers", static_cast<double>(busiest.buffers), Tier::kCompute,
             "p2p messages, ZeRO gathers and reduce-scatters, f32 accumulators");
  add_memory(p, "context-parallel buffers", static_cast<double>(context), Tier::kCompute,
             "the context group's keys and values");
  add_memory(p, "ring scratch", static_cast<double>(ring), Tier::kCompute,
             "at most: the data and tensor groups' ring collectives in flight");
  return busiest_collectives(p, cfg, s);
}

// The executor's collectives on the data and tensor groups as plan items
// (exposed: it waits at each call).
void add_pipeline_comm(Plan& p, const parallel::PipelineExecutor::Collectives& c, bool dp_inter) {
  const Layout& l = p.layout;
  const char* data_what[comm::kNumCommOps] = {};
  data_what[static_cast<int>(comm::CommOp::kAllReduce)] =
      l.overlap ? "gradient buckets, started in the backward (ZeRO 0-1)" : "gradient buckets at the step (ZeRO 0-1)";
  data_what[static_cast<int>(comm::CommOp::kReduceScatter)] =
      l.overlap ? "each micro-batch's gradients, in the backward (ZeRO 2-3)" : "each micro-batch's gradients (ZeRO 2-3)";
  data_what[static_cast<int>(comm::CommOp::kAllGather)] =
      "updated shards (ZeRO 1-2), parameters per use (ZeRO-3), the tied table's lookup rows, the norm";
  for (int op = 0; op < comm::kNumCommOps; ++op) {
    const char* name = comm::comm_op_name(static_cast<comm::CommOp>(op));
    // (ZeRO 0-1's buckets hide behind the backward with overlap_comm, but
    // unit 0's; so do ZeRO 2-3's reduce-scatters, two in flight)
    const bool hidden = (op == static_cast<int>(comm::CommOp::kAllReduce) ||
                         op == static_cast<int>(comm::CommOp::kReduceScatter)) &&
                        l.overlap;
    add_comm(p, "dp", name, data_what[op] != nullptr ? data_what[op] : "", c.data.calls[op],
             static_cast<double>(c.data.bytes[op]), l.dp * l.cp, dp_inter, hidden);
    add_comm(p, "tp", name, "the stages' tensor-parallel sums and gathers, the loss, the norm", c.tensor.calls[op],
             static_cast<double>(c.tensor.bytes[op]), l.tp, spans_nodes(p.cluster, 1, l.tp), false);
  }
}

namespace {

// The state's memory: parameters, gradients, the optimizer (paged off the
// device, or not) and ZeRO's buffers, on the busiest pipeline stage, which
// holds L/pp blocks and the embedding (or the head). Returns the stage's
// parameters per tp rank.
double add_state_memory(Plan& p) {
  const Layout& l = p.layout;
  const std::vector<int64_t> units = p.model.unit_numels();
  const int L = static_cast<int>(p.model.n_layer);
  const double block = static_cast<double>(units[1]);
  const double first = static_cast<double>(units[0]), last = static_cast<double>(units.back());
  const double stage_params = (std::ceil(static_cast<double>(L) / l.pp) * block + std::max(first, last) +
                               (l.pp == 1 ? std::min(first, last) : 0)) / l.tp;
  const int shard = l.dp * l.cp;  // the distributed optimizer shards over dp × cp
  const double esz = l.bf16 ? 2 : 4;
  const int stage = l.zero_stage;
  const double whole = stage_params, part = stage_params / shard;
  const double params = esz * (stage == 3 ? part : whole);
  const double grads = esz * (stage >= 2 ? part : whole);
  const double opt = (l.bf16 ? 12.0 : 8.0) * (stage >= 1 ? part : whole);  // [master +] m + v
  add_memory(p, "parameters", params, Tier::kCompute, l.bf16 ? "bf16" : "fp32");
  add_memory(p, "gradients", grads);
  if (l.paging) {
    add_memory(p, l.bf16 ? "fp32 master + Adam m, v" : "Adam m, v", opt, l.nvme ? Tier::kNvme : Tier::kHost,
               "paged off the device");
    const double bw = l.nvme ? std::min(p.cluster.nvme_read_bw, p.cluster.nvme_write_bw) / p.cluster.devices_per_node
                             : p.cluster.host_bw;
    p.io_s = bw > 0 ? 2 * opt / bw : 0;  // read and written back once per step
    p.io_total_s = p.io_s;
  } else {
    if (l.bf16) add_memory(p, "fp32 master weights", opt / 3);
    add_memory(p, "Adam m, v", l.bf16 ? opt * 2 / 3 : opt);
  }
  if (stage == 3)
    add_memory(p, "gathered-unit buffers", (l.prefetch + 2) * std::max(block, first) / l.tp * esz);
  if (stage < 3) add_memory(p, "communication buckets", std::min(2.0 * static_cast<double>(l.bucket_bytes), grads));
  return stage_params;
}

// The schedule's action lists (parallel/pipeline_schedule.h), timed at
// forward : input backward : weight backward = 1 : 1 : 1, give the bubble
// (the time section reads p.bubble), the most micro-batches a rank holds in
// flight (its activations to the input backward plus, zero-bubble, the
// weight backwards it has deferred) and the busiest rank's sends a step.
struct ScheduleLoad {
  double in_flight = 1;
  uint64_t sends = 0;
};
ScheduleLoad schedule_load(Plan& p) {
  const Layout& l = p.layout;
  ScheduleLoad out;
  if (l.pp == 1) return out;
  namespace pl = parallel::pipeline;
  const pl::Pipeline pipe = pipeline_schedule(p.model, l);
  const pl::Schedule& sched = pipe.schedule;
  const pl::Timing t = pl::simulate(sched);
  p.bubble = p.bubble_stages = t.bubble();
  if (!pipe.stages.empty())
    p.bubble_stages = pl::simulate(sched, pl::stage_costs(engine_config(p.model, l), l.seq, pipe.stages,
                                                          sched.vocab ? l.pp : 0))
                          .bubble();
  out.in_flight = 0;
  for (size_t r = 0; r < t.peak_in_flight.size(); ++r) {
    out.in_flight = std::max<double>(out.in_flight, t.peak_in_flight[r] + t.peak_w_queue[r]);
    const auto& list = sched.actions[r];
    out.sends = std::max<uint64_t>(out.sends, static_cast<uint64_t>(std::count_if(
                                                  list.begin(), list.end(), [](const pl::Action& a) {
                                                    return a.op == pl::Op::kSend;
                                                  })));
  }
  return out;
}

// Activations, Korthikanti et al. (16-bit; fp32 doubles them), with
// flash-style attention (no s×s scores) unless flash_attention is off, the
// sequence split by cp, L / (pp·v) blocks a chunk, `in_flight` micro-batches
// (1F1B: min(pp, m) on the first stage); at pp = 1 what the engine trains
// takes the model's own activation layout. Returns the blocks a chunk holds.
double add_activations(Plan& p, double in_flight, bool engine) {
  const Layout& l = p.layout;
  const ModelSpec& m = p.model;
  const double s = static_cast<double>(l.seq) / l.cp, b = static_cast<double>(l.micro);
  const double h = static_cast<double>(m.n_embd), a = static_cast<double>(m.n_head);
  const double scale = l.bf16 ? 1 : 2;
  const int chunks = l.pp == 1 ? 1 : parallel::pipeline::chunks_per_rank(l.schedule, l.virtual_stages);
  const double layers = std::ceil(static_cast<double>(m.n_layer) / (l.pp * chunks));
  const bool sp = l.tp > 1 && l.sequence_parallel;
  const double full = korthikanti_layer_bytes(s, b, h, a, l.tp, sp, false, l.flash_attention) * scale;
  const double ckpt = korthikanti_layer_bytes(s, b, h, a, l.tp, sp, true, l.flash_attention) * scale / (sp ? l.tp : 1);
  p.activations_no_ckpt = full * layers * in_flight;
  p.activations_ckpt = ckpt * layers * in_flight + full;  // + one layer recomputed
  add_memory(p, "activations", l.checkpointing ? p.activations_ckpt : p.activations_no_ckpt,
             Tier::kCompute, core::str_cat("Korthikanti et al.", l.checkpointing ? ", checkpointed" : ""));
  add_memory(p, "logits / loss buffers", 2 * 4 * s * b * static_cast<double>(m.vocab) / l.tp,
             Tier::kCompute, "fp32 logits and their gradient, last stage");
  if (engine && l.pp == 1) {  // one stage: the model's own activation layout, with and without checkpointing
    model::TransformerConfig c = engine_config(m, l);
    c.bf16_activations = l.bf16;
    c.sequence_parallel = sp;
    const int64_t T = l.seq / l.cp;
    for (const bool on : {false, true}) {
      c.activation_checkpointing = on;
      (on ? p.activations_ckpt : p.activations_no_ckpt) =
          static_cast<double>(model::Transformer::predicted_activation_bytes(c, l.micro, T, l.tp));
    }
    p.activations_formula = static_cast<double>(m.n_layer) *
                            korthikanti_layer_bytes(static_cast<double>(T), b, h, a, l.tp, sp, l.checkpointing, true);
  }
  return layers;
}

// Communication per step: what the engine trains, its executor's own
// collectives (`exact`); otherwise the analytic data and tensor groups'
// traffic; the pipeline's sends; context parallel's.
void add_step_comm(Plan& p, const parallel::PipelineExecutor::Collectives& exact, bool engine, double stage_params,
                   double layers, uint64_t sends) {
  const Layout& l = p.layout;
  const ModelSpec& m = p.model;
  const double s = static_cast<double>(l.seq) / l.cp, b = static_cast<double>(l.micro);
  const double h = static_cast<double>(m.n_embd);
  const double esz = l.bf16 ? 2 : 4;
  const int stage = l.zero_stage;
  const bool sp = l.tp > 1 && l.sequence_parallel;
  // Communication per step.
  const double act_bytes = s * b * h * esz;  // one [s, b, h] activation
  const double mb = static_cast<double>(l.accum());
  const double resz = l.reduce_bf16 ? 2 : 4;
  const bool dp_inter = spans_nodes(p.cluster, static_cast<int64_t>(l.tp) * l.cp, l.dp);
  const int n = l.dp * l.cp;
  // At pp = 1 the data group's gradient traffic overlaps the backward
  // (buckets, reduce-scatters in flight); so do the pipeline executor's
  // ZeRO 0-1 buckets and ZeRO 2-3 reduce-scatters (add_pipeline_comm).
  const bool grads_overlap = l.pp == 1;
  if (engine) add_pipeline_comm(p, exact, dp_inter);
  if (n > 1 && !engine) {
    if (stage == 0) {
      add_comm(p, "dp", "allreduce", "gradients", 1, stage_params * resz, n, dp_inter, grads_overlap);
    } else {
      add_comm(p, "dp", "reduce_scatter", "gradients", stage == 1 ? 1 : static_cast<uint64_t>(mb),
               stage_params * resz * (stage == 1 ? 1 : mb), n, dp_inter, grads_overlap);
      if (stage < 3)
        add_comm(p, "dp", "all_gather", "updated parameters", 1, stage_params * esz, n, dp_inter, false);
      else  // (prefetched along the step's order, at pp = 1 and in a pipeline)
        add_comm(p, "dp", "all_gather", "parameter gathers (forward and backward)",
                 static_cast<uint64_t>(2 * mb), 2 * mb * stage_params * esz, n, dp_inter, grads_overlap);
    }
  }
  if (l.tp > 1 && !engine) {
    const bool inter = spans_nodes(p.cluster, 1, l.tp);
    // Per layer and micro-batch 2 all-reduces forward, 2 backward, 2 more in
    // the recompute; with sequence parallel each is an all-gather +
    // reduce-scatter pair of the same volume (REFERENCE.md).
    const double calls = (l.checkpointing ? 6 : 4) * layers * mb;
    if (sp) {
      add_comm(p, "tp", "all_gather", "sequence-parallel gathers", static_cast<uint64_t>(calls),
               calls * act_bytes, l.tp, inter, false);
      add_comm(p, "tp", "reduce_scatter", "sequence-parallel reductions", static_cast<uint64_t>(calls),
               calls * act_bytes, l.tp, inter, false);
    } else {
      add_comm(p, "tp", "allreduce", "row-parallel outputs", static_cast<uint64_t>(calls),
               calls * act_bytes, l.tp, inter, false);
    }
  }
  if (l.pp > 1) {  // the busiest rank's sends in the schedule, fp32 [rows, C] messages as the executor sends them
    const bool inter = spans_nodes(p.cluster, static_cast<int64_t>(l.tp) * l.cp * l.dp, l.pp);
    add_comm(p, "pp", "send", "activations forward, gradients backward", sends,
             static_cast<double>(sends) * s * b * h * 4 / (sp ? l.tp : 1), 2, inter, false);
  }
  if (l.cp > 1 && engine) {
    add_context_comm(p, blocks_on_busiest_rank(p));
  } else if (l.cp > 1) {
    const bool inter = spans_nodes(p.cluster, l.tp, l.cp);
    const double kv = 2 * s * b * h * static_cast<double>(m.n_kv_head) / static_cast<double>(m.n_head) * esz / l.tp;
    // Ring attention: K, V blocks pass cp - 1 times forward; K, V and their
    // gradients backward.
    add_comm(p, "cp", "send", "ring attention K/V blocks", static_cast<uint64_t>(3 * (l.cp - 1) * layers * mb),
             3 * (l.cp - 1) * layers * mb * kv, 2, inter, true);
  }
}

}  // namespace

void analytic_plan(Plan& p) {
  const double stage_params = add_state_memory(p);
  const ScheduleLoad load = schedule_load(p);
  const bool engine = pipeline_trainable(p);
  const double layers = add_activations(p, load.in_flight, engine);
  parallel::PipelineExecutor::Collectives exact;  // (its memory replaces the analytic items above)
  if (engine) exact = pipeline_engine_memory(p);
  add_step_comm(p, exact, engine, stage_params, layers, load.sends);
  // (Tied embedding and head gradients between the first and last stage: small, not counted.)
}

}  // namespace detail
}  // namespace po::plan
