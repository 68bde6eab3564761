// DeviceMesh arithmetic. Every query reduces to mixed-radix digits of the rank
// in dim order (tp, cp, dp, pp; tp least significant): an axis is a set of dims,
// its group is every rank obtained by varying those digits, the color is the
// mixed-radix number formed by the other digits and the in-group rank the one
// formed by the varied digits. Lower dims are less significant in both, which
// is why groups come out ascending and colors follow the groups' lowest ranks.
#include "comm/mesh.h"

#include <algorithm>
#include <cstdint>
#include <sstream>

#include "core/error.h"

namespace po::comm {
namespace {

using core::str_cat;

constexpr int kTp = 0, kCp = 1, kDp = 2, kPp = 3;
constexpr const char* kDimName[] = {"tp", "cp", "dp", "pp"};

void check_size(const char* key, int value) {
  PO_CHECK(value >= 1, key, " = ", value, " is invalid: every parallel size must be >= 1");
}

// "[0,1,2,3]"; a long group shows its first members and its last.
std::string format_group(const std::vector<int>& g) {
  constexpr size_t kMaxShown = 16;
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < g.size(); ++i) {
    if (g.size() > kMaxShown && i == kMaxShown - 2) {
      os << ",…," << g.back();
      break;
    }
    os << (i ? "," : "") << g[i];
  }
  os << "]";
  return os.str();
}

}  // namespace

const char* axis_name(Axis axis) {
  switch (axis) {
    case Axis::kData: return "dp";
    case Axis::kTensor: return "tp";
    case Axis::kPipeline: return "pp";
    case Axis::kContext: return "cp";
    case Axis::kDataContext: return "dp-cp";
    case Axis::kModel: return "tp-pp";
  }
  return "?";
}

DeviceMesh::DeviceMesh(int world_size, MeshShape shape) : world_size_(world_size), shape_(shape) {
  PO_CHECK(world_size >= 1, "world size ", world_size, " is invalid: must be >= 1");
  check_size("parallel.dp", shape.dp);
  check_size("parallel.tp", shape.tp);
  check_size("parallel.pp", shape.pp);
  check_size("parallel.cp", shape.cp);
  const int64_t product = int64_t{shape.dp} * shape.tp * shape.pp * shape.cp;
  const int64_t model = int64_t{shape.tp} * shape.pp * shape.cp;
  PO_CHECK(product == world_size, "parallel.dp × parallel.tp × parallel.pp × parallel.cp = ",
           shape.dp, " × ", shape.tp, " × ", shape.pp, " × ", shape.cp, " = ", product,
           " does not equal the world size ", world_size, " (number of processes)",
           world_size % model == 0
               ? str_cat("; parallel.dp = ", world_size / model, " would fit")
               : str_cat("; parallel.tp × parallel.pp × parallel.cp = ", model,
                         " does not divide it"));
  extent_[kTp] = shape.tp;
  extent_[kCp] = shape.cp;
  extent_[kDp] = shape.dp;
  extent_[kPp] = shape.pp;
  int stride = 1;
  for (int d = 0; d < kDims; ++d) {
    stride_[d] = stride;
    stride *= extent_[d];
  }
}

unsigned DeviceMesh::dim_mask(Axis axis) const {
  switch (axis) {
    case Axis::kData: return 1u << kDp;
    case Axis::kTensor: return 1u << kTp;
    case Axis::kPipeline: return 1u << kPp;
    case Axis::kContext: return 1u << kCp;
    case Axis::kDataContext: return (1u << kDp) | (1u << kCp);
    case Axis::kModel: return (1u << kTp) | (1u << kPp);
  }
  PO_ASSERT(false, "unknown axis ", static_cast<int>(axis));
  return 0;
}

int DeviceMesh::size(Axis axis) const {
  const unsigned mask = dim_mask(axis);
  int n = 1;
  for (int d = 0; d < kDims; ++d)
    if (mask & (1u << d)) n *= extent_[d];
  return n;
}

void DeviceMesh::check_rank(int rank) const {
  PO_CHECK(rank >= 0 && rank < world_size_, "rank ", rank, " is outside the mesh [0, ",
           world_size_, ")");
}

void DeviceMesh::digits(int rank, int out[kDims]) const {
  check_rank(rank);
  for (int d = 0; d < kDims; ++d) out[d] = (rank / stride_[d]) % extent_[d];
}

