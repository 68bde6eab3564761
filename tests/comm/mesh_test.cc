// DeviceMesh: group structure for every layout of 8 (and 12) ranks, Megatron-LM's
// documented examples checked literally, and errors that name the config keys.
#include "comm/mesh.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"

namespace po::comm {

// gtest finds this by ADL, so failing EXPECT_EQs show coordinates, not bytes.
void PrintTo(const MeshCoords& c, std::ostream* os) {
  *os << "{dp " << c.dp << ", tp " << c.tp << ", pp " << c.pp << ", cp " << c.cp << "}";
}

namespace {

using Groups = std::vector<std::vector<int>>;

// Test-side formatting (ostringstream: GCC 12 warns falsely on "lit" + string&& at -O3).
std::string fmt(const MeshShape& s) {
  std::ostringstream os;
  os << "dp" << s.dp << "_tp" << s.tp << "_pp" << s.pp << "_cp" << s.cp;
  return os.str();
}

std::string fmt(const std::vector<int>& g) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < g.size(); ++i) os << (i ? "," : "") << g[i];
  os << "]";
  return os.str();
}

std::string fmt(const MeshCoords& c) {
  std::ostringstream os;
  os << "{dp " << c.dp << ", tp " << c.tp << ", pp " << c.pp << ", cp " << c.cp << "}";
  return os.str();
}

// Every ordered (dp, tp, pp, cp) whose product is n.
std::vector<MeshShape> factorisations(int n) {
  std::vector<MeshShape> out;
  for (int dp = 1; dp <= n; ++dp)
    for (int tp = 1; tp <= n; ++tp)
      for (int pp = 1; pp <= n; ++pp)
        for (int cp = 1; cp <= n; ++cp)
          if (dp * tp * pp * cp == n) out.push_back({.dp = dp, .tp = tp, .pp = pp, .cp = cp});
  return out;
}

// Whether `axis` lets each coordinate vary (true) or holds it fixed (false).
struct Varies {
  bool dp, tp, pp, cp;
};
Varies varies(Axis axis) {
  switch (axis) {
    case Axis::kData: return {true, false, false, false};
    case Axis::kTensor: return {false, true, false, false};
    case Axis::kPipeline: return {false, false, true, false};
    case Axis::kContext: return {false, false, false, true};
    case Axis::kDataContext: return {true, false, false, true};
    case Axis::kModel: return {false, true, true, false};
  }
  return {};
}

struct Layout {
  int world;
  MeshShape shape;
};

void PrintTo(const Layout& l, std::ostream* os) {
  *os << "world " << l.world << " " << fmt(l.shape);
}

class MeshLayout : public ::testing::TestWithParam<Layout> {};

TEST_P(MeshLayout, CoordsFollowMegatronOrderAndRoundTrip) {
  const auto [world, s] = GetParam();
  const DeviceMesh mesh(world, s);
  for (int r = 0; r < world; ++r) {
    const MeshCoords c = mesh.coords(r);
    EXPECT_EQ(c.tp + s.tp * (c.cp + s.cp * (c.dp + s.dp * c.pp)), r)
        << "rank " << r << " has coords " << fmt(c) << ", not tp-fastest, then cp, dp, pp";
    EXPECT_EQ(mesh.rank_of(c), r) << "rank_of(coords(" << r << ") = " << fmt(c) << ")";
  }
}

TEST_P(MeshLayout, GroupsPartitionTheWorldForEveryAxis) {
  const auto [world, s] = GetParam();
  const DeviceMesh mesh(world, s);
  for (Axis axis : kAllAxes) {
    SCOPED_TRACE(std::string("axis ") + axis_name(axis));
    const Groups all = mesh.groups(axis);
    ASSERT_EQ(static_cast<int>(all.size()), mesh.num_groups(axis));
    EXPECT_EQ(mesh.num_groups(axis) * mesh.size(axis), world);
    std::vector<int> seen(world, 0);
    for (size_t c = 0; c < all.size(); ++c) {
      EXPECT_EQ(static_cast<int>(all[c].size()), mesh.size(axis))
          << "group " << c << " " << fmt(all[c]) << " has the wrong size";
      for (int r : all[c]) {
        ASSERT_TRUE(r >= 0 && r < world) << "group " << c << " holds rank " << r;
        ++seen[r];
      }
    }
    for (int r = 0; r < world; ++r)
      EXPECT_EQ(seen[r], 1) << "rank " << r << " is in " << seen[r] << " groups, not exactly 1";
  }
}

