// The outer step of DiLoCo inside one job (outer_sync.h).
#include "train/outer_sync.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/ops.h"
#include "core/error.h"
#include "core/timer.h"
#include "train/paging_setup.h"

namespace po::train {
using tensor::DType;

ExchangeDtype parse_exchange_dtype(const std::string& name) {
  if (name == "fp32") return ExchangeDtype::kF32;
  if (name == "bf16") return ExchangeDtype::kBf16;
  if (name == "int8") return ExchangeDtype::kInt8;
  PO_THROW(core::InvalidArgument, "outer.exchange_dtype = \"", name, "\": choose \"fp32\", \"bf16\" or \"int8\"");
}

OuterOptions outer_options(const core::Config& cfg, int rank) {
  OuterOptions o;
  o.outer.kind = optim::parse_outer_kind(cfg.get_string("outer.optimizer"));
  o.outer.lr = cfg.get_float("outer.lr");
  o.outer.momentum = cfg.get_float("outer.momentum");
  o.outer.beta2 = cfg.get_float("outer.beta2");
  o.outer.eps = cfg.get_float("outer.eps");
  if (o.outer.kind == optim::OuterKind::kAdam || o.outer.kind == optim::OuterKind::kYogi)
    PO_CHECK(o.outer.momentum > 0, "outer.optimizer = \"", optim::outer_kind_name(o.outer.kind),
             "\" takes its β1 from outer.momentum, which must be > 0");
  o.local_steps = cfg.get_int("train.local_steps");
  o.fragments = static_cast<int>(cfg.get_int("outer.fragments"));
  PO_CHECK(o.fragments == 1 || o.local_steps % o.fragments == 0, "outer.fragments = ", o.fragments,
           " staggers the fragments' outer steps over train.local_steps = ", o.local_steps,
           ", which it must divide");
  o.exchange = parse_exchange_dtype(cfg.get_string("outer.exchange_dtype"));
  o.paged = cfg.get_bool("outer.paged") && !cfg.get_string("memory.nvme_dir").empty();
  if (o.paged) {
    o.pager = pager_options(cfg, rank);
    o.pager.file_name = "outer-" + o.pager.file_name;
  }
  return o;
}

OuterSync::OuterSync(const OuterOptions& o, comm::Communicator* replicas, int64_t numel, const float* initial)
    : o_(o), replicas_(replicas), n_(numel), schema_(optim::outer_schema(o.outer)),
      t_(static_cast<size_t>(o.fragments), 0) {
  PO_ASSERT(o_.local_steps > 0, "an outer step without train.local_steps");
  if (!o_.paged) {
    fields_.resize(schema_.fields.size());
    for (auto& f : fields_) f.assign(static_cast<size_t>(n_), 0.0f);
    std::copy_n(initial, n_, fields_[optim::kOuterGlobal].data());
    return;
  }
  optim::PagedState::Layout layout;
  layout.schema = schema_;
  memory::PagerOptions po = o_.pager;
  const optim::PagedState::Geometry geo = optim::PagedState::geometry(std::max<int64_t>(n_, 1), po.page_bytes, layout);
  // Idle for H - 1 steps of H: the fewest frames, nothing cached on the host.
  po.compute_frames = optim::PagedState::min_compute_frames(geo, po.prefetch);
  po.host_frames = 0;
  pages_ = std::make_unique<optim::PagedState>(std::max<int64_t>(n_, 1), layout, po);
  std::vector<float> zeros(static_cast<size_t>(std::min<int64_t>(n_, 1 << 20)), 0.0f);
  for (int64_t lo = 0; lo < n_; lo += static_cast<int64_t>(zeros.size())) {
    const int64_t k = std::min<int64_t>(static_cast<int64_t>(zeros.size()), n_ - lo);
    pages_->copy_in(optim::kOuterGlobal, lo, k, initial + lo);
    for (int f = 1; f < static_cast<int>(schema_.fields.size()); ++f) pages_->copy_in(f, lo, k, zeros.data());
  }
}

OuterSync::~OuterSync() = default;

int OuterSync::due(int64_t step) const {
  const int64_t H = o_.local_steps, per = H / o_.fragments;
  const int64_t s = (step + 1) % H;  // the fragment f with (s + f·per) mod H = 0
  if (s % per != 0) return -1;
  return static_cast<int>(((H - s) % H) / per);
}

size_t OuterSync::resident_bytes() const {
  size_t b = 0;
  for (const auto& f : fields_) b += f.size() * sizeof(float);
  return b;
}

OuterSync::Saved OuterSync::save() {
  Saved out;
  out.steps = t_;
  for (size_t f = 0; f < schema_.fields.size(); ++f) {
    out.names.emplace_back(schema_.fields[f].name);
    if (!pages_) {
      out.arrays.push_back(fields_[f]);
      continue;
    }
    std::vector<float> all(static_cast<size_t>(n_));
    if (n_ > 0) pages_->copy_out(static_cast<int>(f), 0, n_, all.data());
    out.arrays.push_back(std::move(all));
  }
  return out;
}

void OuterSync::load(const Saved& s, const std::string& what) {
  PO_CHECK(s.steps.size() == t_.size(), what, ": written with outer.fragments = ", s.steps.size(), ", not ",
           t_.size());
  PO_CHECK(s.arrays.size() == schema_.fields.size(), what, ": holds ", s.arrays.size(), " outer fields, outer.optimizer = \"",
           optim::outer_kind_name(o_.outer.kind), "\" keeps ", schema_.fields.size(),
           " (resume with the outer.* settings that wrote it)");
  for (size_t f = 0; f < s.arrays.size(); ++f) {
    PO_CHECK(s.names[f] == schema_.fields[f].name && static_cast<int64_t>(s.arrays[f].size()) == n_, what, ": field ",
             s.names[f], " of ", s.arrays[f].size(), " elements where this rank keeps ", schema_.fields[f].name, " of ",
             n_, " (resume with the parallel layout that wrote it)");
    if (pages_) {
      if (n_ > 0) pages_->copy_in(static_cast<int>(f), 0, n_, s.arrays[f].data());
    } else {
      fields_[f] = s.arrays[f];
    }
  }
  t_ = s.steps;
}

memory::PagerStats OuterSync::take_paging_stats() {
  return pages_ ? pages_->take_stats() : memory::PagerStats{};
}

void OuterSync::exchange(float* d, int64_t n) {
  if (replicas_ == nullptr || n == 0) return;
  const int R = replicas_->size();
  switch (o_.exchange) {
    case ExchangeDtype::kF32:
      replicas_->allreduce(d, static_cast<size_t>(n), DType::kF32, comm::ReduceOp::kSum);
      for (int64_t i = 0; i < n; ++i) d[i] = d[i] / static_cast<float>(R);
      return;
    case ExchangeDtype::kBf16: {
      std::vector<uint16_t> b(static_cast<size_t>(n));
      backend::cpu::f32_to_bf16(b.data(), d, n);  // (round to nearest even, as core/bf16.h)
      replicas_->allreduce(b.data(), static_cast<size_t>(n), DType::kBF16, comm::ReduceOp::kSum);
      backend::cpu::bf16_to_f32(d, b.data(), n);
      for (int64_t i = 0; i < n; ++i) d[i] = d[i] / static_cast<float>(R);
      return;
    }
    case ExchangeDtype::kInt8: {
      // Codes round to nearest of x / (absmax / 127); every replica's codes
      // and scales are gathered and decoded, its own included, so every rank
      // sums the same values in replica order.
      const int64_t blocks = (n + kExchangeBlock - 1) / kExchangeBlock;
      const int64_t words = (n + 3) / 4;
      std::vector<int8_t> codes(static_cast<size_t>(words * 4), 0);
      std::vector<float> scales(static_cast<size_t>(blocks));
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t lo = b * kExchangeBlock, hi = std::min(n, lo + kExchangeBlock);
        float amax = 0;
        for (int64_t i = lo; i < hi; ++i) amax = std::max(amax, std::fabs(d[i]));
        const float scale = amax / 127.0f;
        scales[static_cast<size_t>(b)] = scale;
        for (int64_t i = lo; i < hi; ++i)
          codes[static_cast<size_t>(i)] = scale > 0 ? static_cast<int8_t>(std::nearbyint(d[i] / scale)) : 0;
      }
      std::vector<int8_t> all_codes(static_cast<size_t>(words * 4 * R));
      std::vector<float> all_scales(static_cast<size_t>(blocks * R));
      replicas_->all_gather(codes.data(), all_codes.data(), static_cast<size_t>(words), DType::kI32);
      replicas_->all_gather(scales.data(), all_scales.data(), static_cast<size_t>(blocks), DType::kF32);
      for (int64_t i = 0; i < n; ++i) {
        float sum = 0;
        for (int r = 0; r < R; ++r)
          sum += static_cast<float>(all_codes[static_cast<size_t>(r * words * 4 + i)]) *
                 all_scales[static_cast<size_t>(r * blocks + i / kExchangeBlock)];
        d[i] = sum / static_cast<float>(R);
      }
      return;
    }
  }
}

