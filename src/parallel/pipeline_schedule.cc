#include "parallel/pipeline_schedule.h"

#include <algorithm>
#include <array>
#include <limits>
#include <numeric>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/vocab_head.h"

namespace po::parallel::pipeline {
namespace {

constexpr std::array<std::pair<const char*, ScheduleKind>, 5> kNames = {{
    {"gpipe", ScheduleKind::kGPipe},
    {"1f1b", ScheduleKind::k1F1B},
    {"interleaved", ScheduleKind::kInterleaved},
    {"zb-h1", ScheduleKind::kZbH1},
    {"zbv", ScheduleKind::kZbV},
}};

constexpr double kNever = -1;

bool is_compute(Op op) { return op != Op::kSend && op != Op::kRecv; }

// When each stage's compute of each micro-batch ends (kNever: not yet), and
// how far each stage has got in each kind.
struct Progress {
  std::vector<std::vector<double>> f, b, w;  // [stage][micro]
  std::vector<int> next_f, next_b, next_w;   // [stage]
  // Vocabulary parallel: each rank's S and T ([rank][micro]).
  std::vector<std::vector<double>> hs, hg;
  std::vector<int> next_hs, next_hg;  // [rank]
  Progress(int stages, int micro, int ranks)
      : f(stages, std::vector<double>(micro, kNever)),
        b(f),
        w(f),
        next_f(stages, 0),
        next_b(stages, 0),
        next_w(stages, 0),
        hs(ranks, std::vector<double>(micro, kNever)),
        hg(hs),
        next_hs(ranks, 0),
        next_hg(ranks, 0) {}
};

// A compute action's inputs, as end times (kNever where one has not run), on `rank`.
double inputs_ready(const Schedule& sc, const Progress& pr, const Action& a, int rank) {
  const int stages = sc.stages();
  double t = 0;
  auto need = [&](double end) { t = (end == kNever || t == kNever) ? kNever : std::max(t, end); };
  const size_t s = static_cast<size_t>(a.stage), mb = static_cast<size_t>(a.micro);
  switch (a.op) {
    case Op::kForward:
      if (a.stage > 0) need(pr.f[s - 1][mb]);
      break;
    case Op::kBackward:
    case Op::kBackwardInput:
      need(pr.f[s][mb]);
      if (a.stage < stages - 1) need(pr.b[s + 1][mb]);
      // The head's input gradient: every rank's part of it.
      if (a.stage == stages - 1 && sc.vocab)
        for (int q = 0; q < sc.ranks; ++q) need(pr.hg[static_cast<size_t>(q)][mb]);
      break;
    case Op::kHeadStats:  // the final norm's output
      need(pr.f[static_cast<size_t>(stages - 1)][mb]);
      break;
    case Op::kHeadGrad:  // every rank's statistics
      for (int q = 0; q < sc.ranks; ++q) need(pr.hs[static_cast<size_t>(q)][mb]);
      break;
    case Op::kBackwardWeight:
      need(pr.b[s][mb]);
      break;
    default:
      break;
  }
  return t;
}

double cost_of(Op op, const Costs& c) {
  switch (op) {
    case Op::kForward: return c.forward;
    case Op::kBackward: return c.backward();
    case Op::kBackwardInput: return c.backward_input;
    case Op::kBackwardWeight: return c.backward_weight;
    case Op::kHeadStats: return c.head_stats;
    case Op::kHeadGrad: return c.head_grad;
    default: return 0;
  }
}

// Whether `a` releases its micro-batch's activations on the rank: the input
// backward (fused or not). What a deferred W needs (its GEMMs' inputs and
// output gradients) is counted apart, as the W queue.
bool releases(Op op) { return op == Op::kBackward || op == Op::kBackwardInput; }

void record(Progress& pr, const Action& a, double end, int rank) {
  const size_t s = static_cast<size_t>(a.stage), mb = static_cast<size_t>(a.micro);
  const auto r = static_cast<size_t>(rank);
  switch (a.op) {
    case Op::kHeadStats: pr.hs[r][mb] = end; ++pr.next_hs[r]; break;
    case Op::kHeadGrad: pr.hg[r][mb] = end; ++pr.next_hg[r]; break;
    case Op::kForward: pr.f[s][mb] = end; ++pr.next_f[s]; break;
    case Op::kBackward:
      pr.b[s][mb] = pr.w[s][mb] = end;
      ++pr.next_b[s];
      ++pr.next_w[s];
      break;
    case Op::kBackwardInput: pr.b[s][mb] = end; ++pr.next_b[s]; break;
    case Op::kBackwardWeight: pr.w[s][mb] = end; ++pr.next_w[s]; break;
    default: break;
  }
}

// The schedule's preference among ready actions on one rank: smaller first.
std::array<int, 4> priority(const Schedule& s, const Action& a) {
  const int p = s.ranks, chunk = a.stage / p;
  // The head's pieces first when ready (T, then S): the last stage waits on them.
  if (a.op == Op::kHeadGrad) return {-2, a.micro, 0, 0};
  if (a.op == Op::kHeadStats) return {-1, a.micro, 0, 0};
  switch (s.kind) {
    case ScheduleKind::kGPipe:  // every forward, then the backwards
      return {a.op == Op::kForward ? 0 : 1, a.micro, 0, 0};
    case ScheduleKind::k1F1B:
      return {a.op == Op::kForward ? 1 : 0, a.micro, 0, 0};
    case ScheduleKind::kInterleaved:  // Megatron: groups of p micro-batches, chunk by chunk
      if (a.op == Op::kForward) return {1, a.micro / p, chunk, a.micro};
      return {0, a.micro / p, s.chunks - 1 - chunk, a.micro};
    case ScheduleKind::kZbH1:
    case ScheduleKind::kZbV: {  // B first (it unblocks the previous stage), then F, W fills
      const int rank = a.op == Op::kBackwardInput ? 0 : a.op == Op::kForward ? 1 : 2;
      return {rank, a.micro, -a.stage, 0};
    }
  }
  return {};
}

// Interleaved 1F1B's fixed order of (stage, micro-batch) on a rank, as
// Megatron runs it: groups of p micro-batches, each through chunk 0, then
// chunk 1, ... (backwards: the last chunk first). A greedy order would let
// the early chunks' forwards fill the cap and starve the later chunks.
std::vector<std::pair<int, int>> interleaved_order(const Schedule& s, int rank, bool backward) {
  std::vector<std::pair<int, int>> out;
  const int p = s.ranks, m = s.micro_batches;
  for (int g = 0; g * p < m; ++g) {
    const int n = std::min(p, m - g * p);
    for (int c = 0; c < s.chunks; ++c) {
      const int chunk = backward ? s.chunks - 1 - c : c;
      for (int i = 0; i < n; ++i) out.push_back({chunk * p + rank, g * p + i});
    }
  }
  return out;
}

// Interleaved 1F1B as Megatron runs it on each rank: its warm-up forwards
// ((p - r - 1)·2 + (v - 1)·p), then one forward and one backward in turn,
// then the remaining backwards, each kind in interleaved_order.
std::vector<std::vector<Action>> interleaved_orders(const Schedule& s) {
  std::vector<std::vector<Action>> out(static_cast<size_t>(s.ranks));
  const int total = s.micro_batches * s.chunks;
  for (int r = 0; r < s.ranks; ++r) {
    const auto f = interleaved_order(s, r, false), b = interleaved_order(s, r, true);
    const int warm = std::min(total, (s.ranks - r - 1) * 2 + (s.chunks - 1) * s.ranks);
    auto& list = out[static_cast<size_t>(r)];
    size_t fi = 0, bi = 0;
    for (; fi < static_cast<size_t>(warm); ++fi) list.push_back({Op::kForward, f[fi].second, f[fi].first});
    for (; fi < f.size(); ++fi, ++bi) {
      list.push_back({Op::kForward, f[fi].second, f[fi].first});
      list.push_back({Op::kBackward, b[bi].second, b[bi].first});
    }
    for (; bi < b.size(); ++bi) list.push_back({Op::kBackward, b[bi].second, b[bi].first});
  }
  return out;
}

// The list scheduler: each rank in turn (the earliest free first) runs
// the ready compute the schedule prefers (priority), within its cap of
// micro-batches in flight and of deferred weight backwards; a rank with
// nothing ready waits for the next end anywhere.
class ListScheduler {
 public:
  ListScheduler(const Schedule& s, const std::vector<Costs>& costs)
      : s_(s),
        costs_(costs),
        p_(s.ranks),
        m_(s.micro_batches),
        pr_(s.stages(), s.micro_batches, s.ranks),
        free_at_(static_cast<size_t>(p_), 0),
        in_flight_(static_cast<size_t>(p_), 0),
        w_queue_(static_cast<size_t>(p_), 0),
        left_(static_cast<size_t>(p_), per_rank()),
        stalled_(static_cast<size_t>(p_), false),
        fixed_at_(static_cast<size_t>(p_), 0),
        out_(static_cast<size_t>(p_)) {
    // Interleaved with the head spread: Megatron's order of forwards and
    // backwards stays fixed, and the head's S and T go in as they are ready.
    if (interleaved()) fixed_ = interleaved_orders(s);
  }

