#include "parallel/working_set.h"

#include <algorithm>
#include <deque>
#include <vector>

#include "comm/mpi/ring_sizes.h"
#include "model/layout.h"
#include "parallel/data_parallel.h"
#include "parallel/shard_layout.h"
#include "parallel/units.h"

namespace po::parallel {
namespace {

// UnitBuffers::Pool's size classes: a request takes the smallest free buffer
// that serves it (UnitBuffers::pool_serves), else a new one; buffers are kept.
class PoolReplay {
 public:
  int acquire(double request) {
    const size_t bytes = UnitBuffers::pool_request(static_cast<size_t>(request));
    int best = -1;
    for (size_t i = 0; i < buffers_.size(); ++i) {
      const Buffer& b = buffers_[i];
      if (!b.used && UnitBuffers::pool_serves(b.bytes, bytes) &&
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
  UnitReplay(const ShardLayout& l, const WorkingSetOptions& o, bool paged_shards, bool deferred,
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
  const ShardLayout& layout;
  const model::TransformerConfig& engine;
  int stage, prefetch;
  bool bf16, reduce_bf16, overlap, grouped, paged, defer;
  PoolReplay gather, work, acc;
  std::vector<int> order;
  int next = 0, issued = 0;
  std::deque<std::pair<int, int>> inflight;  // (position, buffer)
  struct Active {
    char pool = 0;  // 'g' / 'w' / 0
    int buf = -1;
    int bits = -1;  // bf16: the gathered buffer a lean use keeps until done
  };
  std::vector<Active> active;
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
    order = UnitBuffers::gather_order(model::Layout(engine));
    next = issued = static_cast<int>(order.size());
    active.assign(static_cast<size_t>(layout.num_units()), Active{});
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
  // Training steps ask UnitHooks::params_lean (bf16 GEMMs): the gathered
  // bits stay beside the widened f32 values until done.
  void serve(int u, int buf) {
    if (!bf16) {
      active[static_cast<size_t>(u)] = {'g', buf, -1};
      return;
    }
    active[static_cast<size_t>(u)] = {'w', work.acquire(4.0 * static_cast<double>(layout.unit_numel(u))), buf};
  }
  void params(int u) {
    if (stage < 3) {
      if (bf16) active[static_cast<size_t>(u)] = {'w', work.acquire(4.0 * static_cast<double>(layout.unit_numel(u))), -1};
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
    Active& a = active[static_cast<size_t>(u)];
    if (a.bits >= 0) gather.release(a.bits);
    if (a.pool == 'g') gather.release(a.buf);
    if (a.pool == 'w') work.release(a.buf);
    a = Active{};
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
    while (pending.size() > UnitBuffers::kMaxReductionsInFlight) complete_front();
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
}  // namespace

double ring_scratch(bool reduce_scatter, double payload, int n) {
  if (n <= 1 || payload < static_cast<double>(comm::mpi::ring::kMinBytes)) return 0;
  double b = comm::mpi::ring::kSlots * static_cast<double>(comm::mpi::ring::kSegmentBytes);
  if (reduce_scatter) b += std::min(n - 2, 2) * payload / n;  // partial sums, one block each
  return b;
}

WorkingSet working_set(const model::TransformerConfig& cfg, const WorkingSetOptions& o) {
  WorkingSet ws;
  const std::vector<int64_t> units = cfg.unit_numels(o.tp);
  const int N = o.ranks, stage = o.zero_stage, U = static_cast<int>(units.size());
  const ShardLayout layout(units, N, 0, o.align);
  const bool grouped = N > 1;
  const double esz = o.bf16 ? 2 : 4;
  const double resz = o.reduce_bf16 && o.bf16 ? 2 : 4;  // gradient bytes on the wire
  const bool has_units = stage >= 2 || o.bf16;
  ws.defer = grouped && o.overlap && stage < 2 && !o.context;  // as DataParallel decides
  if (grouped && stage < 2) {
    ws.buckets = DataParallel::bucket_units(units, static_cast<size_t>(esz), o.bucket_bytes, ws.defer);
    for (auto [lo, hi] : ws.buckets) {
      int64_t n = 0;
      for (int u = lo; u <= hi; ++u) n += units[static_cast<size_t>(u)];
      ws.bucket_numel.push_back(static_cast<double>(n));
    }
  }
  if (has_units) {
    UnitReplay r(layout, o, o.paged && stage == 3, ws.defer, cfg);
    for (int step = 0; step < 2; ++step) {
      for (int64_t mb = 0; mb < o.accum; ++mb) r.micro_batch(mb == o.accum - 1);
      r.step();
    }
    ws.gathered = r.gather.bytes() + r.work.bytes();
    ws.accumulators = r.acc.bytes();
  }
  if (grouped && (stage == 1 || stage == 2)) {  // DataParallel::gather_params' send/receive blocks
    int64_t max_stride = 0, max_padded = 0;
    for (int u = 0; u < U; ++u) {
      max_stride = std::max(max_stride, layout.stride(u));
      if (layout.stride(u) * N != layout.unit_numel(u)) max_padded = std::max(max_padded, layout.stride(u));
    }
    ws.gathered += 2.0 * static_cast<double>(max_stride) * esz + 2.0 * static_cast<double>(max_padded * N) * esz;
  }
  if (ws.defer) ws.lookup_rows = static_cast<double>(o.micro * o.seq * N) * (4 + 4.0 * static_cast<double>(cfg.n_embd));
  // A tied table's lookup rows of the step, gathered at it (tied_pair.h).
  if (model::Layout(cfg, {o.tp, 0}).tied())
    ws.lookup_rows += static_cast<double>(LookupRows::predicted_bytes(o.accum * o.micro * o.seq, cfg.n_embd, N));
  // bf16 gradients all-reduced in f32: at most kMaxStaged buckets staged at
  // once, consecutive ones (transient, part of the peak).
  if (grouped && stage < 2 && o.bf16 && !o.reduce_bf16)
    for (size_t i = 0; i < ws.bucket_numel.size(); ++i)
      ws.staged = std::max(ws.staged, 4 * (ws.bucket_numel[i] + (i > 0 ? ws.bucket_numel[i - 1] : 0)));
  // Ring scratch, at most: one per ring operation that can be in flight at
  // once (every eligible bucket at stages 0-1; kMaxReductionsInFlight + 1
  // reduce-scatters at stages 2-3), each the largest such operation's.
  if (grouped) {
    double largest = 0;
    int eligible = 0;
    auto consider = [&](bool rs, double payload) {
      const double r = ring_scratch(rs, payload, N);
      eligible += r > 0 ? 1 : 0;
      largest = std::max(largest, r);
    };
    if (stage < 2) {
      for (double n : ws.bucket_numel) consider(false, n * resz);
      ws.ring = eligible * largest;
    } else {
      for (int u = 0; u < U; ++u) consider(true, static_cast<double>(layout.stride(u) * N) * resz);
      ws.ring = std::min<double>(eligible, UnitBuffers::kMaxReductionsInFlight + 1) * largest;
    }
  }
  // The tensor group's ring is a channel of its own. Its collectives block,
  // one at a time, and the largest is a [B·T, C] f32 activation: one
  // scratch (a reduce-scatter's under sequence parallel, an all-reduce's
  // otherwise).
  ws.ring += ring_scratch(o.sequence_parallel && o.tp > 1,
                          4.0 * static_cast<double>(o.micro * o.seq * cfg.n_embd), o.tp);
  return ws;
}

}  // namespace po::parallel
