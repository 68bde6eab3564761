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
  g.state_pages = static_cast<size_t>((numel + g.state_elements - 1) / g.state_elements);
  if (layout.shard_bytes() > 0) {
    // A multiple of E (shard bytes <= state bytes, so at least E fit).
    const auto per_page = static_cast<int64_t>(page_bytes / layout.shard_bytes());
    g.shard_elements = std::max<int64_t>(1, per_page / g.state_elements) * g.state_elements;
    g.shard_pages = static_cast<size_t>((numel + g.shard_elements - 1) / g.shard_elements);
  }
  return g;
}

size_t PagedAdamState::min_compute_frames(const Geometry& g, int prefetch) {
  const size_t m = memory::Pager::min_compute_frames(prefetch);
  return std::min(g.state_pages, m) + std::min(g.shard_pages, m);
}

namespace {

// The shard pages' share of `frames`: in proportion to their number, each
// pager keeping at least its minimum; all it needs when everything fits.
size_t shard_share(size_t frames, const PagedAdamState::Geometry& g, size_t min_state,
                   size_t min_shard) {
  if (frames >= g.pages()) return g.shard_pages;
  size_t s = (frames * g.shard_pages + g.pages() / 2) / g.pages();
  s = std::max(s, min_shard);
  return std::min(s, frames > min_state ? frames - min_state : 0);
}

std::string shard_file_name(const std::string& name) {
  const std::string ext = ".swap";
  if (name.size() > ext.size() && name.compare(name.size() - ext.size(), ext.size(), ext) == 0)
    return name.substr(0, name.size() - ext.size()) + "-shards" + ext;
  return name + "-shards";
}

}  // namespace

PagedAdamState::PagedAdamState(int64_t numel, const Layout& layout,
                               const memory::PagerOptions& options)
    : n_(numel), layout_(layout), geo_(geometry(numel, options.page_bytes, layout)) {
  memory::PagerOptions state = options;
  if (geo_.shard_pages > 0) {
    memory::PagerOptions shards = options;
    const size_t m = memory::Pager::min_compute_frames(options.prefetch);
    shards.compute_frames = shard_share(options.compute_frames, geo_, std::min(geo_.state_pages, m),
                                        std::min(geo_.shard_pages, m));
    shards.host_frames = shard_share(options.host_frames, geo_, 0, 0);
    shards.file_name = shard_file_name(options.file_name);
    shards.order = memory::PagerOptions::Order::kFollowAccesses;  // gathers, reductions, the sweep
    state.compute_frames -= shards.compute_frames;
    state.host_frames -= shards.host_frames;
    shards_ = std::make_unique<memory::Pager>(geo_.shard_pages, shards);
  }
  pager_ = std::make_unique<memory::Pager>(geo_.state_pages, state);
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
  if (in_shards(f))
    return f == Field::kParam ? 0 : static_cast<size_t>(geo_.shard_elements) * layout_.param_bytes;
  const auto e = static_cast<size_t>(geo_.state_elements);
  size_t off = 0;
  for (Field g : {Field::kM, Field::kV, Field::kMaster}) {
    if (g == f) return off;
    off += e * field_bytes(g);
  }
  return off;
}

PagedAdamState::View PagedAdamState::view_of(char* data) const {
  View v;
  v.m = reinterpret_cast<float*>(data);
  v.v = reinterpret_cast<float*>(data + field_offset(Field::kV));
  if (layout_.master) v.master = reinterpret_cast<float*>(data + field_offset(Field::kMaster));
  return v;
}

void PagedAdamState::with_shards(size_t page, char* data,
                                 const std::function<void(int64_t, int64_t, const View&)>& fn) {
  View v = view_of(data);
  const int64_t lo = static_cast<int64_t>(page) * geo_.state_elements;
  const int64_t hi = std::min(n_, lo + geo_.state_elements);
  if (!shards_) {
    fn(lo, hi, v);
    return;
  }
  const int64_t j = lo / geo_.shard_elements, in = lo - j * geo_.shard_elements;
  shards_->access(static_cast<size_t>(j), [&](char* sd) {
    v.param = sd + field_offset(Field::kParam) + static_cast<size_t>(in) * layout_.param_bytes;
    v.grad = sd + field_offset(Field::kGrad) + static_cast<size_t>(in) * layout_.grad_bytes;
    fn(lo, hi, v);
  }, true);
}

void PagedAdamState::for_each_page(
    const std::function<void(int64_t, int64_t, const View&)>& fn) {
  pager_->for_each([&](size_t page, char* data) { with_shards(page, data, fn); });
}

void PagedAdamState::visit_page(size_t page,
                                const std::function<void(int64_t, int64_t, const View&)>& fn) {
  pager_->access(page, [&](char* data) { with_shards(page, data, fn); }, true);
}

