#include "optim/adamw.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

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

int64_t PagedAdamState::page_elements(size_t page_bytes, const Layout& l) {
  return static_cast<int64_t>(page_bytes / l.state_bytes() / 16 * 16);
}

PagedAdamState::Geometry PagedAdamState::geometry(int64_t numel, size_t page_bytes,
                                                  const Layout& layout) {
  Geometry g;
  g.state_elements = page_elements(page_bytes, layout);
  PO_CHECK(g.state_elements >= 16, "memory.page_size = ", page_bytes, " bytes is too small a page");
  const int64_t e = g.state_elements;
  auto pages = [numel](int64_t per) { return static_cast<size_t>((numel + per - 1) / per); };
  g.state_pages = pages(e);
  // A multiple of E (a field is at most 4 bytes, a state element at least 8).
  auto per_page = [&](size_t bytes) { return std::max<int64_t>(1, static_cast<int64_t>(page_bytes / bytes) / e) * e; };
  if (layout.param_bytes > 0) {
    g.param_elements = per_page(layout.param_bytes);
    g.param_pages = pages(g.param_elements);
  }
  if (layout.grad_bytes > 0) {
    g.grad_elements = per_page(layout.grad_bytes);
    g.grad_pages = pages(g.grad_elements);
  }
  return g;
}

size_t PagedAdamState::min_compute_frames(const Geometry& g, int prefetch) {
  const size_t m = memory::Pager::min_compute_frames(prefetch);
  return std::min(g.state_pages, m) + std::min(g.param_pages, m) + std::min(g.grad_pages, m);
}

namespace {

std::string suffixed(const std::string& name, const char* what) {
  const std::string ext = ".swap";
  if (name.size() > ext.size() && name.compare(name.size() - ext.size(), ext.size(), ext) == 0)
    return name.substr(0, name.size() - ext.size()) + "-" + what + ext;
  return name + "-" + what;
}

}  // namespace

PagedAdamState::PagedAdamState(int64_t numel, const Layout& layout,
                               const memory::PagerOptions& options)
    : n_(numel), layout_(layout), geo_(geometry(numel, options.page_bytes, layout)) {
  const std::vector<size_t> pages = {geo_.state_pages, geo_.param_pages, geo_.grad_pages};
  const size_t least = memory::Pager::min_compute_frames(options.prefetch);
  const std::vector<size_t> compute = memory::split_frames(options.compute_frames, pages, least);
  const std::vector<size_t> host = memory::split_frames(options.host_frames, pages, 0);
  auto make = [&](size_t i, const char* what) {
    memory::PagerOptions o = options;
    o.compute_frames = compute[i];
    o.host_frames = host[i];
    if (what != nullptr) {
      o.file_name = suffixed(options.file_name, what);
      o.order = memory::PagerOptions::Order::kFollowAccesses;  // gathers, reductions, the sweep
    }
    return std::make_unique<memory::Pager>(pages[i], o);
  };
  state_ = make(0, nullptr);
  if (geo_.param_pages > 0) params_ = make(1, "params");
  if (geo_.grad_pages > 0) {
    grads_ = make(2, "grads");
    consumed_.assign(geo_.grad_pages, 0);
  }
}

const memory::Pager& PagedAdamState::pager_of(Field f) const {
  if (f == Field::kParam && params_) return *params_;
  if (f == Field::kGrad && grads_) return *grads_;
  return *state_;
}

int64_t PagedAdamState::elements_of(Field f) const {
  if (f == Field::kParam && params_) return geo_.param_elements;
  if (f == Field::kGrad && grads_) return geo_.grad_elements;
  return geo_.state_elements;
}

size_t PagedAdamState::field_bytes(Field f) const {
  switch (f) {
    case Field::kM: case Field::kV: return 4;
    case Field::kMaster: return layout_.master ? 4 : 0;
    case Field::kParam: return layout_.param_bytes;
    case Field::kGrad: return layout_.grad_bytes;
  }
  return 0;
}

size_t PagedAdamState::field_offset(Field f) const {
  if (f == Field::kParam || f == Field::kGrad) return 0;  // alone in their pages
  const auto e = static_cast<size_t>(geo_.state_elements);
  return f == Field::kM ? 0 : f == Field::kV ? 4 * e : 8 * e;
}

