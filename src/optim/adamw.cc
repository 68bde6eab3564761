#include "optim/adamw.h"

#include <algorithm>
#include <cmath>

#include "backend/ops.h"
#include "core/error.h"

namespace po::optim {
namespace ops = po::backend::cpu;

AdamW::AdamW(const AdamWConfig& config, std::vector<ParamRange> ranges, int64_t num_params)
    : config_(config),
      ranges_(std::move(ranges)),
      n_(num_params) {
  for (const auto& r : ranges_)
    PO_ASSERT(r.state() >= 0 && r.state() + r.numel <= n_, "range outside the state buffer");
  by_state_ = ranges_;
  std::sort(by_state_.begin(), by_state_.end(),
            [](const ParamRange& a, const ParamRange& b) { return a.state() < b.state(); });
}

PagedAdamState::PagedAdamState(int64_t numel, bool with_master,
                               const memory::PagerOptions& options)
    : n_(numel), e_(page_elements(options.page_bytes, with_master)), fields_(with_master ? 3 : 2) {
  PO_CHECK(e_ >= 1, "memory.page_size = ", options.page_bytes, " bytes holds no element");
  const auto pages = static_cast<size_t>((n_ + e_ - 1) / e_);
  pager_ = std::make_unique<memory::Pager>(pages, options);
}

void PagedAdamState::for_each_page(
    const std::function<void(int64_t, int64_t, float*, float*, float*)>& fn) {
  pager_->for_each([&](size_t page, char* data) {
    auto* f = reinterpret_cast<float*>(data);
    const int64_t lo = static_cast<int64_t>(page) * e_, hi = std::min(n_, lo + e_);
    fn(lo, hi, f, f + e_, fields_ == 3 ? f + 2 * e_ : nullptr);
  });
}

void PagedAdamState::copy_out(Field field, int64_t offset, int64_t n, float* dst) {
  PO_ASSERT(static_cast<int>(field) < fields_, "PagedAdamState: no such field");
  while (n > 0) {
    const int64_t page = offset / e_, in = offset % e_, len = std::min(n, e_ - in);
    pager_->access(static_cast<size_t>(page), [&](char* data) {
      const float* f = reinterpret_cast<const float*>(data) + static_cast<int64_t>(field) * e_;
      std::copy(f + in, f + in + len, dst);
    }, false);
    offset += len;
    dst += len;
    n -= len;
  }
}

void PagedAdamState::copy_in(Field field, int64_t offset, int64_t n, const float* src) {
  PO_ASSERT(static_cast<int>(field) < fields_, "PagedAdamState: no such field");
  while (n > 0) {
    const int64_t page = offset / e_, in = offset % e_, len = std::min(n, e_ - in);
    pager_->access(static_cast<size_t>(page), [&](char* data) {
      float* f = reinterpret_cast<float*>(data) + static_cast<int64_t>(field) * e_;
      std::copy(src, src + len, f + in);
    }, true);
    offset += len;
    src += len;
    n -= len;
  }
}

void AdamW::allocate_state() {
  if (paged_ || m_.data() != nullptr || n_ == 0) return;
  m_ = tensor::Storage(static_cast<size_t>(n_) * sizeof(float));
  v_ = tensor::Storage(static_cast<size_t>(n_) * sizeof(float));
}

float* AdamW::m() {
  allocate_state();
  return m_.f32();
}

float* AdamW::v() {
  allocate_state();
  return v_.f32();
}

void AdamW::enable_paging(const memory::PagerOptions& options, bool with_master) {
  PO_CHECK(t_ == 0, "AdamW::enable_paging after ", t_, " steps");
  paged_ = std::make_unique<PagedAdamState>(n_, with_master, options);
  m_ = tensor::Storage();
  v_ = tensor::Storage();
}

// The paged update: every page in the pager's order, every range cut to it.
namespace {
template <typename Fn>
void for_each_range_piece(PagedAdamState& state, const std::vector<ParamRange>& by_state, Fn fn) {
  state.for_each_page([&](int64_t lo, int64_t hi, float* m, float* v, float* master) {
    auto it = std::lower_bound(by_state.begin(), by_state.end(), lo,
                               [](const ParamRange& r, int64_t x) { return r.state() + r.numel <= x; });
    for (; it != by_state.end() && it->state() < hi; ++it) {
      const int64_t a = std::max(lo, it->state()), b = std::min(hi, it->state() + it->numel);
      if (a >= b) continue;
      fn(*it, a, b - a, m + (a - lo), v + (a - lo), master ? master + (a - lo) : nullptr);
    }
  });
}
}  // namespace

double AdamW::sum_squares(const float* grads, int64_t n) { return ops::sum_squares(grads, n); }

double AdamW::clip_scale(double norm) const {
  PO_CHECK(std::isfinite(norm), "gradient norm is ", norm, " at optimizer step ", t_ + 1,
           " (training diverged; lower train.lr)");
  if (config_.grad_clip > 0) {
    const double coef = config_.grad_clip / (norm + 1e-6);
    if (coef < 1.0) return coef;
  }
  return 1.0;
}

void AdamW::apply(float* params, const float* grads_state, double lr, double scale) {
  allocate_state();
  ++t_;
  if (paged_) {
    for_each_range_piece(*paged_, by_state_, [&](const ParamRange& r, int64_t a, int64_t n,
                                                 float* m, float* v, float*) {
      ops::adamw_update(params + r.offset + (a - r.state()), grads_state + a, m, v, n,
                        static_cast<float>(lr), static_cast<float>(config_.beta1),
                        static_cast<float>(config_.beta2), static_cast<float>(config_.eps),
                        r.decay ? static_cast<float>(config_.weight_decay) : 0.0f,
                        static_cast<float>(scale), t_);
    });
    return;
  }
  for (const auto& r : ranges_) {
    ops::adamw_update(params + r.offset, grads_state + r.state(), m_.f32() + r.state(),
                      v_.f32() + r.state(), r.numel, static_cast<float>(lr),
                      static_cast<float>(config_.beta1), static_cast<float>(config_.beta2),
                      static_cast<float>(config_.eps),
                      r.decay ? static_cast<float>(config_.weight_decay) : 0.0f,
                      static_cast<float>(scale), t_);
  }
}

void AdamW::apply_mixed(float* master, const uint16_t* grads, bool grads_by_state,
                        uint16_t* params_out, double lr, double scale) {
  allocate_state();
  ++t_;
  if (paged_) {
    PO_ASSERT(paged_->with_master(), "AdamW::apply_mixed: the pages hold no master weights");
    for_each_range_piece(*paged_, by_state_, [&](const ParamRange& r, int64_t a, int64_t n,
                                                 float* m, float* v, float* pm) {
      const int64_t rel = a - r.state();
      ops::adamw_update_mixed(pm, grads + (grads_by_state ? a : r.offset + rel), m, v,
                              params_out + r.offset + rel, n, static_cast<float>(lr),
                              static_cast<float>(config_.beta1), static_cast<float>(config_.beta2),
                              static_cast<float>(config_.eps),
                              r.decay ? static_cast<float>(config_.weight_decay) : 0.0f,
                              static_cast<float>(scale), t_);
    });
    return;
  }
  for (const auto& r : ranges_) {
    ops::adamw_update_mixed(master + r.state(), grads + (grads_by_state ? r.state() : r.offset),
                            m_.f32() + r.state(), v_.f32() + r.state(), params_out + r.offset,
                            r.numel, static_cast<float>(lr), static_cast<float>(config_.beta1),
                            static_cast<float>(config_.beta2), static_cast<float>(config_.eps),
                            r.decay ? static_cast<float>(config_.weight_decay) : 0.0f,
                            static_cast<float>(scale), t_);
  }
}

double AdamW::grad_norm(const float* grads, int64_t n) {
  return std::sqrt(ops::sum_squares(grads, n));
}

double AdamW::step(float* params, const float* grads, double lr) {
  for (const auto& r : ranges_)
    PO_ASSERT(r.state() == r.offset, "AdamW::step on sharded state; use apply()");
  const double norm = grad_norm(grads, n_);
  apply(params, grads, lr, clip_scale(norm));
  return norm;
}

}  // namespace po::optim
