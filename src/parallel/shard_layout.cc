#include "parallel/shard_layout.h"

#include <algorithm>

#include "core/error.h"

namespace po::parallel {

ShardLayout::ShardLayout(std::vector<int64_t> unit_numel, int ranks, int rank)
    : numel_(std::move(unit_numel)), ranks_(ranks), rank_(rank) {
  PO_CHECK(ranks >= 1, "ShardLayout: ranks = ", ranks, " must be at least 1");
  PO_CHECK(rank >= 0 && rank < ranks, "ShardLayout: rank ", rank, " is not in [0, ", ranks, ")");
  stride_.reserve(numel_.size());
  local_offset_.assign(1, 0);
  for (int64_t n : numel_) {
    PO_CHECK(n >= 0, "ShardLayout: a unit of ", n, " elements");
    const int64_t s = (n + ranks - 1) / ranks;
    stride_.push_back(s);
    local_offset_.push_back(local_offset_.back() + s);
    total_ += n;
  }
}

int64_t ShardLayout::begin(int u, int r) const {
  return std::min(unit_numel(u), static_cast<int64_t>(r) * stride(u));
}

int64_t ShardLayout::end(int u, int r) const {
  return std::min(unit_numel(u), static_cast<int64_t>(r + 1) * stride(u));
}

int64_t ShardLayout::owned_numel() const {
  int64_t n = 0;
  for (int u = 0; u < num_units(); ++u) n += owned(u);
  return n;
}

std::string ShardLayout::to_string() const {
  return core::str_cat(ranks_, " rank(s) over ", num_units(), " units of ", total_,
                       " elements; rank ", rank_, " owns ", owned_numel(), " (local buffers of ",
                       local_numel(), ")");
}

}  // namespace po::parallel