void PagedAdamState::with_shards(size_t page, char* data, bool consumes_grads,
                                 const std::function<void(int64_t, int64_t, const View&)>& fn) {
  View v;
  v.m = reinterpret_cast<float*>(data);
  v.v = reinterpret_cast<float*>(data + field_offset(Field::kV));
  if (layout_.master) v.master = reinterpret_cast<float*>(data + field_offset(Field::kMaster));
  const int64_t lo = static_cast<int64_t>(page) * geo_.state_elements;
  const int64_t hi = std::min(n_, lo + geo_.state_elements);
  auto with_grads = [&] {
    if (!grads_) {
      fn(lo, hi, v);
      return;
    }
    const int64_t j = lo / geo_.grad_elements;
    grads_->access(static_cast<size_t>(j), [&](char* g) {
      v.grad = g + static_cast<size_t>(lo - j * geo_.grad_elements) * layout_.grad_bytes;
      fn(lo, hi, v);
    }, true);
    if (!consumes_grads) return;
    const int64_t first = j * geo_.grad_elements;
    const int64_t size = std::min(n_, first + geo_.grad_elements) - first;
    auto& done = consumed_[static_cast<size_t>(j)];
    if ((done += hi - lo) == size) {  // every element's gradient is used: zeros from here
      grads_->discard(static_cast<size_t>(j));
      done = 0;
    }
  };
  if (!params_) {
    with_grads();
    return;
  }
  const int64_t j = lo / geo_.param_elements;
  params_->access(static_cast<size_t>(j), [&](char* p) {
    v.param = p + static_cast<size_t>(lo - j * geo_.param_elements) * layout_.param_bytes;
    with_grads();
  }, true);
}

void PagedAdamState::for_each_page(
    const std::function<void(int64_t, int64_t, const View&)>& fn, bool consumes_grads) {
  state_->for_each([&](size_t page, char* data) { with_shards(page, data, consumes_grads, fn); });
}

void PagedAdamState::visit_page(size_t page,
                                const std::function<void(int64_t, int64_t, const View&)>& fn,
                                bool consumes_grads) {
  state_->access(page, [&](char* data) { with_shards(page, data, consumes_grads, fn); }, true);
}

void PagedAdamState::for_each_piece(Field field, int64_t offset, int64_t n, bool dirty,
                                    const std::function<void(char*, int64_t, int64_t)>& fn) {
  const size_t bytes = field_bytes(field), base = field_offset(field);
  PO_ASSERT(bytes > 0, "PagedAdamState: the pages hold no such field");
  memory::Pager& pager = pager_of(field);
  const int64_t e = elements_of(field);
  int64_t done = 0;
  while (done < n) {
    const int64_t at = offset + done, page = at / e, in = at % e, len = std::min(n - done, e - in);
    pager.access(static_cast<size_t>(page), [&](char* data) {
      fn(data + base + static_cast<size_t>(in) * bytes, done, len);
    }, dirty);
    done += len;
  }
}

void PagedAdamState::update(Field field, int64_t offset, int64_t n,
                            const std::function<void(void*, int64_t, int64_t)>& fn) {
  for_each_piece(field, offset, n, true,
                 [&](char* ptr, int64_t first, int64_t count) { fn(ptr, first, count); });
}

void PagedAdamState::copy_out(Field field, int64_t offset, int64_t n, void* dst) {
  const size_t bytes = field_bytes(field);
  for_each_piece(field, offset, n, false, [&](char* ptr, int64_t first, int64_t count) {
    std::memcpy(static_cast<char*>(dst) + static_cast<size_t>(first) * bytes, ptr,
                static_cast<size_t>(count) * bytes);
  });
}

void PagedAdamState::copy_in(Field field, int64_t offset, int64_t n, const void* src) {
  update(field, offset, n, [&](void* ptr, int64_t first, int64_t count) {
    const size_t bytes = field_bytes(field);
    std::memcpy(ptr, static_cast<const char*>(src) + static_cast<size_t>(first) * bytes,
                static_cast<size_t>(count) * bytes);
  });
}

void PagedAdamState::prefetch(Field field, int64_t offset, int64_t n) {
  if (n <= 0) return;
  memory::Pager& pager = pager_of(field);
  const int64_t e = elements_of(field);
  for (int64_t p = offset / e; p <= (offset + n - 1) / e; ++p) pager.prefetch(static_cast<size_t>(p));
}

memory::PagerStats PagedAdamState::take_stats() {
  memory::PagerStats s = state_->take_stats();
  for (memory::Pager* pg : {params_.get(), grads_.get()}) {
    if (pg == nullptr) continue;
    s.add(pg->take_stats(), false);  // (pass_s: the sweep is the state pager's)
  }
  return s;
}

size_t PagedAdamState::resident(memory::Tier t) const {
  size_t n = state_->resident(t);
  for (const memory::Pager* pg : {params_.get(), grads_.get()})
    if (pg != nullptr) n += pg->resident(t);
  return n;
}

