#include "optim/adamw.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "backend/device.h"
#include "backend/ops.h"
#include "core/config.h"
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
  by_state_ = ranges_;
  std::sort(by_state_.begin(), by_state_.end(),
            [](const ParamRange& a, const ParamRange& b) { return a.state() < b.state(); });
  if (quantized()) plan_quantized();
}

AdamWConfig adamw_config(const core::Config& cfg) {
  AdamWConfig o;
  o.beta1 = cfg.get_float("train.beta1");
  o.beta2 = cfg.get_float("train.beta2");
  o.eps = cfg.get_float("train.eps");
  o.weight_decay = cfg.get_float("train.weight_decay");
  o.grad_clip = cfg.get_float("train.grad_clip");
  o.state_bits = static_cast<int>(cfg.get_int("optim.state_bits"));
  PO_CHECK(o.state_bits == 32 || o.state_bits == 8 || o.state_bits == 4, "optim.state_bits = ",
           o.state_bits, " is not one of 32, 8, 4");
  const int64_t block = cfg.get_int("optim.block_size");
  PO_CHECK(block == 0 || (block >= 2 && (block & (block - 1)) == 0), "optim.block_size = ", block,
           " is not a power of two (2 to 4096; 0 takes 256 at 8 bits, 128 at 4)");
  o.block_size = block != 0 ? block : o.state_bits == 4 ? 128 : 256;
  o.state_bits_exclude = cfg.get_string("optim.state_bits_exclude");
  return o;
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
  // Zero state as bitsandbytes and torchao make it: codes 0, absmax 0 (decodes to 0).
  const auto floats = static_cast<size_t>(2 * f32 + 2 * blocks);
  const size_t bytes = floats * sizeof(float) + 2 * static_cast<size_t>(codes);
  if (bytes == 0) return;
  quant_ = tensor::Storage(bytes);  // zero-filled
  f_m_ = quant_.f32();
  f_v_ = f_m_ + f32;
  q_ma_ = f_v_ + f32;
  q_va_ = q_ma_ + blocks;
  q_m_ = reinterpret_cast<uint8_t*>(q_va_ + blocks);
  q_v_ = q_m_ + codes;
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
  overlapping(lo, n, [&](size_t i, int64_t a, int64_t b) {
    const ParamRange& r = ranges_[i];
    const Slot& s = slots_[i];
    float* out = dst + (a - lo);
    if (!s.quantized) {
      std::memcpy(out, (m ? f_m_ : f_v_) + s.at + (a - r.state()), static_cast<size_t>(b - a) * 4);
      return;
    }
    const uint8_t* codes = (m ? q_m_ : q_v_) + s.at;
    const float* absmax = (m ? q_ma_ : q_va_) + s.blocks;
    const backend::BlockCut rb(r.numel, config_.block_size, s.first);
    for (int64_t e = a - r.state(); e < b - r.state(); ++e)
      out[e - (a - r.state())] =
          cb.value[static_cast<size_t>(backend::code_at(codes, e, cb.bits))] * absmax[rb.of(e)];
  });
}

