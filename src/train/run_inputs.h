// What every layout's trainer starts from: the resolved configuration and
// plan, the launched mesh, the data and the schedule of learning rates
// (train() makes them once, before the layout's own set-up).
#pragma once

#include <cstdint>
#include <string>

#include "core/config.h"
#include "data/loader.h"
#include "data/token_file.h"
#include "model/config.h"
#include "optim/adamw.h"
#include "optim/schedule.h"
#include "train/launch.h"

namespace po::train {

struct RunInputs {
  const core::Config& cfg;
  const model::TransformerConfig& mcfg;
  const Plan& p;
  const Launch& launch;
  data::BatchSampler& sampler;
  const optim::LrSchedule& sched;
  const data::TokenFile* val;  // null without data.val
  const data::SftExamples* val_sft;  // val's SFT examples (null: plain text)
  optim::AdamWConfig adam;
  std::string run_dir, config_toml;
  uint64_t seed = 0;
  bool resume = false;
  int threads = 1;  // compute threads per rank (train.threads, resolved)
};

}  // namespace po::train
