// Learning-rate schedules: constant, or linear warm-up then cosine decay to min_lr.
#pragma once

#include <cstdint>
#include <string>

namespace po::optim {

struct LrSchedule {
  std::string kind = "cosine";  // "constant" | "cosine"
  double lr = 6e-4;
  double min_lr = 6e-5;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;

  // Throws InvalidArgument naming train.schedule when the kind is unknown.
  void validate() const;
  // Learning rate for 0-based step s:
  //   s < warmup: lr·(s+1)/warmup; else constant lr, or cosine from lr to min_lr
  //   over the remaining total_steps - warmup steps.
  double at(int64_t step) const;
};

}  // namespace po::optim
