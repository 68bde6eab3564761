#include "optim/paged_state.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>

#include "core/error.h"

namespace po::optim {

PagedState::Geometry PagedState::geometry(int64_t numel, size_t page_bytes, const Layout& layout) {
  const StateSchema& s = layout.schema;
  PO_CHECK(!s.fields.empty() && s.fields.size() <= kMaxFields, "optimizer state schema '", s.name,
           "' has ", s.fields.size(), " fields (1 to ", kMaxFields, " page)");
  // E: a multiple of 16 (fp32 fields then start 64-byte aligned without
  // padding) and of every field's granule.
  int64_t g = 16;
  int bits = 0;
  for (const StateField& f : s.fields) {
    g = std::lcm(g, f.granule());
    bits += f.bits();
  }
  const auto pb = static_cast<int64_t>(page_bytes);
  // The most E that fit, and no more than one shard page holds (every state
  // page then lies in one page of each shard).
  int64_t most = pb * 8 / bits / g;
  for (size_t shard : {layout.param_bytes, layout.grad_bytes})
    if (shard > 0) most = std::min(most, pb / static_cast<int64_t>(shard) / g);
  int64_t lo = 0, hi = most;  // largest k <= most with s.bytes(k·g) <= page_bytes
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (s.bytes(mid * g, kAlign) <= pb) lo = mid;
    else hi = mid - 1;
  }
  Geometry geo;
  geo.state_elements = lo * g;
  PO_CHECK(geo.state_elements >= 16, "memory.page_size = ", page_bytes, " bytes is too small a page for '",
           s.name, "' state (", s.bytes(g, kAlign), " bytes hold its smallest whole piece)");
  const int64_t e = geo.state_elements;
  s.place(e, kAlign, [&geo](size_t i, int64_t codes, int64_t scales) {
    geo.offset[i] = codes;
    geo.scales[i] = scales;
  });
  auto pages = [numel](int64_t per) { return static_cast<size_t>((numel + per - 1) / per); };
  geo.state_pages = pages(e);
  // Shard pages: as many whole state pages' elements as fit.
  auto per_page = [&](size_t bytes) { return pb / static_cast<int64_t>(bytes) / e * e; };
  if (layout.param_bytes > 0) {
    geo.param_elements = per_page(layout.param_bytes);
    geo.param_pages = pages(geo.param_elements);
  }
  if (layout.grad_bytes > 0) {
    geo.grad_elements = per_page(layout.grad_bytes);
    geo.grad_pages = pages(geo.grad_elements);
  }
  if (layout.side_numel > 0) {  // element-wise fp32 fields: a multiple of 16 elements per page
    const StateSchema& side = layout.side;
    PO_CHECK(!side.fields.empty() && side.fields.size() <= kMaxFields, "side state schema '", side.name,
             "' has ", side.fields.size(), " fields (1 to ", kMaxFields, " page)");
    for (const StateField& f : side.fields)
      PO_ASSERT(f.dtype == StateDtype::kF32 && f.block == 0, "side state field '", f.name, "' is not fp32");
    geo.side_elements = pb / (4 * static_cast<int64_t>(side.fields.size())) / 16 * 16;
    PO_CHECK(geo.side_elements >= 16, "memory.page_size = ", page_bytes, " bytes is too small a page for '",
             side.name, "' state");
    side.place(geo.side_elements, kAlign, [&geo](size_t i, int64_t codes, int64_t) { geo.side_offset[i] = codes; });
    geo.side_pages = static_cast<size_t>((layout.side_numel + geo.side_elements - 1) / geo.side_elements);
  }
  return geo;
}

size_t PagedState::min_compute_frames(const Geometry& g, int prefetch) {
  const size_t m = memory::Pager::min_compute_frames(prefetch);
  return std::min(g.state_pages, m) + std::min(g.param_pages, m) + std::min(g.grad_pages, m) +
         std::min(g.side_pages, m);
}

