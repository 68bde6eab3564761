#include "parallel/shard_layout.h"

#include <gtest/gtest.h>

#include <vector>

#include "core/error.h"

namespace po::parallel {
namespace {

// Every element of every unit has exactly one owner, shards are contiguous and
// in rank order, and local offsets are the running sums of the strides.
TEST(ShardLayout, EveryElementHasOneOwner) {
  const std::vector<int64_t> units = {0, 1, 7, 8, 1000003, 64};
  for (int ranks : {1, 2, 3, 4, 8}) {
    for (int rank = 0; rank < ranks; ++rank) {
      const ShardLayout l(units, ranks, rank);
      int64_t local = 0;
      for (int u = 0; u < l.num_units(); ++u) {
        EXPECT_EQ(l.local_offset(u), local) << "ranks " << ranks << " unit " << u;
        local += l.stride(u);
        int64_t covered = 0;
        for (int r = 0; r < ranks; ++r) {
          EXPECT_EQ(l.begin(u, r), covered) << "ranks " << ranks << " unit " << u << " rank " << r;
          EXPECT_LE(l.end(u, r) - l.begin(u, r), l.stride(u));
          covered = l.end(u, r);
        }
        EXPECT_EQ(covered, units[static_cast<size_t>(u)]) << "ranks " << ranks << " unit " << u;
      }
      EXPECT_EQ(l.local_numel(), local);
    }
  }
}

TEST(ShardLayout, OneRankIsTheWholeUnit) {
  const ShardLayout l({5, 9}, 1, 0);
  EXPECT_EQ(l.owned(0), 5);
  EXPECT_EQ(l.owned(1), 9);
  EXPECT_EQ(l.local_offset(1), 5);
  EXPECT_EQ(l.owned_numel(), 14);
}

TEST(ShardLayout, ShortAndEmptyLastShards) {
  // 7 elements over 4 ranks: stride 2 -> [0,2) [2,4) [4,6) [6,7)
  const ShardLayout l({7}, 4, 3);
  EXPECT_EQ(l.stride(0), 2);
  EXPECT_EQ(l.begin(0), 6);
  EXPECT_EQ(l.owned(0), 1);
  // 1 element over 3 ranks: ranks 1 and 2 own nothing
  const ShardLayout e({1}, 3, 2);
  EXPECT_EQ(e.owned(0), 0);
}

// A pipeline checkpoint's cut: each unit whole on its stage's rank, the
// rank's units back to back locally.
TEST(ShardLayout, WholeUnitsLieWithTheirOwners) {
  const std::vector<int64_t> units = {5, 9, 4, 6};
  const std::vector<int> owner = {0, 0, 1, 0};
  for (int rank : {0, 1}) {
    const ShardLayout l = ShardLayout::whole_units(units, owner, 2, rank);
    int64_t local = 0;
    for (int u = 0; u < 4; ++u) {
      const bool mine = owner[static_cast<size_t>(u)] == rank;
      EXPECT_EQ(l.begin(u), 0) << "rank " << rank << " unit " << u;
      EXPECT_EQ(l.owned(u), mine ? units[static_cast<size_t>(u)] : 0) << "rank " << rank << " unit " << u;
      EXPECT_EQ(l.end(u, owner[static_cast<size_t>(u)]), units[static_cast<size_t>(u)]);
      EXPECT_EQ(l.local_offset(u), local) << "rank " << rank << " unit " << u;
      if (mine) local += units[static_cast<size_t>(u)];
    }
    EXPECT_EQ(l.local_numel(), local);
    EXPECT_EQ(l.owned_numel(), rank == 0 ? 20 : 4);
  }
  EXPECT_THROW(ShardLayout::whole_units(units, {0, 0, 2, 0}, 2, 0), core::InvalidArgument);
  EXPECT_THROW(ShardLayout::whole_units(units, {0, 0}, 2, 0), core::InvalidArgument);
}

// The cut of a pipeline's data ranks' checkpoint files: each unit cut as ZeRO
// cuts it over its stage's block of ranks, nothing of it on the other blocks;
// every element has one owner, and a block of all the ranks is the ZeRO cut.
TEST(ShardLayout, StageUnitsAreCutOverTheirStagesRanks) {
  const std::vector<int64_t> units = {5, 9, 4, 6, 0};
  const std::vector<int> owner = {0, 1, 1, 2, 0};
  const int stages = 3, dp = 2;
  for (int rank = 0; rank < stages * dp; ++rank) {
    const ShardLayout l = ShardLayout::stage_units(units, owner, stages, dp, rank);
    ASSERT_EQ(l.ranks(), stages * dp);
    int64_t local = 0;
    for (int u = 0; u < l.num_units(); ++u) {
      const auto n = units[static_cast<size_t>(u)];
      const int g = owner[static_cast<size_t>(u)];
      EXPECT_EQ(l.stride(u), ShardLayout::stride_of(n, dp)) << "unit " << u;
      EXPECT_EQ(l.local_offset(u), local) << "rank " << rank << " unit " << u;
      if (rank / dp == g) local += l.stride(u);
      int64_t covered = 0;
      for (int r = 0; r < stages * dp; ++r) {
        if (r / dp != g) {
          EXPECT_EQ(l.end(u, r) - l.begin(u, r), 0) << "unit " << u << " on rank " << r << " of another stage";
          continue;
        }
        EXPECT_EQ(l.begin(u, r), covered) << "unit " << u << " rank " << r;
        covered = l.end(u, r);
      }
      EXPECT_EQ(covered, n) << "unit " << u;
    }
    EXPECT_EQ(l.local_numel(), local) << "rank " << rank;
  }
  // One block is the ZeRO cut, aligned as it is.
  for (int rank = 0; rank < 4; ++rank) {
    const ShardLayout a = ShardLayout::stage_units(units, {0, 0, 0, 0, 0}, 1, 4, rank, 2), b(units, 4, rank, 2);
    for (int u = 0; u < a.num_units(); ++u) {
      EXPECT_EQ(a.begin(u), b.begin(u)) << "rank " << rank << " unit " << u;
      EXPECT_EQ(a.end(u), b.end(u)) << "rank " << rank << " unit " << u;
      EXPECT_EQ(a.local_offset(u), b.local_offset(u)) << "rank " << rank << " unit " << u;
    }
  }
  EXPECT_THROW(ShardLayout::stage_units(units, owner, 2, 2, 0), core::InvalidArgument);  // owner 2 of 2
  EXPECT_THROW(ShardLayout::stage_units(units, owner, 3, 0, 0), core::InvalidArgument);
}

TEST(ShardLayout, BadArgumentsAreErrors) {
  EXPECT_THROW(ShardLayout({1}, 0, 0), core::InvalidArgument);
  EXPECT_THROW(ShardLayout({1}, 2, 2), core::InvalidArgument);
  EXPECT_THROW(ShardLayout({-1}, 1, 0), core::InvalidArgument);
}

}  // namespace
}  // namespace po::parallel