  std::vector<std::vector<Action>> run() {
    for (int done = 0, total = p_ * per_rank(); done < total;) {
      const int r = next_rank();
      const double t = free_at_[static_cast<size_t>(r)];
      if (const std::optional<Action> a = best_ready(r, t)) {
        take(r, t, *a);
        ++done;
      } else {
        wait(r, t);
      }
    }
    return std::move(out_);
  }

 private:
  bool interleaved() const { return s_.kind == ScheduleKind::kInterleaved; }
  int per_rank() const {
    return s_.chunks * m_ * (s_.split_backward() ? 3 : 2) + (s_.vocab ? 2 * m_ : 0);
  }
  double cost(const Action& a) const {
    static const Costs unit;
    return cost_of(a.op, costs_.empty() ? unit : costs_[static_cast<size_t>(a.stage)]);
  }

  // The rank that decides next: with compute left, not stalled, free first.
  int next_rank() const {
    int r = -1;
    for (int q = 0; q < p_; ++q) {
      const auto qi = static_cast<size_t>(q);
      if (left_[qi] > 0 && !stalled_[qi] && (r < 0 || free_at_[qi] < free_at_[static_cast<size_t>(r)])) r = q;
    }
    PO_ASSERT(r >= 0, "pipeline schedule ", schedule_name(s_.kind), " (p ", p_, ", m ", m_, ", v ", s_.chunks,
              ") deadlocks");
    return r;
  }

