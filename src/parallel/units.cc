#include "parallel/units.h"

#include <algorithm>
#include <cstring>

#include "backend/device.h"
#include "backend/ops.h"
#include "core/bf16.h"
#include "core/error.h"
#include "core/timer.h"

namespace po::parallel {
namespace ops = po::backend::cpu;
using tensor::DType;

void* UnitBuffers::Pool::acquire(size_t bytes) {
  bytes = pool_request(bytes);
  Buffer* best = nullptr;
  for (Buffer& b : buffers_)
    if (!b.used && pool_serves(b.bytes, bytes) && (!best || b.bytes < best->bytes)) best = &b;
  if (best == nullptr) {
    buffers_.push_back({tensor::Storage(bytes), bytes, false});
    best = &buffers_.back();
  }
  best->used = true;
  return best->storage.data();
}

void UnitBuffers::Pool::release(void* p) {
  for (Buffer& b : buffers_)
    if (b.storage.data() == p) {
      PO_ASSERT(b.used, "UnitBuffers: a pool buffer released twice");
      b.used = false;
      return;
    }
  PO_ASSERT(false, "UnitBuffers: released a buffer the pool does not hold");
}

size_t UnitBuffers::Pool::bytes() const {
  size_t n = 0;
  for (const Buffer& b : buffers_) n += b.storage.size();
  return n;
}

std::vector<int> UnitBuffers::gather_order(const model::Layout& layout) {
  return layout.param_visit_order();
}

UnitBuffers::UnitBuffers(model::Transformer& model, const ShardLayout& layout, comm::Communicator* group,
                         void* grad_shard, const Options& options)
    : model_(model), layout_(layout), group_(group), grad_shard_(grad_shard), options_(options) {
  PO_CHECK(layout.num_units() == model.num_units(), "UnitBuffers: the layout has ",
           layout.num_units(), " units, the model ", model.num_units());
  PO_CHECK(group != nullptr || layout.ranks() == 1, "UnitBuffers: ", layout.ranks(),
           " ranks need a communicator");
  PO_CHECK(options.prefetch >= 0, "parallel.prefetch = ", options.prefetch, " must be >= 0");
  auto f32_or_bf16 = [](DType d) { return d == DType::kF32 || d == DType::kBF16; };
  PO_CHECK(f32_or_bf16(options.param_dtype) && f32_or_bf16(options.grad_dtype) &&
               f32_or_bf16(options.reduce_dtype),
           "UnitBuffers: parameters, gradients and reductions are f32 or bf16");
  PO_CHECK(options.grads == Grads::kReduceScatter || options.grad_dtype == DType::kBF16,
           "UnitBuffers: a whole gradient is kept here only in bf16");
  PO_CHECK(options.grads == Grads::kReduceScatter || !options.shard_params,
           "UnitBuffers: sharded parameters need sharded gradients (ZeRO-3)");
  const int units = model.num_units();
  order_ = gather_order(model.layout());
  next_ = issued_ = static_cast<int>(order_.size());    // nothing expected before a pass starts
  active_.assign(static_cast<size_t>(units), nullptr);
  bits_.assign(static_cast<size_t>(units), nullptr);
  acc_.assign(static_cast<size_t>(units), nullptr);
  if (options_.grads == Grads::kFull) {
    full_grads_ = tensor::Storage(static_cast<size_t>(model.num_params()) * sizeof(uint16_t));
  }
  model_.release_grads();
  model_.set_unit_hooks({[this](int u) { return params(u); }, [this](int u) { done(u); },
                         [this](int u) { return grads(u); }, [this](int u) { grads_ready(u); },
                         [this](int u) { return params_bf16(u); },
                         [this](int u) { return params(u, true); }});
}

// Whole bf16 parameters are the stored copy itself; a sharded unit's
// gathered bf16 buffer is kept while a lean use of it lasts (otherwise it is
// given back once widened, and there are no bits to offer).
const uint16_t* UnitBuffers::params_bf16(int u) const {
  if (options_.param_dtype != DType::kBF16) return nullptr;
  if (options_.shard_params) return static_cast<const uint16_t*>(bits_[static_cast<size_t>(u)]);
  if (stored_ == nullptr) return nullptr;
  return static_cast<const uint16_t*>(stored_) + model_.unit_offset(u);
}

UnitBuffers::~UnitBuffers() {
  model_.set_unit_hooks({});
  // inflight_ and pending_ are destroyed before the pools: each Work waits first.
}

void UnitBuffers::zero_full_grads() {
  if (full_grads_.data() != nullptr) backend::device_zero(full_grads_.data(), full_grads_.size());
}

void UnitBuffers::use_paged_shards(PagedShards shards) {
  PO_CHECK(!sharded_ && options_.shard_params && options_.grads == Grads::kReduceScatter,
           "UnitBuffers: paged shards are for ZeRO-3, before shard_params()");
  paged_ = std::move(shards);
}

void UnitBuffers::shard_params() { shard_params({}); }

void UnitBuffers::shard_params(const std::function<const float*(int u)>& given) {
  if (sharded_) return;
  PO_CHECK(!given || options_.shard_params, "UnitBuffers: unit-by-unit sharding is ZeRO-3's");
  sharded_ = true;
  if (options_.before_shard) options_.before_shard();
  if (paged_.read) {  // before_shard moved them into the pages
    model_.release_params();
    return;
  }
  auto source = [&](int u) -> const float* {
    return given ? given(u) : model_.params() + model_.unit_offset(u);
  };
  const bool bf16 = options_.param_dtype == DType::kBF16;
  if (!options_.shard_params) {
    if (!bf16) {  // fp32, whole: the model's own buffer
      stored_ = model_.params();
      return;
    }
    own_ = tensor::Storage(static_cast<size_t>(model_.num_params()) * sizeof(uint16_t));
    ops::f32_to_bf16(static_cast<uint16_t*>(own_.data()), model_.params(), model_.num_params());
    stored_ = own_.data();
    model_.release_params();
    return;
  }
  if (layout_.ranks() == 1 && !bf16 && !given) {  // stride(u) = n_u, local_offset(u) = unit_offset(u)
    stored_ = model_.params();
    return;
  }
  own_ = tensor::Storage(static_cast<size_t>(layout_.local_numel()) * param_esz());
  stored_ = own_.data();  // zero-filled: the padding stays 0
  for (int u = 0; u < layout_.num_units(); ++u) {
    const float* src = source(u) + layout_.begin(u);
    if (bf16)
      ops::f32_to_bf16(static_cast<uint16_t*>(stored_) + layout_.local_offset(u), src,
                       layout_.owned(u));
    else
      backend::device_copy(static_cast<float*>(stored_) + layout_.local_offset(u), src,
                  static_cast<size_t>(layout_.owned(u)) * sizeof(float));
  }
  model_.release_params();
}

float* UnitBuffers::param_shard(int u) {
  PO_ASSERT(options_.param_dtype == DType::kF32 || !sharded_,
            "UnitBuffers::param_shard: the parameters are stored in bf16");
  PO_ASSERT(!(sharded_ && paged_.read), "UnitBuffers::param_shard: the shards are paged");
  if (!sharded_ || !options_.shard_params)
    return model_.params() + model_.unit_offset(u) + layout_.begin(u);
  return static_cast<float*>(stored_) + layout_.local_offset(u);
}

const float* UnitBuffers::param_shard(int u) const {
  return const_cast<UnitBuffers*>(this)->param_shard(u);
}

void UnitBuffers::wait(comm::Work& w) {
  if (w.done()) return;
  core::Timer t;
  w.wait();
  wait_s_ += t.seconds();
}

double UnitBuffers::take_wait_seconds() {
  const double s = wait_s_;
  wait_s_ = 0;
  return s;
}

comm::Work UnitBuffers::start_gather(int u, void* buf) {
  const int64_t stride = layout_.stride(u);
  if (paged_.read) {
    // The shard comes out of the pages into the block after the gathered
    // unit (the buffer has room for it), or straight into place on one rank.
    char* send = static_cast<char*>(buf) +
                 (group_ != nullptr ? static_cast<size_t>(stride * layout_.ranks()) * param_esz() : 0);
    paged_.read(u, send);
    if (group_ == nullptr) return {};
    return group_->iall_gather(send, buf, static_cast<size_t>(stride), options_.param_dtype);
  }
  const char* mine = static_cast<const char*>(stored_) +
                     static_cast<size_t>(layout_.local_offset(u)) * param_esz();
  if (group_ != nullptr)
    return group_->iall_gather(mine, buf, static_cast<size_t>(stride), options_.param_dtype);
  backend::device_copy(buf, mine, static_cast<size_t>(stride) * param_esz());
  return {};
}

// Rank r's block of a gathered unit is its padded shard [r·S, r·S + S), and
// only the last ranks' blocks are short: the buffer starts with the unit's
// n_u elements in order.
size_t UnitBuffers::gather_bytes(int u) const {
  const auto padded = static_cast<size_t>(layout_.stride(u) * layout_.ranks());
  const size_t send = paged_.read && group_ != nullptr ? static_cast<size_t>(layout_.stride(u)) : 0;
  return (padded + send) * param_esz();
}

float* UnitBuffers::serve(int u, void* gathered, bool lean) {
  if (options_.param_dtype == DType::kF32) return static_cast<float*>(gathered);
  float* f = static_cast<float*>(
      work_pool_.acquire(static_cast<size_t>(model_.unit_numel(u)) * sizeof(float)));
  widen_unit(model_.layout(), u, static_cast<const uint16_t*>(gathered), f, lean);
  if (lean)
    bits_[static_cast<size_t>(u)] = gathered;
  else
    gather_pool_.release(gathered);
  return f;
}

void UnitBuffers::issue_gather(int pos) {
  PO_ASSERT(pos == issued_, "UnitBuffers: gathers must be issued in order");
  const int u = order_[static_cast<size_t>(pos)];
  void* buf = gather_pool_.acquire(gather_bytes(u));
  inflight_.push_back({pos, buf, start_gather(u, buf)});
  ++issued_;
}

void UnitBuffers::drain_gathers() {
  for (Gather& g : inflight_) {
    wait(g.work);
    gather_pool_.release(g.buf);
  }
  inflight_.clear();
  issued_ = next_;
}

void widen_unit(const model::Layout& layout, int u, const uint16_t* src, float* dst, bool lean) {
  if (!lean) {
    ops::bf16_to_f32(dst, src, layout.unit_numel(u));
    return;
  }
  for (const auto& [b, e] : layout.f32_read_ranges(u)) ops::bf16_to_f32(dst + b, src + b, e - b);
}

float* UnitBuffers::params(int u, bool lean) {
  shard_params();
  progress();
  PO_ASSERT(active_[static_cast<size_t>(u)] == nullptr, "UnitBuffers: unit ", u,
            " requested twice without done()");
  float* out = nullptr;
  if (!options_.shard_params) {  // whole on this rank
    if (options_.param_dtype == DType::kF32) {
      out = model_.params() + model_.unit_offset(u);
    } else {
      out = static_cast<float*>(
          work_pool_.acquire(static_cast<size_t>(model_.unit_numel(u)) * sizeof(float)));
      widen_unit(model_.layout(), u, static_cast<const uint16_t*>(stored_) + model_.unit_offset(u),
                 out, lean);
    }
  } else {
    const int n = static_cast<int>(order_.size());
    if (next_ >= n || order_[static_cast<size_t>(next_)] != u) {
      drain_gathers();  // what was prefetched is not what is asked for
      next_ = issued_ = order_[0] == u ? 0 : n;
    }
    if (next_ < n) {
      if (inflight_.empty()) issue_gather(next_);
      Gather& g = inflight_.front();
      PO_ASSERT(g.pos == next_, "UnitBuffers: in-flight gathers out of order");
      wait(g.work);
      void* buf = g.buf;
      inflight_.pop_front();
      ++next_;
      // The next units' gathers run while this one computes.
      const int ahead = static_cast<int>(std::min<int64_t>(n, next_ + int64_t{options_.prefetch}));
      while (issued_ < ahead) issue_gather(issued_);
      // Paged shards: the pages of the gather after those start coming in.
      if (paged_.prefetch && issued_ < n) paged_.prefetch(order_[static_cast<size_t>(issued_)]);
      out = serve(u, buf, lean);
    } else {  // off the order: served alone
      void* buf = gather_pool_.acquire(gather_bytes(u));
      comm::Work w = start_gather(u, buf);
      wait(w);
      out = serve(u, buf, lean);
    }
  }
  active_[static_cast<size_t>(u)] = out;
  return out;
}

void UnitBuffers::done(int u) {
  float*& buf = active_[static_cast<size_t>(u)];
  PO_ASSERT(buf != nullptr, "UnitBuffers: done(", u, ") without params(", u, ")");
  if (void*& bits = bits_[static_cast<size_t>(u)]; bits != nullptr) {
    gather_pool_.release(bits);
    bits = nullptr;
  }
  if (options_.param_dtype == DType::kBF16)
    work_pool_.release(buf);
  else if (options_.shard_params)
    gather_pool_.release(buf);
  buf = nullptr;
  progress();
}

// An accumulator: the f32 gradient padded to ranks x stride, then (bf16 on
// the wire) its bf16 copy, then the reduce-scatter's receive block.
size_t UnitBuffers::acc_bytes(int u) const {
  const size_t padded = static_cast<size_t>(layout_.stride(u) * layout_.ranks());
  size_t bytes = padded * sizeof(float);
  if (options_.grads == Grads::kFull || group_ == nullptr) return bytes;
  const size_t wire = tensor::dtype_size(options_.reduce_dtype);
  if (options_.reduce_dtype != DType::kF32) bytes += padded * wire;
  return bytes + static_cast<size_t>(layout_.stride(u)) * wire;
}

const void* UnitBuffers::reduce_send(int u, float* acc) const {
  if (options_.reduce_dtype == DType::kF32) return acc;
  return acc + layout_.stride(u) * layout_.ranks();
}

void* UnitBuffers::reduce_recv(int u, float* acc) const {
  const size_t padded = static_cast<size_t>(layout_.stride(u) * layout_.ranks());
  char* end = reinterpret_cast<char*>(acc) + padded * sizeof(float);
  if (options_.reduce_dtype != DType::kF32) end += padded * tensor::dtype_size(options_.reduce_dtype);
  return end;
}

float* UnitBuffers::grads(int u) {
  float*& acc = acc_[static_cast<size_t>(u)];
  if (acc != nullptr) return acc;
  // At most one accumulator per unit: the previous micro-batch's must be in.
  auto reducing_u = [u](const Reduction& r) { return r.unit == u; };
  while (std::any_of(pending_.begin(), pending_.end(), reducing_u)) complete_front();
  const int64_t padded = layout_.stride(u) * layout_.ranks();
  acc = static_cast<float*>(acc_pool_.acquire(acc_bytes(u)));
  backend::device_zero(acc, static_cast<size_t>(padded) * sizeof(float));
  return acc;
}

void UnitBuffers::grads_ready(int u) {
  float* acc = acc_[static_cast<size_t>(u)];
  if (acc == nullptr) return;  // no gradient this micro-batch
  acc_[static_cast<size_t>(u)] = nullptr;
  if (options_.grads == Grads::kFull) {  // into the whole bf16 gradient
    ops::bf16_add_f32(full_grads() + model_.unit_offset(u), acc, model_.unit_numel(u));
    acc_pool_.release(acc);
    return;
  }
  if (group_ == nullptr) {  // one rank: the sum is the accumulator
    add_reduced(u, acc, final_micro_);
    acc_pool_.release(acc);
    if (final_micro_ && on_final_) on_final_(u);
    return;
  }
  const int64_t stride = layout_.stride(u);
  if (options_.reduce_dtype == DType::kBF16)
    ops::f32_to_bf16(static_cast<uint16_t*>(const_cast<void*>(reduce_send(u, acc))), acc,
                     stride * layout_.ranks());
  Reduction r{u, acc, {}, final_micro_};
  r.work = group_->ireduce_scatter(reduce_send(u, acc), reduce_recv(u, acc),
                                   static_cast<size_t>(stride), options_.reduce_dtype,
                                   comm::ReduceOp::kSum);
  pending_.push_back(std::move(r));
  if (!options_.overlap) {
    finish_grads();
    return;
  }
  while (pending_.size() > kMaxReductionsInFlight) complete_front();
  progress();
}

// block: the unit's reduced block (one rank: the f32 accumulator itself).
void UnitBuffers::add_reduced(int u, const void* block, bool final) {
  const int64_t off = layout_.local_offset(u);
  const int64_t n = layout_.stride(u);  // the padding adds zeros to zeros
  const bool block_bf16 = group_ != nullptr && options_.reduce_dtype == DType::kBF16;
  if (paged_.add) {
    paged_.add(u, block, block_bf16 ? DType::kBF16 : DType::kF32, final);
    return;
  }
  add_block(static_cast<char*>(grad_shard_) + off * static_cast<int64_t>(tensor::dtype_size(options_.grad_dtype)),
            options_.grad_dtype, block, block_bf16 ? DType::kBF16 : DType::kF32, n);
}

void add_block(void* dst, DType dst_dtype, const void* block, DType block_dtype, int64_t n) {
  const bool block_bf16 = block_dtype == DType::kBF16;
  if (dst_dtype == DType::kF32) {
    float* d = static_cast<float*>(dst);
    if (block_bf16) {
      const auto* b = static_cast<const uint16_t*>(block);
      for (int64_t i = 0; i < n; ++i) d[i] += core::bf16_to_f32(core::bf16{b[i]});
    } else {
      const auto* b = static_cast<const float*>(block);
      for (int64_t i = 0; i < n; ++i) d[i] += b[i];
    }
    return;
  }
  auto* d = static_cast<uint16_t*>(dst);
  if (block_bf16)
    ops::bf16_add_bf16(d, static_cast<const uint16_t*>(block), n);
  else
    ops::bf16_add_f32(d, static_cast<const float*>(block), n);
}

void UnitBuffers::complete_front() {
  Reduction& r = pending_.front();
  wait(r.work);
  add_reduced(r.unit, reduce_recv(r.unit, r.acc), r.final);
  acc_pool_.release(r.acc);
  const int u = r.unit;
  const bool final = r.final;
  pending_.pop_front();
  if (final && on_final_) on_final_(u);
}

void UnitBuffers::finish_grads() {
  while (!pending_.empty()) complete_front();
}

// MPI progresses inside its calls: poll everything in flight at each hook.
// A landed reduction is taken (added into the gradient shard, its
// accumulator freed) only where the count in flight or the end of the
// backward forces it, never because it happened to land early: so the
// additions keep their order, and the accumulators held at every point do
// not depend on timing (the planner's replay predicts the peak exactly).
void UnitBuffers::progress() {
  for (Gather& g : inflight_) g.work.test();
  for (Reduction& r : pending_) r.work.test();
}

}  // namespace po::parallel