MeshCoords DeviceMesh::coords(int rank) const {
  int g[kDims];
  digits(rank, g);
  return MeshCoords{.dp = g[kDp], .tp = g[kTp], .pp = g[kPp], .cp = g[kCp]};
}

int DeviceMesh::rank_of(const MeshCoords& c) const {
  const int g[kDims] = {c.tp, c.cp, c.dp, c.pp};
  int rank = 0;
  for (int d = 0; d < kDims; ++d) {
    PO_CHECK(g[d] >= 0 && g[d] < extent_[d], "mesh coordinate ", kDimName[d], " = ", g[d],
             " is outside [0, ", extent_[d], ")");
    rank += g[d] * stride_[d];
  }
  return rank;
}

std::vector<int> DeviceMesh::group(int rank, Axis axis) const {
  int g[kDims];
  digits(rank, g);
  const unsigned mask = dim_mask(axis);
  int base = 0;
  for (int d = 0; d < kDims; ++d)
    if (!(mask & (1u << d))) base += g[d] * stride_[d];
  // Count through the varied digits, lowest dim fastest: ranks come out ascending.
  std::vector<int> members;
  members.reserve(size(axis));
  for (int i = 0, n = size(axis); i < n; ++i) {
    int r = base, rest = i;
    for (int d = 0; d < kDims; ++d) {
      if (!(mask & (1u << d))) continue;
      r += (rest % extent_[d]) * stride_[d];
      rest /= extent_[d];
    }
    members.push_back(r);
  }
  return members;
}

int DeviceMesh::rank_in_group(int rank, Axis axis) const {
  int g[kDims];
  digits(rank, g);
  const unsigned mask = dim_mask(axis);
  int index = 0, scale = 1;
  for (int d = 0; d < kDims; ++d) {
    if (!(mask & (1u << d))) continue;
    index += g[d] * scale;
    scale *= extent_[d];
  }
  return index;
}

int DeviceMesh::group_color(int rank, Axis axis) const {
  int g[kDims];
  digits(rank, g);
  const unsigned mask = dim_mask(axis);
  int color = 0, scale = 1;
  for (int d = 0; d < kDims; ++d) {
    if (mask & (1u << d)) continue;
    color += g[d] * scale;
    scale *= extent_[d];
  }
  return color;
}

std::vector<std::vector<int>> DeviceMesh::groups(Axis axis) const {
  std::vector<std::vector<int>> all(num_groups(axis));
  for (int r = 0; r < world_size_; ++r) all[group_color(r, axis)].push_back(r);
  return all;
}

std::optional<int> DeviceMesh::prev_stage_rank(int rank, bool wrap_around) const {
  MeshCoords c = coords(rank);
  if (c.pp == 0 && !wrap_around) return std::nullopt;
  c.pp = (c.pp + shape_.pp - 1) % shape_.pp;
  return rank_of(c);
}

std::optional<int> DeviceMesh::next_stage_rank(int rank, bool wrap_around) const {
  MeshCoords c = coords(rank);
  if (c.pp == shape_.pp - 1 && !wrap_around) return std::nullopt;
  c.pp = (c.pp + 1) % shape_.pp;
  return rank_of(c);
}

bool DeviceMesh::is_first_stage(int rank) const { return coords(rank).pp == 0; }

bool DeviceMesh::is_last_stage(int rank) const { return coords(rank).pp == shape_.pp - 1; }

std::string DeviceMesh::to_string() const {
  // Enough groups to see the pattern; a 1024-rank log line should not be 10 kB.
  constexpr int kMaxGroupsShown = 8;
  std::ostringstream os;
  os << "device mesh: world " << world_size_ << " = dp " << shape_.dp << " × tp " << shape_.tp
     << " × pp " << shape_.pp << " × cp " << shape_.cp
     << " (rank = tp + tp·(cp + cp·(dp + dp·pp)): tp fastest, then cp, dp, pp)";
  for (Axis axis : kAllAxes) {
    const auto all = groups(axis);
    os << "\n  " << axis_name(axis) << ": " << all.size() << " group"
       << (all.size() == 1 ? "" : "s") << " of " << size(axis) << ":";
    const int shown = std::min<int>(kMaxGroupsShown, static_cast<int>(all.size()));
    for (int c = 0; c < shown; ++c) {
      os << " " << format_group(all[c]);
    }
    if (shown < static_cast<int>(all.size())) os << " … (" << all.size() - shown << " more)";
  }
  return os.str();
}

}  // namespace po::comm
