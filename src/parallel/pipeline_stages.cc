#include "parallel/pipeline_stages.h"

#include <algorithm>
#include <limits>
#include <sstream>

#include "core/error.h"
#include "model/layout.h"

namespace po::parallel::pipeline {

namespace {

double unit_cost(const model::TransformerConfig& config, const model::Layout& layout, int64_t T, int u) {
  const double C = static_cast<double>(config.n_embd);
  if (u == 0) return 0;
  if (u == layout.head_unit()) return 2.0 * static_cast<double>(config.vocab_size) * C;
  return 2.0 * static_cast<double>(layout.unit_numel(u)) + 2.0 * static_cast<double>(T) * C;
}

}  // namespace

double unit_cost(const model::TransformerConfig& config, int64_t T, int u) {
  return unit_cost(config, model::Layout(config), T, u);
}

namespace {

// Blocks per stage from "4,4,3,1".
std::vector<int64_t> parse_stage_layers(const std::string& text, int stages, int64_t n_layer) {
  std::vector<int64_t> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    size_t used = 0;
    int64_t n = 0;
    try {
      n = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    PO_CHECK(used > 0 && used == item.find_last_not_of(' ') + 1 && n >= 1,
             "parallel.stage_layers = \"", text, "\": '", item, "' is not a positive block count");
    out.push_back(n);
  }
  int64_t sum = 0;
  for (int64_t n : out) sum += n;
  PO_CHECK(static_cast<int>(out.size()) == stages && sum == n_layer, "parallel.stage_layers = \"",
           text, "\" gives ", out.size(), " stages of ", sum, " blocks; parallel.pp × stages per rank = ",
           stages, " stages of model.n_layer = ", n_layer, " blocks are needed");
  return out;
}

// The blocks per stage whose costliest stage is cheapest: a linear
// partition by dynamic programming over (stages, blocks).
std::vector<int64_t> balanced_blocks(const std::vector<double>& block, double first, double last,
                                     int stages) {
  const int L = static_cast<int>(block.size());
  std::vector<double> prefix(static_cast<size_t>(L) + 1, 0);
  for (int i = 0; i < L; ++i) prefix[static_cast<size_t>(i) + 1] = prefix[static_cast<size_t>(i)] + block[static_cast<size_t>(i)];
  auto cost = [&](int s, int a, int b) {  // stage s holding blocks [a, b)
    double c = prefix[static_cast<size_t>(b)] - prefix[static_cast<size_t>(a)];
    if (s == 0) c += first;
    if (s == stages - 1) c += last;
    return c;
  };
  const double inf = std::numeric_limits<double>::infinity();
  // best[s][b]: the least possible maximum over stages 0..s holding blocks [0, b).
  std::vector<std::vector<double>> best(static_cast<size_t>(stages),
                                        std::vector<double>(static_cast<size_t>(L) + 1, inf));
  std::vector<std::vector<int>> cut(best.size(), std::vector<int>(static_cast<size_t>(L) + 1, 0));
  for (int b = 1; b <= L; ++b) best[0][static_cast<size_t>(b)] = cost(0, 0, b);
  for (int s = 1; s < stages; ++s)
    for (int b = s + 1; b <= L; ++b)
      for (int a = s; a < b; ++a) {
        const double v = std::max(best[static_cast<size_t>(s) - 1][static_cast<size_t>(a)], cost(s, a, b));
        if (v < best[static_cast<size_t>(s)][static_cast<size_t>(b)]) {
          best[static_cast<size_t>(s)][static_cast<size_t>(b)] = v;
          cut[static_cast<size_t>(s)][static_cast<size_t>(b)] = a;
        }
      }
  std::vector<int64_t> out(static_cast<size_t>(stages));
  for (int s = stages - 1, b = L; s >= 0; --s) {
    const int a = s == 0 ? 0 : cut[static_cast<size_t>(s)][static_cast<size_t>(b)];
    out[static_cast<size_t>(s)] = b - a;
    b = a;
  }
  return out;
}

}  // namespace

namespace {

std::vector<model::UnitRange> ranges_of(const std::vector<int64_t>& blocks, int64_t L) {
  std::vector<model::UnitRange> out;
  int next = 1;  // the first block's unit
  const auto stages = static_cast<int>(blocks.size());
  for (int s = 0; s < stages; ++s) {
    model::UnitRange r;
    r.first = s == 0 ? 0 : next;
    next += static_cast<int>(blocks[static_cast<size_t>(s)]);
    r.last = s == stages - 1 ? static_cast<int>(L) + 1 : next - 1;
    out.push_back(r);
  }
  return out;
}

std::vector<int64_t> blocks_of(const std::vector<model::UnitRange>& ranges, int64_t L) {
  std::vector<int64_t> out;
  for (size_t s = 0; s < ranges.size(); ++s) {
    const int first = std::max(ranges[s].first, 1);
    const int last = ranges[s].last < 0 || ranges[s].last > L ? static_cast<int>(L) : ranges[s].last;
    out.push_back(last - first + 1);
  }
  return out;
}

}  // namespace

std::vector<model::UnitRange> partition_stages(const model::TransformerConfig& config, int64_t T,
                                               const Schedule& schedule,
                                               const std::string& stage_layers) {
  const int S = schedule.stages();
  std::vector<model::UnitRange> stages = partition_stages(config, T, S, stage_layers, !schedule.vocab);
  if (!stage_layers.empty() || schedule.chunks == 1) return stages;
  // Several stages per rank: move blocks across stage boundaries, one at a
  // time, while that lowers the busiest rank's total compute (forward +
  // both backward halves, stage_costs), then the sum of squares of the
  // ranks' totals; deterministic, from the stage-balanced split.
  const int64_t L = config.n_layer;
  // Each block's total and the head's (one stage_costs of a stage per block).
  std::vector<model::UnitRange> singles;
  for (int u = 1; u <= L; ++u) singles.push_back({u, u});
  std::vector<double> prefix(1, 0.0);
  for (const Costs& k : stage_costs(config, T, singles)) prefix.push_back(prefix.back() + k.forward + k.backward());
  const double head = stage_costs(config, T, {model::UnitRange{static_cast<int>(L) + 1, -1}})[0].forward;
  auto score = [&](const std::vector<int64_t>& blocks) {
    std::vector<double> rank(static_cast<size_t>(schedule.ranks), 0.0);
    int64_t at = 0;
    for (int s = 0; s < S; ++s) {
      const int64_t n = blocks[static_cast<size_t>(s)];
      rank[static_cast<size_t>(schedule.rank_of(s))] +=
          prefix[static_cast<size_t>(at + n)] - prefix[static_cast<size_t>(at)] +
          (s == S - 1 && !schedule.vocab ? head : 0.0);
      at += n;
    }
    double most = 0, squares = 0;
    for (double r : rank) {
      most = std::max(most, r);
      squares += r * r;
    }
    return std::pair{most, squares};
  };
  std::vector<int64_t> blocks = blocks_of(stages, L);
  auto best = score(blocks);
  for (bool moved = true; moved;) {
    moved = false;
    std::vector<int64_t> pick;
    for (int s = 0; s + 1 < S; ++s)
      for (int dir : {-1, 1}) {  // -1: a block from s + 1 to s; +1: from s to s + 1
        std::vector<int64_t> b = blocks;
        int64_t& from = dir > 0 ? b[static_cast<size_t>(s)] : b[static_cast<size_t>(s) + 1];
        int64_t& to = dir > 0 ? b[static_cast<size_t>(s) + 1] : b[static_cast<size_t>(s)];
        if (from <= 1) continue;
        --from;
        ++to;
        const auto v = score(b);
        if (v.first < best.first - 1e-9 ||
            (v.first <= best.first + 1e-9 && v.second < best.second - 1e-9)) {
          best = v;
          pick = b;
        }
      }
    if (!pick.empty()) {
      blocks = pick;
      moved = true;
    }
  }
  return ranges_of(blocks, L);
}

std::vector<model::UnitRange> partition_stages(const model::TransformerConfig& config, int64_t T,
                                               int stages, const std::string& stage_layers,
                                               bool head_on_last) {
  const int64_t L = config.n_layer;
  PO_CHECK(stages >= 1 && stages <= L, "parallel.pp × stages per rank = ", stages,
           " must be between 1 and model.n_layer = ", L, " (every stage holds a block)");
  std::vector<int64_t> blocks;
  if (!stage_layers.empty()) {
    blocks = parse_stage_layers(stage_layers, stages, L);
  } else {
    const model::Layout layout(config);
    std::vector<double> cost;
    for (int u = 1; u <= L; ++u) cost.push_back(unit_cost(config, layout, T, u));
    blocks = balanced_blocks(cost, unit_cost(config, layout, T, 0),
                             head_on_last ? unit_cost(config, layout, T, static_cast<int>(L) + 1) : 0.0,
                             stages);
  }
  return ranges_of(blocks, L);
}

std::vector<Costs> stage_costs(const model::TransformerConfig& config, int64_t T,
                               const std::vector<model::UnitRange>& stages, int vocab_ranks) {
  const model::TransformerConfig c = config.resolved();
  const model::Layout layout(c);
  const int head = layout.head_unit();
  const double C = static_cast<double>(c.n_embd), attn = 2.0 * static_cast<double>(T) * C;
  const double unit = 2.0 * static_cast<double>(layout.unit_numel(1)) + attn;  // a block's forward
  std::vector<Costs> out;
  for (const model::UnitRange& r : stages) {
    const int last = r.last < 0 ? head : r.last;
    Costs k{0, 0, 0, 0, 0};
    for (int u = std::max(r.first, 1); u <= std::min(last, head - 1); ++u) {
      const double params = 2.0 * static_cast<double>(layout.unit_numel(u));
      k.forward += params + attn;
      k.backward_input += params + 2 * attn;
      k.backward_weight += params;
    }
    const double head_gemm = 2.0 * static_cast<double>(c.vocab_size) * C;
    if (last == head && vocab_ranks == 0) k.forward += 3 * head_gemm;
    if (last == head && vocab_ranks > 0) {  // each rank's share: S the logits, T two GEMMs
      k.head_stats = head_gemm / vocab_ranks / unit;
      k.head_grad = 2 * head_gemm / vocab_ranks / unit;
    }
    k.forward /= unit;
    k.backward_input /= unit;
    k.backward_weight /= unit;
    out.push_back(k);
  }
  return out;
}

Pipeline make_pipeline(const model::TransformerConfig& config, int64_t T, ScheduleKind kind,
                       int ranks, int micro_batches, int virtual_stages, bool vocab,
                       const std::string& stage_layers) {
  const int chunks = chunks_per_rank(kind, virtual_stages);
  Pipeline out;
  out.schedule = make_schedule(kind, ranks, micro_batches, chunks, vocab);
  out.stages = partition_stages(config, T, out.schedule, stage_layers);
  if (ranks > 1)
    out.schedule = make_schedule(kind, ranks, micro_batches, chunks, vocab,
                                 stage_costs(config, T, out.stages, out.schedule.vocab ? ranks : 0));
  return out;
}

}  // namespace po::parallel::pipeline
