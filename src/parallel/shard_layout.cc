#include "parallel/shard_layout.h"

#include <algorithm>

#include "core/error.h"

namespace po::parallel {

ShardLayout::ShardLayout(std::vector<int64_t> unit_numel, int ranks, int rank, int64_t align)
    : numel_(std::move(unit_numel)), group_ranks_(ranks), ranks_(ranks), rank_(rank) {
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

ShardLayout ShardLayout::stage_units(std::vector<int64_t> unit_numel, std::vector<int> owner, int groups,
                                     int group_ranks, int rank, int64_t align) {
  PO_CHECK(owner.size() == unit_numel.size(), "ShardLayout: ", owner.size(), " owners for ",
           unit_numel.size(), " units");
  PO_CHECK(groups >= 1 && group_ranks >= 1, "ShardLayout: ", groups, " blocks of ", group_ranks, " ranks");
  ShardLayout l(std::move(unit_numel), groups * group_ranks, rank, align);
  const int mine = rank / group_ranks;
  l.local_offset_.assign(1, 0);
  for (size_t u = 0; u < owner.size(); ++u) {
    PO_CHECK(owner[u] >= 0 && owner[u] < groups, "ShardLayout: unit ", u, "'s owner ", owner[u],
             " is not in [0, ", groups, ")");
    l.stride_[u] = stride_of(l.numel_[u], group_ranks, align);
    l.local_offset_.push_back(l.local_offset_.back() + (owner[u] == mine ? l.stride_[u] : 0));
  }
  l.owner_ = std::move(owner);
  l.group_ranks_ = group_ranks;
  return l;
}

int64_t ShardLayout::begin(int u, int r) const {
  if (!owner_.empty() && owner_[static_cast<size_t>(u)] != r / group_ranks_) return 0;
  return std::min(unit_numel(u), static_cast<int64_t>(r % group_ranks_) * stride(u));
}

int64_t ShardLayout::end(int u, int r) const {
  if (!owner_.empty() && owner_[static_cast<size_t>(u)] != r / group_ranks_) return 0;
  return std::min(unit_numel(u), static_cast<int64_t>(r % group_ranks_ + 1) * stride(u));
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
