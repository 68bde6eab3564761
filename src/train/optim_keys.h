// The optimizer's keys, read at the edge: optim/ takes only its typed
// AdamWConfig (no layer below cli/ and train/ reads a key by its name).
#pragma once

#include "core/config.h"
#include "optim/adamw.h"

namespace po::train {

// train.beta1, beta2, eps, weight_decay, grad_clip and the optim.* keys,
// checked (a one-line error naming the key).
optim::AdamWConfig adamw_config(const core::Config& cfg);

}  // namespace po::train
