#include "optim/adamw.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "backend/device.h"
#include "core/bf16.h"
#include "backend/ops.h"
#include "core/error.h"
#include "backend/quant_map.h"

namespace po::optim {
namespace ops = po::backend::cpu;

AdamW::AdamW(const AdamWConfig& config, std::vector<ParamRange> ranges, int64_t num_params)
    : config_(config),
      ranges_(std::move(ranges)),
      n_(num_params) {
  for (const auto& r : ranges_)
    PO_ASSERT(r.state() >= 0 && r.state() + r.numel <= n_, "range outside the state buffer");
  by_state_.resize(ranges_.size());
  for (size_t i = 0; i < ranges_.size(); ++i) by_state_[i] = i;
  std::sort(by_state_.begin(), by_state_.end(),
            [this](size_t a, size_t b) { return ranges_[a].state() < ranges_[b].state(); });
  if (quantized()) plan_quantized();
}

int64_t quant_blocks(int64_t n, int64_t block, int64_t unit_offset) {
  return backend::BlockCut(n, block, (block - unit_offset % block) % block).count();
}

int64_t moment_bytes(const AdamWConfig& c, bool quantized, int64_t n, int64_t unit_offset) {
  if (!quantized || c.state_bits >= 32) return 8 * n;
  return 2 * ((n * c.state_bits + 7) / 8 + 4 * quant_blocks(n, c.block_size, unit_offset));
}

void AdamW::plan_quantized() {
  const int64_t B = config_.block_size;
  PO_CHECK(config_.state_bits == 8 || config_.state_bits == 4, "optim.state_bits = ",
           config_.state_bits, " is not one of 32, 8, 4");
  PO_CHECK(B >= 2 && B <= backend::cpu::kMaxQuantBlock && (B & (B - 1)) == 0, "optim.block_size = ", B,
           " is not a power of two in [2, ", backend::cpu::kMaxQuantBlock, "]");
  int64_t f32 = 0, codes = 0, blocks = 0;
  for (const ParamRange& r : ranges_) {
    Slot s;
    s.quantized = r.quantized;
    if (r.quantized) {
      s.first = (B - r.unit_offset % B) % B;
      PO_CHECK(config_.state_bits == 8 || (s.first % 2 == 0 && r.numel % 2 == 0),
               "optim.state_bits = 4 packs two codes to a byte: a range of ", r.numel,
               " elements at unit offset ", r.unit_offset, " is not cut at even elements");
      s.at = codes;
      s.blocks = blocks;
      codes += (r.numel * config_.state_bits + 7) / 8;
      blocks += quant_blocks(r.numel, B, r.unit_offset);
    } else {
      s.at = f32;
      f32 += r.numel;
    }
    slots_.push_back(s);
  }
  f32_numel_ = f32;
  code_bytes_ = codes;
  blocks_ = blocks;
  const StateDtype code = config_.state_bits == 8 ? StateDtype::kU8 : StateDtype::kU4;
  paged_fields_ = {StateField{"adam_m", code, B, true, true}, StateField{"adam_v", code, B, true, true},
                   kAdamWFields[kMaster]};
}

void AdamW::allocate_quantized() {
  // Zero state as bitsandbytes and torchao make it: codes 0, absmax 0 (decodes to 0).
  const auto floats = static_cast<size_t>(2 * f32_numel_ + 2 * blocks_);
  const size_t bytes = floats * sizeof(float) + 2 * static_cast<size_t>(code_bytes_);
  if (bytes == 0 || quant_.data() != nullptr) return;
  quant_ = tensor::Storage(bytes);  // zero-filled
  f_m_ = quant_.f32();
  f_v_ = f_m_ + f32_numel_;
  q_ma_ = f_v_ + f32_numel_;
  q_va_ = q_ma_ + blocks_;
  q_m_ = reinterpret_cast<uint8_t*>(q_va_ + blocks_);
  q_v_ = q_m_ + code_bytes_;
}

// The pages' coordinates: the state's, except that with quantized moments
// each unit (ranges sharing one grid origin, state() - unit_offset) starts
// its grid on a multiple of the block, shifted up past the one before, and
// (compact) the 32-bit ranges take no place.
AdamW::PagedCoordinates AdamW::paged_coordinates(const PagedState::Layout& layout) const {
  PagedCoordinates c;
  c.start.assign(ranges_.size(), 0);
  c.len.assign(ranges_.size(), 0);
  bool some_quantized = false, some_not = false;
  for (const ParamRange& r : ranges_) (r.quantized ? some_quantized : some_not) = true;
  const bool compact = quantized() && some_quantized && some_not && layout.param_bytes == 0 &&
                       layout.grad_bytes == 0 && layout.schema.fields.size() <= static_cast<size_t>(kMaster);
  const int64_t B = config_.block_size;
  int64_t delta = 0, end = 0;  // the shift so far; the pages' end of the last range placed
  for (size_t i : by_state_) {
    const ParamRange& r = ranges_[i];
    int64_t at = r.state() + delta;
    if (compact && !r.quantized) {
      c.start[i] = at;
      delta -= r.numel;
      continue;
    }
    if (quantized() && r.quantized && ((at - r.unit_offset) % B + B) % B != 0) {
      const int64_t origin = std::max(at, end) - r.unit_offset;  // the grid origin, moved up to a line
      const int64_t moved = (origin + B - 1) / B * B + r.unit_offset;
      delta += moved - at;
      at = moved;
      c.shifts.push_back({r.state(), delta});
    }
    c.start[i] = at;
    c.len[i] = r.numel;
    end = at + r.numel;
  }
  c.numel = std::max(end, n_ + delta);
  for (int64_t& s : c.start) s = std::min(s, std::max<int64_t>(c.numel - 1, 0));  // (trailing 32-bit ranges)
  return c;
}

int64_t AdamW::paged_at(int64_t x) const {
  // The last range starting at or before x; an element between ranges moves with the one before.
  auto it = std::upper_bound(by_state_.begin(), by_state_.end(), x,
                             [this](int64_t v, size_t i) { return v < ranges_[i].state(); });
  if (it == by_state_.begin()) return x;
  const size_t i = *std::prev(it);
  const ParamRange& r = ranges_[i];
  const int64_t len = coords_.len[i];
  if (x < r.state() + r.numel) return coords_.start[i] + (len > 0 ? x - r.state() : 0);
  return std::min(coords_.start[i] + len + (x - r.state() - r.numel), std::max<int64_t>(coords_.numel - 1, 0));
}

std::pair<size_t, size_t> AdamW::pages_of(int64_t lo, int64_t n) const {
  PO_ASSERT(paged_ != nullptr && n > 0, "AdamW::pages_of without pages or elements");
  const int64_t e = paged_->elements_per_page();
  return {static_cast<size_t>(paged_at(lo) / e), static_cast<size_t>(paged_at(lo + n - 1) / e)};
}

PagedState::Layout AdamW::paged_layout(const PagedState::Layout& layout) const {
  PagedState::Layout out = layout;
  if (!quantized()) return out;
  PO_CHECK(paged_coordinates(layout).shifts.empty() || (layout.param_bytes == 0 && layout.grad_bytes == 0),
           "paged parameter shards (ZeRO-3) with quantized moments need shards cut on the blocks' grid");
  const bool master = layout.schema.fields.size() > static_cast<size_t>(kMaster);
  out.schema = {"adamw", std::span<const StateField>(paged_fields_.data(), master ? 3 : 2)};
  if (f32_numel_ > 0) {
    out.side = adamw_schema(false);  // m and v, fp32
    out.side_numel = f32_numel_;
  }
  return out;
}

int64_t AdamW::ledger_paged_bytes(const PagedState::Layout& layout) const {
  if (!quantized()) return layout.bytes(n_);
  const bool master = layout.schema.fields.size() > static_cast<size_t>(kMaster);
  return moment_bytes() + n_ * static_cast<int64_t>((master ? 4 : 0) + layout.param_bytes + layout.grad_bytes);
}

int64_t AdamW::moment_bytes() const {
  int64_t b = 0;
  for (const ParamRange& r : ranges_) b += optim::moment_bytes(config_, r.quantized, r.numel, r.unit_offset);
  return b;
}

namespace {

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// The codes and absmax that decode x[len] (block-local codes from element
// 0) to exactly x, if some do: the absmax is the largest positive value (its
// code is 1.0) or the most negative one over the map's first value, to a
// few ulps; each is checked element by element.
bool recover_block(const backend::Codebook& cb, const float* x, int64_t len, uint8_t* codes,
                   float& absmax) {
  float hi = 0.0f, lo = 0.0f;
  for (int64_t i = 0; i < len; ++i) {
    if (!std::isfinite(x[i])) return false;
    hi = std::max(hi, x[i]);
    lo = std::min(lo, x[i]);
  }
  float tries[8];
  int n = 0;
  tries[n++] = hi;  // also the zero block: absmax 0, every code decodes to 0
  if (hi == 0.0f && lo == 0.0f) tries[n++] = cb.absmax_stored(0.0f);
  if (lo < 0.0f && cb.value[0] < 0.0f) {
    float a = lo / cb.value[0];
    for (int k = 0; k < 2; ++k) a = std::nextafter(a, 0.0f);
    for (int k = 0; k < 5; ++k, a = std::nextafter(a, INFINITY)) tries[n++] = a;
  }
  for (int t = 0; t < n; ++t) {
    const float a = tries[t];
    bool ok = true;
    for (int64_t i = 0; ok && i < len; ++i) {
      const int c = a == 0.0f ? (x[i] == 0.0f ? 0 : -1) : cb.code(x[i] / a);
      ok = c >= 0 && same_bits(cb.value[static_cast<size_t>(c)] * a, x[i]);
      if (ok) backend::set_code(codes, i, c, cb.bits);
    }
    if (ok) {
      absmax = a;
      return true;
    }
  }
  return false;
}

}  // namespace

const backend::Codebook& AdamW::moment_map(bool m) const {
  const bool eight = config_.state_bits == 8;
  return backend::codebook(m ? (eight ? backend::QuantMap::kSigned8 : backend::QuantMap::kSigned4)
                    : (eight ? backend::QuantMap::kUnsigned8 : backend::QuantMap::kUnsigned4));
}

template <typename Fn>
void AdamW::overlapping(int64_t lo, int64_t n, Fn fn) const {
  for (size_t i = 0; i < ranges_.size(); ++i) {
    const ParamRange& r = ranges_[i];
    const int64_t a = std::max(lo, r.state()), b = std::min(lo + n, r.state() + r.numel);
    if (a < b) fn(i, a, b);
  }
}

void AdamW::read_moment(StateKind kind, int64_t lo, int64_t n, float* dst) const {
  PO_ASSERT(quantized() && kind != StateKind::kParams, "AdamW::read_moment of fp32 or parameter state");
  const bool m = kind == StateKind::kAdamM;
  const backend::Codebook& cb = moment_map(m);
  const bool none = paged_ == nullptr && quant_.data() == nullptr;  // never written: zeros
  overlapping(lo, n, [&](size_t i, int64_t a, int64_t b) {
    const ParamRange& r = ranges_[i];
    const Slot& s = slots_[i];
    float* out = dst + (a - lo);
    const int64_t e0 = a - r.state(), e1 = b - r.state();
    if (none) {
      std::fill(out, out + (e1 - e0), 0.0f);
    } else if (!s.quantized) {
      if (paged_)
        paged_->copy_out(PagedState::side_field(m ? 0 : 1), s.at + e0, e1 - e0, out);
      else
        std::memcpy(out, (m ? f_m_ : f_v_) + s.at + e0, static_cast<size_t>(e1 - e0) * 4);
      return;
    }
    if (none) return;
    const backend::BlockCut rb(r.numel, config_.block_size, s.first);
    for (int64_t k = rb.of(e0); k <= rb.of(e1 - 1); ++k) {
      const int64_t x0 = rb.start(k), len = rb.start(k + 1) - x0;
      const int64_t from = std::max(x0, e0), to = std::min(x0 + len, e1);
      const auto decode = [&](const uint8_t* codes, float absmax) {  // codes: the block's
        for (int64_t e = from; e < to; ++e)
          out[e - e0] = cb.value[static_cast<size_t>(backend::code_at(codes, e - x0, cb.bits))] * absmax;
      };
      if (paged_)
        paged_block(i, x0, len, false, [&](uint8_t* mc, float* ms, uint8_t* vc, float* vs) {
          decode(m ? mc : vc, m ? *ms : *vs);
        });
      else
        decode((m ? q_m_ : q_v_) + s.at + backend::code_offset(x0, cb.bits), (m ? q_ma_ : q_va_)[s.blocks + k]);
    }
  });
}

int64_t AdamW::write_moment(StateKind kind, int64_t lo, int64_t n, const float* src) {
  PO_ASSERT(quantized() && kind != StateKind::kParams, "AdamW::write_moment of fp32 or parameter state");
  allocate_state();
  const bool m = kind == StateKind::kAdamM;
  const backend::Codebook& cb = moment_map(m);
  int64_t quantized_blocks = 0;
  overlapping(lo, n, [&](size_t i, int64_t a, int64_t b) {
    const ParamRange& r = ranges_[i];
    const Slot& s = slots_[i];
    const float* in = src + (a - lo);
    const int64_t e0 = a - r.state(), e1 = b - r.state();
    if (!s.quantized) {
      if (paged_)
        paged_->copy_in(PagedState::side_field(m ? 0 : 1), s.at + e0, e1 - e0, in);
      else
        std::memcpy((m ? f_m_ : f_v_) + s.at + e0, in, static_cast<size_t>(e1 - e0) * 4);
      return;
    }
    const backend::BlockCut rb(r.numel, config_.block_size, s.first);
    const int64_t k0 = rb.of(e0), k1 = rb.of(e1 - 1);
    PO_CHECK(rb.start(k0) == e0 && rb.start(k1 + 1) == e1, "quantized Adam state is written in whole blocks: ",
             "elements [", e0, ", ", e1, ") of a range of ", r.numel, " cut a block of optim.block_size = ",
             config_.block_size);
    for (int64_t k = k0; k <= k1; ++k) {
      const int64_t x0 = rb.start(k), len = rb.start(k + 1) - x0;
      const auto store = [&](uint8_t* codes, float* absmax) {  // the block's
        if (!recover_block(cb, in + (x0 - e0), len, codes, *absmax)) {
          ops::quantize_blockwise(&cb, in + (x0 - e0), len, len, codes, absmax, 0);
          ++quantized_blocks;
        }
      };
      if (paged_)
        paged_block(i, x0, len, true, [&](uint8_t* mc, float* ms, uint8_t* vc, float* vs) {
          store(m ? mc : vc, m ? ms : vs);
        });
      else
        store((m ? q_m_ : q_v_) + s.at + backend::code_offset(x0, cb.bits), (m ? q_ma_ : q_va_) + s.blocks + k);
    }
  });
  return quantized_blocks;
}

void AdamW::update_elements(const ParamRange& r, const Operands& x, float* m, float* v,
                            const ops::QuantMoments* q, int64_t n, double lr, double scale) const {
  const auto f = [](double d) { return static_cast<float>(d); };
  const float decay = r.decay ? f(config_.weight_decay) : 0.0f;
  if (config_.sgd) {
    const float lrf = f(lr), keep = 1.0f - lrf * decay, gs = f(scale);
    for (int64_t i = 0; i < n; ++i) {
      const float g = (x.gb != nullptr ? core::bf16_to_f32({x.gb[i]}) : x.g[i]) * gs;
      x.p[i] = x.p[i] * keep - lrf * g;
      if (x.out != nullptr) x.out[i] = core::f32_to_bf16(x.p[i]).bits;
    }
    return;
  }
  if (q != nullptr)
    ops::adamw_update_quant(x.p, x.g, x.gb, x.out, q, n, f(lr), f(config_.beta1), f(config_.beta2),
                            f(config_.eps), decay, f(scale), t_);
  else if (x.gb != nullptr)
    ops::adamw_update_mixed(x.p, x.gb, m, v, x.out, n, f(lr), f(config_.beta1), f(config_.beta2),
                            f(config_.eps), decay, f(scale), t_);
  else
    ops::adamw_update(x.p, x.g, m, v, n, f(lr), f(config_.beta1), f(config_.beta2), f(config_.eps), decay,
                      f(scale), t_);
}

void AdamW::apply_quantized(float* params, const float* grads_state, float* master,
                            const uint16_t* grads_bf16, bool grads_by_state, uint16_t* params_out,
                            double lr, double scale) {
  const backend::Codebook& mmap = moment_map(true);
  const backend::Codebook& vmap = moment_map(false);
  for (size_t i = 0; i < ranges_.size(); ++i) {
    const ParamRange& r = ranges_[i];
    const Slot& s = slots_[i];
    // fp32: the parameter at its offset, the gradient at its state offset;
    // bf16: the master at the state offset, the gradient where it lies.
    Operands x;
    x.p = master != nullptr ? master + r.state() : params + r.offset;
    if (grads_state != nullptr) x.g = grads_state + r.state();
    if (grads_bf16 != nullptr) x.gb = grads_bf16 + (grads_by_state ? r.state() : r.offset);
    if (params_out != nullptr) x.out = params_out + r.offset;
    if (s.quantized) {
      const ops::QuantMoments q{q_m_ + s.at, q_ma_ + s.blocks, q_v_ + s.at, q_va_ + s.blocks, &mmap, &vmap,
                                config_.block_size, s.first};
      update_elements(r, x, nullptr, nullptr, &q, r.numel, lr, scale);
    } else {
      update_elements(r, x, f_m_ + s.at, f_v_ + s.at, nullptr, r.numel, lr, scale);
    }
  }
}

void AdamW::enable_paging(const memory::PagerOptions& options,
                          const PagedState::Layout& layout) {
  PO_CHECK(t_ == 0, "AdamW::enable_paging after ", t_, " steps");
  PO_ASSERT(layout.schema.name == adamw_schema(false).name, "AdamW paged with schema '",
            layout.schema.name, "'");
  coords_ = paged_coordinates(layout);
  paged_ = std::make_unique<PagedState>(coords_.numel, paged_layout(layout), options);
  m_ = tensor::Storage();
  v_ = tensor::Storage();
  quant_ = tensor::Storage();
}

// The paged update: every page in the pager's order, every range cut to it.
namespace {
// fn(range index, first element, count) for every range piece inside page
// [lo, hi) (the pages' coordinates); then the page's gradient field is
// zeroed (the shard starts the next step at zero).
template <typename Fn>
void page_pieces(const PagedState& state, const std::vector<size_t>& by_state, const std::vector<int64_t>& start,
                 const std::vector<int64_t>& len, int64_t lo, int64_t hi, const PagedState::View& view, Fn fn) {
  // (A range of length 0 is placed at one element: the page that holds it updates it.)
  auto it = std::lower_bound(by_state.begin(), by_state.end(), lo,
                             [&](size_t i, int64_t x) { return start[i] + std::max<int64_t>(len[i], 1) <= x; });
  for (; it != by_state.end() && start[*it] < hi; ++it) {
    if (len[*it] == 0) {
      fn(*it, start[*it], int64_t{0});
      continue;
    }
    const int64_t a = std::max(lo, start[*it]), b = std::min(hi, start[*it] + len[*it]);
    if (a < b) fn(*it, a, b - a);
  }
  if (view.grad)
    backend::device_zero(view.grad, static_cast<size_t>(hi - lo) * state.field_bytes(PagedState::kGrad));
}

}  // namespace

void AdamW::begin_paged_step() {
  PO_ASSERT(paged_ != nullptr, "AdamW::begin_paged_step without pages");
  ++t_;
}

void AdamW::update_piece(size_t i, int64_t a, int64_t n, int64_t lo, const PagedState::View& page,
                         const OutsidePages& out, double lr, double scale) {
  const ParamRange& r = ranges_[i];
  if (coords_.len[i] == 0) n = r.numel;  // placed nowhere: the whole range, here
  const int64_t rel = a - coords_.start[i], k = a - lo;  // into the range; into the page
  const int64_t state = r.state() + rel;
  const auto at = [&page, k](const void* f, size_t bytes) {
    return f ? static_cast<char*>(const_cast<void*>(f)) + static_cast<size_t>(k) * bytes : nullptr;
  };
  const size_t pb = paged_->field_bytes(PagedState::kParam), gb = paged_->field_bytes(PagedState::kGrad);
  Operands x;
  if (paged_->has(kMaster)) {
    x.p = page.f32(kMaster) + k;
    x.gb = page.grad ? reinterpret_cast<const uint16_t*>(at(page.grad, gb))
                     : out.grads_bf16 + (out.grads_by_state ? state : r.offset + rel);
    x.out = page.param ? reinterpret_cast<uint16_t*>(at(page.param, pb)) : out.params_out + r.offset + rel;
  } else {
    x.p = page.param ? reinterpret_cast<float*>(at(page.param, pb)) : out.params + r.offset + rel;
    x.g = page.grad ? reinterpret_cast<const float*>(at(page.grad, gb)) : out.grads_state + state;
  }
  if (!quantized()) {
    update_elements(r, x, page.f32(kM) + k, page.f32(kV) + k, nullptr, n, lr, scale);
    return;
  }
  if (!r.quantized) {  // fp32 moments in the side pages, at the range's compact offset
    paged_->update_side(slots_[i].at + rel, n, [&](float* const* f, int64_t first, int64_t count) {
      update_elements(r, x + first, f[0], f[1], nullptr, count, lr, scale);
    });
    return;
  }
  // The blocks from k to the last grid line before k + n reach their
  // blocks' ends (first scales); a part after it ends inside its block, at
  // the tensor's end (second scales).
  const int64_t B = config_.block_size, end = k + n, line = std::max(k, end / B * B);
  const int64_t nb = paged_->elements_per_page() / B;  // grid blocks per page
  const backend::Codebook& mmap = moment_map(true);
  const backend::Codebook& vmap = moment_map(false);
  const auto run = [&](int64_t from, int64_t count, int64_t slot) {
    if (count == 0) return;
    ops::QuantMoments q{reinterpret_cast<uint8_t*>(page.field[kM].codes) + backend::code_offset(from, mmap.bits),
                        page.field[kM].scales + slot,
                        reinterpret_cast<uint8_t*>(page.field[kV].codes) + backend::code_offset(from, vmap.bits),
                        page.field[kV].scales + slot, &mmap, &vmap, B, (B - from % B) % B};
    update_elements(r, x + (from - k), nullptr, nullptr, &q, count, lr, scale);
  };
  run(k, line - k, k / B);
  run(line, end - line, nb + line / B);
}

// Every state page in the pager's order (a sweep), each range piece updated.
void AdamW::apply_paged(const OutsidePages& outside, double lr, double scale) {
  paged_->for_each_page([&](int64_t lo, int64_t hi, const PagedState::View& view) {
    page_pieces(*paged_, by_state_, coords_.start, coords_.len, lo, hi, view, [&](size_t i, int64_t a, int64_t n) {
      update_piece(i, a, n, lo, view, outside, lr, scale);
    });
  }, true);
}

void AdamW::update_page(size_t page, double lr, double scale, const OutsidePages& outside) {
  PO_ASSERT(paged_ != nullptr, "AdamW::update_page without pages");
  paged_->visit_page(page, [&](int64_t lo, int64_t hi, const PagedState::View& view) {
    page_pieces(*paged_, by_state_, coords_.start, coords_.len, lo, hi, view, [&](size_t i, int64_t a, int64_t n) {
      update_piece(i, a, n, lo, view, outside, lr, scale);
    });
  }, true);
}

void AdamW::paged_block(size_t i, int64_t x0, int64_t len, bool dirty,
                        const std::function<void(uint8_t*, float*, uint8_t*, float*)>& fn) const {
  const PagedState::Geometry& g = paged_->geometry();
  const int64_t B = config_.block_size, e = g.state_elements;
  const int64_t at = coords_.start[i] + x0, page = at / e, q = at % e;
  // The first scale where the block reaches its grid block's end, else the second.
  const int64_t slot = (q + len) % B == 0 ? q / B : e / B + q / B;
  const int bits = config_.state_bits;
  paged_->pager().access(static_cast<size_t>(page), [&](char* data) {
    fn(reinterpret_cast<uint8_t*>(data + g.offset[kM]) + backend::code_offset(q, bits),
       reinterpret_cast<float*>(data + g.scales[kM]) + slot,
       reinterpret_cast<uint8_t*>(data + g.offset[kV]) + backend::code_offset(q, bits),
       reinterpret_cast<float*>(data + g.scales[kV]) + slot);
  }, dirty);
}

void AdamW::for_each_unshifted(int64_t lo, int64_t n, const std::function<void(int64_t, int64_t, int64_t)>& fn) const {
  for (int64_t done = 0; done < n;) {  // pieces that one shift moves
    auto next = std::upper_bound(coords_.shifts.begin(), coords_.shifts.end(), lo + done,
                                 [](int64_t v, const Shift& s) { return v < s.from; });
    const int64_t len = next == coords_.shifts.end() ? n - done : std::min(n - done, next->from - (lo + done));
    fn(paged_at(lo + done), done, len);
    done += len;
  }
}

void AdamW::copy_out_paged(PagedState::Field f, int64_t lo, int64_t n, void* dst, backend::Device::Direction d) {
  const size_t bytes = paged_->field_bytes(f);
  for_each_unshifted(lo, n, [&](int64_t at, int64_t done, int64_t len) {
    paged_->copy_out(f, at, len, static_cast<char*>(dst) + static_cast<size_t>(done) * bytes, d);
  });
}

void AdamW::copy_in_paged(PagedState::Field f, int64_t lo, int64_t n, const void* src, backend::Device::Direction d) {
  const size_t bytes = paged_->field_bytes(f);
  for_each_unshifted(lo, n, [&](int64_t at, int64_t done, int64_t len) {
    paged_->copy_in(f, at, len, static_cast<const char*>(src) + static_cast<size_t>(done) * bytes, d);
  });
}

void AdamW::allocate_state() {
  if (paged_ || n_ == 0) return;
  if (quantized()) return allocate_quantized();
  if (m_.data() != nullptr) return;
  m_ = tensor::Storage(static_cast<size_t>(n_) * sizeof(float));
  v_ = tensor::Storage(static_cast<size_t>(n_) * sizeof(float));
}

float* AdamW::m() {
  PO_CHECK(!quantized(), "Adam's moments are stored in ", config_.state_bits,
           " bits (optim.state_bits): they have no fp32 buffer");
  allocate_state();
  return m_.f32();
}

float* AdamW::v() {
  PO_CHECK(!quantized(), "Adam's moments are stored in ", config_.state_bits,
           " bits (optim.state_bits): they have no fp32 buffer");
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
  if (quantized()) return apply_quantized(params, grads_state, nullptr, nullptr, false, nullptr, lr, scale);
  for (const auto& r : ranges_)
    update_elements(r, {params + r.offset, grads_state + r.state()}, m_.f32() + r.state(), v_.f32() + r.state(),
                    nullptr, r.numel, lr, scale);
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
  if (quantized()) return apply_quantized(nullptr, nullptr, master, grads, grads_by_state, params_out, lr, scale);
  for (const auto& r : ranges_)
    update_elements(r, {master + r.state(), nullptr, grads + (grads_by_state ? r.state() : r.offset),
                        params_out + r.offset},
                    m_.f32() + r.state(), v_.f32() + r.state(), nullptr, r.numel, lr, scale);
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
