#include "parallel/zero3.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/timer.h"

namespace po::parallel {
using tensor::DType;

float* Zero3Units::Pool::acquire(int64_t n) {
  Buffer* best = nullptr;
  for (Buffer& b : buffers_)  // its size class: [n, 2n]
    if (!b.used && b.floats >= n && b.floats <= 2 * n && (!best || b.floats < best->floats))
      best = &b;
  if (best == nullptr) {
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float);
    buffers_.push_back({tensor::Storage(bytes), n, false});
    best = &buffers_.back();
  }
  best->used = true;
  return best->storage.f32();
}

void Zero3Units::Pool::release(float* p) {
  for (Buffer& b : buffers_)
    if (b.storage.f32() == p) {
      PO_ASSERT(b.used, "Zero3Units: a pool buffer released twice");
      b.used = false;
      return;
    }
  PO_ASSERT(false, "Zero3Units: released a buffer the pool does not hold");
}

size_t Zero3Units::Pool::bytes() const {
  size_t n = 0;
  for (const Buffer& b : buffers_) n += b.storage.size();
  return n;
}

Zero3Units::Zero3Units(model::GPT2& model, const ShardLayout& layout, comm::Communicator* group,
                       float* grad_shard, const Options& options)
    : model_(model), layout_(layout), group_(group), grad_shard_(grad_shard), options_(options) {
  PO_CHECK(layout.num_units() == model.num_units(), "Zero3Units: the layout has ",
           layout.num_units(), " units, the model ", model.num_units());
  PO_CHECK(group != nullptr || layout.ranks() == 1, "Zero3Units: ", layout.ranks(),
           " ranks need a communicator");
  PO_CHECK(options.prefetch >= 0, "parallel.prefetch = ", options.prefetch, " must be >= 0");
  const int units = model.num_units(), L = units - 2;
  order_.push_back(0);                                  // embedding forward
  for (int u = 1; u <= L; ++u) order_.push_back(u);     // block forwards
  order_.push_back(0);                                  // the tied head ...
  order_.push_back(L + 1);                              // ... and the final LayerNorm
  for (int u = L; u >= 1; --u) order_.push_back(u);     // block backwards
  next_ = issued_ = static_cast<int>(order_.size());    // nothing expected before a pass starts
  active_.assign(static_cast<size_t>(units), nullptr);
  acc_.assign(static_cast<size_t>(units), nullptr);
  model_.release_grads();
  model_.set_unit_hooks({[this](int u) { return params(u); }, [this](int u) { done(u); },
                         [this](int u) { return grads(u); }, [this](int u) { grads_ready(u); }});
}

Zero3Units::~Zero3Units() {
  model_.set_unit_hooks({});
  // inflight_ and pending_ are destroyed before the pools: each Work waits first.
}

void Zero3Units::shard_params() {
  if (shard_ != nullptr) return;
  if (layout_.ranks() == 1) {  // stride(u) = n_u, local_offset(u) = unit_offset(u)
    shard_ = model_.params();
    return;
  }
  own_shard_ = tensor::Storage(static_cast<size_t>(layout_.local_numel()) * sizeof(float));
  shard_ = own_shard_.f32();  // zero-filled: the padding stays 0
  const float* full = model_.params();
  for (int u = 0; u < layout_.num_units(); ++u)
    std::memcpy(shard_ + layout_.local_offset(u), full + model_.unit_offset(u) + layout_.begin(u),
                static_cast<size_t>(layout_.owned(u)) * sizeof(float));
  model_.release_params();
}

float* Zero3Units::param_shard(int u) {
  if (shard_ == nullptr) return model_.params() + model_.unit_offset(u) + layout_.begin(u);
  return shard_ + layout_.local_offset(u);
}

const float* Zero3Units::param_shard(int u) const {
  if (shard_ == nullptr)
    return static_cast<const model::GPT2&>(model_).params() + model_.unit_offset(u) +
           layout_.begin(u);
  return shard_ + layout_.local_offset(u);
}

void Zero3Units::wait(comm::Work& w) {
  if (w.done()) return;
  core::Timer t;
  w.wait();
  wait_s_ += t.seconds();
}

double Zero3Units::take_wait_seconds() {
  const double s = wait_s_;
  wait_s_ = 0;
  return s;
}

void Zero3Units::issue_gather(int pos) {
  PO_ASSERT(pos == issued_, "Zero3Units: gathers must be issued in order");
  const int u = order_[static_cast<size_t>(pos)];
  const int64_t stride = layout_.stride(u);
  float* buf = gather_pool_.acquire(stride * layout_.ranks());
  const float* mine = shard_ + layout_.local_offset(u);
  Gather g{pos, buf, {}};
  if (group_ != nullptr)
    g.work = group_->iall_gather(mine, buf, static_cast<size_t>(stride), DType::kF32);
  else
    std::memcpy(buf, mine, static_cast<size_t>(stride) * sizeof(float));
  inflight_.push_back(std::move(g));
  ++issued_;
}

