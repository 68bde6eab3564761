// The planner's front: layouts (from a config, checked), the ZeRO ledger and
// Korthikanti et al.'s activation formula, the items a plan is made of, and
// make_plan, which fills a Plan by the engine's replay (replay.cc) or the
// analytic model (analytic.cc) and then fits it to the cluster and times it.
// The layout search is in search.cc.
#include "plan/planner.h"
#include "plan/capabilities.h"

#include <algorithm>
#include <cstdio>

#include "core/error.h"
#include "parallel/context_parallel.h"
#include "plan/plan_parts.h"

namespace po::plan {
namespace {

// Payload (comm::Traffic's bytes) to what each rank sends with a ring.
double wire_bytes(const std::string& op, double payload, int n) {
  if (n <= 1) return 0;
  const double f = static_cast<double>(n - 1) / n;
  if (op == "allreduce") return 2 * f * payload;
  if (op == "reduce_scatter" || op == "all_gather" || op == "all_to_all") return f * payload;
  return payload;  // send / broadcast
}

}  // namespace

std::string Layout::describe() const {
  std::string s = core::str_cat("dp ", dp, " × tp ", tp, " × pp ", pp, " × cp ", cp, ", ZeRO-",
                                zero_stage, ", ", bf16 ? "bf16" : "fp32", ", micro ", micro);
  if (pp > 1) {
    s += core::str_cat(", ", parallel::pipeline::schedule_name(schedule));
    if (virtual_stages > 1 && schedule == parallel::pipeline::ScheduleKind::kInterleaved)
      s += core::str_cat(" v", virtual_stages);
    if (vocab_parallel) s += ", vocab parallel";
  }
  if (checkpointing) s += ", ckpt";
  if (paging) s += nvme ? ", paged (nvme)" : ", paged (host)";
  return s;
}

double korthikanti_layer_bytes(double s, double b, double h, double a, int t, bool sp,
                               bool recompute, bool flash) {
  if (recompute) return 2 * s * b * h;
  const double scores = flash ? 0 : 5 * a * s / h;
  if (t <= 1) return s * b * h * (34 + scores);
  if (sp) return s * b * h / t * (34 + scores);
  return s * b * h * (10 + 24.0 / t + scores / t);
}

double korthikanti_layer_elements(double s, double b, double h, int t, bool sp) {
  if (t <= 1) return 16 * s * b * h;
  if (sp) return 16 * s * b * h / t;
  return s * b * h * (4 + 12.0 / t);
}

double zero_model_state_bytes(double psi, int ranks, int stage) {
  const double n = ranks;
  switch (stage) {
    case 0: return 16 * psi;
    case 1: return 4 * psi + 12 * psi / n;
    case 2: return 2 * psi + 14 * psi / n;
    default: return 16 * psi / n;
  }
}

void check_layout(const ModelSpec& m, const Layout& l, int devices) {
  PO_CHECK(l.dp >= 1 && l.tp >= 1 && l.pp >= 1 && l.cp >= 1, "parallel.dp, tp, pp, cp must be >= 1");
  if (devices > 0)
    PO_CHECK(l.devices() == devices, "parallel.dp × tp × pp × cp = ", l.dp, " × ", l.tp, " × ",
             l.pp, " × ", l.cp, " = ", l.devices(), " but the cluster has ", devices, " devices");
  PO_CHECK(m.n_head % l.tp == 0, "parallel.tp = ", l.tp, " must divide the ", m.n_head,
           " attention heads");
  PO_CHECK(m.n_kv_head % l.tp == 0 || l.tp % m.n_kv_head == 0, "parallel.tp = ", l.tp,
           " must divide (or be a multiple of) the ", m.n_kv_head, " key/value heads");
  PO_CHECK(l.pp <= m.n_layer, "parallel.pp = ", l.pp, " exceeds the ", m.n_layer, " layers");
  if (l.pp > 1) {
    const int chunks = parallel::pipeline::chunks_per_rank(l.schedule, l.virtual_stages);
    PO_CHECK(l.pp * chunks <= m.n_layer, "parallel.pp × stages per rank = ", l.pp, " × ", chunks,
             " (parallel.schedule = \"", parallel::pipeline::schedule_name(l.schedule),
             "\") exceeds the ", m.n_layer, " layers");
    parallel::pipeline::check_schedule(l.schedule, l.pp, static_cast<int>(l.accum()),
                                       l.virtual_stages);
    PO_CHECK(!l.vocab_parallel || l.pp <= 8, "parallel.vocab_parallel spreads the head's 8 vocabulary ",
             "pieces over at most 8 pipeline ranks, not parallel.pp = ", l.pp);
  }
  PO_CHECK(l.seq % l.cp == 0, "parallel.cp = ", l.cp, " must divide the sequence of ", l.seq,
           " tokens");
  PO_CHECK(l.zero_stage >= 0 && l.zero_stage <= 3, "parallel.zero_stage = ", l.zero_stage,
           " is not one of 0, 1, 2, 3");
  PO_CHECK(l.micro >= 1 && l.batch % (static_cast<int64_t>(l.dp) * l.micro) == 0,
           "train.batch_size = ", l.batch, " must be a multiple of parallel.dp × micro_batch_size = ",
           l.dp, " × ", l.micro);
}

namespace detail {

std::string gib(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f GiB", bytes / kGiB);
  return b;
}

// ---- time of one collective -------------------------------------------------

// Whether a group whose members sit `stride` devices apart, `size` of them,
// spans nodes (Megatron order: tp innermost, then cp, dp, pp).
bool spans_nodes(const ClusterSpec& c, int64_t stride, int64_t size) {
  return size > 1 && stride * size > c.devices_per_node;
}

void add_comm(Plan& p, const std::string& dim, const std::string& op, const std::string& what,
              uint64_t calls, double bytes, int n, bool inter, bool overlaps) {
  if (calls == 0) return;
  CommItem c;
  c.dim = dim;
  c.op = op;
  c.what = what;
  c.calls = calls;
  c.bytes = bytes;
  c.wire_bytes = wire_bytes(op, bytes, n);
  const double bw = inter ? p.cluster.inter_bw : p.cluster.intra_bw;
  const double steps = op == "allreduce" ? 2.0 * (n - 1) : std::max(1, n - 1);
  c.seconds = static_cast<double>(calls) * p.cluster.latency * steps + (bw > 0 ? c.wire_bytes / bw : 0);
  c.overlaps = overlaps;
  p.comm.push_back(c);
}

void add_model_tp_comm(Plan& p, const model::TransformerConfig& cfg, model::UnitRange range,
                       uint64_t micro_batches, bool inter) {
  const Layout& l = p.layout;
  using C = model::Transformer::Collective;
  for (const auto& item : model::Transformer::predicted_tp_collectives(cfg, l.micro, l.seq, l.tp, range)) {
    const char* op = item.op == C::kAllReduce ? "allreduce" : item.op == C::kReduceScatter ? "reduce_scatter" : "all_gather";
    add_comm(p, "tp", op, item.what, item.calls * micro_batches, item.bytes * static_cast<double>(micro_batches),
             l.tp, inter, false);
  }
}

double context_buffer_bytes(const ModelSpec& m, const Layout& l) {
  if (l.cp == 1) return 0;
  const model::TransformerConfig local = m.engine.shard(l.tp);
  return static_cast<double>(parallel::ContextParallelOps::predicted_buffer_bytes(
      l.cp_allgather ? parallel::CpMode::kAllGather : parallel::CpMode::kRing, l.cp, l.micro, l.seq / l.cp,
      local.n_kv_head * local.head_dim()));
}

void add_context_comm(Plan& p, uint64_t layers) {
  const Layout& l = p.layout;
  if (l.cp == 1) return;
  const model::TransformerConfig cfg = p.model.engine.shard(l.tp);
  const int64_t kv_width = cfg.n_kv_head * cfg.head_dim(), T = l.seq / l.cp;
  const double n = static_cast<double>(l.micro * T * 2 * kv_width), bytes = 4 * n;  // one rank's keys and values, f32
  const auto accum = static_cast<uint64_t>(l.accum());
  const uint64_t forwards = l.checkpointing ? 2 : 1, c = static_cast<uint64_t>(l.cp);
  const bool inter = spans_nodes(p.cluster, l.tp, l.cp);
  if (l.cp_allgather) {
    const uint64_t gathers = accum * layers * (forwards + 1), scatters = accum * layers;
    add_comm(p, "cp", "all_gather", "keys and values", gathers, static_cast<double>(gathers) * bytes * l.cp, l.cp, inter, false);
    add_comm(p, "cp", "reduce_scatter", "key and value gradients", scatters, static_cast<double>(scatters) * bytes * l.cp, l.cp, inter, false);
  } else {
    const uint64_t blocks = accum * layers * (forwards * (c - 1) + (c - 1) + c);
    add_comm(p, "cp", "send", "ring: key/value blocks and gradient accumulators", blocks, static_cast<double>(blocks) * bytes, 2, inter, true);
    add_comm(p, "cp", "recv", "ring: the sends' other ends", blocks, static_cast<double>(blocks) * bytes, 2, inter, true);
    p.comm.back().wire_bytes = p.comm.back().seconds = 0;  // the sends carry the time
  }
}

void add_paged_io(Plan& p, const memory::PagingPlan& plan, double lent_frames) {
  const Layout& l = p.layout;
  const double page = static_cast<double>(l.page_bytes);
  const auto nvme_pages = static_cast<double>(plan.nvme_pages);
  const auto host_frames = static_cast<double>(plan.host_frames);
  p.lent_frames = lent_frames;
  const double lent = std::min(nvme_pages, p.lent_frames);
  const double host_part = host_frames * page, nvme_part = nvme_pages * page;
  const double rbw = p.cluster.nvme_read_bw, wbw = p.cluster.nvme_write_bw;
  const double host_io = p.cluster.host_bw > 0 ? 2 * host_part / p.cluster.host_bw : 0;
  p.io_under_backward_s = rbw > 0 ? lent * page / rbw : 0;
  p.io_under_forward_s = wbw > 0 ? lent * page / wbw : 0;
  p.io_total_s = host_io + (rbw > 0 ? nvme_part / rbw : 0) + (wbw > 0 ? nvme_part / wbw : 0);
  p.io_s = p.io_total_s - p.io_under_backward_s - p.io_under_forward_s;  // the sweep's
}

void add_memory(Plan& p, const std::string& name, double bytes, Tier tier,
                const std::string& note) {
  if (bytes <= 0) return;
  p.memory.push_back({name, bytes, tier, note});
}

void add_paged_tiers(Plan& p, const memory::PagingPlan& plan, const Layout& l, const std::string& what) {
  const auto page = static_cast<double>(l.page_bytes);
  p.min_compute_budget = static_cast<double>(plan.min_compute_bytes);
  if (!plan.compute_fits) {
    p.fits = false;
    p.rejections.push_back(core::str_cat("memory.compute_budget ", gib(static_cast<double>(l.compute_budget)),
                                         " is below the", l.pp > 1 ? " neediest pipeline rank's" : "",
                                         " working set: at least ", gib(p.min_compute_budget)));
  }
  add_memory(p, "pages (compute tier)", static_cast<double>(plan.compute_frames) * page, Tier::kCompute,
             core::str_cat(plan.compute_frames, " of ", plan.pages, " pages", what));
  add_memory(p, "pages (host tier)", static_cast<double>(plan.host_frames) * page, Tier::kHost);
  add_memory(p, "pages (NVMe)", static_cast<double>(plan.nvme_pages) * page, Tier::kNvme);
  if (!plan.nvme_fits) {
    p.fits = false;
    p.rejections.push_back(core::str_cat(plan.nvme_pages, " pages fit in neither budget: set memory.nvme_dir"));
  }
}

std::vector<std::string> not_trainable(const ModelSpec& m, const Layout& l) {
  std::vector<std::string> why;
  if (!l.flash_attention) why.push_back("attention keeping the s×s scores (the engine's is flash-style)");
  // TransformerConfig::shard splits the kv heads and the MLP's columns.
  if (m.n_kv_head % l.tp != 0 || m.ffn % l.tp != 0)
    why.push_back("tensor parallel replicating kv heads or splitting the MLP unevenly");
  // What the engine does not build: the one table train refuses by (capabilities.h).
  std::string with;
  for (const Refusal& r : refusals(l)) with += (with.empty() ? "" : ", ") + r.what;
  if (!with.empty()) why.push_back("pipeline parallel with " + with);
  if (l.cp > 1 && l.seq % (2 * l.cp) != 0)
    why.push_back("context parallel whose sequence does not split into 2·cp zig-zag chunks");
  return why;
}

}  // namespace detail

Plan make_plan(const ModelSpec& model, const ClusterSpec& cluster, const Layout& layout) {
  using detail::gib;
  check_layout(model, layout);
  Plan p;
  p.model = model;
  p.cluster = cluster;
  p.layout = layout;
  // What the engine trains takes its memory and its data and tensor
  // collectives from the executor's own accounting (PipelineExecutor::predict,
  // predict_collectives: analytic.cc); the rest is the analytic model. At
  // pp = 1 the whole plan is the engine's (engine_exact); a pipeline's time
  // and bubble stay analytic.
  p.not_trainable = detail::not_trainable(model, layout);
  p.engine_exact = p.not_trainable.empty() && layout.pp == 1;
  detail::analytic_plan(p);
  for (const MemoryItem& it : p.memory) {
    if (it.tier == Tier::kCompute) p.compute_peak += it.bytes;
    if (it.tier == Tier::kHost) p.host_bytes += it.bytes;
    if (it.tier == Tier::kNvme) p.nvme_bytes += it.bytes;
  }
  p.device_peak = p.compute_peak + cluster.overhead +
                  (layout.devices() > 1 ? cluster.multi_process_overhead : 0.0);

  // Fit. (A CPU build's ranks share the node's memory.)
  p.cluster.device_memory = cluster.memory_per_rank(layout.devices());
  if (p.device_peak > p.cluster.device_memory) {
    const auto largest = std::max_element(p.memory.begin(), p.memory.end(), [](const auto& a, const auto& b) {
      return (a.tier == Tier::kCompute ? a.bytes : 0) < (b.tier == Tier::kCompute ? b.bytes : 0);
    });
    p.fits = false;
    p.rejections.push_back(core::str_cat("needs ", gib(p.device_peak), " per device, has ",
                                         gib(p.cluster.device_memory), ": over by ",
                                         gib(p.device_peak - p.cluster.device_memory), " (largest: ",
                                         largest->name, " ", gib(largest->bytes), ")"));
  }
  const double host_per_device = cluster.host_memory / cluster.devices_per_node;
  if (p.host_bytes > host_per_device && cluster.host_memory > 0) {
    p.fits = false;
    p.rejections.push_back(core::str_cat("host tier needs ", gib(p.host_bytes), " per device, has ",
                                         gib(host_per_device)));
  }
  if (p.nvme_bytes > 0 && cluster.nvme_read_bw <= 0) {
    p.fits = false;
    p.rejections.push_back("the cluster has no NVMe for " + gib(p.nvme_bytes) + " of pages");
  }

  // Time.
  const double tokens = static_cast<double>(layout.batch * layout.seq);
  p.model_flops = model.flops_per_token(layout.seq) * tokens;
  const double hw_flops = p.model_flops * (layout.checkpointing ? 4.0 / 3.0 : 1.0);
  double peak = layout.bf16 ? cluster.peak_flops_bf16 : cluster.peak_flops_fp32;
  if (cluster.shared_cores)  // a node's cores split over the ranks on it
    peak *= static_cast<double>(cluster.devices_per_node) /
            std::min(layout.devices(), cluster.devices_per_node);
  p.compute_s = hw_flops / layout.devices() / (peak * cluster.efficiency);
  if (layout.pp > 1)  // (analytic_plan's, with the stages' costs)
    p.bubble_s = p.compute_s * p.bubble_stages / (1 - p.bubble_stages);
  double hidden_budget = p.compute_s, overlappable = 0, exposed = 0;
  for (const CommItem& c : p.comm) {
    p.comm_s += c.seconds;
    (c.overlaps ? overlappable : exposed) += c.seconds;
  }
  p.exposed_comm_s = exposed + std::max(0.0, overlappable - hidden_budget);
  // Paging: the lent frames' I/O hides under the backward (reads, about 2/3
  // of the compute) and the forward (writes, 1/3) as far as they last; the
  // disk does one thing at a time, so a step is never shorter than its I/O.
  const double unpaged = p.compute_s + p.bubble_s + p.exposed_comm_s;
  p.io_s += std::max(0.0, p.io_under_backward_s - p.compute_s * 2 / 3) +
            std::max(0.0, p.io_under_forward_s - p.compute_s / 3);
  p.step_s = std::max(unpaged + p.io_s, p.io_total_s);
  p.io_limit_s = std::max(unpaged, p.io_total_s);
  p.tokens_per_s = tokens / p.step_s;
  p.mfu = p.model_flops / (p.step_s * layout.devices() * peak);
  return p;
}

}  // namespace po::plan
