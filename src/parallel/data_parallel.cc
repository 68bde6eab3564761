#include "parallel/data_parallel.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "backend/ops.h"
#include "core/bf16.h"
#include "core/error.h"
#include "core/timer.h"
#include "parallel/units.h"

namespace po::parallel {
namespace ops = po::backend::cpu;
using tensor::DType;

namespace {

std::vector<int64_t> unit_sizes(const model::Transformer& m) {
  std::vector<int64_t> n;
  for (int u = 0; u < m.num_units(); ++u) n.push_back(m.unit_numel(u));
  return n;
}

// AdamW ranges over this rank's shard: each tensor cut to the owned part of
// its unit, state (m, v and the gradient shard) in the rank's local buffers,
// parameters in the model's flat buffer (stages 1-2) or, with `local_params`
// (stage 3), in the local parameter shard at the same offsets as the state.
std::vector<optim::ParamRange> shard_ranges(const model::Transformer& m, const ShardLayout& l,
                                            bool local_params) {
  std::vector<optim::ParamRange> ranges;
  for (const auto& info : m.param_infos()) {
    const int u = info.unit;
    const int64_t unit_lo = m.unit_offset(u);
    const int64_t lo = std::max(info.offset - unit_lo, l.begin(u));
    const int64_t hi = std::min(info.offset + info.numel() - unit_lo, l.end(u));
    if (lo >= hi) continue;
    const int64_t local = l.local_offset(u) + (lo - l.begin(u));
    ranges.push_back({local_params ? local : unit_lo + lo, hi - lo, info.decay, local});
  }
  return ranges;
}

}  // namespace

DataParallel::DataParallel(model::Transformer& model, const optim::AdamWConfig& adam,
                           comm::Communicator* group, const DataParallelOptions& options)
    : model_(model),
      group_(group),
      options_(options),
      layout_(unit_sizes(model), group ? group->size() : 1, group ? group->rank() : 0) {
  PO_CHECK(options.zero_stage >= 0 && options.zero_stage <= 3, "parallel.zero_stage = ",
           options.zero_stage, " is not one of 0, 1, 2, 3");
  auto f32_or_bf16 = [](DType d) { return d == DType::kF32 || d == DType::kBF16; };
  PO_CHECK(f32_or_bf16(options.param_dtype) && f32_or_bf16(options.reduce_dtype),
           "DataParallel: parameters and reductions are fp32 or bf16");
  const int units = model.num_units();
  const int stage = options_.zero_stage;
  if (stage == 0) {
    std::vector<optim::ParamRange> ranges;
    for (const auto& info : model.param_infos())
      ranges.push_back({info.offset, info.numel(), info.decay});
    adam_ = std::make_unique<optim::AdamW>(adam, std::move(ranges), model.num_params());
  } else {
    adam_ = std::make_unique<optim::AdamW>(adam, shard_ranges(model, layout_, stage == 3),
                                           layout_.local_numel());
  }
  if (stage >= 2 || bf16()) {
    UnitBuffers::Options o;
    o.prefetch = options_.prefetch;
    o.overlap = options_.overlap;
    o.shard_params = stage == 3;
    o.param_dtype = options_.param_dtype;
    o.grads = stage >= 2 ? UnitBuffers::Grads::kReduceScatter : UnitBuffers::Grads::kFull;
    o.grad_dtype = options_.param_dtype;
    o.reduce_dtype = options_.reduce_dtype;
    o.before_shard = [this] {
      if (bf16() || paged_shards_) take_master();
      allocate_unpaged();
    };
    units_ = std::make_unique<UnitBuffers>(model, layout_, group_, nullptr, o);
  }
  if (group_ == nullptr || stage == 3) return;

  defer_embedding_ = options_.overlap && stage < 2;
  if (stage < 2) {
    bucket_of_.assign(static_cast<size_t>(units), 0);
    for (const auto& [lo, hi] : bucket_units(unit_sizes(model), param_esz(), options_.bucket_bytes,
                                             defer_embedding_)) {
      for (int u = lo; u <= hi; ++u) bucket_of_[static_cast<size_t>(u)] = static_cast<int>(buckets_.size());
      buckets_.push_back({lo, model.unit_offset(lo),
                          model.unit_offset(hi) + model.unit_numel(hi) - model.unit_offset(lo)});
    }
  }
  if (stage >= 1) {
    int64_t max_stride = 0;
    for (int u = 0; u < units; ++u) max_stride = std::max(max_stride, layout_.stride(u));
    gather_send_ = tensor::Storage(static_cast<size_t>(2 * max_stride) * param_esz());
    // Units that ranks x stride covers exactly are gathered straight into the
    // parameter buffer; only the others (padded) need a receive buffer.
    int64_t max_padded = 0;
    for (int u = 0; u < units; ++u)
      if (!gathers_in_place(u)) max_padded = std::max(max_padded, layout_.stride(u));
    gather_recv_ =
        tensor::Storage(static_cast<size_t>(2 * max_padded * layout_.ranks()) * param_esz());
  }
  if (defer_embedding_) {
    const size_t rows = static_cast<size_t>(model.batch() * model.seq_len());
    lookup_rows_ = rows * static_cast<size_t>(layout_.ranks());
    lookup_tokens_ = tensor::Storage(lookup_rows_ * sizeof(int32_t));
    lookup_grads_ = tensor::Storage(lookup_rows_ * static_cast<size_t>(model.config().n_embd) * sizeof(float));
  }
}

DataParallel::~DataParallel() = default;

// Buckets of consecutive units in the order the backward finishes them.
std::vector<std::pair<int, int>> DataParallel::bucket_units(const std::vector<int64_t>& unit_numel,
                                                            size_t esz, uint64_t bucket_bytes,
                                                            bool defer) {
  std::vector<std::pair<int, int>> out;
  const uint64_t limit = std::max<uint64_t>(1, bucket_bytes);
  int hi = static_cast<int>(unit_numel.size()) - 1;
  while (hi >= 0) {
    int lo = hi;
    uint64_t bytes = static_cast<uint64_t>(unit_numel[static_cast<size_t>(lo)]) * esz;
    // With the embedding deferred, unit 0 goes alone (it is ready first),
    // and so does unit 1: the backward finishes it last, so nothing can
    // hide its reduction and it should be as short as possible.
    const int floor = !defer || hi == 0 ? 0 : hi == 1 ? 1 : 2;
    while (lo > floor && bytes < limit)
      bytes += static_cast<uint64_t>(unit_numel[static_cast<size_t>(--lo)]) * esz;
    out.emplace_back(lo, hi);
    hi = lo - 1;
  }
  return out;
}

// bf16: the fp32 master weights from the model's fp32 parameters, before the
// model's buffer gives way to bf16 storage (stage 0: all, else this rank's
// shard at its local offsets, padding 0).
const float* DataParallel::unit_values(int u) {
  if (unit_source_) return unit_source_(u);
  return model_.params() + model_.unit_offset(u);
}

void DataParallel::shard_params_from(const std::function<void(int u, float* dst)>& init) {
  PO_CHECK(options_.zero_stage == 3, "DataParallel::shard_params_from is for ZeRO-3");
  tensor::Storage buf;
  int held = -1;
  unit_source_ = [&](int u) -> const float* {
    if (held != u) {
      const auto bytes = static_cast<size_t>(model_.unit_numel(u)) * sizeof(float);
      if (buf.size() < bytes) buf = tensor::Storage(bytes);
      init(u, buf.f32());
      held = u;
    }
    return buf.f32();
  };
  units_->shard_params([this](int u) { return unit_values(u); });
  unit_source_ = {};
  allocate_unpaged();
}

void DataParallel::take_master() {
  using F = optim::PagedAdamState::Field;
  if (paged_shards_) {  // parameter shard (and bf16 master) into the pages, padding 0
    optim::PagedAdamState& st = *adam_->paged_state();
    std::vector<uint16_t> h;
    for (int u = 0; u < layout_.num_units(); ++u) {
      const float* src = unit_values(u) + layout_.begin(u);
      const int64_t n = layout_.owned(u);
      if (bf16()) {
        h.resize(static_cast<size_t>(n));
        ops::f32_to_bf16(h.data(), src, n);
        st.copy_in(F::kParam, state_offset(u), n, h.data());
        st.copy_in(F::kMaster, state_offset(u), n, src);
      } else {
        st.copy_in(F::kParam, state_offset(u), n, src);
      }
    }
    return;
  }
  const bool whole = options_.zero_stage == 0;  // every rank updates everything
  if (whole) {
    const float* full = model_.params();
    if (adam_->paged()) {
      adam_->paged_state()->copy_in(F::kMaster, 0, model_.num_params(), full);
    } else {
      master_ = tensor::Storage(static_cast<size_t>(model_.num_params()) * sizeof(float));
      std::memcpy(master_.f32(), full, static_cast<size_t>(model_.num_params()) * sizeof(float));
    }
    return;
  }
  if (!adam_->paged())
    master_ = tensor::Storage(static_cast<size_t>(layout_.local_numel()) * sizeof(float));
  for (int u = 0; u < layout_.num_units(); ++u) {
    const float* src = unit_values(u) + layout_.begin(u);
    if (adam_->paged())
      adam_->paged_state()->copy_in(F::kMaster, state_offset(u), layout_.owned(u), src);
    else
      std::memcpy(master_.f32() + state_offset(u), src,
                  static_cast<size_t>(layout_.owned(u)) * sizeof(float));
  }
}

int64_t DataParallel::state_offset(int u) const {
  if (options_.zero_stage == 0) return model_.unit_offset(u) + layout_.begin(u);
  return layout_.local_offset(u);
}

optim::PagedAdamState::Layout DataParallel::paging_layout() const {
  optim::PagedAdamState::Layout layout;
  layout.master = bf16();
  if (options_.zero_stage == 3) layout.param_bytes = layout.grad_bytes = param_esz();
  return layout;
}

void DataParallel::enable_paging(const memory::PagerOptions& options) {
  PO_CHECK(master_.data() == nullptr && (!units_ || !units_->sharded()),
           "DataParallel::enable_paging after shard_params()");
  paged_shards_ = options_.zero_stage == 3;
  if (paged_shards_) unit_sq_.assign(static_cast<size_t>(layout_.num_units()), {});
  early_ = adam_->config().grad_clip <= 0 && options_.overlap && options_.update_in_backward;
  memory::PagerOptions o = options;
  // Early updates walk the state pages down with the backward (no sweeps):
  // evict and read ahead by that walk.
  if (early_) o.order = memory::PagerOptions::Order::kFollowAccesses;
  adam_->enable_paging(o, paging_layout());
  optim::PagedAdamState* st = adam_->paged_state();
  if (early_) {  // which units' gradients each page holds
    const int64_t e = st->elements_per_page();
    page_units_.assign(st->state_pages(), 0);
    for (int u = 0; u < layout_.num_units(); ++u) {
      const auto [lo, n] = state_range(u);
      if (n == 0) continue;
      for (int64_t p = lo / e; p <= (lo + n - 1) / e; ++p) ++page_units_[static_cast<size_t>(p)];
    }
    page_waiting_ = page_units_;
    page_done_.assign(st->state_pages(), false);
    // Stage 2: a unit is final once its last micro-batch's reduce-scatter is in.
    if (options_.zero_stage == 2) units_->set_on_final([this](int u) { unit_final(u); });
  }
  if (!paged_shards_) return;
  units_->use_paged_shards(
      {[this, st](int u, void* dst) {
         st->copy_out(optim::PagedAdamState::Field::kParam, layout_.local_offset(u),
                      layout_.stride(u), dst);
       },
       [this](int u, const void* block, DType dtype, bool final) {
         add_paged_grad(u, block, dtype, final);
       },
       [this, st](int u) {
         st->prefetch(optim::PagedAdamState::Field::kParam, layout_.local_offset(u), layout_.stride(u));
       }});
}

namespace {
inline double square(float x) { return static_cast<double>(x) * x; }
inline double square(uint16_t b) {
  const double d = core::bf16_to_f32(core::bf16{b});
  return d * d;
}
}  // namespace

// Element i of the range goes to lane i % kLanes: the lanes vectorise, and
// the sum is the same however the range arrives in pieces (paged and unpaged
// shards must agree bit for bit).
template <typename T>
void DataParallel::SumOfSquares::add(const T* x, int64_t n) {
  int64_t i = 0;
  for (; i < n && pos % kLanes != 0; ++i, ++pos) lane[pos % kLanes] += square(x[i]);
  for (; i + kLanes <= n; i += kLanes, pos += kLanes)
    for (int j = 0; j < kLanes; ++j) lane[j] += square(x[i + j]);
  for (; i < n; ++i, ++pos) lane[pos % kLanes] += square(x[i]);
}

double DataParallel::SumOfSquares::total() const {
  double t = 0;
  for (double v : lane) t += v;
  return t;
}

void DataParallel::start_micro_batch(bool last) {
  if (units_) units_->set_final_micro_batch(last);
}

void DataParallel::add_paged_grad(int u, const void* block, DType dtype, bool final) {
  SumOfSquares& sq = unit_sq_[static_cast<size_t>(u)];
  adam_->paged_state()->update(
      optim::PagedAdamState::Field::kGrad, layout_.local_offset(u), layout_.stride(u),
      [&](void* ptr, int64_t first, int64_t count) {
        if (bf16()) {
          auto* g = static_cast<uint16_t*>(ptr);
          if (dtype == DType::kBF16)
            ops::bf16_add_bf16(g, static_cast<const uint16_t*>(block) + first, count);
          else
            ops::bf16_add_f32(g, static_cast<const float*>(block) + first, count);
          if (final) sq.add(g, count);
        } else {
          auto* g = static_cast<float*>(ptr);
          if (dtype == DType::kBF16) {
            const auto* b = static_cast<const uint16_t*>(block) + first;
            for (int64_t i = 0; i < count; ++i) g[i] += core::bf16_to_f32(core::bf16{b[i]});
          } else {
            const auto* b = static_cast<const float*>(block) + first;
            for (int64_t i = 0; i < count; ++i) g[i] += b[i];
          }
          if (final) sq.add(g, count);
        }
      });
  if (final && early_ && lr_known_) update_final_pages(u);
}

// Unit u's gradient shard is final: the pages that now wait for no unit are
// updated at once (no clipping, so the scale is 1), from the top down as the
// backward walks, and the pages of the unit final next start coming in, so
// their reads overlap that unit's backward.
void DataParallel::update_final_pages(int u) {
  optim::PagedAdamState& st = *adam_->paged_state();
  const int64_t e = st.elements_per_page();
  const auto [lo, n] = state_range(u);
  if (n == 0) return;
  const optim::OutsidePages outside = outside_pages();
  for (int64_t p = (lo + n - 1) / e; p >= lo / e; --p) {
    const auto i = static_cast<size_t>(p);
    if (--page_waiting_[i] > 0) continue;
    if (!step_begun_) {
      adam_->begin_paged_step();
      step_begun_ = true;
    }
    adam_->update_page(i, step_lr_, 1.0, outside);
    page_done_[i] = true;
    if (!in_step_) ++early_count_;  // (finish_grads() in step() lands the last ones)
  }
  // The backward finishes L+1, then L, ..., 1, then 0.
  const int last = layout_.num_units() - 1;
  const int next = u == last ? last - 1 : u - 1;
  if (next < 0) return;
  const auto [next_lo, next_n] = state_range(next);
  if (next_n == 0) return;
  const int64_t top = (next_lo + next_n - 1) / e, bottom = next_lo / e;
  const auto ahead = static_cast<int64_t>(st.pager().options().compute_frames / 2);
  for (int64_t p = top; p >= std::max(bottom, top - ahead + 1); --p)
    if (!page_done_[static_cast<size_t>(p)]) st.pager().prefetch(static_cast<size_t>(p));
}

// The pages the backward did not update (none when every unit's last
// reduction landed in time), then the counters start over.
void DataParallel::finish_early_step(double lr) {
  if (!step_begun_) adam_->begin_paged_step();
  const optim::OutsidePages outside = outside_pages();
  for (size_t p = 0; p < page_done_.size(); ++p)
    if (!page_done_[p]) adam_->update_page(p, lr, 1.0, outside);
  page_waiting_ = page_units_;
  std::fill(page_done_.begin(), page_done_.end(), false);
  step_begun_ = false;
  early_last_ = early_count_;
  early_count_ = 0;
}

// Unit u's elements in state coordinates (Adam's m, v and the pages): the
// whole model's layout at stage 0, the rank's local shards above.
std::pair<int64_t, int64_t> DataParallel::state_range(int u) const {
  if (options_.zero_stage == 0) return {model_.unit_offset(u), model_.unit_numel(u)};
  return {layout_.local_offset(u), layout_.stride(u)};
}

// Where a page's update finds what the pages do not hold, by stage and
// precision: the arguments step() gives apply() / apply_mixed().
optim::OutsidePages DataParallel::outside_pages() {
  optim::OutsidePages o;
  if (paged_shards_) return o;  // all in the pages
  if (!bf16()) {
    o.params = model_.params();
    o.grads_state = options_.zero_stage == 0 ? model_.grads() : grad_f32();
    return o;
  }
  o.params_out = static_cast<uint16_t*>(stored_params());
  o.grads_by_state = options_.zero_stage >= 2;
  o.grads_bf16 = o.grads_by_state ? grad_bf16() : units_->full_grads();
  return o;
}

// Stage 1 (fp32): this rank's shard of unit u's reduced gradient, into the
// gradient shard the update reads.
void DataParallel::copy_grad_shard(int u) {
  std::memcpy(grad_f32() + layout_.local_offset(u),
              model_.grads() + model_.unit_offset(u) + layout_.begin(u),
              static_cast<size_t>(layout_.owned(u)) * sizeof(float));
}

// Unit u's gradient is final (stages 0-2): its pages may go.
void DataParallel::unit_final(int u) {
  if (!early_ || !lr_known_) return;
  if (options_.zero_stage == 1 && !bf16()) copy_grad_shard(u);
  update_final_pages(u);
}

// Stages 0-1: the buckets whose all-reduce has landed make their units final
// (the deferred embedding's waits for its lookup rows, added in step()).
void DataParallel::fire_reduced_buckets() {
  for (Pending& p : pending_) {
    if (p.bucket < 0 || !p.work.test()) continue;
    const int index = p.bucket;
    finish(p);  // (a staged bf16 bucket is narrowed back first)
    for (int u = 0; u < model_.num_units(); ++u)
      if (bucket_of_[static_cast<size_t>(u)] == index && !(u == 0 && defer_embedding_)) unit_final(u);
  }
}

// Where this rank's shard of `kind` lives when it is not addressable: the
// pages' field (none: param_shard / adam_m_shard / adam_v_shard point at it).
std::optional<optim::PagedAdamState::Field> DataParallel::paged_field(Shard kind) const {
  using F = optim::PagedAdamState::Field;
  if (!adam_->paged()) return std::nullopt;
  if (kind == Shard::kAdamM) return F::kM;
  if (kind == Shard::kAdamV) return F::kV;
  if (bf16()) return F::kMaster;  // a bf16 run's parameters are its fp32 master
  if (paged_shards_ && units_->sharded()) return F::kParam;
  return std::nullopt;
}

float* DataParallel::shard_pointer(Shard kind, int u) {
  if (kind == Shard::kParams) return param_shard(u);
  return kind == Shard::kAdamM ? adam_m_shard(u) : adam_v_shard(u);
}

void DataParallel::read_shard(Shard kind, int u, float* dst) {
  if (const auto f = paged_field(kind)) {
    adam_->paged_state()->copy_out(*f, state_offset(u), layout_.owned(u), dst);
    return;
  }
  std::memcpy(dst, shard_pointer(kind, u), static_cast<size_t>(layout_.owned(u)) * sizeof(float));
}

void DataParallel::write_shard(Shard kind, int u, const float* src) {
  PO_CHECK(!(kind == Shard::kParams && paged_shards_ && units_->sharded()),
           "DataParallel::write_shard: parameters are loaded before shard_params()");
  if (const auto f = paged_field(kind)) {
    adam_->paged_state()->copy_in(*f, state_offset(u), layout_.owned(u), src);
    return;
  }
  std::memcpy(shard_pointer(kind, u), src, static_cast<size_t>(layout_.owned(u)) * sizeof(float));
}

// The end of set-up: state that was not paged is allocated now (not in the
// constructor, so that a paged run never holds it, even briefly).
void DataParallel::allocate_unpaged() {
  const auto local = static_cast<size_t>(layout_.local_numel());
  const int stage = options_.zero_stage;
  if (!paged_shards_ && grad_shard_f32_.size() + grad_shard_bf16_.size() == 0) {
    if (stage >= 2 && bf16())
      grad_shard_bf16_ = tensor::Storage(local * sizeof(uint16_t));
    else if (stage >= 1 && !bf16())
      grad_shard_f32_ = tensor::Storage(local * sizeof(float));
    if (stage >= 2) units_->set_grad_shard(bf16() ? grad_shard_bf16_.data() : grad_shard_f32_.data());
  }
  adam_->allocate_state();  // in memory unless paged
}

void DataParallel::shard_params() {
  if (units_) units_->shard_params();
  allocate_unpaged();
}

void* DataParallel::stored_params() {
  if (units_) {
    units_->shard_params();
    return units_->stored_params();
  }
  return model_.params();
}

std::function<void(int)> DataParallel::unit_ready() {
  if (options_.zero_stage >= 2) return {};
  if (group_ == nullptr) {  // one rank: a unit is final when its backward ends
    if (!early_) return {};
    return [this](int unit) { unit_final(unit); };
  }
  if (!options_.overlap) return {};
  return [this](int unit) { on_unit_ready(unit); };
}

void DataParallel::on_unit_ready(int unit) {
  for (auto& p : pending_) p.work.test();  // MPI progresses inside its calls
  if (unit == buckets_[static_cast<size_t>(bucket_of_[static_cast<size_t>(unit)])].lo)
    issue_allreduce(unit);
  if (early_) fire_reduced_buckets();
}

void DataParallel::issue_allreduce(int unit) {
  const int index = bucket_of_[static_cast<size_t>(unit)];
  const Bucket& b = buckets_[static_cast<size_t>(index)];
  Pending p;
  p.bucket = index;
  if (!bf16()) {
    p.work = group_->iallreduce(model_.grads() + b.offset, static_cast<size_t>(b.numel),
                                DType::kF32, comm::ReduceOp::kSum);
  } else if (options_.reduce_dtype == DType::kBF16) {
    p.work = group_->iallreduce(units_->full_grads() + b.offset, static_cast<size_t>(b.numel),
                                DType::kBF16, comm::ReduceOp::kSum);
  } else {  // bf16 gradients summed in fp32: staged, a bounded number at once
    size_t staged = 0;
    for (const Pending& q : pending_) staged += q.staged.size() == 0 ? 0 : 1;
    for (auto it = pending_.begin(); staged >= kMaxStaged && it != pending_.end(); ++it)
      if (it->staged.size() != 0) {
        const double before = comm_wait_s_;
        finish(*it);
        staged_wait_s_ += comm_wait_s_ - before;
        --staged;
      }
    p.staged = tensor::Storage(static_cast<size_t>(b.numel) * sizeof(float));
    ops::bf16_to_f32(p.staged.f32(), units_->full_grads() + b.offset, b.numel);
    p.work = group_->iallreduce(p.staged.f32(), static_cast<size_t>(b.numel), DType::kF32,
                                comm::ReduceOp::kSum);
  }
  pending_.push_back(std::move(p));
}

// Waits for one all-reduce (timed) and narrows a staged one back to bf16.
void DataParallel::finish(Pending& p) {
  if (p.bucket < 0) return;
  if (!p.work.done()) {
    core::Timer wait;
    p.work.wait();
    comm_wait_s_ += wait.seconds();
  }
  if (p.staged.size() != 0) {
    const Bucket& b = buckets_[static_cast<size_t>(p.bucket)];
    ops::f32_to_bf16(units_->full_grads() + b.offset, p.staged.f32(), b.numel);
    p.staged = tensor::Storage();
  }
  p.bucket = -1;
}

int64_t DataParallel::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void DataParallel::backward_done(const int32_t* tokens) {
  backward_end_ns_ = now_ns();
  if (group_ == nullptr || options_.zero_stage >= 2) return;
  if (!options_.overlap)  // every unit after the backward: the comm time, unhidden
    for (int u = model_.num_units() - 1; u >= 0; --u) on_unit_ready(u);
  if (defer_embedding_) {
    const size_t rows = static_cast<size_t>(model_.batch() * model_.seq_len());
    Pending t, g;
    t.work = group_->iall_gather(tokens, lookup_tokens_.data(), rows, DType::kI32);
    g.work = group_->iall_gather(model_.embedding_output_grad(), lookup_grads_.f32(),
                                 rows * static_cast<size_t>(model_.config().n_embd), DType::kF32);
    pending_.push_back(std::move(t));
    pending_.push_back(std::move(g));
  }
  if (early_) fire_reduced_buckets();
}

// Every rank adds every rank's lookup rows into the reduced bf16 gradient, in
// rank order (as ops::embedding_backward does for fp32).
void DataParallel::add_lookup_rows_bf16() {
  const int64_t C = model_.config().n_embd, T = model_.seq_len();
  const model::TensorSpec* pos = model_.layout().position_embedding();
  uint16_t* wte = units_->full_grads() + model_.layout().token_embedding().offset;
  uint16_t* wpe = pos ? units_->full_grads() + pos->offset : nullptr;
  const auto rows = static_cast<int64_t>(lookup_rows_);
  const auto* tokens = static_cast<const int32_t*>(lookup_tokens_.data());
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = lookup_grads_.f32() + r * C;
    ops::bf16_add_f32(wte + static_cast<int64_t>(tokens[r]) * C, g, C);
    if (wpe) ops::bf16_add_f32(wpe + (r % T) * C, g, C);
  }
}

