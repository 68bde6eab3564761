// train() at parallel.pp > 1: the pipeline executor (parallel/pipeline_executor.h)
// over the launch's dp × tp × pp mesh, with the trainer's data, schedule of
// learning rates, evaluation, checkpoints and metrics. A step's loss, norm
// and update are the bits of the pp = 1 trainer at the same micro-batching.
//
// Checkpoints are the whole model's (any layout reads them: pp 2 -> pp 1,
// pp -> dp, and back): each stage's writer (its dp 0, tp 0, cp 0 rank)
// writes its stage's units, whole, in parallel with the others; at start
// every rank reads the units it holds. metrics.jsonl adds the step's measured bubble (1 - mean compute /
// step, over the stages) beside the schedule's formula, the p2p bytes and
// the micro-batches each stage held at once. train.trace writes the last
// step of every rank as Chrome trace-event JSON.
#pragma once

#include <string>

#include "train/run_inputs.h"
#include "train/trainer.h"

namespace po::train {

// Returns with every rank's state freed (swap files removed); the caller
// (train()) holds the ranks together after that on a stop.
TrainResult train_pipeline(const RunInputs& run);

}  // namespace po::train
