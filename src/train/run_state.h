// Training checkpoints: model parameters, AdamW state, step, data position and
// RNG seed, plus the resolved config, in one checksummed container file
// (checkpoint/container.h) written atomically. Files are
// RUN/checkpoints/step_<8 digits>.ckpt; the newest complete one is the resume
// point, and `checkpoint.keep` bounds how many stay.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "model/gpt2.h"
#include "optim/adamw.h"

namespace po::train {

// Model shapes from model.preset plus any explicitly set model.* keys.
model::GPT2Config resolve_model_config(const core::Config& config);

struct TrainState {
  int64_t step = 0;       // optimizer steps completed
  uint64_t seed = 0;      // data order and sampling seed (train.seed)
  uint64_t tokens = 0;    // tokens consumed so far
};

// Writes checkpoint `path` (atomic; the previous file survives a crash).
void save_checkpoint(const std::string& path, const model::GPT2& model, optim::AdamW& opt,
                     const TrainState& state, const std::string& config_toml);

// Loads a checkpoint written by save_checkpoint into a model of the same
// shape; `opt` may be null (export, generate). Errors name the file.
TrainState load_checkpoint(const std::string& path, model::GPT2& model, optim::AdamW* opt);

// The resolved config stored in a checkpoint.
core::Config checkpoint_config(const std::string& path);

// Checkpoint files in `dir`, oldest first (empty when the directory is absent).
std::vector<std::string> list_checkpoints(const std::string& dir);

// A checkpoint path from a file or a run directory (its newest checkpoint).
std::string resolve_checkpoint(const std::string& ckpt_or_run);

// "RUN/checkpoints/step_00000042.ckpt"
std::string checkpoint_path(const std::string& run_dir, int64_t step);

}  // namespace po::train
