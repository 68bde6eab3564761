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

std::vector<OwnedPiece> owned_pieces(const model::Layout& layout, const ShardLayout& shard) {
  std::vector<OwnedPiece> out;
  const std::vector<model::TensorSpec>& tensors = layout.tensors();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const model::TensorSpec& t = tensors[i];
    const int64_t at = t.offset - layout.unit_offset(t.unit);
    const int64_t lo = std::max(at, shard.begin(t.unit)), hi = std::min(at + t.numel(), shard.end(t.unit));
    if (lo < hi) out.push_back({i, lo, hi});
  }
  return out;
}

int64_t moment_bytes(const model::Layout& layout, const optim::AdamWConfig& adam,
                     const ShardLayout* shard) {
  const std::vector<bool> q = quantized_tensors(layout, adam);
  const ShardLayout whole(layout.unit_numels(), 1, 0);  // every tensor whole
  int64_t bytes = 0;
  for (const OwnedPiece& p : owned_pieces(layout, shard != nullptr ? *shard : whole))
    bytes += optim::moment_bytes(adam, q[p.tensor], p.hi - p.lo, p.lo);
  return bytes;
}

std::vector<optim::ParamRange> adam_ranges(const model::Layout& layout, const optim::AdamWConfig& adam,
                                           const ShardLayout* shard, bool local_params) {
  const std::vector<bool> quantized = quantized_tensors(layout, adam);
  const std::vector<model::TensorSpec>& tensors = layout.tensors();
  std::vector<optim::ParamRange> ranges;
  if (shard == nullptr) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      const model::TensorSpec& t = tensors[i];
      ranges.push_back({t.offset, t.numel(), t.decay, -1, quantized[i], t.offset - layout.unit_offset(t.unit)});
    }
    return ranges;
  }
  for (const OwnedPiece& p : owned_pieces(layout, *shard)) {
    const model::TensorSpec& t = tensors[p.tensor];
    const int64_t local = shard->local_offset(t.unit) + (p.lo - shard->begin(t.unit));
    ranges.push_back({local_params ? local : layout.unit_offset(t.unit) + p.lo, p.hi - p.lo, t.decay, local,
                      quantized[p.tensor], p.lo});
  }
  return ranges;
}

}  // namespace po::parallel