size_t PagedAdamState::compute_frames() const {
  size_t n = state_->options().compute_frames;
  for (const memory::Pager* pg : {params_.get(), grads_.get()})
    if (pg != nullptr) n += pg->options().compute_frames;
  return n;
}

size_t PagedAdamState::host_frames() const {
  size_t n = state_->options().host_frames;
  for (const memory::Pager* pg : {params_.get(), grads_.get()})
    if (pg != nullptr) n += pg->options().host_frames;
  return n;
}

void AdamW::enable_paging(const memory::PagerOptions& options,
                          const PagedAdamState::Layout& layout) {
  PO_CHECK(t_ == 0, "AdamW::enable_paging after ", t_, " steps");
  paged_ = std::make_unique<PagedAdamState>(n_, layout, options);
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
void page_pieces(const PagedAdamState& state, const std::vector<ParamRange>& by_state, int64_t lo,
                 int64_t hi, const PagedAdamState::View& view, Fn fn) {
  const size_t pb = state.field_bytes(PagedAdamState::Field::kParam);
  const size_t gb = state.field_bytes(PagedAdamState::Field::kGrad);
  {
    auto it = std::lower_bound(by_state.begin(), by_state.end(), lo,
                               [](const ParamRange& r, int64_t x) { return r.state() + r.numel <= x; });
    for (; it != by_state.end() && it->state() < hi; ++it) {
      const int64_t a = std::max(lo, it->state()), b = std::min(hi, it->state() + it->numel);
      if (a >= b) continue;
      const auto k = static_cast<size_t>(a - lo);
      PagedAdamState::View at;
      at.m = view.m + k;
      at.v = view.v + k;
      at.master = view.master ? view.master + k : nullptr;
      at.param = view.param ? static_cast<char*>(view.param) + k * pb : nullptr;
      at.grad = view.grad ? static_cast<char*>(view.grad) + k * gb : nullptr;
      fn(*it, a, b - a, at);
    }
    if (view.grad) std::memset(view.grad, 0, static_cast<size_t>(hi - lo) * gb);
  }
}

}  // namespace

void AdamW::begin_paged_step() {
  PO_ASSERT(paged_ != nullptr, "AdamW::begin_paged_step without pages");
  ++t_;
}

void AdamW::update_piece(const ParamRange& r, int64_t a, int64_t n, const PagedAdamState::View& at,
                         const OutsidePages& out, double lr, double scale) {
  const int64_t rel = a - r.state();
  const float decay = r.decay ? static_cast<float>(config_.weight_decay) : 0.0f;
  if (paged_->with_master()) {
    const auto* g = at.grad ? static_cast<const uint16_t*>(at.grad)
                            : out.grads_bf16 + (out.grads_by_state ? a : r.offset + rel);
    auto* dst = at.param ? static_cast<uint16_t*>(at.param) : out.params_out + r.offset + rel;
    ops::adamw_update_mixed(at.master, g, at.m, at.v, dst, n, static_cast<float>(lr),
                            static_cast<float>(config_.beta1), static_cast<float>(config_.beta2),
                            static_cast<float>(config_.eps), decay, static_cast<float>(scale), t_);
    return;
  }
  float* p = at.param ? static_cast<float*>(at.param) : out.params + r.offset + rel;
  const float* g = at.grad ? static_cast<const float*>(at.grad) : out.grads_state + a;
  ops::adamw_update(p, g, at.m, at.v, n, static_cast<float>(lr), static_cast<float>(config_.beta1),
                    static_cast<float>(config_.beta2), static_cast<float>(config_.eps), decay,
                    static_cast<float>(scale), t_);
}

// Every state page in the pager's order (a sweep), each range piece updated.
void AdamW::apply_paged(const OutsidePages& outside, double lr, double scale) {
  paged_->for_each_page([&](int64_t lo, int64_t hi, const PagedAdamState::View& view) {
    page_pieces(*paged_, by_state_, lo, hi, view,
                [&](const ParamRange& r, int64_t a, int64_t n, const PagedAdamState::View& at) {
                  update_piece(r, a, n, at, outside, lr, scale);
                });
  }, true);
}

void AdamW::update_page(size_t page, double lr, double scale, const OutsidePages& outside) {
  PO_ASSERT(paged_ != nullptr, "AdamW::update_page without pages");
  paged_->visit_page(page, [&](int64_t lo, int64_t hi, const PagedAdamState::View& view) {
    page_pieces(*paged_, by_state_, lo, hi, view,
                [&](const ParamRange& r, int64_t a, int64_t n, const PagedAdamState::View& at) {
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
    PO_ASSERT(paged_->with_master(), "AdamW::apply_mixed: the pages hold no master weights");
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
