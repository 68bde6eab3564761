#include "parallel/data_parallel.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "backend/ops.h"
#include "core/error.h"
#include "core/timer.h"
#include "parallel/zero3.h"

namespace po::parallel {
namespace ops = po::backend::cpu;
using tensor::DType;

namespace {

std::vector<int64_t> unit_sizes(const model::GPT2& m) {
  std::vector<int64_t> n;
  for (int u = 0; u < m.num_units(); ++u) n.push_back(m.unit_numel(u));
  return n;
}

// AdamW ranges over this rank's shard: each tensor cut to the owned part of
// its unit, state (m, v and the gradient shard) in the rank's local buffers,
// parameters in the model's flat buffer (stages 1-2) or, with `local_params`
// (stage 3), in the local parameter shard at the same offsets as the state.
std::vector<optim::ParamRange> shard_ranges(const model::GPT2& m, const ShardLayout& l,
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

DataParallel::DataParallel(model::GPT2& model, const optim::AdamWConfig& adam,
                           comm::Communicator* group, const DataParallelOptions& options)
    : model_(model),
      group_(group),
      options_(options),
      layout_(unit_sizes(model), group ? group->size() : 1, group ? group->rank() : 0) {
  PO_CHECK(options.zero_stage >= 0 && options.zero_stage <= 3, "parallel.zero_stage = ",
           options.zero_stage, " is not one of 0, 1, 2, 3");
  const int units = model.num_units();
  if (options_.zero_stage == 0) {
    std::vector<optim::ParamRange> ranges;
    for (const auto& info : model.param_infos())
      ranges.push_back({info.offset, info.numel(), info.decay});
    adam_ = std::make_unique<optim::AdamW>(adam, std::move(ranges), model.num_params());
  } else {
    adam_ = std::make_unique<optim::AdamW>(
        adam, shard_ranges(model, layout_, options_.zero_stage == 3), layout_.local_numel());
    grad_shard_.assign(static_cast<size_t>(layout_.local_numel()), 0.0f);
  }
  if (options_.zero_stage == 3) {
    zero3_ = std::make_unique<Zero3Units>(model, layout_, group_, grad_shard_.data(),
                                          Zero3Units::Options{options_.prefetch, options_.overlap});
    return;
  }
  if (group_ == nullptr) return;

  defer_embedding_ = options_.overlap && options_.zero_stage < 2;
  if (options_.zero_stage < 2) {
    // Buckets of consecutive units in the order the backward finishes them.
    bucket_of_.assign(static_cast<size_t>(units), 0);
    const uint64_t limit = std::max<uint64_t>(1, options_.bucket_bytes);
    int hi = units - 1;
    while (hi >= 0) {
      int lo = hi;
      uint64_t bytes = static_cast<uint64_t>(model.unit_numel(lo)) * sizeof(float);
      // With the embedding deferred, unit 0 goes alone (it is ready first),
      // and so does unit 1: the backward finishes it last, so nothing can
      // hide its reduction and it should be as short as possible.
      const int floor = !defer_embedding_ || hi == 0 ? 0 : hi == 1 ? 1 : 2;
      while (lo > floor && bytes < limit)
        bytes += static_cast<uint64_t>(model.unit_numel(--lo)) * sizeof(float);
      for (int u = lo; u <= hi; ++u) bucket_of_[static_cast<size_t>(u)] = static_cast<int>(buckets_.size());
      buckets_.push_back({lo, model.unit_offset(lo),
                          model.unit_offset(hi) + model.unit_numel(hi) - model.unit_offset(lo)});
      hi = lo - 1;
    }
  } else {
    padded_.resize(static_cast<size_t>(units));
    for (int u = 0; u < units; ++u)
      if (layout_.stride(u) * layout_.ranks() != model.unit_numel(u))
        padded_[static_cast<size_t>(u)].assign(
            static_cast<size_t>(layout_.stride(u) * layout_.ranks()), 0.0f);
  }
  if (options_.zero_stage >= 1) {
    int64_t max_stride = 0;
    for (int u = 0; u < units; ++u) max_stride = std::max(max_stride, layout_.stride(u));
    gather_send_.assign(static_cast<size_t>(2 * max_stride), 0.0f);
    // Units that ranks x stride covers exactly are gathered straight into the
    // parameter buffer; only the others (padded) need a receive buffer.
    int64_t max_padded = 0;
    for (int u = 0; u < units; ++u)
      if (!gathers_in_place(u)) max_padded = std::max(max_padded, layout_.stride(u));
    gather_recv_.assign(static_cast<size_t>(2 * max_padded * layout_.ranks()), 0.0f);
  }
  if (defer_embedding_) {
    const size_t rows = static_cast<size_t>(model.batch() * model.seq_len());
    lookup_tokens_.resize(rows * static_cast<size_t>(layout_.ranks()));
    lookup_grads_.resize(lookup_tokens_.size() * static_cast<size_t>(model.config().n_embd));
  }
}

DataParallel::~DataParallel() = default;

void DataParallel::shard_params() {
  if (zero3_) zero3_->shard_params();
}

std::function<void(int)> DataParallel::unit_ready() {
  if (group_ == nullptr || !options_.overlap || zero3_) return {};
  return [this](int unit) { on_unit_ready(unit); };
}

void DataParallel::on_unit_ready(int unit) {
  for (auto& w : pending_) w.test();  // MPI progresses inside its calls
  if (options_.zero_stage >= 2)
    issue_reduce_scatter(unit);
  else if (unit == buckets_[static_cast<size_t>(bucket_of_[static_cast<size_t>(unit)])].lo)
    issue_allreduce(unit);
}

void DataParallel::issue_allreduce(int unit) {
  const Bucket& b = buckets_[static_cast<size_t>(bucket_of_[static_cast<size_t>(unit)])];
  pending_.push_back(group_->iallreduce(model_.grads() + b.offset, static_cast<size_t>(b.numel),
                                        DType::kF32, comm::ReduceOp::kSum));
}

void DataParallel::issue_reduce_scatter(int unit) {
  const int64_t n = model_.unit_numel(unit);
  float* send = model_.grads() + model_.unit_offset(unit);
  auto& pad = padded_[static_cast<size_t>(unit)];
  if (!pad.empty()) {  // zero padding up to ranks * stride
    std::memcpy(pad.data(), send, static_cast<size_t>(n) * sizeof(float));
    send = pad.data();
  }
  pending_.push_back(group_->ireduce_scatter(send, grad_shard_.data() + layout_.local_offset(unit),
                                             static_cast<size_t>(layout_.stride(unit)),
                                             DType::kF32, comm::ReduceOp::kSum));
}

int64_t DataParallel::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void DataParallel::backward_done(const int32_t* tokens) {
  backward_end_ns_ = now_ns();
  if (group_ == nullptr || zero3_) return;
  if (!options_.overlap)  // every unit after the backward: the comm time, unhidden
    for (int u = model_.num_units() - 1; u >= 0; --u) on_unit_ready(u);
  if (defer_embedding_) {
    const size_t rows = static_cast<size_t>(model_.batch() * model_.seq_len());
    pending_.push_back(group_->iall_gather(tokens, lookup_tokens_.data(), rows, DType::kI32));
    pending_.push_back(group_->iall_gather(model_.embedding_output_grad(), lookup_grads_.data(),
                                           rows * static_cast<size_t>(model_.config().n_embd),
                                           DType::kF32));
  }
}

double DataParallel::step(double lr) {
  comm_wait_s_ = 0;
  if (zero3_) return step_zero3(lr);
  if (group_ != nullptr) {
    core::Timer wait;
    for (auto& w : pending_) w.wait();
    pending_.clear();
    comm_wait_s_ = wait.seconds();
    wait_end_ns_ = now_ns();
    if (defer_embedding_)  // every rank adds every rank's lookup rows, in rank order
      ops::embedding_backward(model_.grads() + model_.param("wte.weight").offset,
                              model_.grads() + model_.param("wpe.weight").offset,
                              lookup_grads_.data(), lookup_tokens_.data(),
                              model_.batch() * layout_.ranks(), model_.seq_len(),
                              model_.config().n_embd);
  }
  if (options_.zero_stage == 0) return adam_->step(model_.params(), model_.grads(), lr);

  if (options_.zero_stage == 1 || group_ == nullptr) {
    // The full reduced gradient is here: its norm needs no communication, and
    // this rank's shard of it feeds the update.
    const double norm = std::sqrt(optim::AdamW::sum_squares(model_.grads(), model_.num_params()));
    for (int u = 0; u < layout_.num_units(); ++u)
      std::memcpy(grad_shard_.data() + layout_.local_offset(u),
                  model_.grads() + model_.unit_offset(u) + layout_.begin(u),
                  static_cast<size_t>(layout_.owned(u)) * sizeof(float));
    adam_->apply(model_.params(), grad_shard_.data(), lr, adam_->clip_scale(norm));
    if (group_ != nullptr) gather_params();
    return norm;
  }
  const double norm = sharded_grad_norm();
  adam_->apply(model_.params(), grad_shard_.data(), lr, adam_->clip_scale(norm));
  gather_params();
  return norm;
}

// The gradient shards' global norm: the per-rank sums of squares all-gathered
// as doubles and added in rank order (the same value on every rank).
double DataParallel::sharded_grad_norm() {
  double mine = optim::AdamW::sum_squares(grad_shard_.data(), layout_.local_numel());
  if (group_ != nullptr) {
    std::vector<double> all(static_cast<size_t>(layout_.ranks()));
    group_->all_gather(&mine, all.data(), 2, DType::kI32);  // doubles, bit-exact
    mine = 0;
    for (double s : all) mine += s;
  }
  return std::sqrt(mine);
}

// Stage 3: the micro-batches' reductions are all in the gradient shard once
// the last ones are waited; the update writes only the local parameter shard
// (no gather: the next forward gathers), and the gradient shard starts the
// next step at zero.
double DataParallel::step_zero3(double lr) {
  zero3_->shard_params();
  zero3_->finish_grads();
  zero3_->drain_gathers();  // speculative ones read the shard about to change
  comm_wait_s_ = zero3_->take_wait_seconds();
  wait_end_ns_ = now_ns();
  const double norm = sharded_grad_norm();
  adam_->apply(zero3_->param_shard_base(), grad_shard_.data(), lr, adam_->clip_scale(norm));
  std::fill(grad_shard_.begin(), grad_shard_.end(), 0.0f);
  return norm;
}

// Every unit's updated shards to every rank: two units in flight, each through
// a padded send block and a receive buffer of ranks x stride.
bool DataParallel::gathers_in_place(int u) const {
  return layout_.stride(u) * layout_.ranks() == layout_.unit_numel(u);
}

void DataParallel::gather_params() {
  const int units = layout_.num_units();
  const int64_t half_send = static_cast<int64_t>(gather_send_.size() / 2);
  const int64_t half_recv = static_cast<int64_t>(gather_recv_.size() / 2);
  comm::Work inflight[2];
  int unit_in[2] = {-1, -1};
  auto finish = [&](int slot) {
    if (unit_in[slot] < 0) return;
    inflight[slot].wait();
    const int u = unit_in[slot];
    if (!gathers_in_place(u))
      std::memcpy(model_.params() + model_.unit_offset(u), gather_recv_.data() + slot * half_recv,
                  static_cast<size_t>(model_.unit_numel(u)) * sizeof(float));
    unit_in[slot] = -1;
  };
  for (int u = 0; u < units; ++u) {
    const int slot = u & 1;
    finish(slot);
    float* send = gather_send_.data() + slot * half_send;
    const int64_t owned = layout_.owned(u), stride = layout_.stride(u);
    std::memcpy(send, model_.params() + model_.unit_offset(u) + layout_.begin(u),
                static_cast<size_t>(owned) * sizeof(float));
    std::fill(send + owned, send + stride, 0.0f);
    // In place: the send block is a copy of this rank's shard, so it does not
    // overlap the receive region it is gathered into.
    float* recv = gathers_in_place(u) ? model_.params() + model_.unit_offset(u)
                                      : gather_recv_.data() + slot * half_recv;
    inflight[slot] = group_->iall_gather(send, recv, static_cast<size_t>(stride), DType::kF32);
    unit_in[slot] = u;
  }
  finish(0);
  finish(1);
}

float* DataParallel::param_shard(int u) {
  if (zero3_) return zero3_->param_shard(u);
  return model_.params() + model_.unit_offset(u) + layout_.begin(u);
}

const float* DataParallel::param_shard(int u) const {
  if (zero3_) return static_cast<const Zero3Units&>(*zero3_).param_shard(u);
  return model_.params() + model_.unit_offset(u) + layout_.begin(u);
}

float* DataParallel::adam_m_shard(int u) {
  if (options_.zero_stage == 0) return adam_->m() + model_.unit_offset(u) + layout_.begin(u);
  return adam_->m() + layout_.local_offset(u);
}

float* DataParallel::adam_v_shard(int u) {
  if (options_.zero_stage == 0) return adam_->v() + model_.unit_offset(u) + layout_.begin(u);
  return adam_->v() + layout_.local_offset(u);
}

MemoryReport DataParallel::memory() const {
  MemoryReport r;
  if (zero3_) {  // what is held now: the model's buffers only until released
    r.params = model_.params_bytes() + zero3_->param_shard_bytes();
    r.grads = model_.grads_bytes() + grad_shard_.size() * sizeof(float) +
              zero3_->accumulator_bytes();
    r.adam = adam_->state_bytes();
    r.gathered = zero3_->gathered_bytes();
    r.activations = model_.activation_bytes();
    return r;
  }
  r.params = static_cast<size_t>(model_.num_params()) * sizeof(float);
  r.grads = r.params + grad_shard_.size() * sizeof(float);
  r.adam = adam_->state_bytes();
  r.gathered = (gather_send_.size() + gather_recv_.size()) * sizeof(float);
  for (const auto& p : padded_) r.buckets += p.size() * sizeof(float);
  r.buckets += lookup_tokens_.size() * sizeof(int32_t) + lookup_grads_.size() * sizeof(float);
  r.activations = model_.activation_bytes();
  return r;
}

}  // namespace po::parallel