TEST_P(MeshLayout, GroupColorAndRankInGroupAgree) {
  const auto [world, s] = GetParam();
  const DeviceMesh mesh(world, s);
  for (Axis axis : kAllAxes) {
    SCOPED_TRACE(std::string("axis ") + axis_name(axis));
    const Groups all = mesh.groups(axis);
    int last_lowest = -1;
    for (size_t c = 0; c < all.size(); ++c) {
      // Colors follow the groups' lowest ranks: the same numbering on every rank.
      EXPECT_GT(all[c].front(), last_lowest) << "group " << c << " " << fmt(all[c]);
      last_lowest = all[c].front();
    }
    for (int r = 0; r < world; ++r) {
      const std::vector<int> g = mesh.group(r, axis);
      const int color = mesh.group_color(r, axis);
      ASSERT_TRUE(color >= 0 && color < mesh.num_groups(axis))
          << "rank " << r << " color " << color << " outside [0, " << mesh.num_groups(axis) << ")";
      EXPECT_EQ(g, all[color]) << "rank " << r << ": group " << fmt(g) << " but color " << color
                               << " names " << fmt(all[color]);
      EXPECT_TRUE(std::is_sorted(g.begin(), g.end())) << "rank " << r << ": " << fmt(g);
      const int index = mesh.rank_in_group(r, axis);
      ASSERT_TRUE(index >= 0 && index < static_cast<int>(g.size()))
          << "rank " << r << " rank_in_group " << index << " in " << fmt(g);
      EXPECT_EQ(g[index], r) << "rank " << r << " has rank_in_group " << index << " in "
                             << fmt(g);
      for (int m : g) {
        EXPECT_EQ(mesh.group_color(m, axis), color)
            << "rank " << m << " is in rank " << r << "'s group " << fmt(g)
            << " but has another color";
      }
    }
  }
}

TEST_P(MeshLayout, MembersShareExactlyTheFixedCoordinates) {
  const auto [world, s] = GetParam();
  const DeviceMesh mesh(world, s);
  for (Axis axis : kAllAxes) {
    const Varies v = varies(axis);
    for (int r = 0; r < world; ++r) {
      const MeshCoords a = mesh.coords(r);
      const std::vector<int> g = mesh.group(r, axis);
      for (int m : g) {
        const MeshCoords b = mesh.coords(m);
        EXPECT_TRUE((v.dp || a.dp == b.dp) && (v.tp || a.tp == b.tp) &&
                    (v.pp || a.pp == b.pp) && (v.cp || a.cp == b.cp))
            << axis_name(axis) << " group of rank " << r << " " << fmt(a) << " holds rank " << m
            << " " << fmt(b);
      }
      // The group is every rank with the same fixed coordinates, not just a subset.
      int expected = 0;
      for (int o = 0; o < world; ++o) {
        const MeshCoords b = mesh.coords(o);
        expected += (v.dp || a.dp == b.dp) && (v.tp || a.tp == b.tp) &&
                    (v.pp || a.pp == b.pp) && (v.cp || a.cp == b.cp);
      }
      EXPECT_EQ(static_cast<int>(g.size()), expected) << axis_name(axis) << " rank " << r;
    }
  }
}

TEST_P(MeshLayout, TensorGroupsAreContiguousRanks) {
  const auto [world, s] = GetParam();
  const DeviceMesh mesh(world, s);
  for (int r = 0; r < world; ++r) {
    const std::vector<int> g = mesh.group(r, Axis::kTensor);
    EXPECT_EQ(g.front() % s.tp, 0) << "rank " << r << " tp group " << fmt(g);
    for (size_t i = 0; i < g.size(); ++i)
      EXPECT_EQ(g[i], g.front() + static_cast<int>(i)) << "rank " << r << " tp group " << fmt(g);
  }
}

