#include "optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace po::optim {

void LrSchedule::validate() const {
  PO_CHECK(kind == "constant" || kind == "cosine", "train.schedule must be \"constant\" or ",
           "\"cosine\", got \"", kind, "\"");
  PO_CHECK(min_lr <= lr || kind == "constant", "train.min_lr = ", min_lr,
           " must not exceed train.lr = ", lr);
}

double LrSchedule::at(int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps)
    return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  if (kind == "constant") return lr;
  const double ratio = static_cast<double>(step - warmup_steps) /
                       static_cast<double>(std::max<int64_t>(1, total_steps - warmup_steps));
  const double coeff = 0.5 * (1.0 + std::cos(std::numbers::pi * std::min(1.0, ratio)));
  return min_lr + coeff * (lr - min_lr);
}

}  // namespace po::optim
