// The planner's layout from a config: where `pagedoptim plan` (and the
// planner-vs-engine test) read the parallel.*, train.* and memory.* keys, so
// that plan/ takes only its typed structs.
#pragma once

#include "core/config.h"
#include "plan/planner.h"

namespace po::cli {

// The layout a config asks for (the keys the trainer reads, as it reads them).
plan::Layout plan_layout(const core::Config& cfg, const plan::ModelSpec& model);

}  // namespace po::cli