double DataParallel::step(double lr) {
  allocate_unpaged();  // for callers that never called shard_params() (stages 0-1)
  comm_wait_s_ = 0;
  const int stage = options_.zero_stage;
  if (stage >= 2) return step_sharded_grads(lr);
  comm_wait_s_ = staged_wait_s_;  // the backward waited for staging buffers
  staged_wait_s_ = 0;
  if (group_ != nullptr) {
    for (auto& p : pending_) {
      if (!p.work.done()) {
        core::Timer wait;
        p.work.wait();
        comm_wait_s_ += wait.seconds();
      }
    }
    for (auto& p : pending_) finish(p);
    pending_.clear();
    wait_end_ns_ = now_ns();
    if (defer_embedding_) {  // every rank adds every rank's lookup rows, in rank order
      if (bf16()) {
        add_lookup_rows_bf16();
      } else {
        const model::TensorSpec* pos = model_.layout().position_embedding();
        ops::embedding_backward(model_.grads() + model_.layout().token_embedding().offset,
                                pos ? model_.grads() + pos->offset : nullptr,
                                lookup_grads_.f32(), static_cast<const int32_t*>(lookup_tokens_.data()),
                                model_.batch() * layout_.ranks(), model_.seq_len(),
                                model_.config().n_embd);
      }
    }
  }
  if (early_ && lr_known_) {  // the pages not updated in the backward (at least unit 0's)
    PO_ASSERT(lr == step_lr_, "DataParallel: step(", lr, ") after set_step_lr(", step_lr_, ")");
    const double norm =
        std::sqrt(bf16() ? ops::sum_squares_bf16(units_->full_grads(), model_.num_params())
                         : optim::AdamW::sum_squares(model_.grads(), model_.num_params()));
    (void)adam_->clip_scale(norm);  // (no clipping; stops on a non-finite norm)
    if (stage == 1 && !bf16())
      for (int u = 0; u < layout_.num_units(); ++u) copy_grad_shard(u);
    finish_early_step(lr);
    lr_known_ = false;
    if (bf16()) units_->zero_full_grads();
    if (stage == 1 && group_ != nullptr) gather_params();
    return norm;
  }
  if (bf16()) {
    // The whole reduced bf16 gradient is here: its norm needs no communication.
    uint16_t* grads = units_->full_grads();
    const double norm = std::sqrt(ops::sum_squares_bf16(grads, model_.num_params()));
    auto* params = static_cast<uint16_t*>(stored_params());
    adam_->apply_mixed(master_.f32(), grads, false, params, lr, adam_->clip_scale(norm));
    units_->zero_full_grads();
    if (stage == 1 && group_ != nullptr) gather_params();
    return norm;
  }
  if (stage == 0) return adam_->step(model_.params(), model_.grads(), lr);

  // The full reduced gradient is here: its norm needs no communication, and
  // this rank's shard of it feeds the update.
  const double norm = std::sqrt(optim::AdamW::sum_squares(model_.grads(), model_.num_params()));
  for (int u = 0; u < layout_.num_units(); ++u) copy_grad_shard(u);
  adam_->apply(model_.params(), grad_f32(), lr, adam_->clip_scale(norm));
  if (group_ != nullptr) gather_params();
  return norm;
}

