#include "optim/adamw.h"

#include <cmath>

#include "backend/ops.h"
#include "core/error.h"

namespace po::optim {
namespace ops = po::backend::cpu;

AdamW::AdamW(const AdamWConfig& config, std::vector<ParamRange> ranges, int64_t num_params)
    : config_(config),
      ranges_(std::move(ranges)),
      n_(num_params),
      m_(static_cast<size_t>(num_params) * sizeof(float)),
      v_(static_cast<size_t>(num_params) * sizeof(float)) {
  for (const auto& r : ranges_)
    PO_ASSERT(r.offset >= 0 && r.offset + r.numel <= n_, "range outside the buffer");
}

double AdamW::grad_norm(const float* grads, int64_t n) {
  return std::sqrt(ops::sum_squares(grads, n));
}

double AdamW::step(float* params, const float* grads, double lr) {
  const double norm = grad_norm(grads, n_);
  PO_CHECK(std::isfinite(norm), "gradient norm is ", norm, " at optimizer step ", t_ + 1,
           " (training diverged; lower train.lr)");
  double scale = 1.0;
  if (config_.grad_clip > 0) {
    const double coef = config_.grad_clip / (norm + 1e-6);
    if (coef < 1.0) scale = coef;
  }
  ++t_;
  for (const auto& r : ranges_) {
    ops::adamw_update(params + r.offset, grads + r.offset, m_.f32() + r.offset,
                      v_.f32() + r.offset, r.numel, static_cast<float>(lr),
                      static_cast<float>(config_.beta1), static_cast<float>(config_.beta2),
                      static_cast<float>(config_.eps),
                      r.decay ? static_cast<float>(config_.weight_decay) : 0.0f,
                      static_cast<float>(scale), t_);
  }
  return norm;
}

}  // namespace po::optim