namespace {

std::string suffixed(const std::string& name, const char* what) {
  const std::string ext = ".swap";
  if (name.size() > ext.size() && name.compare(name.size() - ext.size(), ext.size(), ext) == 0)
    return name.substr(0, name.size() - ext.size()) + "-" + what + ext;
  return name + "-" + what;
}

}  // namespace

PagedState::PagedState(int64_t numel, const Layout& layout, const memory::PagerOptions& options)
    : n_(numel), layout_(layout), geo_(geometry(numel, options.page_bytes, layout)) {
  const std::vector<size_t> pages = {geo_.state_pages, geo_.param_pages, geo_.grad_pages, geo_.side_pages};
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
  if (geo_.side_pages > 0) side_ = make(3, "side");  // visited in the state pages' order
}

bool PagedState::has(Field f) const {
  if (f == kParam) return params_ != nullptr;
  if (f == kGrad) return grads_ != nullptr;
  if (f <= side_field(0)) return side_ != nullptr && side_field(0) - f < static_cast<int>(layout_.side.fields.size());
  return f >= 0 && static_cast<size_t>(f) < layout_.schema.fields.size();
}

const memory::Pager& PagedState::pager_of(Field f) const {
  if (f == kParam && params_) return *params_;
  if (f == kGrad && grads_) return *grads_;
  if (f <= side_field(0) && side_) return *side_;
  return *state_;
}

int64_t PagedState::elements_of(Field f) const {
  if (f == kParam && params_) return geo_.param_elements;
  if (f == kGrad && grads_) return geo_.grad_elements;
  if (f <= side_field(0) && side_) return geo_.side_elements;
  return geo_.state_elements;
}

size_t PagedState::field_bytes(Field f) const {
  if (f == kParam) return layout_.param_bytes;
  if (f == kGrad) return layout_.grad_bytes;
  if (!has(f)) return 0;
  if (f <= side_field(0)) return 4;
  const StateField& sf = layout_.schema.fields[static_cast<size_t>(f)];
  return sf.block == 0 && sf.bits() % 8 == 0 ? static_cast<size_t>(sf.bits() / 8) : 0;
}

size_t PagedState::field_offset(Field f) const {
  if (f == kParam || f == kGrad) return 0;  // alone in their pages
  if (f <= side_field(0)) return static_cast<size_t>(geo_.side_offset[static_cast<size_t>(side_field(0) - f)]);
  return static_cast<size_t>(geo_.offset[static_cast<size_t>(f)]);
}

PagedState::View PagedState::advanced(const View& view, int64_t k) const {
  View at = view;
  for (size_t i = 0; i < layout_.schema.fields.size(); ++i) {
    const StateField& f = layout_.schema.fields[i];
    PO_ASSERT(k % f.granule() == 0, "PagedState: field '", f.name, "' cut at element ", k,
              ", not a multiple of its granule ", f.granule());
    at.field[i].codes = view.field[i].codes + f.code_bytes(k);
    if (view.field[i].scales != nullptr) at.field[i].scales = view.field[i].scales + k / f.block;
  }
  if (view.param) at.param = static_cast<char*>(view.param) + static_cast<size_t>(k) * layout_.param_bytes;
  if (view.grad) at.grad = static_cast<char*>(view.grad) + static_cast<size_t>(k) * layout_.grad_bytes;
  return at;
}