// The gradient shards' global norm: the per-rank sums of squares all-gathered
// as doubles and added in rank order (the same value on every rank).
double DataParallel::sharded_grad_norm() {
  // Per unit in unit order, each a SumOfSquares (paged shards add up the
  // same sums as their last gradients land).
  double mine = 0;
  for (int u = 0; u < layout_.num_units(); ++u) {
    double sq = 0;
    if (paged_shards_) {
      sq = unit_sq_[static_cast<size_t>(u)].total();
      unit_sq_[static_cast<size_t>(u)] = {};
    } else if (bf16()) {
      SumOfSquares acc;
      acc.add(grad_bf16() + layout_.local_offset(u), layout_.stride(u));
      sq = acc.total();
    } else {
      SumOfSquares acc;
      acc.add(grad_f32() + layout_.local_offset(u), layout_.stride(u));
      sq = acc.total();
    }
    mine += sq;
  }
  if (group_ != nullptr) {
    std::vector<double> all(static_cast<size_t>(layout_.ranks()));
    group_->all_gather(&mine, all.data(), 2, DType::kI32);  // doubles, bit-exact
    mine = 0;
    for (double s : all) mine += s;
  }
  return std::sqrt(mine);
}

// Stages 2-3: the micro-batches' reductions are all in the gradient shard once
// the last ones are waited. Stage 3's update writes only the local parameter
// shard (no gather: the next forward gathers); stage 2 gathers the updated
// shards into the whole parameters. The gradient shard starts the next step
// at zero.
double DataParallel::step_sharded_grads(double lr) {
  in_step_ = true;
  struct Leave {
    bool& flag;
    ~Leave() { flag = false; }
  } leave{in_step_};
  units_->shard_params();
  units_->finish_grads();
  units_->drain_gathers();  // speculative ones read the shard about to change
  comm_wait_s_ = units_->take_wait_seconds();
  wait_end_ns_ = now_ns();
  const double norm = sharded_grad_norm();
  const double clip = adam_->clip_scale(norm);
  if (early_ && lr_known_) {
    PO_ASSERT(lr == step_lr_, "DataParallel: step(", lr, ") after set_step_lr(", step_lr_, ")");
    finish_early_step(lr);
    lr_known_ = false;
    if (grad_shard_bf16_.size() > 0) std::memset(grad_shard_bf16_.data(), 0, grad_shard_bf16_.size());
    if (grad_shard_f32_.size() > 0) std::memset(grad_shard_f32_.data(), 0, grad_shard_f32_.size());
    if (options_.zero_stage == 2 && group_ != nullptr) gather_params();
    return norm;
  }
  if (bf16()) {
    adam_->apply_mixed(master_.f32(), grad_bf16(), true,
                       static_cast<uint16_t*>(stored_params()), lr, clip);
    if (grad_shard_bf16_.size() > 0) std::memset(grad_shard_bf16_.data(), 0, grad_shard_bf16_.size());
  } else {
    adam_->apply(static_cast<float*>(stored_params()), grad_f32(), lr, clip);
    if (grad_shard_f32_.size() > 0) std::memset(grad_shard_f32_.data(), 0, grad_shard_f32_.size());
  }
  if (options_.zero_stage == 2 && group_ != nullptr) gather_params();
  return norm;
}