int64_t AdamW::write_moment(StateKind kind, int64_t lo, int64_t n, const float* src) {
  PO_ASSERT(quantized() && kind != StateKind::kParams, "AdamW::write_moment of fp32 or parameter state");
  const bool m = kind == StateKind::kAdamM;
  const backend::Codebook& cb = moment_map(m);
  int64_t quantized_blocks = 0;
  overlapping(lo, n, [&](size_t i, int64_t a, int64_t b) {
    const ParamRange& r = ranges_[i];
    const Slot& s = slots_[i];
    const float* in = src + (a - lo);
    if (!s.quantized) {
      std::memcpy((m ? f_m_ : f_v_) + s.at + (a - r.state()), in, static_cast<size_t>(b - a) * 4);
      return;
    }
    uint8_t* codes = (m ? q_m_ : q_v_) + s.at;
    float* absmax = (m ? q_ma_ : q_va_) + s.blocks;
    const backend::BlockCut rb(r.numel, config_.block_size, s.first);
    const int64_t e0 = a - r.state(), e1 = b - r.state();
    const int64_t k0 = rb.of(e0), k1 = rb.of(e1 - 1);
    PO_CHECK(rb.start(k0) == e0 && rb.start(k1 + 1) == e1, "quantized Adam state is written in whole blocks: ",
             "elements [", e0, ", ", e1, ") of a range of ", r.numel, " cut a block of optim.block_size = ",
             config_.block_size);
    for (int64_t k = k0; k <= k1; ++k) {
      const int64_t x0 = rb.start(k), len = rb.start(k + 1) - x0;
      uint8_t* block_codes = codes + backend::code_offset(x0, cb.bits);
      if (!recover_block(cb, in + (x0 - e0), len, block_codes, absmax[k])) {
        ops::quantize_blockwise(&cb, in + (x0 - e0), len, len, block_codes, absmax + k, 0);
        ++quantized_blocks;
      }
    }
  });
  return quantized_blocks;
}

void AdamW::apply_quantized(float* params, const float* grads_state, float* master,
                            const uint16_t* grads_bf16, bool grads_by_state, uint16_t* params_out,
                            double lr, double scale) {
  const backend::Codebook& mmap = moment_map(true);
  const backend::Codebook& vmap = moment_map(false);
  const auto f = [](double x) { return static_cast<float>(x); };
  for (size_t i = 0; i < ranges_.size(); ++i) {
    const ParamRange& r = ranges_[i];
    const Slot& s = slots_[i];
    const float decay = r.decay ? f(config_.weight_decay) : 0.0f;
    // fp32: the parameter at its offset, the gradient at its state offset;
    // bf16: the master at the state offset, the gradient where it lies.
    float* p = master != nullptr ? master + r.state() : params + r.offset;
    const float* g = grads_state != nullptr ? grads_state + r.state() : nullptr;
    const uint16_t* gb = grads_bf16 != nullptr ? grads_bf16 + (grads_by_state ? r.state() : r.offset) : nullptr;
    uint16_t* out = params_out != nullptr ? params_out + r.offset : nullptr;
    if (s.quantized) {
      ops::QuantMoments q{q_m_ + s.at, q_ma_ + s.blocks, q_v_ + s.at, q_va_ + s.blocks, &mmap, &vmap,
                          config_.block_size, s.first};
      ops::adamw_update_quant(p, g, gb, out, &q, r.numel, f(lr), f(config_.beta1), f(config_.beta2),
                              f(config_.eps), decay, f(scale), t_);
    } else if (gb != nullptr) {
      ops::adamw_update_mixed(p, gb, f_m_ + s.at, f_v_ + s.at, out, r.numel, f(lr),
                              f(config_.beta1), f(config_.beta2), f(config_.eps), decay, f(scale), t_);
    } else {
      ops::adamw_update(p, g, f_m_ + s.at, f_v_ + s.at, r.numel, f(lr),
                        f(config_.beta1), f(config_.beta2), f(config_.eps), decay, f(scale), t_);
    }
  }
}

void AdamW::enable_paging(const memory::PagerOptions& options,
                          const PagedState::Layout& layout) {
  PO_CHECK(t_ == 0, "AdamW::enable_paging after ", t_, " steps");
  PO_CHECK(!quantized(), "optim.state_bits = ", config_.state_bits,
           " with paging (memory.*) is not built yet; use optim.state_bits = 32 or no paging");
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
  if (paged_ || quantized() || m_.data() != nullptr || n_ == 0) return;
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
  if (quantized()) return apply_quantized(params, grads_state, nullptr, nullptr, false, nullptr, lr, scale);
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
  if (quantized()) return apply_quantized(nullptr, nullptr, master, grads, grads_by_state, params_out, lr, scale);
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
