#include "train/tp_checkpoint.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <map>
#include <optional>
#include <utility>

#include "comm/communicator.h"
#include "core/error.h"
#include "parallel/shard_layout.h"

namespace po::train {
namespace {

using checkpoint::StateKind;
using tensor::DType;

}  // namespace

void assemble_unit(const std::vector<model::Layout>& ranks, const model::Layout& whole, int u,
                   const float* pieces, float* out) {
  const int64_t base = whole.unit_offset(u);
  for (size_t r = 0; r < ranks.size(); ++r) {
    const model::Layout& held = ranks[r];
    const float* piece = pieces + static_cast<int64_t>(r) * held.unit_numel(u);
    const int64_t held_base = held.unit_offset(u);
    for (size_t k = 0; k < held.tensors().size(); ++k) {
      const model::TensorSpec& t = held.tensors()[k];
      if (t.unit != u) continue;
      // Replicated tensors are the same on every rank: rank 0's.
      if (t.partition == model::Partition::kReplicated && r > 0) continue;
      const float* src = piece + (t.offset - held_base);
      float* dst = out + (whole.tensors()[k].offset - base);
      held.global_runs(t, [&](int64_t local, int64_t global, int64_t n) {
        if (global >= 0) std::memcpy(dst + global, src + local, static_cast<size_t>(n) * sizeof(float));
      });
    }
  }
}

std::vector<model::Layout> tp_rank_layouts(const model::TransformerConfig& config, int tp) {
  std::vector<model::Layout> out;
  for (int r = 0; r < tp; ++r) out.emplace_back(config, model::TensorSplit{tp, r});
  return out;
}

void gather_whole_unit(comm::Communicator& tensor, const std::vector<model::Layout>& ranks,
                       const model::Layout& whole, int u, const float* held_unit, int64_t n,
                       std::vector<float>& out) {
  std::vector<float> pieces(static_cast<size_t>(n) * static_cast<size_t>(tensor.size()));
  tensor.all_gather(held_unit, pieces.data(), static_cast<size_t>(n), DType::kF32);
  if (tensor.rank() != 0) return;
  out.assign(static_cast<size_t>(whole.unit_numel(u)), 0.0f);
  assemble_unit(ranks, whole, u, pieces.data(), out.data());
}

void shard_unit(const model::Layout& held, const model::Layout& whole, int u,
                const float* whole_unit, float* held_unit) {
  const int64_t base = whole.unit_offset(u), held_base = held.unit_offset(u);
  for (size_t k = 0; k < held.tensors().size(); ++k) {
    const model::TensorSpec& t = held.tensors()[k];
    if (t.unit != u) continue;
    const float* src = whole_unit + (whole.tensors()[k].offset - base);
    float* dst = held_unit + (t.offset - held_base);
    held.global_runs(t, [&](int64_t local, int64_t global, int64_t n) {
      if (global < 0)
        std::fill(dst + local, dst + local + n, 0.0f);
      else
        std::memcpy(dst + local, src + global, static_cast<size_t>(n) * sizeof(float));
    });
  }
}

checkpoint::ShardSource WholeSlices::source() const {
  return [this](StateKind k, int u) -> const float* { return slices.at({k, u}).data(); };
}

WholeSlices gather_whole_slices(const model::Transformer& model, const parallel::ShardLayout& held_sl,
                                const checkpoint::ShardSource& source, const TensorParallelGroups& g,
                                const std::vector<StateKind>& kinds) {
  PO_ASSERT(g.tensor != nullptr, "gather_whole_slices without a tensor group");
  const model::Layout whole(model.config());
  const model::Layout& held = model.layout();
  const int tp = g.tensor->size();
  const int dp = g.data ? g.data->size() : 1;
  WholeSlices out{parallel::ShardLayout(model.config().unit_numels(), dp, g.data ? g.data->rank() : 0), {},
                  g.tensor->rank() == 0};
  // Every tp rank's held layout, for the assembly.
  const std::vector<model::Layout> ranks = out.writer ? tp_rank_layouts(model.config(), tp)
                                                      : std::vector<model::Layout>{};
  std::vector<float> shard, unit, assembled;
  for (StateKind k : kinds) {
    for (int u = 0; u < held.num_units(); ++u) {
      const int64_t stride = held_sl.stride(u), n = held.unit_numel(u);
      shard.assign(static_cast<size_t>(stride), 0.0f);
      if (held_sl.owned(u) > 0)
        std::memcpy(shard.data(), source(k, u), static_cast<size_t>(held_sl.owned(u)) * sizeof(float));
      unit.resize(static_cast<size_t>(stride) * static_cast<size_t>(dp));
      if (g.data != nullptr)
        g.data->all_gather(shard.data(), unit.data(), static_cast<size_t>(stride), DType::kF32);
      else
        unit = shard;
      gather_whole_unit(*g.tensor, ranks, whole, u, unit.data(), n, assembled);
      if (!out.writer) continue;
      out.slices[{k, u}].assign(assembled.begin() + out.layout.begin(u), assembled.begin() + out.layout.end(u));
    }
  }
  return out;
}

void save_tensor_parallel_checkpoint(const std::string& path, const model::Transformer& model,
                                     const parallel::ShardLayout& held_sl,
                                     const checkpoint::ShardSource& source,
                                     const TrainState& state, const std::string& config_toml,
                                     const TensorParallelGroups& g,
                                     const std::vector<StateKind>& kinds) {
  const WholeSlices mine = gather_whole_slices(model, held_sl, source, g, kinds);
  std::exception_ptr error;
  if (mine.writer) {
    try {
      save_checkpoint_sharded(path, model::Layout(model.config()), mine.layout, mine.source(), state,
                              config_toml, g.data, kinds);
    } catch (...) {
      error = std::current_exception();
    }
  }
  checkpoint::agree_on_success(g.tensor, error, path + ": saving");
}

TrainState load_tensor_parallel_checkpoint(const std::string& path,
                                           const model::Transformer& model,
                                           const parallel::ShardLayout& held_sl,
                                           const checkpoint::ShardDest& dest,
                                           comm::Communicator* world,
                                           const std::vector<StateKind>& kinds) {
  const model::Layout whole(model.config());
  const model::Layout& held = model.layout();
  const parallel::ShardLayout whole_one(model.config().unit_numels(), 1, 0);
  // The loader fills one whole unit at a time; the previous one is complete
  // when the next is asked for (and at the end).
  std::vector<float> staged, unit;
  std::optional<std::pair<StateKind, int>> pending;
  auto flush = [&] {
    if (!pending) return;
    const auto [k, u] = *pending;
    pending.reset();
    if (held_sl.owned(u) == 0) return;
    unit.resize(static_cast<size_t>(held.unit_numel(u)));
    shard_unit(held, whole, u, staged.data(), unit.data());
    std::memcpy(dest(k, u), unit.data() + held_sl.begin(u),
                static_cast<size_t>(held_sl.owned(u)) * sizeof(float));
  };
  const TrainState s = load_checkpoint_sharded(
      path, whole, whole_one,
      [&](StateKind k, int u) -> float* {
        flush();
        staged.assign(static_cast<size_t>(whole.unit_numel(u)), 0.0f);
        pending = std::make_pair(k, u);
        return staged.data();
      },
      world, kinds);
  flush();
  return s;
}

}  // namespace po::train