TEST_P(MeshLayout, PipelineNeighboursAreConsistent) {
  const auto [world, s] = GetParam();
  const DeviceMesh mesh(world, s);
  for (int r = 0; r < world; ++r) {
    const MeshCoords c = mesh.coords(r);
    const std::vector<int> stages = mesh.group(r, Axis::kPipeline);
    EXPECT_EQ(stages[c.pp], r) << "rank " << r << " stage " << c.pp << " in " << fmt(stages);
    EXPECT_EQ(mesh.is_first_stage(r), c.pp == 0) << "rank " << r;
    EXPECT_EQ(mesh.is_last_stage(r), c.pp == s.pp - 1) << "rank " << r;

    const auto next = mesh.next_stage_rank(r), prev = mesh.prev_stage_rank(r);
    EXPECT_EQ(next.has_value(), !mesh.is_last_stage(r)) << "rank " << r;
    EXPECT_EQ(prev.has_value(), !mesh.is_first_stage(r)) << "rank " << r;
    if (next) {
      EXPECT_EQ(*next, stages[c.pp + 1]) << "rank " << r;
      EXPECT_EQ(mesh.prev_stage_rank(*next), r) << "prev(next(" << r << ")) with next " << *next;
    }
    if (prev) {
      EXPECT_EQ(*prev, stages[c.pp - 1]) << "rank " << r;
      EXPECT_EQ(mesh.next_stage_rank(*prev), r) << "next(prev(" << r << ")) with prev " << *prev;
    }
    // With wrap-around the stages form a ring of length pp.
    const int wrap_next = mesh.next_stage_rank(r, true).value();
    const int wrap_prev = mesh.prev_stage_rank(r, true).value();
    EXPECT_EQ(wrap_next, stages[(c.pp + 1) % s.pp]) << "rank " << r;
    EXPECT_EQ(wrap_prev, stages[(c.pp + s.pp - 1) % s.pp]) << "rank " << r;
    int at = r;
    for (int i = 0; i < s.pp; ++i) at = mesh.next_stage_rank(at, true).value();
    EXPECT_EQ(at, r) << "walking " << s.pp << " stages from rank " << r << " ends elsewhere";
  }
}

TEST_P(MeshLayout, ToStringHasOneLinePerGroupKind) {
  const auto [world, s] = GetParam();
  const std::string text = DeviceMesh(world, s).to_string();
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), std::size(kAllAxes)) << text;
  for (Axis axis : kAllAxes)
    EXPECT_NE(text.find(std::string("\n  ") + axis_name(axis) + ": "), std::string::npos)
        << "no line for " << axis_name(axis) << " in:\n" << text;
}

std::vector<Layout> all_layouts() {
  std::vector<Layout> out;
  for (int world : {1, 8, 12})
    for (const MeshShape& s : factorisations(world)) out.push_back({world, s});
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllFactorisations, MeshLayout, ::testing::ValuesIn(all_layouts()),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           std::ostringstream os;
                           os << "w" << info.param.world << "_" << fmt(info.param.shape);
                           return os.str();
                         });