// Every unit's updated shards to every rank: two units in flight, each through
// a padded send block and a receive buffer of ranks x stride.
bool DataParallel::gathers_in_place(int u) const {
  return layout_.stride(u) * layout_.ranks() == layout_.unit_numel(u);
}

void DataParallel::gather_params() {
  const int units = layout_.num_units();
  const size_t esz = param_esz();
  const size_t half_send = gather_send_.size() / 2, half_recv = gather_recv_.size() / 2;
  char* params = static_cast<char*>(stored_params());  // whole, in the model's layout
  char* send_base = static_cast<char*>(gather_send_.data());
  char* recv_base = static_cast<char*>(gather_recv_.data());
  const DType dtype = bf16() ? DType::kBF16 : DType::kF32;
  comm::Work inflight[2];
  int unit_in[2] = {-1, -1};
  auto unit_at = [&](int u) { return params + static_cast<size_t>(model_.unit_offset(u)) * esz; };
  auto finish_slot = [&](int slot) {
    if (unit_in[slot] < 0) return;
    inflight[slot].wait();
    const int u = unit_in[slot];
    if (!gathers_in_place(u))
      std::memcpy(unit_at(u), recv_base + slot * half_recv,
                  static_cast<size_t>(model_.unit_numel(u)) * esz);
    unit_in[slot] = -1;
  };
  for (int u = 0; u < units; ++u) {
    const int slot = u & 1;
    finish_slot(slot);
    char* send = send_base + slot * half_send;
    const auto owned = static_cast<size_t>(layout_.owned(u));
    const auto stride = static_cast<size_t>(layout_.stride(u));
    std::memcpy(send, unit_at(u) + static_cast<size_t>(layout_.begin(u)) * esz, owned * esz);
    std::memset(send + owned * esz, 0, (stride - owned) * esz);
    // In place: the send block is a copy of this rank's shard, so it does not
    // overlap the receive region it is gathered into.
    char* recv = gathers_in_place(u) ? unit_at(u) : recv_base + slot * half_recv;
    inflight[slot] = group_->iall_gather(send, recv, stride, dtype);
    unit_in[slot] = u;
  }
  finish_slot(0);
  finish_slot(1);
}