OuterSync::Stats OuterSync::step(int fragment, float* local, const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  core::Timer timer;
  Stats st;
  const comm::Traffic before = replicas_ ? replicas_->traffic() : comm::Traffic{};
  int64_t n = 0;
  for (const auto& [off, k] : ranges) n += k;
  // Δ of every range, back to back: one exchange for the whole step.
  std::vector<float> delta(static_cast<size_t>(n));
  {
    int64_t at = 0;
    for (const auto& [off, k] : ranges) {
      float* d = delta.data() + at;
      if (pages_) pages_->copy_out(optim::kOuterGlobal, off, k, d);
      else std::copy_n(fields_[optim::kOuterGlobal].data() + off, k, d);
      for (int64_t i = 0; i < k; ++i) d[i] = d[i] - local[off + i];
      at += k;
    }
  }
  exchange(delta.data(), n);
  for (int64_t i = 0; i < n; ++i) st.delta_sq += static_cast<double>(delta[static_cast<size_t>(i)]) * delta[static_cast<size_t>(i)];
  const bool has_m = schema_.fields.size() > 1, has_v = schema_.fields.size() > 2;
  int64_t& t = t_[static_cast<size_t>(fragment)];
  ++t;
  int64_t at = 0;
  std::vector<float> g, m, v;
  for (const auto& [off, k] : ranges) {
    const float* d = delta.data() + at;
    at += k;
    if (!pages_) {
      float* m_ptr = has_m ? fields_[optim::kOuterM].data() + off : nullptr;
      float* v_ptr = has_v ? fields_[optim::kOuterV].data() + off : nullptr;
      optim::outer_update(o_.outer, t, fields_[optim::kOuterGlobal].data() + off, m_ptr, v_ptr, d, k, local + off);
      continue;
    }
    g.resize(static_cast<size_t>(k));
    pages_->copy_out(optim::kOuterGlobal, off, k, g.data());
    if (has_m) {
      m.resize(static_cast<size_t>(k));
      pages_->copy_out(optim::kOuterM, off, k, m.data());
    }
    if (has_v) {
      v.resize(static_cast<size_t>(k));
      pages_->copy_out(optim::kOuterV, off, k, v.data());
    }
    optim::outer_update(o_.outer, t, g.data(), has_m ? m.data() : nullptr, has_v ? v.data() : nullptr, d, k, local + off);
    pages_->copy_in(optim::kOuterGlobal, off, k, g.data());
    if (has_m) pages_->copy_in(optim::kOuterM, off, k, m.data());
    if (has_v) pages_->copy_in(optim::kOuterV, off, k, v.data());
  }
  st.elements = n;
  if (replicas_) {
    const comm::Traffic tr = replicas_->traffic().since(before);
    for (int op = 0; op < comm::kNumCommOps; ++op) st.bytes += tr.bytes[op];
  }
  st.seconds = timer.seconds();
  return st;
}

}  // namespace po::train
