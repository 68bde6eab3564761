// Checkpoints of tensor-parallel runs, in the whole model's layout.
//
// A tp rank holds shards of the declared tensors (model/layout.h); a
// checkpoint holds whole tensors, in the units of the unsplit model, exactly
// as a tp = 1 run writes them. So a checkpoint of dp 2 × tp 2 resumes at tp 1
// × dp 4, at tp 4, at dp 1, exports to Hugging Face names and generates with
// the tp = 1 code; and every checkpoint written before tensor parallel loads
// into a tensor-parallel run.
//
// Saving, per kind and unit: each rank's dp shard of its held unit is
// all-gathered over the data group (the held unit), the held units over the
// tensor group (every shard of the unit), and tp rank 0 of each data group
// assembles the whole unit through Layout::global_runs and keeps the slice
// the whole-model ShardLayout over dp gives it. Those ranks then write a
// checkpoint of the whole model as a data-parallel run would (a collective
// over tp rank 0's data group); the other tp ranks wait for the outcome.
// Transient memory: one whole unit (all its tp shards) at a time, plus this
// rank's 1/dp of the whole state until it is written.
//
// Loading: every rank reads each whole unit and keeps its tp shard's dp shard
// (it reads the whole checkpoint: simple, not I/O-optimal).
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/sharded.h"
#include "parallel/shard_layout.h"
#include "model/transformer.h"
#include "train/run_state.h"

namespace po::comm {
class Communicator;
}

namespace po::train {

// The mesh groups of a tensor-parallel rank: the tensor group (size > 1) and
// the data group (null at dp = 1), and the world (errors agree over it).
struct TensorParallelGroups {
  comm::Communicator* tensor = nullptr;
  comm::Communicator* data = nullptr;
  comm::Communicator* world = nullptr;
};

// What tp rank 0 of a data group writes: its slices of the whole model's
// state under `layout` (the whole model's units over the data group), per
// kind and unit. Empty on the other tp ranks.
struct WholeSlices {
  parallel::ShardLayout layout;
  std::map<std::pair<checkpoint::StateKind, int>, std::vector<float>> slices;
  bool writer = false;  // tp rank 0
  checkpoint::ShardSource source() const;
};

// The gathers of a save (a collective over the mesh), without the writing:
// `held` is the ShardLayout of this rank's held units over the data group
// (the executor's ShardLayout), `source` gives its shards (the contract of
// checkpoint::ShardSource under `held`). Background saves write the result
// later (train/async_checkpoint.h).
WholeSlices gather_whole_slices(const model::Transformer& model, const parallel::ShardLayout& held,
                                const checkpoint::ShardSource& source, const TensorParallelGroups& groups,
                                const std::vector<checkpoint::StateKind>& kinds);

// Every rank of the mesh calls it: gather_whole_slices, then tp rank 0 of each
// data group writes its slices (a collective over the data group).
void save_tensor_parallel_checkpoint(const std::string& path, const model::Transformer& model,
                                     const parallel::ShardLayout& held,
                                     const checkpoint::ShardSource& source,
                                     const TrainState& state, const std::string& config_toml,
                                     const TensorParallelGroups& groups,
                                     const std::vector<checkpoint::StateKind>& kinds);

// Fills this rank's shards under `held` (held units, any dp) through `dest`
// from a checkpoint of the whole model (any layout wrote it).
TrainState load_tensor_parallel_checkpoint(const std::string& path,
                                           const model::Transformer& model,
                                           const parallel::ShardLayout& held,
                                           const checkpoint::ShardDest& dest,
                                           comm::Communicator* world,
                                           const std::vector<checkpoint::StateKind>& kinds);

// Unit u of a tensor-parallel rank's `held` layout from unit u of the whole
// model (`whole`): held[...] = whole[...] along held.global_runs, padding 0.
void shard_unit(const model::Layout& held, const model::Layout& whole, int u,
                const float* whole_unit, float* held_unit);

// Unit u of the whole model from every tp rank's held unit u (pieces[r] at
// r · held unit size; ranks[r] is tp rank r's layout): the inverse of
// shard_unit (replicated tensors are taken from rank 0).
void assemble_unit(const std::vector<model::Layout>& ranks, const model::Layout& whole, int u,
                   const float* pieces, float* out);

// Every tp rank's layout of `config`'s model (what assemble_unit reads).
std::vector<model::Layout> tp_rank_layouts(const model::TransformerConfig& config, int tp);

// Unit u made whole over the tensor group (a collective): each rank gives its
// held unit (n floats); tp rank 0 gets the whole unit in `out` (`ranks`:
// tp_rank_layouts, needed there only), the others leave it as it is.
void gather_whole_unit(comm::Communicator& tensor, const std::vector<model::Layout>& ranks,
                       const model::Layout& whole, int u, const float* held_unit, int64_t n,
                       std::vector<float>& out);

}  // namespace po::train
