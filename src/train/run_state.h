// Training checkpoints: model parameters, AdamW state, step, data position and
// RNG seed, plus the resolved config, as a sharded checkpoint directory
// (checkpoint/sharded.h): RUN/checkpoints/step_<8 digits>/ holding
// manifest.json and one rank_<5 digits>.bin per writing rank, written
// atomically (complete or absent). The newest complete one is the resume
// point, and `checkpoint.keep` bounds how many stay. Any layout loads any
// checkpoint (reshard on load).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/sharded.h"
#include "core/config.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "train/model_setup.h"

namespace po::comm {
class Communicator;
}
namespace po::parallel {
class ShardLayout;
}

namespace po::train {


struct TrainState {
  int64_t step = 0;     // optimizer steps completed
  uint64_t seed = 0;    // data order and sampling seed (train.seed)
  uint64_t tokens = 0;  // tokens consumed so far
  int64_t adam_t = 0;   // AdamW steps taken (bias correction); set by the loaders
  // Compute threads per rank of the run (0: unknown, a checkpoint written
  // before they were recorded). Bit-identity across layouts and with an
  // uninterrupted run holds at equal threads per rank: oneDNN splits a
  // GEMM's work by the thread count.
  int threads = 0;
};

// After a resume: warns (on the leader) when the checkpoint was written at
// another thread count than `threads`, this run's, which `state` then takes.
void keep_threads(TrainState& state, int threads, bool leader);

// Writes checkpoint directory `path` from one process holding the whole state
// (atomic; the previous checkpoints survive a crash). state.adam_t is taken from `opt`.
void save_checkpoint(const std::string& path, const model::Transformer& model, optim::AdamW& opt,
                     const TrainState& state, const std::string& config_toml);

// Loads a checkpoint written by any layout into a model of the same shape;
// `opt` may be null (export, generate: only params are read). Errors name the
// checkpoint and file.
TrainState load_checkpoint(const std::string& path, model::Transformer& model, optim::AdamW* opt);

// ZeRO: every rank of `layout` (a collective over `comm`; nullptr when
// layout.ranks() == 1) writes the shards `source` gives (checkpoint/sharded.h)
// of `kinds`; state.adam_t is stored as AdamW's step count. The layout's units
// must be the model's. Rank 0 records parallel.dp and parallel.zero_stage
// from `config_toml`. Every rank returns once the directory is complete, or
// every rank throws.
void save_checkpoint_sharded(const std::string& path, const model::Transformer& model,
                             const parallel::ShardLayout& layout,
                             const checkpoint::ShardSource& source, const TrainState& state,
                             const std::string& config_toml, comm::Communicator* comm,
                             const std::vector<checkpoint::StateKind>& kinds = {
                                 checkpoint::kAllStateKinds.begin(),
                                 checkpoint::kAllStateKinds.end()});

// ZeRO: fills this rank's shards under `layout` (any rank count, whatever
// layout wrote the checkpoint) through `dest`, for `kinds`; checks the stored
// tensors against `model`'s. With `comm`, every rank succeeds or every rank
// throws. Returns step, seed, tokens and adam_t.
TrainState load_checkpoint_sharded(const std::string& path, const model::Transformer& model,
                                   const parallel::ShardLayout& layout,
                                   const checkpoint::ShardDest& dest, comm::Communicator* comm,
                                   const std::vector<checkpoint::StateKind>& kinds = {
                                       checkpoint::kAllStateKinds.begin(),
                                       checkpoint::kAllStateKinds.end()});

// The tensors of `model` as a checkpoint records them (offsets within units).
std::vector<checkpoint::TensorRecord> checkpoint_tensors(const model::Transformer& model);
std::vector<checkpoint::TensorRecord> checkpoint_tensors(const model::Layout& layout);

// The same two for a checkpoint in the units of `layout` (the whole model's,
// when tensor-parallel ranks save and load: train/tp_checkpoint.h).
void save_checkpoint_sharded(const std::string& path, const model::Layout& layout_units,
                             const parallel::ShardLayout& layout,
                             const checkpoint::ShardSource& source, const TrainState& state,
                             const std::string& config_toml, comm::Communicator* comm,
                             const std::vector<checkpoint::StateKind>& kinds);
TrainState load_checkpoint_sharded(const std::string& path, const model::Layout& layout_units,
                                   const parallel::ShardLayout& layout,
                                   const checkpoint::ShardDest& dest, comm::Communicator* comm,
                                   const std::vector<checkpoint::StateKind>& kinds);

// The metadata save_checkpoint_sharded records for `state` (rank 0 also reads
// parallel.dp and parallel.zero_stage out of `config_toml`).
checkpoint::CheckpointMeta checkpoint_meta(const std::string& path, const model::Layout& units,
                                           const parallel::ShardLayout& layout, const TrainState& state,
                                           const std::string& config_toml);

// The resolved config stored in a checkpoint.
core::Config checkpoint_config(const std::string& path);

// The step of a checkpoint directory name "step_<digits>"; nullopt otherwise
// (including "step_<digits>.tmp", a save in progress or interrupted).
std::optional<int64_t> checkpoint_step(const std::string& name);

// Complete checkpoint directories in `dir` (step_<digits>, not the .tmp of an
// unfinished save), oldest first (empty when `dir` is absent).
std::vector<std::string> list_checkpoints(const std::string& dir);

// Keeps the newest `keep` checkpoints in `dir`, removing older ones whole
// (oldest first), and any stale staging directory (step_*.tmp) of a save that
// did not finish. Call on one rank only, between saves.
void remove_old_checkpoints(const std::string& dir, int64_t keep);

// A checkpoint directory from a checkpoint directory or a run directory (its
// newest checkpoint).
std::string resolve_checkpoint(const std::string& ckpt_or_run);

// "RUN/checkpoints/step_00000042"
std::string checkpoint_path(const std::string& run_dir, int64_t step);

}  // namespace po::train