  // The compute rank r prefers among those ready at t, if any.
  std::optional<Action> best_ready(int r, double t) const {
    const auto ri = static_cast<size_t>(r);
    // zbv: a rank's first-chunk forwards leave a place in its cap for a
    // second-chunk forward, which alone leads to the input backwards that
    // free the cap (at uneven costs the first chunk could otherwise fill it
    // while the second waits for its input: a deadlock).
    const int reserve = s_.kind == ScheduleKind::kZbV ? 1 : 0;
    std::optional<Action> best;
    auto offer = [&](const Action& a) {
      if (!best || priority(s_, a) < priority(s_, *best)) best = a;
    };
    auto consider = [&](const Action& a) {
      const double ready = inputs_ready(s_, pr_, a, r);
      if (ready == kNever || ready > t) return;
      const bool first_chunk = a.stage < s_.ranks;
      if (a.op == Op::kForward && in_flight_[ri] >= s_.in_flight_cap(r) - (first_chunk ? reserve : 0)) return;
      // A full W queue runs its oldest W before anything else.
      if (s_.split_backward() && a.op != Op::kBackwardWeight && w_queue_[ri] >= s_.w_queue_cap(r)) return;
      offer(a);
    };
    if (interleaved()) {
      if (fixed_at_[ri] < fixed_[ri].size()) {
        const Action& a = fixed_[ri][fixed_at_[ri]];
        const double ready = inputs_ready(s_, pr_, a, r);
        if (ready != kNever && ready <= t) offer(a);
      }
    } else {
      for (int st : s_.stages_of(r)) {
        const auto si = static_cast<size_t>(st);
        if (pr_.next_f[si] < m_) consider({Op::kForward, pr_.next_f[si], st});
        if (pr_.next_b[si] < m_)
          consider({s_.split_backward() ? Op::kBackwardInput : Op::kBackward, pr_.next_b[si], st});
        if (s_.split_backward() && pr_.next_w[si] < m_ && pr_.next_w[si] < pr_.next_b[si])
          consider({Op::kBackwardWeight, pr_.next_w[si], st});
      }
    }
    if (s_.vocab) {
      const int S = s_.stages();
      if (pr_.next_hs[ri] < m_) consider({Op::kHeadStats, pr_.next_hs[ri], S - 1});
      if (pr_.next_hg[ri] < pr_.next_hs[ri]) consider({Op::kHeadGrad, pr_.next_hg[ri], S - 1});
    }
    return best;
  }

