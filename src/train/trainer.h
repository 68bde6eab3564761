// The single-process trainer: wires config, model, optimizer, data, metrics and
// checkpoints. Each step: zero grads, accumulate micro-batches, clip, AdamW,
// record. Batches are a pure function of (seed, step), and a checkpoint holds
// everything else, so a resumed run is bit-identical to an uninterrupted one.
#pragma once

#include <cstdint>
#include <string>

#include "core/config.h"

namespace po::train {

struct TrainResult {
  int64_t steps = 0;         // optimizer steps completed in total
  double last_loss = 0;      // train loss of the last step
  double last_val_loss = -1; // -1 when never evaluated
  std::string run_dir;
  bool leader = true;        // rank 0 (or the only process): the one that reports
  int stopped_by = 0;        // a stop request's signal (train/stop.h): checkpointed, resume me
};

// Runs training as configured. Throws on bad input (naming the key or file)
// before anything in run.dir is overwritten.
TrainResult train(const core::Config& config);

// The start-up checks of train() that need no data or processes: model
// preset, batch split over parallel.dp, unsupported settings. For tools that
// prepare a job (`pagedoptim sbatch`) so that a bad config fails before it
// waits in a queue.
void check_config(const core::Config& config);

}  // namespace po::train