void Zero3Units::drain_gathers() {
  for (Gather& g : inflight_) {
    wait(g.work);
    gather_pool_.release(g.buf);
  }
  inflight_.clear();
  issued_ = next_;
}

// Rank r's block of a gathered unit is its padded shard [r·S, r·S + S), and
// only the last ranks' blocks are short: the buffer starts with the unit's
// n_u elements in order.
float* Zero3Units::params(int u) {
  shard_params();
  progress();
  const int n = static_cast<int>(order_.size());
  if (next_ >= n || order_[static_cast<size_t>(next_)] != u) {
    drain_gathers();  // what was prefetched is not what is asked for
    next_ = issued_ = order_[0] == u ? 0 : n;
  }
  float* buf = nullptr;
  if (next_ < n) {
    if (inflight_.empty()) issue_gather(next_);
    Gather& g = inflight_.front();
    PO_ASSERT(g.pos == next_, "Zero3Units: in-flight gathers out of order");
    wait(g.work);
    buf = g.buf;
    inflight_.pop_front();
    ++next_;
    // The next units' gathers run while this one computes.
    const int ahead = static_cast<int>(std::min<int64_t>(n, next_ + int64_t{options_.prefetch}));
    while (issued_ < ahead) issue_gather(issued_);
  } else {  // off the order: served alone
    const int64_t stride = layout_.stride(u);
    buf = gather_pool_.acquire(stride * layout_.ranks());
    const float* mine = shard_ + layout_.local_offset(u);
    if (group_ != nullptr) {
      comm::Work w = group_->iall_gather(mine, buf, static_cast<size_t>(stride), DType::kF32);
      wait(w);
    } else {
      std::memcpy(buf, mine, static_cast<size_t>(stride) * sizeof(float));
    }
  }
  PO_ASSERT(active_[static_cast<size_t>(u)] == nullptr, "Zero3Units: unit ", u,
            " requested twice without done()");
  active_[static_cast<size_t>(u)] = buf;
  return buf;
}

void Zero3Units::done(int u) {
  float*& buf = active_[static_cast<size_t>(u)];
  PO_ASSERT(buf != nullptr, "Zero3Units: done(", u, ") without params(", u, ")");
  gather_pool_.release(buf);
  buf = nullptr;
  progress();
}

float* Zero3Units::grads(int u) {
  float*& acc = acc_[static_cast<size_t>(u)];
  if (acc != nullptr) return acc;
  // At most one accumulator per unit: the previous micro-batch's must be in.
  auto reducing_u = [u](const Reduction& r) { return r.unit == u; };
  while (std::any_of(pending_.begin(), pending_.end(), reducing_u)) complete_front();
  const int64_t padded = layout_.stride(u) * layout_.ranks();
  // The reduce-scatter's receive block sits after the padded send blocks.
  acc = acc_pool_.acquire(padded + (group_ != nullptr ? layout_.stride(u) : 0));
  std::memset(acc, 0, static_cast<size_t>(padded) * sizeof(float));
  return acc;
}

void Zero3Units::grads_ready(int u) {
  float* acc = acc_[static_cast<size_t>(u)];
  if (acc == nullptr) return;  // no gradient this micro-batch
  acc_[static_cast<size_t>(u)] = nullptr;
  if (group_ == nullptr) {  // one rank: the sum is the accumulator
    add_reduced(u, acc);
    acc_pool_.release(acc);
    return;
  }
  const int64_t stride = layout_.stride(u);
  Reduction r{u, acc, {}};
  r.work = group_->ireduce_scatter(acc, acc + stride * layout_.ranks(), static_cast<size_t>(stride),
                                   DType::kF32, comm::ReduceOp::kSum);
  pending_.push_back(std::move(r));
  if (!options_.overlap) {
    finish_grads();
    return;
  }
  while (pending_.size() > kMaxReductionsInFlight) complete_front();
  progress();
}

void Zero3Units::add_reduced(int u, const float* block) {
  float* dst = grad_shard_ + layout_.local_offset(u);
  const int64_t n = layout_.stride(u);  // the padding adds zeros to zeros
  for (int64_t i = 0; i < n; ++i) dst[i] += block[i];
}

void Zero3Units::complete_front() {
  Reduction& r = pending_.front();
  wait(r.work);
  add_reduced(r.unit, r.acc + layout_.stride(r.unit) * layout_.ranks());
  acc_pool_.release(r.acc);
  pending_.pop_front();
}

void Zero3Units::finish_grads() {
  while (!pending_.empty()) complete_front();
}

// MPI progresses inside its calls: poll everything in flight at each hook.
// Reductions are taken only from the front, so the additions into the
// gradient shard keep their order whatever completes first.
void Zero3Units::progress() {
  for (Gather& g : inflight_) g.work.test();
  for (Reduction& r : pending_) r.work.test();
  while (!pending_.empty() && pending_.front().work.done()) complete_front();
}

}  // namespace po::parallel
