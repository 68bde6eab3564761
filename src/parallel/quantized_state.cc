#include "parallel/quantized_state.h"

#include <algorithm>
#include <sstream>
#include <string>

#include "core/error.h"

namespace po::parallel {

std::vector<bool> quantized_tensors(const model::Layout& layout, const optim::AdamWConfig& adam) {
  const auto& tensors = layout.tensors();
  std::vector<bool> q(tensors.size(), adam.state_bits < 32);
  if (adam.state_bits >= 32) return q;
  std::istringstream words(adam.state_bits_exclude);
  for (std::string w; words >> w;) {
    bool found = false;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const model::TensorSpec& t = tensors[i];
      const bool hit = w == t.name || (w == "token_embedding" && t.slot == model::Slot::kTokenEmbedding) ||
                       (w == "head" && t.slot == model::Slot::kHead);
      if (hit) q[i] = false;
      found = found || hit;
    }
    PO_CHECK(found || w == "head", "optim.state_bits_exclude names '", w,
             "', which is neither a tensor of this model (\"", tensors.front().name, "\", ...) nor ",
             "\"token_embedding\" or \"head\"");
  }
  for (size_t i = 0; i < tensors.size(); ++i)  // (the whole tensor's size: a tp rank's piece is quantized alike)
    if (tensor::shape_numel(tensors[i].global_shape) < optim::kMinQuantizedNumel) q[i] = false;
  return q;
}

int64_t moment_bytes(const model::Layout& layout, const optim::AdamWConfig& adam,
                     const ShardLayout* shard) {
  int64_t bytes = 0;
  for (const optim::ParamRange& r : adam_ranges(layout, adam, shard, false))
    bytes += optim::moment_bytes(adam, r.quantized, r.numel, r.unit_offset);
  return bytes;
}

std::vector<optim::ParamRange> unit_ranges(const model::Layout& layout, int first, int last, const ShardLayout& shard,
                                           bool local_params, const std::vector<bool>& quantized,
                                           const std::function<bool(const model::TensorSpec&)>& keep) {
  std::vector<optim::ParamRange> ranges;
  const int64_t base = layout.unit_offset(first);
  const std::vector<model::TensorSpec>& tensors = layout.tensors();
  for (size_t k = 0; k < tensors.size(); ++k) {
    const model::TensorSpec& t = tensors[k];
    if (t.unit < first || t.unit > last || (keep && !keep(t))) continue;
    const int i = t.unit - first;
    const int64_t unit_lo = layout.unit_offset(t.unit);
    const int64_t lo = std::max(t.offset - unit_lo, shard.begin(i));
    const int64_t hi = std::min(t.offset + t.numel() - unit_lo, shard.end(i));
    if (lo >= hi) continue;
    const int64_t state = shard.local_offset(i) + (lo - shard.begin(i));
    ranges.push_back({local_params ? state : unit_lo - base + lo, hi - lo, t.decay, state, quantized[k], lo});
  }
  return ranges;
}

std::vector<optim::ParamRange> adam_ranges(const model::Layout& layout, const optim::AdamWConfig& adam,
                                           const ShardLayout* shard, bool local_params) {
  const ShardLayout whole(layout.unit_numels(), 1, 0);  // ZeRO-0: every tensor whole, its state at its offset
  return unit_ranges(layout, 0, layout.head_unit(), shard != nullptr ? *shard : whole, local_params,
                     quantized_tensors(layout, adam));
}

}  // namespace po::parallel