void PagedState::with_shards(size_t page, char* data, bool consumes_grads,
                             const std::function<void(int64_t, int64_t, const View&)>& fn) {
  View v;
  const int64_t e = geo_.state_elements;
  for (size_t i = 0; i < layout_.schema.fields.size(); ++i) {
    v.field[i].codes = data + geo_.offset[i];
    if (geo_.scales[i] >= 0) v.field[i].scales = reinterpret_cast<float*>(data + geo_.scales[i]);
  }
  const int64_t lo = static_cast<int64_t>(page) * e;
  const int64_t hi = std::min(n_, lo + e);
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

void PagedState::for_each_page(const std::function<void(int64_t, int64_t, const View&)>& fn,
                               bool consumes_grads) {
  state_->for_each([&](size_t page, char* data) { with_shards(page, data, consumes_grads, fn); });
}

void PagedState::visit_page(size_t page, const std::function<void(int64_t, int64_t, const View&)>& fn,
                            bool consumes_grads) {
  state_->access(page, [&](char* data) { with_shards(page, data, consumes_grads, fn); }, true);
}

void PagedState::for_each_piece(Field field, int64_t offset, int64_t n, bool dirty,
                                const std::function<void(char*, int64_t, int64_t)>& fn) {
  const size_t bytes = field_bytes(field), base = field_offset(field);
  PO_ASSERT(bytes > 0, "PagedState: no element-wise field ", field,
            " (absent, or stored in blocks: visit its pages)");
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
void PagedState::update(Field field, int64_t offset, int64_t n,
                            const std::function<void(void*, int64_t, int64_t)>& fn) {
  for_each_piece(field, offset, n, true,
                 [&](char* ptr, int64_t first, int64_t count) { fn(ptr, first, count); });
}

void PagedState::copy_out(Field field, int64_t offset, int64_t n, void* dst, backend::Device::Direction d) {
  const size_t bytes = field_bytes(field);
  for_each_piece(field, offset, n, false, [&](char* ptr, int64_t first, int64_t count) {
    backend::compute_device().copy(static_cast<char*>(dst) + static_cast<size_t>(first) * bytes, ptr,
                                   static_cast<size_t>(count) * bytes, d);
  });
}

void PagedState::copy_in(Field field, int64_t offset, int64_t n, const void* src, backend::Device::Direction d) {
  const size_t bytes = field_bytes(field);
  update(field, offset, n, [&](void* ptr, int64_t first, int64_t count) {
    backend::compute_device().copy(ptr, static_cast<const char*>(src) + static_cast<size_t>(first) * bytes,
                                   static_cast<size_t>(count) * bytes, d);
  });
}

void PagedState::update_side(int64_t offset, int64_t n,
                             const std::function<void(float* const*, int64_t, int64_t)>& fn) {
  PO_ASSERT(side_ != nullptr, "PagedState::update_side without side state");
  const size_t k = layout_.side.fields.size();
  float* fields[kMaxFields] = {};
  for_each_piece(side_field(0), offset, n, true, [&](char* ptr, int64_t first, int64_t count) {
    // ptr: field 0 at the piece's first element; the others lie in the same page.
    for (size_t i = 0; i < k; ++i)
      fields[i] = reinterpret_cast<float*>(ptr + (geo_.side_offset[i] - geo_.side_offset[0]));
    fn(fields, first, count);
  });
}

void PagedState::prefetch(Field field, int64_t offset, int64_t n) {
  if (n <= 0) return;
  memory::Pager& pager = pager_of(field);
  const int64_t e = elements_of(field);
  for (int64_t p = offset / e; p <= (offset + n - 1) / e; ++p) pager.prefetch(static_cast<size_t>(p));
}

memory::PagerStats PagedState::take_stats() {
  memory::PagerStats s = state_->take_stats();
  for (memory::Pager* pg : {params_.get(), grads_.get(), side_.get()}) {
    if (pg == nullptr) continue;
    s.add(pg->take_stats(), false);  // (pass_s: the sweep is the state pager's)
  }
  return s;
}

size_t PagedState::resident(memory::Tier t) const {
  size_t n = state_->resident(t);
  for (const memory::Pager* pg : {params_.get(), grads_.get(), side_.get()})
    if (pg != nullptr) n += pg->resident(t);
  return n;
}

size_t PagedState::compute_frames() const {
  size_t n = state_->options().compute_frames;
  for (const memory::Pager* pg : {params_.get(), grads_.get(), side_.get()})
    if (pg != nullptr) n += pg->options().compute_frames;
  return n;
}

size_t PagedState::host_frames() const {
  size_t n = state_->options().host_frames;
  for (const memory::Pager* pg : {params_.get(), grads_.get(), side_.get()})
    if (pg != nullptr) n += pg->options().host_frames;
  return n;
}


}  // namespace po::optim
