// Checkpoints of tensor-parallel runs, in the whole model's layout.
//
// A tp rank holds shards of the declared tensors (model/layout.h); a
// checkpoint holds whole tensors, in the units of the unsplit model, exactly
// as a tp = 1 run writes them. So a checkpoint of dp 2 × tp 2 resumes at tp 1
// × dp 4, at tp 4, at dp 1, exports to Hugging Face names and generates with
// the tp = 1 code; and every checkpoint written before tensor parallel loads
// into a tensor-parallel run.
//
// Saving (train/pipeline_train.cc): per kind and unit, the held unit made
// whole over the data group, then over the tensor group (every rank
// assembles it: gather_whole_unit), and every rank writes its cut of the
// whole unit (ShardLayout::stage_units over the stage's data × tensor
// ranks). Loading: every rank reads each whole unit and keeps its shard
// (shard_unit).
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
// held unit (n floats) and gets the whole unit in `out` (`ranks`:
// tp_rank_layouts).
void gather_whole_unit(comm::Communicator& tensor, const std::vector<model::Layout>& ranks,
                       const model::Layout& whole, int u, const float* held_unit, int64_t n,
                       std::vector<float>& out);

}  // namespace po::train
