#include "plan/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <map>
#include <numeric>

#include "comm/mpi/ring.h"
#include "core/error.h"
#include "memory/pager.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "parallel/data_parallel.h"
#include "parallel/shard_layout.h"
#include "parallel/units.h"

namespace po::plan {
namespace {

std::string gib(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f GiB", bytes / kGiB);
  return b;
}

}  // namespace

std::string Layout::describe() const {
  std::string s = core::str_cat("dp ", dp, " × tp ", tp, " × pp ", pp, " × cp ", cp, ", ZeRO-",
                                zero_stage, ", ", bf16 ? "bf16" : "fp32", ", micro ", micro);
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

double zero_model_state_bytes(double psi, int ranks, int stage) {
  const double n = ranks;
  switch (stage) {
    case 0: return 16 * psi;
    case 1: return 4 * psi + 12 * psi / n;
    case 2: return 2 * psi + 14 * psi / n;
    default: return 16 * psi / n;
  }
}

Layout layout_from_config(const core::Config& cfg, const ModelSpec& model) {
  Layout l;
  l.dp = static_cast<int>(cfg.get_int("parallel.dp"));
  l.tp = static_cast<int>(cfg.get_int("parallel.tp"));
  l.pp = static_cast<int>(cfg.get_int("parallel.pp"));
  l.cp = static_cast<int>(cfg.get_int("parallel.cp"));
  l.zero_stage = static_cast<int>(cfg.get_int("parallel.zero_stage"));
  const std::string& precision = cfg.get_string("train.precision");
  PO_CHECK(precision == "fp32" || precision == "bf16", "train.precision = \"", precision,
           "\": choose \"fp32\" or \"bf16\"");
  l.bf16 = precision == "bf16";
  l.reduce_bf16 = cfg.get_string("parallel.reduce_dtype") == "bf16";
  l.batch = cfg.get_int("train.batch_size");
  l.micro = cfg.get_int("train.micro_batch_size");
  if (l.micro == 0) l.micro = l.batch / l.dp;
  l.seq = model.seq_len;
  l.checkpointing = cfg.get_bool("model.activation_checkpointing");
  l.overlap = cfg.get_bool("parallel.overlap_comm");
  l.bucket_bytes = cfg.get_size("parallel.bucket_size");
  l.prefetch = static_cast<int>(cfg.get_int("parallel.prefetch"));
  l.compute_budget = cfg.get_size("memory.compute_budget");
  l.host_budget = cfg.get_size("memory.host_budget");
  l.nvme = !cfg.get_string("memory.nvme_dir").empty();
  l.paging = l.host_budget > 0 || l.nvme;  // as the trainer decides (train/trainer.cc)
  l.page_bytes = cfg.get_size("memory.page_size");
  l.page_prefetch = static_cast<int>(cfg.get_int("memory.prefetch"));
  return l;
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
  PO_CHECK(l.seq % l.cp == 0, "parallel.cp = ", l.cp, " must divide the sequence of ", l.seq,
           " tokens");
  PO_CHECK(l.zero_stage >= 0 && l.zero_stage <= 3, "parallel.zero_stage = ", l.zero_stage,
           " is not one of 0, 1, 2, 3");
  PO_CHECK(l.micro >= 1 && l.batch % (static_cast<int64_t>(l.dp) * l.micro) == 0,
           "train.batch_size = ", l.batch, " must be a multiple of parallel.dp × micro_batch_size = ",
           l.dp, " × ", l.micro);
}

namespace {

// ---- time of one collective -------------------------------------------------

// Whether a group whose members sit `stride` devices apart, `size` of them,
// spans nodes (Megatron order: tp innermost, then cp, dp, pp).
bool spans_nodes(const ClusterSpec& c, int64_t stride, int64_t size) {
  return size > 1 && stride * size > c.devices_per_node;
}

// Payload (comm::Traffic's bytes) to what each rank sends with a ring.
double wire_bytes(const std::string& op, double payload, int n) {
  if (n <= 1) return 0;
  const double f = static_cast<double>(n - 1) / n;
  if (op == "allreduce") return 2 * f * payload;
  if (op == "reduce_scatter" || op == "all_gather" || op == "all_to_all") return f * payload;
  return payload;  // send / broadcast
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

void add_memory(Plan& p, const std::string& name, double bytes, Tier tier = Tier::kCompute,
                const std::string& note = "") {
  if (bytes <= 0) return;
  p.memory.push_back({name, bytes, tier, note});
}

// ---- engine-exact: the engine's own rules -------------------------------------

// UnitBuffers::Pool's size classes: a request takes the smallest free buffer
// that serves it (UnitBuffers::pool_serves), else a new one; buffers are kept.
class PoolReplay {
 public:
  int acquire(double request) {
    const size_t bytes = parallel::UnitBuffers::pool_request(static_cast<size_t>(request));
    int best = -1;
    for (size_t i = 0; i < buffers_.size(); ++i) {
      const Buffer& b = buffers_[i];
      if (!b.used && parallel::UnitBuffers::pool_serves(b.bytes, bytes) &&
          (best < 0 || b.bytes < buffers_[static_cast<size_t>(best)].bytes))
        best = static_cast<int>(i);
    }
    if (best < 0) {
      buffers_.push_back({bytes, false});
      best = static_cast<int>(buffers_.size()) - 1;
    }
    buffers_[static_cast<size_t>(best)].used = true;
    return best;
  }
  void release(int i) { buffers_[static_cast<size_t>(i)].used = false; }
  double bytes() const {
    double n = 0;
    for (const Buffer& b : buffers_) n += static_cast<double>(b.bytes);
    return n;
  }

 private:
  struct Buffer {
    size_t bytes;
    bool used;
  };
  std::vector<Buffer> buffers_;
};

// UnitBuffers (parallel/units.cc) replayed along GPT2's hook order
// (model/transformer.h) for `steps` steps of `accum` micro-batches: the pools'
// sizes once every buffer they will keep exists. Reductions are assumed to
// complete only when waited for (the most buffers they can hold).
struct UnitReplay {
  UnitReplay(const parallel::ShardLayout& l, const Layout& o, bool paged_shards, bool deferred,
             const model::TransformerConfig& config)
      : layout(l),
        engine(config),
        stage(o.zero_stage),
        prefetch(o.prefetch),
        bf16(o.bf16),
        reduce_bf16(o.reduce_bf16 && l.ranks() > 1),
        overlap(o.overlap),
        grouped(l.ranks() > 1),
        paged(paged_shards),
        defer(deferred) {
    init();
  }
  const parallel::ShardLayout& layout;
  const model::TransformerConfig& engine;
  int stage, prefetch;
  bool bf16, reduce_bf16, overlap, grouped, paged, defer;
  PoolReplay gather, work, acc;
  std::vector<int> order;
  int next = 0, issued = 0;
  std::deque<std::pair<int, int>> inflight;  // (position, buffer)
  std::vector<std::pair<char, int>> active;  // pool ('g' / 'w' / 0), buffer
  std::vector<int> acc_of;                   // unit -> accumulator buffer or -1
  std::deque<std::pair<int, int>> pending;   // (unit, buffer) reductions in flight

  double esz() const { return bf16 ? 2 : 4; }
  bool full_grads() const { return stage < 2; }
  double gather_bytes(int u) const {
    const double padded = static_cast<double>(layout.stride(u) * layout.ranks());
    const double send = paged && grouped ? static_cast<double>(layout.stride(u)) : 0;
    return (padded + send) * esz();
  }
  double acc_bytes(int u) const {
    const double padded = static_cast<double>(layout.stride(u) * layout.ranks());
    double b = padded * 4;
    if (full_grads() || !grouped) return b;
    const double wire = reduce_bf16 ? 2 : 4;
    if (reduce_bf16) b += padded * wire;
    return b + static_cast<double>(layout.stride(u)) * wire;
  }
  void init() {
    order = parallel::UnitBuffers::gather_order(po::model::Layout(engine));
    next = issued = static_cast<int>(order.size());
    active.assign(static_cast<size_t>(layout.num_units()), {0, -1});
    acc_of.assign(static_cast<size_t>(layout.num_units()), -1);
  }
  void issue(int pos) {
    inflight.emplace_back(pos, gather.acquire(gather_bytes(order[static_cast<size_t>(pos)])));
    ++issued;
  }
  void drain() {
    for (auto& g : inflight) gather.release(g.second);
    inflight.clear();
    issued = next;
  }
  void serve(int u, int buf) {
    if (!bf16) {
      active[static_cast<size_t>(u)] = {'g', buf};
      return;
    }
    active[static_cast<size_t>(u)] = {'w', work.acquire(4.0 * static_cast<double>(layout.unit_numel(u)))};
    gather.release(buf);
  }
  void params(int u) {
    if (stage < 3) {
      if (bf16) active[static_cast<size_t>(u)] = {'w', work.acquire(4.0 * static_cast<double>(layout.unit_numel(u)))};
      return;
    }
    const int n = static_cast<int>(order.size());
    if (next >= n || order[static_cast<size_t>(next)] != u) {
      drain();
      next = issued = order[0] == u ? 0 : n;
    }
    if (next < n) {
      if (inflight.empty()) issue(next);
      const int buf = inflight.front().second;
      inflight.pop_front();
      ++next;
      const int ahead = std::min(n, next + prefetch);
      while (issued < ahead) issue(issued);
      serve(u, buf);
    } else {
      serve(u, gather.acquire(gather_bytes(u)));
    }
  }
  void done(int u) {
    auto& [pool, buf] = active[static_cast<size_t>(u)];
    if (pool == 'g') gather.release(buf);
    if (pool == 'w') work.release(buf);
    pool = 0;
  }
  void complete_front() {
    acc.release(pending.front().second);
    pending.pop_front();
  }
  void grads(int u) {
    if (acc_of[static_cast<size_t>(u)] >= 0) return;
    while (std::any_of(pending.begin(), pending.end(), [u](auto& r) { return r.first == u; }))
      complete_front();
    acc_of[static_cast<size_t>(u)] = acc.acquire(acc_bytes(u));
  }
  void grads_ready(int u) {
    const int buf = acc_of[static_cast<size_t>(u)];
    if (buf < 0) return;
    acc_of[static_cast<size_t>(u)] = -1;
    if (full_grads() || !grouped) {
      acc.release(buf);
      return;
    }
    pending.emplace_back(u, buf);
    if (!overlap) {
      while (!pending.empty()) complete_front();
      return;
    }
    while (pending.size() > parallel::UnitBuffers::kMaxReductionsInFlight) complete_front();
  }
  // One forward_backward: the declared schedule's steps (model::Layout::
  // training_steps) with the hooks each asks, as model/transformer.h runs them.
  void micro_batch(bool last) {
    const bool deferred = defer && last;
    const model::Layout decl(engine);
    const int hu = decl.head_unit();
    for (const model::Step& s : decl.training_steps()) {
      const std::vector<int> units = decl.step_units(s);
      switch (s.kind) {
        case model::Step::kEmbedForward:
        case model::Step::kBlockForward:
          for (int u : units) {
            params(u);
            done(u);
          }
          break;
        case model::Step::kHead:
          for (int u : units) params(u);
          for (int u : units) grads(u);
          for (auto it = units.rbegin(); it != units.rend(); ++it) done(*it);
          grads_ready(hu);
          if (deferred) grads_ready(0);
          break;
        case model::Step::kBlockBackward:
          params(units[0]);
          grads(units[0]);
          done(units[0]);
          grads_ready(units[0]);
          break;
        case model::Step::kEmbedBackward:
          if (!deferred) {
            grads(0);
            grads_ready(0);
          }
          break;
      }
    }
  }
  void step() {
    while (!pending.empty()) complete_front();
    drain();
  }
};

// The ring all-reduce / reduce-scatter's scratch per operation in flight
// (comm/mpi/ring.h), for collectives large enough to take it.
double ring_scratch(const std::string& op, double payload, int n) {
  if (n <= 1 || payload < static_cast<double>(comm::mpi::ring::kMinBytes)) return 0;
  if (op != "allreduce" && op != "reduce_scatter") return 0;
  double b = comm::mpi::ring::kSlots * static_cast<double>(comm::mpi::ring::kSegmentBytes);
  if (op == "reduce_scatter") b += std::min(n - 2, 2) * payload / n;  // partial sums, one block each
  return b;
}

void engine_plan(Plan& p) {
  const Layout& l = p.layout;
  const ModelSpec& m = p.model;
  model::TransformerConfig cfg = m.gpt2();
  cfg.seq_len = std::max(cfg.seq_len, l.seq);
  cfg.activation_checkpointing = l.checkpointing;
  cfg.bf16_activations = l.bf16;
  const std::vector<int64_t> units = cfg.unit_numels();
  const int N = l.dp, stage = l.zero_stage, U = static_cast<int>(units.size());
  const parallel::ShardLayout layout(units, N, 0);
  const bool grouped = N > 1;
  const double psi = static_cast<double>(cfg.num_params());
  const double local = static_cast<double>(layout.local_numel());
  const double esz = l.bf16 ? 2 : 4;
  const double resz = l.reduce_bf16 && l.bf16 ? 2 : 4;  // gradient bytes on the wire
  const bool has_units = stage >= 2 || l.bf16;
  const bool defer = grouped && l.overlap && stage < 2;
  const int64_t accum = l.accum();
  const int64_t rows = l.micro * l.seq;

  // Buckets (stages 0-1 with a group).
  std::vector<std::pair<int, int>> buckets;
  int64_t max_bucket = 0;
  std::vector<double> bucket_numel;
  if (grouped && stage < 2) {
    buckets = parallel::DataParallel::bucket_units(units, static_cast<size_t>(esz), l.bucket_bytes, defer);
    for (auto [lo, hi] : buckets) {
      int64_t n = 0;
      for (int u = lo; u <= hi; ++u) n += units[static_cast<size_t>(u)];
      bucket_numel.push_back(static_cast<double>(n));
      max_bucket = std::max(max_bucket, n);
    }
  }

  // Paging (the trainer's set-up, train/trainer.cc setup_paging).
  optim::PagedAdamState::Layout pl;
  pl.master = l.bf16;
  if (stage == 3) pl.param_bytes = pl.grad_bytes = static_cast<size_t>(esz);
  const bool paged = l.paging;
  const bool paged_shards = paged && stage == 3;
  const double state_numel = stage == 0 ? psi : local;

  // Model states (DataParallel::memory()'s kinds).
  double params = stage == 3 ? local * esz : psi * esz;
  if (stage == 3 && N == 1 && !l.bf16) params = psi * 4;
  double grads = stage < 2 ? psi * esz : local * esz;
  if (!l.bf16 && stage == 1) grads += local * 4;  // the update's shard of the reduced gradient
  double master = l.bf16 ? state_numel * 4 : 0;
  double adam = 8 * state_numel;
  const double unpaged_states = params + grads + master + adam;
  const double paged_bytes = paged ? state_numel * static_cast<double>(pl.element_bytes()) : 0;
  if (paged) {
    adam = 0;
    master = 0;
    if (paged_shards) params = grads = 0;
  }
  add_memory(p, "parameters", params, Tier::kCompute, l.bf16 ? "bf16" : "fp32");
  add_memory(p, "gradients", grads);
  add_memory(p, "fp32 master weights", master);
  add_memory(p, "Adam m, v", adam);

  // Gathered-unit buffers and accumulators (UnitBuffers' pools, replayed).
  double gathered = 0, accumulators = 0;
  if (has_units) {
    UnitReplay r(layout, l, paged_shards, defer, m.engine);
    for (int step = 0; step < 2; ++step) {
      for (int64_t mb = 0; mb < accum; ++mb) r.micro_batch(mb == accum - 1);
      r.step();
    }
    gathered = r.gather.bytes() + r.work.bytes();
    accumulators = r.acc.bytes();
  }
  if (grouped && (stage == 1 || stage == 2)) {  // DataParallel::gather_params' send/receive blocks
    int64_t max_stride = 0, max_padded = 0;
    for (int u = 0; u < U; ++u) {
      max_stride = std::max(max_stride, layout.stride(u));
      if (layout.stride(u) * N != layout.unit_numel(u)) max_padded = std::max(max_padded, layout.stride(u));
    }
    gathered += 2.0 * static_cast<double>(max_stride) * esz + 2.0 * static_cast<double>(max_padded * N) * esz;
  }
  add_memory(p, "gathered-unit buffers", gathered);
  double buckets_bytes = accumulators;
  if (defer) buckets_bytes += static_cast<double>(rows * N) * (4 + 4.0 * static_cast<double>(cfg.n_embd));
  // bf16 gradients all-reduced in f32: at most kMaxStaged buckets staged at
  // once, consecutive ones (transient, part of the peak).
  double staged = 0;
  if (grouped && stage < 2 && l.bf16 && !l.reduce_bf16)
    for (size_t i = 0; i < bucket_numel.size(); ++i)
      staged = std::max(staged, 4 * (bucket_numel[i] + (i > 0 ? bucket_numel[i - 1] : 0)));
  add_memory(p, "communication buckets", buckets_bytes + staged, Tier::kCompute,
             staged > 0 ? "incl. f32 staging of bf16 buckets" : "");

  // Activations: the engine's layout (model/gpt2.cc layout_activations).
  const double logits = static_cast<double>(model::Transformer::predicted_logits_bytes(cfg, l.micro, l.seq));
  const double acts = static_cast<double>(model::Transformer::predicted_activation_bytes(cfg, l.micro, l.seq));
  add_memory(p, "activations", acts - logits, Tier::kCompute, l.checkpointing ? "checkpointed" : "");
  add_memory(p, "logits / loss buffers", logits);
  model::TransformerConfig other = cfg;
  other.activation_checkpointing = !l.checkpointing;
  const double acts_other = static_cast<double>(model::Transformer::predicted_activation_bytes(other, l.micro, l.seq));
  p.activations_no_ckpt = l.checkpointing ? acts_other : acts;
  p.activations_ckpt = l.checkpointing ? acts : acts_other;
  p.activations_formula = static_cast<double>(cfg.n_layer) *
                          korthikanti_layer_bytes(static_cast<double>(l.seq), static_cast<double>(l.micro),
                                                  static_cast<double>(cfg.n_embd),
                                                  static_cast<double>(cfg.n_head), 1, false,
                                                  l.checkpointing, true);

  // Collectives per step (what comm::Traffic counts on the data-parallel group).
  // Ring scratch, at most: one per ring operation that can be in flight at
  // once (every eligible bucket at stages 0-1; kMaxReductionsInFlight + 1
  // reduce-scatters at stages 2-3), each the largest such operation's.
  double ring = 0;
  if (grouped) {
    const bool inter = spans_nodes(p.cluster, 1, N);
    if (stage < 2) {
      double total = 0, largest = 0;
      int eligible = 0;
      for (double n : bucket_numel) {
        total += n * resz;
        const double r = ring_scratch("allreduce", n * resz, N);
        eligible += r > 0 ? 1 : 0;
        largest = std::max(largest, r);
      }
      ring = eligible * largest;
      add_comm(p, "dp", "allreduce", "gradient buckets", buckets.size(), total, N, inter, l.overlap);
      if (defer)
        add_comm(p, "dp", "all_gather", "embedding-lookup rows", 2,
                 static_cast<double>(rows * N) * (4 + 4.0 * static_cast<double>(cfg.n_embd)), N,
                 inter, false);
    } else {
      double rs = 0, largest = 0;
      int eligible = 0;
      for (int u = 0; u < U; ++u) {
        const double payload = static_cast<double>(layout.stride(u) * N) * resz;
        rs += payload;
        const double r = ring_scratch("reduce_scatter", payload, N);
        eligible += r > 0 ? 1 : 0;
        largest = std::max(largest, r);
      }
      ring = std::min<double>(eligible, parallel::UnitBuffers::kMaxReductionsInFlight + 1) * largest;
      add_comm(p, "dp", "reduce_scatter", "gradient shards, per unit and micro-batch",
               static_cast<uint64_t>(U * accum), rs * static_cast<double>(accum), N, inter, l.overlap);
      add_comm(p, "dp", "all_gather", "gradient norm (sums of squares)", 1, 8.0 * N, N, inter, false);
    }
    if (stage == 1 || stage == 2) {
      double ag = 0;
      for (int u = 0; u < U; ++u) ag += static_cast<double>(layout.stride(u) * N) * esz;
      add_comm(p, "dp", "all_gather", "updated parameter shards", static_cast<uint64_t>(U), ag, N,
               inter, false);
    }
    if (stage == 3) {
      double ag = 0;
      const std::vector<int> order = parallel::UnitBuffers::gather_order(model::Layout(m.engine));
      const auto n = static_cast<int>(order.size());
      for (int u : order) ag += static_cast<double>(layout.stride(u) * N) * esz;
      add_comm(p, "dp", "all_gather", "parameter gathers, per unit use and micro-batch",
               static_cast<uint64_t>(n * accum), ag * static_cast<double>(accum), N, inter, true);
    }
  }
  add_memory(p, "ring scratch", ring, Tier::kCompute, ring > 0 ? "at most" : "");
  p.working_bytes = gathered + buckets_bytes + staged + ring;

  // Pages: the trainer's frame count for the budgets.
  if (paged) {
    const optim::PagedAdamState::Geometry geo =
        optim::PagedAdamState::geometry(static_cast<int64_t>(state_numel), l.page_bytes, pl);
    const auto pages = static_cast<double>(geo.pages());
    const double page = static_cast<double>(l.page_bytes);
    const double fixed = unpaged_states - paged_bytes + acts + p.working_bytes;
    const auto min_frames = static_cast<double>(optim::PagedAdamState::min_compute_frames(geo, l.page_prefetch));
    double frames = pages;
    p.min_compute_budget = fixed + min_frames * page;
    if (l.compute_budget > 0) {
      const double need = p.min_compute_budget;
      if (static_cast<double>(l.compute_budget) < need) {
        p.fits = false;
        p.rejections.push_back(core::str_cat("memory.compute_budget ", gib(static_cast<double>(l.compute_budget)),
                                             " is below the working set: at least ", gib(need)));
        frames = min_frames;
      } else {
        frames = std::min(pages, std::floor((static_cast<double>(l.compute_budget) - fixed) / page));
      }
    }
    const double host_frames = std::min(pages - frames, std::floor(static_cast<double>(l.host_budget) / page));
    const double nvme_pages = pages - frames - host_frames;
    add_memory(p, "pages (compute tier)", frames * page, Tier::kCompute,
               core::str_cat(static_cast<int64_t>(frames), " of ", static_cast<int64_t>(pages), " pages"));
    add_memory(p, "pages (host tier)", static_cast<double>(l.host_budget > 0 ? std::floor(static_cast<double>(l.host_budget) / page) : 0) * page, Tier::kHost);
    add_memory(p, "pages (NVMe)", nvme_pages * page, Tier::kNvme);
    if (nvme_pages > 0 && !l.nvme) {
      p.fits = false;
      p.rejections.push_back(core::str_cat(static_cast<int64_t>(nvme_pages),
                                           " pages fit in neither budget: set memory.nvme_dir"));
    }
    // Every page not in the compute tier is read and written once per step.
    const double host_part = host_frames * page, nvme_part = nvme_pages * page;
    const double io = (p.cluster.host_bw > 0 ? 2 * host_part / p.cluster.host_bw : 0) +
                      (p.cluster.nvme_read_bw > 0 ? nvme_part / p.cluster.nvme_read_bw : 0) +
                      (p.cluster.nvme_write_bw > 0 ? nvme_part / p.cluster.nvme_write_bw : 0);
    p.io_s = io;
  }
}

// ---- analytic: Megatron-style layouts ----------------------------------------

void analytic_plan(Plan& p) {
  const Layout& l = p.layout;
  const ModelSpec& m = p.model;
  const std::vector<int64_t> units = m.unit_numels();
  const int L = static_cast<int>(m.n_layer);
  const double block = static_cast<double>(units[1]);
  const double first = static_cast<double>(units[0]), last = static_cast<double>(units.back());
  // The busiest pipeline stage holds L/pp blocks and the embedding (or the head).
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
  } else {
    if (l.bf16) add_memory(p, "fp32 master weights", opt / 3);
    add_memory(p, "Adam m, v", l.bf16 ? opt * 2 / 3 : opt);
  }
  if (stage == 3)
    add_memory(p, "gathered-unit buffers", (l.prefetch + 2) * std::max(block, first) / l.tp * esz);
  if (stage < 3) add_memory(p, "communication buckets", std::min(2.0 * static_cast<double>(l.bucket_bytes), grads));

  // Activations, Korthikanti et al. (16-bit; fp32 doubles them), with
  // flash-style attention (no s×s scores) unless flash_attention is off,
  // the sequence split by cp; 1F1B keeps min(pp, m)
  // micro-batches in flight on the first stage.
  const double s = static_cast<double>(l.seq) / l.cp, b = static_cast<double>(l.micro);
  const double h = static_cast<double>(m.n_embd), a = static_cast<double>(m.n_head);
  const double scale = l.bf16 ? 1 : 2;
  const double layers = std::ceil(static_cast<double>(L) / l.pp);
  const double in_flight = std::min<double>(l.pp, static_cast<double>(l.accum()));
  const bool sp = l.tp > 1 && l.sequence_parallel;
  const double full = korthikanti_layer_bytes(s, b, h, a, l.tp, sp, false, l.flash_attention) * scale;
  const double ckpt = korthikanti_layer_bytes(s, b, h, a, l.tp, sp, true, l.flash_attention) * scale / (sp ? l.tp : 1);
  p.activations_no_ckpt = full * layers * in_flight;
  p.activations_ckpt = ckpt * layers * in_flight + full;  // + one layer recomputed
  add_memory(p, "activations", l.checkpointing ? p.activations_ckpt : p.activations_no_ckpt,
             Tier::kCompute, core::str_cat("Korthikanti et al.", l.checkpointing ? ", checkpointed" : ""));
  add_memory(p, "logits / loss buffers", 2 * 4 * s * b * static_cast<double>(m.vocab) / l.tp,
             Tier::kCompute, "fp32 logits and their gradient, last stage");

  // Communication per step.
  const double act_bytes = s * b * h * esz;  // one [s, b, h] activation
  const double mb = static_cast<double>(l.accum());
  const double resz = l.reduce_bf16 ? 2 : 4;
  const bool dp_inter = spans_nodes(p.cluster, static_cast<int64_t>(l.tp) * l.cp, l.dp);
  const int n = shard;
  if (n > 1) {
    if (stage == 0) {
      add_comm(p, "dp", "allreduce", "gradients", 1, stage_params * resz, n, dp_inter, true);
    } else {
      add_comm(p, "dp", "reduce_scatter", "gradients", stage == 1 ? 1 : static_cast<uint64_t>(mb),
               stage_params * resz * (stage == 1 ? 1 : mb), n, dp_inter, true);
      if (stage < 3)
        add_comm(p, "dp", "all_gather", "updated parameters", 1, stage_params * esz, n, dp_inter, false);
      else
        add_comm(p, "dp", "all_gather", "parameter gathers (forward and backward)",
                 static_cast<uint64_t>(2 * mb), 2 * mb * stage_params * esz, n, dp_inter, true);
    }
  }
  if (l.tp > 1) {
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
  if (l.pp > 1) {
    const bool inter = spans_nodes(p.cluster, static_cast<int64_t>(l.tp) * l.cp * l.dp, l.pp);
    add_comm(p, "pp", "send", "activations forward, gradients backward", static_cast<uint64_t>(2 * mb),
             2 * mb * act_bytes / (sp ? l.tp : 1), 2, inter, false);
  }
  if (l.cp > 1) {
    const bool inter = spans_nodes(p.cluster, l.tp, l.cp);
    const double kv = 2 * s * b * h * static_cast<double>(m.n_kv_head) / static_cast<double>(m.n_head) * esz / l.tp;
    // Ring attention: K, V blocks pass cp - 1 times forward; K, V and their
    // gradients backward.
    add_comm(p, "cp", "send", "ring attention K/V blocks", static_cast<uint64_t>(3 * (l.cp - 1) * layers * mb),
             3 * (l.cp - 1) * layers * mb * kv, 2, inter, true);
  }
  // (Tied embedding and head gradients between the first and last stage: small, not counted.)
}

}  // namespace

double engine_working_bytes(const ModelSpec& model, const Layout& layout) {
  PO_CHECK(layout.tp == 1 && layout.pp == 1 && layout.cp == 1,
           "engine_working_bytes: a layout the engine runs (GPT-2, data parallel)");
  Plan p;
  p.model = model;
  p.layout = layout;
  engine_plan(p);
  return p.working_bytes;
}

Plan make_plan(const ModelSpec& model, const ClusterSpec& cluster, const Layout& layout) {
  check_layout(model, layout);
  Plan p;
  p.model = model;
  p.cluster = cluster;
  p.layout = layout;
  if (!model.engine_trainable())
    p.not_trainable.push_back("architecture (RMSNorm, SwiGLU, RoPE, grouped-query attention, untied head)");
  if (layout.tp > 1) p.not_trainable.push_back("tensor parallel");
  if (layout.pp > 1) p.not_trainable.push_back("pipeline parallel");
  if (layout.cp > 1) p.not_trainable.push_back("context parallel");
  p.engine_exact = layout.tp == 1 && layout.pp == 1 && layout.cp == 1;
  if (p.engine_exact) {
    engine_plan(p);
  } else {
    analytic_plan(p);
  }
  for (const MemoryItem& it : p.memory) {
    if (it.tier == Tier::kCompute) p.compute_peak += it.bytes;
    if (it.tier == Tier::kHost) p.host_bytes += it.bytes;
    if (it.tier == Tier::kNvme) p.nvme_bytes += it.bytes;
  }
  p.device_peak = p.compute_peak + cluster.overhead;

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
  const double mb = static_cast<double>(layout.accum());
  if (layout.pp > 1) p.bubble_s = p.compute_s * (layout.pp - 1) / mb;  // 1F1B
  double hidden_budget = p.compute_s, overlappable = 0, exposed = 0;
  for (const CommItem& c : p.comm) {
    p.comm_s += c.seconds;
    (c.overlaps ? overlappable : exposed) += c.seconds;
  }
  p.exposed_comm_s = exposed + std::max(0.0, overlappable - hidden_budget);
  p.step_s = p.compute_s + p.bubble_s + p.exposed_comm_s + p.io_s;
  p.tokens_per_s = tokens / p.step_s;
  p.mfu = p.model_flops / (p.step_s * layout.devices() * peak);
  return p;
}

SearchResult search(const ModelSpec& model, const ClusterSpec& cluster, const Layout& base, int devices,
                    bool trainable_only) {
  SearchResult r;
  auto divisors = [](int n) {
    std::vector<int> d;
    for (int i = 1; i <= n; ++i)
      if (n % i == 0) d.push_back(i);
    return d;
  };
  for (int tp : divisors(devices)) {
    if (tp > cluster.devices_per_node) continue;
    for (int pp : divisors(devices / tp)) {
      for (int cp : divisors(devices / tp / pp)) {
        if (cp > 8) continue;
        const int dp = devices / tp / pp / cp;
        for (int stage = 0; stage <= 3; ++stage) {
          for (int64_t micro : {1, 2, 4, 8, 16}) {
            for (bool ckpt : {false, true}) {
              bool unpaged_fits = false;
              for (int paging = 0; paging < 2; ++paging) {
                Layout l = base;
                l.dp = dp;
                l.tp = tp;
                l.pp = pp;
                l.cp = cp;
                l.zero_stage = stage;
                l.micro = micro;
                l.checkpointing = ckpt;
                l.paging = paging == 1;
                l.compute_budget = 0;
                l.host_budget = 0;
                l.nvme = false;
                if (l.paging) {
                  if (unpaged_fits) continue;  // paging only where the state does not fit otherwise
                  if (model.engine_trainable() && tp * pp * cp == 1) {
                    // The engine's pages: the device keeps what its memory
                    // holds; the rest goes to host RAM (a GPU node) or NVMe
                    // (a CPU node, whose host RAM is its device memory).
                    const double device = cluster.memory_per_rank(devices);
                    l.compute_budget = static_cast<uint64_t>(std::max(0.0, device - cluster.overhead));
                    if (cluster.shared_cores) l.nvme = cluster.nvme_read_bw > 0;
                    else l.host_budget = static_cast<uint64_t>(cluster.host_memory / cluster.devices_per_node);
                  }
                }
                try {
                  check_layout(model, l, devices);
                } catch (const core::Error&) {
                  ++r.invalid;
                  continue;
                }
                Plan p = make_plan(model, cluster, l);
                if (!l.paging) unpaged_fits = p.fits;
                if (trainable_only && !p.not_trainable.empty()) continue;
                (p.fits ? r.fitting : r.rejected).push_back(std::move(p));
              }
            }
          }
        }
      }
    }
  }
  auto faster = [](const Plan& a, const Plan& b) { return a.tokens_per_s > b.tokens_per_s; };
  std::stable_sort(r.fitting.begin(), r.fitting.end(), faster);
  std::stable_sort(r.rejected.begin(), r.rejected.end(), faster);
  return r;
}

}  // namespace po::plan
