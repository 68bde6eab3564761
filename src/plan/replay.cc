// The engine-exact plan: the engine's own rules replayed for a data-parallel
// layout — the shard layout, the all-reduce buckets (DataParallel::
// bucket_units), UnitBuffers' pools walked along the declared schedule, the
// activation layout, the ring's scratch and the pager's frames — so that the
// predicted compute-tier peak and collectives are what the engine measures.
#include <algorithm>
#include <cmath>
#include <deque>
#include <vector>

#include "comm/mpi/ring_sizes.h"
#include "core/error.h"
#include "model/layout.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "parallel/data_parallel.h"
#include "parallel/shard_layout.h"
#include "parallel/units.h"
#include "plan/plan_parts.h"
#include "plan/planner.h"

namespace po::plan {
namespace {

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

}  // namespace

namespace detail {

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

  // Paging (the trainer's set-up, train/paging_setup.cc setup_paging).
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

}  // namespace detail

double engine_working_bytes(const ModelSpec& model, const Layout& layout) {
  PO_CHECK(layout.tp == 1 && layout.pp == 1 && layout.cp == 1,
           "engine_working_bytes: a layout the engine runs (GPT-2, data parallel)");
  Plan p;
  p.model = model;
  p.layout = layout;
  detail::engine_plan(p);
  return p.working_bytes;
}

}  // namespace po::plan
