// How ZeRO cuts the flat per-unit buffers over the ranks of a data-parallel
// group: the one layout that sharded optimizer state, gradients, parameters
// and sharded checkpoints all agree on.
//
// Unit u (n_u elements) is cut into `ranks` shards of equal stride
// S_u = ceil(n_u / ranks); rank r owns the global element range
// [min(n_u, r·S_u), min(n_u, (r+1)·S_u)) of that unit, so the last shards may
// be short or empty and every element has exactly one owner. A rank keeps its
// shards of all units back to back in local buffers, each padded to S_u (so a
// reduce-scatter or all-gather of unit u moves `ranks` equal blocks of S_u):
// unit u's shard starts at local_offset(u) = Σ_{v<u} S_v.
//
// With ranks = 1 a shard is the whole unit and local offsets are the model's
// unit offsets.
//
// `align` (quantized optimizer state, optim.state_bits < 32: its block size)
// rounds S_u up to a multiple of itself, so every cut falls on the unit's
// grid of blocks and no block of state is split between ranks.
//
// stage_units() makes the cut a pipeline's checkpoint writers take: the ranks
// are `groups` blocks of `group_ranks` (a stage's data ranks), unit u belongs
// to block owner[u], and within it is cut as above over the block's ranks;
// the other blocks own none of it. With one block it is the ZeRO cut; with
// blocks of one rank each unit lies whole on its owner (whole_units()).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace po::parallel {

class ShardLayout {
 public:
  // unit_numel[u] = elements of unit u; 0 <= rank < ranks; align >= 1.
  ShardLayout(std::vector<int64_t> unit_numel, int ranks, int rank, int64_t align = 1);
  // Rank r = g·group_ranks + d is rank d of block g (of `groups`); unit u is
  // cut over the ranks of block owner[u] (in [0, groups)) with stride
  // stride_of(n_u, group_ranks, align), and is nothing on the other blocks'
  // ranks; a rank's units back to back in its local buffers (local_offset).
  // For checkpoint files only: the executor's ZeRO shards are its own.
  static ShardLayout stage_units(std::vector<int64_t> unit_numel, std::vector<int> owner, int groups,
                                 int group_ranks, int rank, int64_t align = 1);
  // Unit u whole on rank owner[u] (in [0, ranks)), nothing of it elsewhere:
  // stage_units with blocks of one rank.
  static ShardLayout whole_units(std::vector<int64_t> unit_numel, std::vector<int> owner,
                                 int ranks, int rank) {
    return stage_units(std::move(unit_numel), std::move(owner), ranks, 1, rank);
  }

  int ranks() const { return ranks_; }
  int rank() const { return rank_; }
  int num_units() const { return static_cast<int>(numel_.size()); }
  int64_t unit_numel(int u) const { return numel_[static_cast<size_t>(u)]; }
  const std::vector<int64_t>& unit_numels() const { return numel_; }
  // S_u: the padded size of every shard of unit u.
  int64_t stride(int u) const { return stride_[static_cast<size_t>(u)]; }
  // S for a unit of n elements over `ranks` ranks: ceil(n / ranks), rounded
  // up to a multiple of `align` (one rank: n, the whole unit).
  static int64_t stride_of(int64_t n, int ranks, int64_t align = 1) {
    if (ranks == 1) return n;
    const int64_t s = (n + ranks - 1) / ranks;
    return (s + align - 1) / align * align;
  }
  // Global element range of unit u owned by rank r: [begin, end).
  int64_t begin(int u, int r) const;
  int64_t end(int u, int r) const;
  int64_t begin(int u) const { return begin(u, rank_); }
  int64_t end(int u) const { return end(u, rank_); }
  // Elements of unit u this rank owns (end - begin; may be 0).
  int64_t owned(int u) const { return end(u) - begin(u); }
  // Where unit u's shard starts in this rank's local buffers.
  int64_t local_offset(int u) const { return local_offset_[static_cast<size_t>(u)]; }
  // Elements of a local buffer: Σ_u S_u (padding included).
  int64_t local_numel() const { return local_offset_.back(); }
  // Elements this rank owns over all units (padding excluded).
  int64_t owned_numel() const;
  // Σ_u n_u.
  int64_t total_numel() const { return total_; }

  std::string to_string() const;  // "4 ranks over 8 units, rank 1 owns ..."

 private:
  std::vector<int64_t> numel_, stride_, local_offset_;
  std::vector<int> owner_;  // stage_units(): each unit's block (empty: the ZeRO cut)
  int group_ranks_ = 1;     // ranks per block (the ZeRO cut: all of them)
  int ranks_ = 1, rank_ = 0;
  int64_t total_ = 0;
};

}  // namespace po::parallel