  // Nothing ready on rank r at t: it waits for the next end, or the next
  // decision, anywhere (none: stalled until another rank decides).
  void wait(int r, double t) {
    const auto ri = static_cast<size_t>(r);
    const auto after = ends_.upper_bound(t);
    double next = after == ends_.end() ? std::numeric_limits<double>::infinity() : *after;
    for (int q = 0; q < p_; ++q)
      if (left_[static_cast<size_t>(q)] > 0 && free_at_[static_cast<size_t>(q)] > t)
        next = std::min(next, free_at_[static_cast<size_t>(q)]);
    if (next == std::numeric_limits<double>::infinity())
      stalled_[ri] = true;
    else
      free_at_[ri] = next;
  }

  void take(int r, double t, const Action& a) {
    const auto ri = static_cast<size_t>(r);
    std::fill(stalled_.begin(), stalled_.end(), false);
    const double end = t + cost(a);
    record(pr_, a, end, r);
    if (interleaved() && (a.op == Op::kForward || a.op == Op::kBackward)) ++fixed_at_[ri];
    ends_.insert(end);
    if (a.op == Op::kForward) ++in_flight_[ri];
    if (releases(a.op)) --in_flight_[ri];
    if (a.op == Op::kBackwardInput) ++w_queue_[ri];
    if (a.op == Op::kBackwardWeight) --w_queue_[ri];
    free_at_[ri] = end;
    --left_[ri];
    out_[ri].push_back(a);
  }

