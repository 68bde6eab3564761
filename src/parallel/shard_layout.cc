#include "parallel/shard_layout.h"

#include <algorithm>

#include "core/error.h"

namespace po::parallel {

ShardLayout::ShardLayout(std::vector<int64_t> unit_numel, int ranks, int rank, int64_t align)
    : numel_(std::move(unit_numel)), ranks_(ranks), rank_(rank) {
  PO_CHECK(ranks >= 1, "ShardLayout: ranks = ", ranks, " must be at least 1");
  PO_CHECK(align >= 1, "ShardLayout: align = ", align, " must be at least 1");
  PO_CHECK(rank >= 0 && rank < ranks, "ShardLayout: rank ", rank, " is not in [0, ", ranks, ")");
  stride_.reserve(numel_.size());
  local_offset_.assign(1, 0);
  for (int64_t n : numel_) {
    PO_CHECK(n >= 0, "ShardLayout: a unit of ", n, " elements");
    const int64_t s = stride_of(n, ranks, align);
    stride_.push_back(s);
    local_offset_.push_back(local_offset_.back() + s);
    total_ += n;
  }
}

ShardLayout ShardLayout::whole_units(std::vector<int64_t> unit_numel, std::vector<int> owner,
                                     int ranks, int rank) {
  PO_CHECK(owner.size() == unit_numel.size(), "ShardLayout: ", owner.size(), " owners for ",
           unit_numel.size(), " units");
  ShardLayout l(std::move(unit_numel), ranks, rank);
  l.local_offset_.assign(1, 0);
  for (size_t u = 0; u < owner.size(); ++u) {
    PO_CHECK(owner[u] >= 0 && owner[u] < ranks, "ShardLayout: unit ", u, "'s owner ", owner[u],
             " is not in [0, ", ranks, ")");
    l.stride_[u] = l.numel_[u];
    l.local_offset_.push_back(l.local_offset_.back() + (owner[u] == rank ? l.numel_[u] : 0));
  }
  l.owner_ = std::move(owner);
  return l;
}

int64_t ShardLayout::begin(int u, int r) const {
  if (!owner_.empty()) return 0;
  return std::min(unit_numel(u), static_cast<int64_t>(r) * stride(u));
}

int64_t ShardLayout::end(int u, int r) const {
  if (!owner_.empty()) return owner_[static_cast<size_t>(u)] == r ? unit_numel(u) : 0;
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