// Checkpoints hold fp32: the parameters themselves, or a bf16 run's master.
float* DataParallel::param_shard(int u) {
  if (bf16() && master_.data() != nullptr) return master_.f32() + state_offset(u);
  PO_ASSERT(!(bf16() && adam_->paged() && units_ && units_->sharded()),
            "DataParallel::param_shard: the master weights are paged (use read_shard)");
  if (units_) return units_->param_shard(u);
  return model_.params() + model_.unit_offset(u) + layout_.begin(u);
}

const float* DataParallel::param_shard(int u) const {
  return const_cast<DataParallel*>(this)->param_shard(u);
}

float* DataParallel::adam_m_shard(int u) {
  PO_ASSERT(!adam_->paged(), "DataParallel::adam_m_shard: Adam state is paged (use read_shard)");
  if (options_.zero_stage == 0) return adam_->m() + model_.unit_offset(u) + layout_.begin(u);
  return adam_->m() + layout_.local_offset(u);
}

float* DataParallel::adam_v_shard(int u) {
  PO_ASSERT(!adam_->paged(), "DataParallel::adam_v_shard: Adam state is paged (use read_shard)");
  if (options_.zero_stage == 0) return adam_->v() + model_.unit_offset(u) + layout_.begin(u);
  return adam_->v() + layout_.local_offset(u);
}

