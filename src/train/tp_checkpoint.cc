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
using tensor::DType;

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


}  // namespace po::train
