// The device mesh: how the world's ranks are arranged into dp × tp × pp × cp
// and which process groups each rank belongs to. Pure arithmetic, no
// communication: the communicator layer calls split(group_color, rank_in_group)
// for each axis to build the real groups.
//
// Rank order (Megatron-LM's "tp-cp-dp-pp"): tp varies fastest, then cp, then
// dp, then pp:
//
//   rank = tp_rank + tp · (cp_rank + cp · (dp_rank + dp · pp_rank))
//
// so a tensor-parallel group is always a run of consecutive ranks (on one node
// when tp ≤ GPUs per node, where its heavy all-reduces want to be), and each
// pipeline stage is a contiguous block of world/pp ranks.
//
// Invariants:
//  - every rank belongs to exactly one group per axis; the groups of an axis
//    are disjoint, cover the world and all have size(axis) members;
//  - group(rank, axis) is sorted ascending and rank_in_group is the index in it,
//    so it is the natural split key;
//  - group_color numbers an axis's groups 0..num_groups-1 in the order of their
//    lowest rank; it is the same for every member, whatever rank computes it.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace po::comm {

// Sizes of the four parallel axes (config keys parallel.{dp,tp,pp,cp}).
// Use designated initializers: DeviceMesh(8, {.dp = 2, .tp = 2, .pp = 2}).
struct MeshShape {
  int dp = 1;  // data parallel (replicas; ZeRO shards over it)
  int tp = 1;  // tensor (+ sequence) parallel
  int pp = 1;  // pipeline stages
  int cp = 1;  // context parallel (sequence split across ranks, ring attention)
};

// Where one rank sits in the mesh; each field is in [0, size of that axis).
struct MeshCoords {
  int dp = 0;
  int tp = 0;
  int pp = 0;
  int cp = 0;
  friend bool operator==(const MeshCoords&, const MeshCoords&) = default;
};

// A kind of process group. The first four vary one axis; the last two vary
// several at once and are what the parallel layer actually reduces over.
enum class Axis {
  kData,         // dp: same tp, pp, cp
  kTensor,       // tp: same dp, pp, cp (consecutive ranks)
  kPipeline,     // pp: same dp, tp, cp; ordered by stage
  kContext,      // cp: same dp, tp, pp
  kDataContext,  // dp × cp: same tp, pp. Gradients are reduced (and ZeRO
                 // shards spread) over it when cp > 1, as in Megatron-LM
  kModel,        // tp × pp: same dp, cp. The ranks that hold one full copy of
                 // the parameters: grad-norm and parameter-count reductions
};

inline constexpr Axis kAllAxes[] = {Axis::kData,    Axis::kTensor,      Axis::kPipeline,
                                    Axis::kContext, Axis::kDataContext, Axis::kModel};

// Short name for logs and messages: "dp", "tp", "pp", "cp", "dp-cp", "tp-pp".
const char* axis_name(Axis axis);

class DeviceMesh {
 public:
  // Throws InvalidArgument naming the config keys when a size is < 1 or
  // dp·tp·pp·cp != world_size.
  DeviceMesh(int world_size, MeshShape shape);

  int world_size() const { return world_size_; }
  const MeshShape& shape() const { return shape_; }

  // Members of one group of this axis (dp·cp for kDataContext, tp·pp for kModel).
  int size(Axis axis) const;
  // Number of groups of this axis: world_size / size(axis).
  int num_groups(Axis axis) const { return world_size_ / size(axis); }

  // Throws InvalidArgument when rank is outside [0, world_size).
  MeshCoords coords(int rank) const;
  // Throws InvalidArgument when a coordinate is outside its axis.
  int rank_of(const MeshCoords& c) const;

  // Ranks that share every coordinate with `rank` except those of `axis`,
  // ascending. For kPipeline this is also stage order.
  std::vector<int> group(int rank, Axis axis) const;
  // Index of `rank` in group(rank, axis); use as the split key.
  int rank_in_group(int rank, Axis axis) const;
  // Id of group(rank, axis) in [0, num_groups(axis)), equal for all members,
  // distinct between groups; ordered by the groups' lowest ranks.
  int group_color(int rank, Axis axis) const;
  // All groups of an axis; element c is the group whose color is c.
  std::vector<std::vector<int>> groups(Axis axis) const;

  // Pipeline neighbours (same dp, tp, cp; stage ± 1). Without wrap_around
  // there is no previous stage for the first and no next for the last; with
  // it the stages form a ring (interleaved schedules, warm-up hand-offs).
  std::optional<int> prev_stage_rank(int rank, bool wrap_around = false) const;
  std::optional<int> next_stage_rank(int rank, bool wrap_around = false) const;
  bool is_first_stage(int rank) const;
  bool is_last_stage(int rank) const;

  // Multi-line description for start-up logs: the shape and rank order, then
  // one line per group kind listing its groups (long lists are elided).
  std::string to_string() const;

 private:
  // Internally an axis is a set of dims in rank order, dim 0 varying fastest:
  // 0 = tp, 1 = cp, 2 = dp, 3 = pp.
  static constexpr int kDims = 4;
  unsigned dim_mask(Axis axis) const;
  void check_rank(int rank) const;
  void digits(int rank, int out[kDims]) const;

  int world_size_;
  MeshShape shape_;
  int extent_[kDims];  // sizes in dim order
  int stride_[kDims];  // rank stride of each dim
};

}  // namespace po::comm