size_t DataParallel::predicted_model_state_bytes() const {
  const auto whole = static_cast<double>(model_.num_params());
  const auto shard = static_cast<double>(layout_.local_numel());
  const int s = options_.zero_stage;
  const double p = bf16() ? 2 : 4;  // parameter and gradient bytes
  double bytes = p * (s == 3 ? shard : whole) + p * (s >= 2 ? shard : whole);
  bytes += (bf16() ? 12.0 : 8.0) * (s >= 1 ? shard : whole);  // [master +] m + v
  if (!bf16() && s == 1) bytes += 4 * shard;  // the shard of the reduced gradient the update reads
  return static_cast<size_t>(bytes);
}

MemoryReport DataParallel::memory() const {
  MemoryReport r;
  r.params = model_.params_bytes();
  // (fp32 stage 1 also holds a copy of its shard of the whole gradient.)
  r.grads = model_.grads_bytes() + grad_shard_bf16_.size() + grad_shard_f32_.size();
  r.master = master_.size();
  r.adam = adam_->state_bytes();
  if (adam_->paged()) {
    const optim::PagedAdamState& st = *adam_->paged_state();
    r.pages = st.compute_frames() * st.page_bytes();
    r.host = st.host_frames() * st.page_bytes();
  }
  r.gathered = gather_send_.size() + gather_recv_.size();
  if (units_) {
    r.params += units_->stored_bytes();
    r.grads += units_->full_grad_bytes();
    r.gathered += units_->gathered_bytes();
    r.buckets += units_->accumulator_bytes();
  }
  for (const auto& p : pending_) r.buckets += p.staged.size();
  r.buckets += lookup_tokens_.size() + lookup_grads_.size();
  r.activations = model_.activation_bytes();
  return r;
}

}  // namespace po::parallel