  const Schedule& s_;
  const std::vector<Costs>& costs_;
  int p_, m_;
  Progress pr_;
  std::vector<double> free_at_;
  std::vector<int> in_flight_, w_queue_, left_;  // per rank; w_queue_: B done, W not yet
  std::vector<bool> stalled_;  // nothing ready and nothing to wait for yet: another rank decides first
  std::set<double> ends_;      // every decided end time (for idle ranks to wait to)
  std::vector<std::vector<Action>> fixed_;  // interleaved: Megatron's order per rank
  std::vector<size_t> fixed_at_;
  std::vector<std::vector<Action>> out_;
};

// Each rank's compute, in the order the list scheduler runs it at `costs`
// (each stage's; empty: unit costs).
std::vector<std::vector<Action>> compute_orders(const Schedule& s, const std::vector<Costs>& costs) {
  if (s.kind == ScheduleKind::kInterleaved && !s.vocab) return interleaved_orders(s);
  return ListScheduler(s, costs).run();
}

// The compute orders with the sends and receives between ranks around them.
std::vector<std::vector<Action>> with_messages(const Schedule& s,
                                               const std::vector<std::vector<Action>>& compute) {
  const int S = s.stages();
  std::vector<std::vector<Action>> out(compute.size());
  for (size_t r = 0; r < compute.size(); ++r) {
    const int rank = static_cast<int>(r);
    for (const Action& a : compute[r]) {
      const bool fwd = a.op == Op::kForward;
      const bool bwd = a.op == Op::kBackward || a.op == Op::kBackwardInput;
      const int from = fwd ? a.stage - 1 : a.stage + 1;  // the stage whose output it reads
      const int to = fwd ? a.stage + 1 : a.stage - 1;    // the stage that reads its output
      const Payload pl = fwd ? Payload::kActivation : Payload::kGradient;
      if ((fwd || bwd) && from >= 0 && from < S && s.rank_of(from) != rank)
        out[r].push_back({Op::kRecv, a.micro, a.stage, s.rank_of(from), pl});
      out[r].push_back(a);
      if ((fwd || bwd) && to >= 0 && to < S && s.rank_of(to) != rank)
        out[r].push_back({Op::kSend, a.micro, to, s.rank_of(to), pl});
      if (!s.vocab) continue;
      // The head's messages: the final norm's output to every rank after
      // the last stage's forward; the statistics to every rank after an S;
      // after a T the input gradient's tree nodes of this rank's pieces to
      // the last stage's rank.
      const int p = s.ranks, mb = a.micro;
      if (a.op == Op::kForward && a.stage == S - 1)
        for (int q = 0; q < p; ++q)
          if (q != rank) out[r].push_back({Op::kSend, mb, S + 1 + q, q, Payload::kHeadInput});
      if (a.op == Op::kHeadStats)
        for (int q = 0; q < p; ++q)
          if (q != rank) out[r].push_back({Op::kSend, mb, S + 1 + p + rank, q, Payload::kHeadStats});
      if (a.op == Op::kHeadGrad && rank != s.rank_of(S - 1))
        for (const auto& node : s.grad_nodes(rank))
          out[r].push_back({Op::kSend, mb, S + 1 + 2 * p + node.first, s.rank_of(S - 1), Payload::kHeadGrad});
    }
  }
  // Receives, before the compute that reads them.
  if (s.vocab) {
    const int p = s.ranks, head = s.rank_of(S - 1);
    for (size_t r = 0; r < out.size(); ++r) {
      const int rank = static_cast<int>(r);
      std::vector<Action> with;
      for (const Action& a : out[r]) {
        const int mb = a.micro;
        if (a.op == Op::kHeadStats && rank != head)
          with.push_back({Op::kRecv, mb, S + 1 + rank, head, Payload::kHeadInput});
        if (a.op == Op::kHeadGrad)
          for (int q = 0; q < p; ++q)
            if (q != rank) with.push_back({Op::kRecv, mb, S + 1 + p + q, q, Payload::kHeadStats});
        const bool head_backward = (a.op == Op::kBackward || a.op == Op::kBackwardInput) && a.stage == S - 1;
        if (head_backward)
          for (int q = 0; q < p; ++q)
            if (q != rank)
              for (const auto& node : s.grad_nodes(q))
                with.push_back({Op::kRecv, mb, S + 1 + 2 * p + node.first, q, Payload::kHeadGrad});
        with.push_back(a);
      }
      out[r] = std::move(with);
    }
  }
  return out;
}

}  // namespace

ScheduleKind parse_schedule(const std::string& name) {
  for (const auto& [n, k] : kNames)
    if (name == n) return k;
  std::string known;
  for (const auto& [n, k] : kNames) known += std::string(known.empty() ? "" : ", ") + "\"" + n + "\"";
  PO_THROW(core::InvalidArgument, "parallel.schedule = \"", name, "\": choose one of ", known);
}

const char* schedule_name(ScheduleKind kind) {
  for (const auto& [n, k] : kNames)
    if (k == kind) return n;
  return "?";
}

const char* op_name(Op op) {
  switch (op) {
    case Op::kForward: return "forward";
    case Op::kBackward: return "backward";
    case Op::kBackwardInput: return "backward-input";
    case Op::kBackwardWeight: return "backward-weight";
    case Op::kSend: return "send";
    case Op::kRecv: return "recv";
    case Op::kHeadStats: return "head-stats";
    case Op::kHeadGrad: return "head-grad";
  }
  return "?";
}

std::string describe(const Action& a) {
  static constexpr const char* kLetter[] = {"F", "BW", "B", "W", "", "", "S", "T"};
  static constexpr const char* kPayload[] = {" act", " grad", " head-input", " head-stats",
                                             " head-grad"};
  if (is_compute(a.op))
    return core::str_cat(kLetter[static_cast<int>(a.op)], a.micro, "@s", a.stage);
  return core::str_cat(op_name(a.op), kPayload[static_cast<int>(a.payload)], " m", a.micro, " s",
                       a.stage, a.op == Op::kSend ? " -> r" : " <- r", a.peer);
}

int Schedule::rank_of(int stage) const {
  if (kind == ScheduleKind::kZbV) return stage < ranks ? stage : 2 * ranks - 1 - stage;
  return stage % ranks;
}

std::vector<int> Schedule::stages_of(int rank) const {
  if (kind == ScheduleKind::kZbV) return {rank, 2 * ranks - 1 - rank};
  std::vector<int> out;
  for (int c = 0; c < chunks; ++c) out.push_back(c * ranks + rank);
  return out;
}

int Schedule::in_flight_cap(int rank) const {
  const int p = ranks, m = micro_batches;
  switch (kind) {
    case ScheduleKind::kGPipe: return m;
    case ScheduleKind::k1F1B:
    case ScheduleKind::kZbH1: return p - rank + (vocab ? 1 : 0);  // p on the first stage
    case ScheduleKind::kInterleaved:  // Megatron's warm-up forwards, plus the steady one
      return std::min(m * chunks, (p - rank - 1) * 2 + (chunks - 1) * p + 1);
    case ScheduleKind::kZbV: return 2 * p + (vocab ? 2 : 0);  // chunks of half a stage: 1F1B's bytes
  }
  return m;
}

int Schedule::w_queue_cap(int rank) const {
  switch (kind) {
    // ZB-H1 defers W freely: the published bubble, (p-1)/(3m+p-1), needs
    // the first stages to hold back up to m of them (bounding the queue at
    // p - r costs most of the gain: 0.20 instead of 0.11 at p 4, m 8).
    case ScheduleKind::kZbH1: return micro_batches;
    case ScheduleKind::kZbV: return in_flight_cap(rank);  // 2p: the bubble stays near 0
    default: return 0;
  }
}

std::pair<int, int> Schedule::pieces_of(int rank, int pieces) const {
  const int j = holder_index(rank), n = static_cast<int>(holders.size());
  if (j < 0) return {0, 0};
  return {j * pieces / n, (j + 1) * pieces / n};
}

int Schedule::holder_index(int rank) const {
  for (size_t j = 0; j < holders.size(); ++j)
    if (holders[j] == rank) return static_cast<int>(j);
  return -1;
}

std::vector<std::pair<int, int>> Schedule::grad_nodes(int rank) const {
  const auto [k0, k1] = pieces_of(rank, model::vocab::kPieces);
  return model::vocab::tree_nodes(model::vocab::kPieces, k0, k1);
}

int chunks_per_rank(ScheduleKind kind, int virtual_stages) {
  if (kind == ScheduleKind::kZbV) return 2;
  return kind == ScheduleKind::kInterleaved ? virtual_stages : 1;
}

void check_schedule(ScheduleKind kind, int ranks, int micro_batches, int virtual_stages) {
  PO_CHECK(ranks >= 1, "parallel.pp must be >= 1, got ", ranks);
  PO_CHECK(micro_batches >= 1, "parallel.micro_batches must be >= 1, got ", micro_batches);
  PO_CHECK(virtual_stages >= 1, "parallel.virtual_stages must be >= 1, got ", virtual_stages);
  PO_CHECK(kind != ScheduleKind::kInterleaved || micro_batches >= ranks,
           "parallel.schedule = \"interleaved\" needs parallel.micro_batches >= parallel.pp (",
           micro_batches, " < ", ranks, ")");
  const int stages = ranks * chunks_per_rank(kind, virtual_stages);
  PO_CHECK(stages <= 64, "parallel.pp × stages per rank = ", stages, ": at most 64 stages");
}

Schedule make_schedule(ScheduleKind kind, int ranks, int micro_batches, int chunks, bool vocab,
                       const std::vector<Costs>& costs) {
  check_schedule(kind, ranks, micro_batches, chunks);
  chunks = chunks_per_rank(kind, chunks);
  Schedule s;
  s.kind = kind;
  s.ranks = ranks;
  s.micro_batches = micro_batches;
  s.chunks = chunks;
  s.vocab = vocab && ranks > 1;
  if (s.vocab) {
    PO_CHECK(ranks <= 8, "parallel.vocab_parallel spreads the head's 8 vocabulary pieces over at ",
             "most 8 pipeline ranks (parallel.pp = ", ranks, ")");
    PO_CHECK(s.stages() + 2 * ranks + 1 + model::vocab::kPieces <= 64, "parallel.vocab_parallel: ",
             s.stages(), " stages on ", ranks, " ranks leave no message tags for the head ",
             "(stages + 2·pp + 9 <= 64)");
    const int head = s.rank_of(s.stages() - 1);
    for (int r = 0; r < ranks; ++r)
      if (r != head) s.holders.push_back(r);
    s.holders.push_back(head);
  }
  s.actions = with_messages(s, compute_orders(s, {}));
  if (!costs.empty()) {
    PO_CHECK(static_cast<int>(costs.size()) == s.stages(), "make_schedule: ", costs.size(),
             " stage costs for ", s.stages(), " stages");
    Schedule at_costs = s;
    at_costs.actions = with_messages(s, compute_orders(s, costs));
    if (simulate(at_costs, costs).step < simulate(s, costs).step) return at_costs;
  }
  return s;
}

int message_tag(const Action& a) {
  // Micro-batches 120 apart share a tag: they are never in flight together.
  // Below 15360, so StageLink's 2·tag + 1 stays under MPI's guaranteed 32767.
  const bool odd = a.payload == Payload::kGradient || a.payload == Payload::kHeadGrad;
  return ((a.micro % 120) * 64 + a.stage) * 2 + (odd ? 1 : 0);
}

double Timing::bubble() const {
  if (step <= 0 || busy.empty()) return 0;
  const double mean = std::accumulate(busy.begin(), busy.end(), 0.0) / static_cast<double>(busy.size());
  return 1 - mean / step;
}

Timing simulate(const Schedule& s, const Costs& costs) {
  return simulate(s, std::vector<Costs>(static_cast<size_t>(s.stages()), costs));
}

Timing simulate(const Schedule& s, const std::vector<Costs>& stage_costs) {
  const int p = s.ranks, S = s.stages();
  PO_CHECK(static_cast<int>(stage_costs.size()) == S, "simulate: ", stage_costs.size(),
           " stage costs for ", S, " stages");
  Progress pr(S, s.micro_batches, p);
  Timing t;
  t.busy.assign(static_cast<size_t>(p), 0);
  t.spans.assign(static_cast<size_t>(p), {});
  t.peak_in_flight.assign(static_cast<size_t>(p), 0);
  std::vector<size_t> next(static_cast<size_t>(p), 0);
  std::vector<double> free_at(static_cast<size_t>(p), 0);
  std::vector<int> held(static_cast<size_t>(p), 0), queued(static_cast<size_t>(p), 0);
  t.peak_w_queue.assign(static_cast<size_t>(p), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      const auto ri = static_cast<size_t>(r);
      const auto& list = s.actions[ri];
      while (next[ri] < list.size()) {
        const Action& a = list[next[ri]];
        if (!is_compute(a.op)) {
          ++next[ri];
          continue;
        }
        const double ready = inputs_ready(s, pr, a, r);
        if (ready == kNever) break;  // waits for another rank
        const double cost = cost_of(a.op, stage_costs[static_cast<size_t>(a.stage)]);
        const double end = std::max(free_at[ri], ready) + cost;
        record(pr, a, end, r);
        t.spans[ri].push_back({a, end - cost, end});
        free_at[ri] = end;
        t.busy[ri] += cost;
        if (a.op == Op::kForward) t.peak_in_flight[ri] = std::max(t.peak_in_flight[ri], ++held[ri]);
        if (releases(a.op)) --held[ri];
        if (a.op == Op::kBackwardInput) t.peak_w_queue[ri] = std::max(t.peak_w_queue[ri], ++queued[ri]);
        if (a.op == Op::kBackwardWeight) --queued[ri];
        t.step = std::max(t.step, end);
        ++next[ri];
        progress = true;
      }
    }
  }
  for (int r = 0; r < p; ++r)
    PO_ASSERT(next[static_cast<size_t>(r)] == s.actions[static_cast<size_t>(r)].size(),
              "simulate: rank ", r, " of ", schedule_name(s.kind), " never gets its inputs at ",
              describe(s.actions[static_cast<size_t>(r)][next[static_cast<size_t>(r)]]));
  return t;
}

