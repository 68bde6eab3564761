// train() at parallel.pp > 1: the pipeline executor (parallel/pipeline_executor.h)
// over the launch's dp × tp × pp mesh, with the trainer's data, schedule of
// learning rates, evaluation, checkpoints and metrics. A step's loss, norm
// and update are the bits of the pp = 1 trainer at the same micro-batching.
//
// Checkpoints are the whole model's (any layout reads them: pp 2 -> pp 1,
// pp -> dp, and back): the first data-parallel replica's stages send their
// units to rank 0, which writes them; at start every rank reads the units it
// holds. metrics.jsonl adds the step's measured bubble (1 - mean compute /
// step, over the stages) beside the schedule's formula, the p2p bytes and
// the micro-batches each stage held at once. train.trace writes the last
// step of every rank as Chrome trace-event JSON.
#pragma once

#include <string>

#include "core/config.h"
#include "data/loader.h"
#include "data/token_file.h"
#include "model/config.h"
#include "optim/adamw.h"
#include "optim/schedule.h"
#include "train/launch.h"
#include "train/trainer.h"

namespace po::train {

struct PipelineRun {
  const core::Config& cfg;
  const model::TransformerConfig& mcfg;
  const Plan& p;
  const Launch& launch;
  data::BatchSampler& sampler;
  const optim::LrSchedule& sched;
  const data::TokenFile* val;  // null without data.val
  optim::AdamWConfig adam;
  std::string run_dir, config_toml;
  uint64_t seed = 0;
  bool resume = false;
};

TrainResult train_pipeline(const PipelineRun& run);

}  // namespace po::train
