#include "optim/adamw.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "backend/device.h"
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

void AdamW::enable_paging(const memory::PagerOptions& options,
                          const PagedState::Layout& layout) {
  PO_CHECK(t_ == 0, "AdamW::enable_paging after ", t_, " steps");
  PO_ASSERT(layout.schema.name == adamw_schema(false).name, "AdamW paged with schema '",
            layout.schema.name, "'");
  paged_ = std::make_unique<PagedState>(n_, layout, options);
  m_ = tensor::Storage();
  v_ = tensor::Storage();
}

// The paged update: every page in the pager's order, every range cut to it;
// fn(range, first element, count, view at that element).
namespace {
// fn(range, first element, count, view at that element) for every range
// piece inside page [lo, hi); then the page's gradient field is zeroed (the
// shard starts the next step at zero).
template <typename Fn>
void page_pieces(const PagedState& state, const std::vector<ParamRange>& by_state, int64_t lo,
                 int64_t hi, const PagedState::View& view, Fn fn) {
  auto it = std::lower_bound(by_state.begin(), by_state.end(), lo,
                             [](const ParamRange& r, int64_t x) { return r.state() + r.numel <= x; });
  for (; it != by_state.end() && it->state() < hi; ++it) {
    const int64_t a = std::max(lo, it->state()), b = std::min(hi, it->state() + it->numel);
    if (a >= b) continue;
    fn(*it, a, b - a, state.advanced(view, a - lo));
  }
  if (view.grad)
    backend::device_zero(view.grad, static_cast<size_t>(hi - lo) * state.field_bytes(PagedState::kGrad));
}

}  // namespace

void AdamW::begin_paged_step() {
  PO_ASSERT(paged_ != nullptr, "AdamW::begin_paged_step without pages");
  ++t_;
}

void AdamW::update_piece(const ParamRange& r, int64_t a, int64_t n, const PagedState::View& at,
                         const OutsidePages& out, double lr, double scale) {
  const int64_t rel = a - r.state();
  const float decay = r.decay ? static_cast<float>(config_.weight_decay) : 0.0f;
  float* m = at.f32(kM);
  float* v = at.f32(kV);
  if (paged_->has(kMaster)) {
    const auto* g = at.grad ? static_cast<const uint16_t*>(at.grad)
                            : out.grads_bf16 + (out.grads_by_state ? a : r.offset + rel);
    auto* dst = at.param ? static_cast<uint16_t*>(at.param) : out.params_out + r.offset + rel;
    ops::adamw_update_mixed(at.f32(kMaster), g, m, v, dst, n, static_cast<float>(lr),
                            static_cast<float>(config_.beta1), static_cast<float>(config_.beta2),
                            static_cast<float>(config_.eps), decay, static_cast<float>(scale), t_);
    return;
  }
  float* p = at.param ? static_cast<float*>(at.param) : out.params + r.offset + rel;
  const float* g = at.grad ? static_cast<const float*>(at.grad) : out.grads_state + a;
  ops::adamw_update(p, g, m, v, n, static_cast<float>(lr), static_cast<float>(config_.beta1),
                    static_cast<float>(config_.beta2), static_cast<float>(config_.eps), decay,
                    static_cast<float>(scale), t_);
}

// Every state page in the pager's order (a sweep), each range piece updated.
void AdamW::apply_paged(const OutsidePages& outside, double lr, double scale) {
  paged_->for_each_page([&](int64_t lo, int64_t hi, const PagedState::View& view) {
    page_pieces(*paged_, by_state_, lo, hi, view,
                [&](const ParamRange& r, int64_t a, int64_t n, const PagedState::View& at) {
                  update_piece(r, a, n, at, outside, lr, scale);
                });
  }, true);
}

void AdamW::update_page(size_t page, double lr, double scale, const OutsidePages& outside) {
  PO_ASSERT(paged_ != nullptr, "AdamW::update_page without pages");
  paged_->visit_page(page, [&](int64_t lo, int64_t hi, const PagedState::View& view) {
    page_pieces(*paged_, by_state_, lo, hi, view,
                [&](const ParamRange& r, int64_t a, int64_t n, const PagedState::View& at) {
                  update_piece(r, a, n, at, outside, lr, scale);
                });
  }, true);
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
    OutsidePages out;
    out.params = params;
    out.grads_state = grads_state;
    apply_paged(out, lr, scale);
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
    PO_ASSERT(paged_->has(kMaster), "AdamW::apply_mixed: the pages hold no master weights");
    OutsidePages out;
    out.grads_bf16 = grads;
    out.grads_by_state = grads_by_state;
    out.params_out = params_out;
    apply_paged(out, lr, scale);
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