// The example in Megatron-LM's initialize_model_parallel docstring, literally:
// 16 GPUs, tp 2, pp 4 (so dp 2).
TEST(MeshMegatron, SixteenRanksTp2Pp4) {
  const DeviceMesh mesh(16, {.dp = 2, .tp = 2, .pp = 4});
  EXPECT_EQ(mesh.groups(Axis::kData),
            (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(mesh.groups(Axis::kTensor),
            (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(mesh.groups(Axis::kPipeline),
            (Groups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}));
  // Without cp the combined group is the dp group.
  EXPECT_EQ(mesh.groups(Axis::kDataContext), mesh.groups(Axis::kData));
  // Megatron's model-parallel group: tp × pp.
  EXPECT_EQ(mesh.groups(Axis::kModel),
            (Groups{{0, 1, 4, 5, 8, 9, 12, 13}, {2, 3, 6, 7, 10, 11, 14, 15}}));
  EXPECT_EQ(mesh.next_stage_rank(5), 9);
  EXPECT_EQ(mesh.prev_stage_rank(5), 1);
  EXPECT_EQ(mesh.next_stage_rank(13), std::nullopt);
  EXPECT_EQ(mesh.next_stage_rank(13, true), 1);
  EXPECT_EQ(mesh.prev_stage_rank(2, true), 14);
}

// Megatron-LM's context_parallel_size example: 8 GPUs, tp 4, cp 2.
TEST(MeshMegatron, EightRanksTp4Cp2) {
  const DeviceMesh mesh(8, {.tp = 4, .cp = 2});
  EXPECT_EQ(mesh.groups(Axis::kContext), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(mesh.groups(Axis::kTensor), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(mesh.groups(Axis::kDataContext), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(mesh.groups(Axis::kData), (Groups{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}));
}

// dp 2 × tp 2 × cp 2: gradients reduce over dp × cp, i.e. the 4 ranks of one tp index.
TEST(MeshMegatron, DataContextGroupWithCp) {
  const DeviceMesh mesh(8, {.dp = 2, .tp = 2, .cp = 2});
  EXPECT_EQ(mesh.groups(Axis::kTensor), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(mesh.groups(Axis::kContext), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(mesh.groups(Axis::kData), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(mesh.groups(Axis::kDataContext), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(mesh.coords(6), (MeshCoords{.dp = 1, .tp = 0, .pp = 0, .cp = 1}));
  EXPECT_EQ(mesh.rank_in_group(6, Axis::kDataContext), 3);
  EXPECT_EQ(mesh.group_color(5, Axis::kDataContext), 1);
}

TEST(MeshToString, ElidesLongListings) {
  const DeviceMesh mesh(1024, {.dp = 64, .tp = 8, .pp = 2});
  const std::string text = mesh.to_string();
  EXPECT_NE(text.find("world 1024 = dp 64 × tp 8 × pp 2 × cp 1"), std::string::npos) << text;
  EXPECT_NE(text.find("tp: 128 groups of 8: [0,1,2,3,4,5,6,7] [8,"), std::string::npos) << text;
  EXPECT_NE(text.find("(120 more)"), std::string::npos) << text;
  EXPECT_LT(text.size(), 2000u) << text;
}

// Runs `fn` and returns the InvalidArgument message, or fails the test.
template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const core::InvalidArgument& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected InvalidArgument";
  return "";
}

void expect_contains(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "message lacks \"" << part << "\": " << text;
}

TEST(MeshErrors, ProductMustEqualWorldSize) {
  const std::string m = error_of([] { DeviceMesh(8, {.dp = 3, .tp = 2}); });
  expect_contains(m, "parallel.dp × parallel.tp × parallel.pp × parallel.cp = 3 × 2 × 1 × 1 = 6");
  expect_contains(m, "does not equal the world size 8");
  expect_contains(m, "parallel.dp = 4 would fit");
  const std::string odd = error_of([] { DeviceMesh(8, {.tp = 3}); });
  expect_contains(odd, "parallel.tp × parallel.pp × parallel.cp = 3 does not divide it");
}

TEST(MeshErrors, SizesMustBePositive) {
  expect_contains(error_of([] { DeviceMesh(8, {.dp = 0, .tp = 8}); }), "parallel.dp = 0");
  expect_contains(error_of([] { DeviceMesh(8, {.tp = -2}); }), "parallel.tp = -2");
  expect_contains(error_of([] { DeviceMesh(8, {.pp = 0}); }), "parallel.pp = 0");
  const std::string m = error_of([] { DeviceMesh(8, {.cp = 0}); });
  expect_contains(m, "parallel.cp = 0");
  expect_contains(m, ">= 1");
  expect_contains(error_of([] { DeviceMesh(0, {}); }), "world size 0");
}

TEST(MeshErrors, HugeProductDoesNotOverflow) {
  const std::string m = error_of([] { DeviceMesh(8, {.dp = 65536, .tp = 65536, .pp = 2}); });
  expect_contains(m, "= 8589934592 does not equal the world size 8");
}

TEST(MeshErrors, RanksAndCoordinatesOutOfRange) {
  const DeviceMesh mesh(8, {.dp = 2, .tp = 2, .pp = 2});
  expect_contains(error_of([&] { mesh.coords(8); }), "rank 8 is outside the mesh [0, 8)");
  expect_contains(error_of([&] { mesh.group(-1, Axis::kData); }), "rank -1");
  expect_contains(error_of([&] { mesh.rank_of({.tp = 2}); }), "tp = 2 is outside [0, 2)");
  expect_contains(error_of([&] { mesh.next_stage_rank(9); }), "rank 9");
}

}  // namespace
}  // namespace po::comm