std::string chrome_trace(const Schedule& s, const Timing& t, double us_per_unit) {
  nlohmann::json events = nlohmann::json::array();
  for (size_t r = 0; r < t.spans.size(); ++r) {
    events.push_back({{"ph", "M"}, {"pid", 0}, {"tid", r}, {"name", "thread_name"},
                      {"args", {{"name", core::str_cat("rank ", r)}}}});
    for (const Span& sp : t.spans[r])
      events.push_back({{"ph", "X"}, {"pid", 0}, {"tid", r}, {"name", describe(sp.action)},
                        {"cat", op_name(sp.action.op)}, {"ts", sp.start * us_per_unit},
                        {"dur", (sp.end - sp.start) * us_per_unit},
                        {"args", {{"micro_batch", sp.action.micro}, {"stage", sp.action.stage}}}});
  }
  nlohmann::json doc = {{"traceEvents", events},
                        {"displayTimeUnit", "ms"},
                        {"otherData",
                         {{"schedule", schedule_name(s.kind)}, {"pp", s.ranks},
                          {"micro_batches", s.micro_batches}, {"stages_per_rank", s.chunks},
                          {"bubble", t.bubble()}}}};
  return doc.dump(1);
}

double formula_bubble(ScheduleKind kind, int ranks, int micro_batches, int chunks) {
  const double p = ranks, m = micro_batches, v = chunks;
  switch (kind) {
    case ScheduleKind::kGPipe:
    case ScheduleKind::k1F1B: return (p - 1) / (m + p - 1);
    case ScheduleKind::kInterleaved: return (p - 1) / (v * m + p - 1);
    case ScheduleKind::kZbH1: return (p - 1) / (3 * m + p - 1);
    case ScheduleKind::kZbV: return 0;
  }
  return 0;
}

}  // namespace po::parallel::pipeline