void PagedAdamState::for_each_piece(Field field, int64_t offset, int64_t n, bool dirty,
                                    const std::function<void(char*, int64_t, int64_t)>& fn) {
  const size_t bytes = field_bytes(field), base = field_offset(field);
  PO_ASSERT(bytes > 0, "PagedAdamState: the pages hold no such field");
  memory::Pager& pager = in_shards(field) ? *shards_ : *pager_;
  const int64_t e = in_shards(field) ? geo_.shard_elements : geo_.state_elements;
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
  memory::Pager& pager = in_shards(field) ? *shards_ : *pager_;
  const int64_t e = in_shards(field) ? geo_.shard_elements : geo_.state_elements;
  for (int64_t p = offset / e; p <= (offset + n - 1) / e; ++p) pager.prefetch(static_cast<size_t>(p));
}

memory::PagerStats PagedAdamState::take_stats() {
  memory::PagerStats s = pager_->take_stats();
  if (shards_) {
    const memory::PagerStats t = shards_->take_stats();
    s.nvme_read_bytes += t.nvme_read_bytes;
    s.nvme_written_bytes += t.nvme_written_bytes;
    s.host_read_bytes += t.host_read_bytes;
    s.host_written_bytes += t.host_written_bytes;
    s.accesses += t.accesses;
    s.hits += t.hits;
    s.wait_s += t.wait_s;  // (pass_s: the sweep is the state pager's)
  }
  return s;
}

size_t PagedAdamState::resident(memory::Tier t) const {
  return pager_->resident(t) + (shards_ ? shards_->resident(t) : 0);
}

size_t PagedAdamState::compute_frames() const {
  return pager_->options().compute_frames + (shards_ ? shards_->options().compute_frames : 0);
}

size_t PagedAdamState::host_frames() const {
  return pager_->options().host_frames + (shards_ ? shards_->options().host_frames : 0);
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

template <typename Fn>
void for_each_range_piece(PagedAdamState& state, const std::vector<ParamRange>& by_state, Fn fn) {
  state.for_each_page([&](int64_t lo, int64_t hi, const PagedAdamState::View& view) {
    page_pieces(state, by_state, lo, hi, view, fn);
  });
}
}  // namespace

void AdamW::begin_paged_step() {
  PO_ASSERT(paged_ != nullptr, "AdamW::begin_paged_step without pages");
  ++t_;
}

void AdamW::update_page(size_t page, double lr, double scale) {
  PO_ASSERT(paged_ && paged_->layout().param_bytes && paged_->layout().grad_bytes,
            "AdamW::update_page: the pages hold no parameters and gradients");
  const bool mixed = paged_->with_master();
  paged_->visit_page(page, [&](int64_t lo, int64_t hi, const PagedAdamState::View& view) {
    page_pieces(*paged_, by_state_, lo, hi, view,
                [&](const ParamRange& r, int64_t, int64_t n, const PagedAdamState::View& at) {
                  const float decay = r.decay ? static_cast<float>(config_.weight_decay) : 0.0f;
                  if (mixed)
                    ops::adamw_update_mixed(at.master, static_cast<const uint16_t*>(at.grad), at.m,
                                            at.v, static_cast<uint16_t*>(at.param), n,
                                            static_cast<float>(lr), static_cast<float>(config_.beta1),
                                            static_cast<float>(config_.beta2),
                                            static_cast<float>(config_.eps), decay,
                                            static_cast<float>(scale), t_);
                  else
                    ops::adamw_update(static_cast<float*>(at.param), static_cast<const float*>(at.grad),
                                      at.m, at.v, n, static_cast<float>(lr),
                                      static_cast<float>(config_.beta1),
                                      static_cast<float>(config_.beta2),
                                      static_cast<float>(config_.eps), decay,
                                      static_cast<float>(scale), t_);
                });
  });
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
    for_each_range_piece(*paged_, by_state_, [&](const ParamRange& r, int64_t a, int64_t n,
                                                 const PagedAdamState::View& at) {
      float* p = at.param ? static_cast<float*>(at.param) : params + r.offset + (a - r.state());
      const float* g = at.grad ? static_cast<const float*>(at.grad) : grads_state + a;
      ops::adamw_update(p, g, at.m, at.v, n,
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
                                                 const PagedAdamState::View& at) {
      const int64_t rel = a - r.state();
      const uint16_t* g = at.grad ? static_cast<const uint16_t*>(at.grad)
                                  : grads + (grads_by_state ? a : r.offset + rel);
      uint16_t* out = at.param ? static_cast<uint16_t*>(at.param) : params_out + r.offset + rel;
      ops::adamw_update_mixed(at.master, g, at.m, at.v, out, n, static_cast<float>(lr),
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
