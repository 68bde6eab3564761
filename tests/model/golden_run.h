// The training run a golden file of tools/torch_ref describes in its
// metadata (lr, min_lr, warmup_steps, steps, beta1, beta2, eps,
// weight_decay, grad_clip): its warm-up + cosine schedule and its AdamW over
// a model's declared tensors (decay on those of dim >= 2, as the scripts'
// param_groups).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "optim/schedule.h"

namespace po::test {

struct GoldenRun {
  optim::LrSchedule schedule;
  optim::AdamWConfig adam;

  explicit GoldenRun(const checkpoint::SafetensorsReader& f) {
    auto meta = [&](const std::string& key) { return std::stod(f.metadata().at(key)); };
    schedule.kind = "cosine";
    schedule.lr = meta("lr");
    schedule.min_lr = meta("min_lr");
    schedule.warmup_steps = static_cast<int64_t>(meta("warmup_steps"));
    schedule.total_steps = static_cast<int64_t>(meta("steps"));
    adam.beta1 = meta("beta1");
    adam.beta2 = meta("beta2");
    adam.eps = meta("eps");
    adam.weight_decay = meta("weight_decay");
    adam.grad_clip = meta("grad_clip");
  }
  // AdamW over the model's trainable tensors (its adapters, when it has them).
  optim::AdamW optimizer(const model::Transformer& m) const {
    std::vector<optim::ParamRange> ranges;
    for (const model::TensorSpec& p : m.param_infos()) ranges.push_back({p.offset, p.numel(), p.decay});
    return optim::AdamW(adam, ranges, m.num_params());
  }
};

}  // namespace po::test
