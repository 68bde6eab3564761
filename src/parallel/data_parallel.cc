// DataParallel's set-up and its step: construction by stage and precision,
// the master weights, the end of set-up (allocate_unpaged), the optimizer
// step (stages 0-1 on the whole reduced gradient, 2-3 on the gradient
// shards), the parameter all-gather after it, and the memory ledger. The
// gradients' reduction is in grad_buckets.cc, the updates made during the
// backward in early_update.cc, the norm in grad_norm.cc, checkpoint access
// in shard_access.cc.
#include "parallel/data_parallel.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "backend/device.h"
#include "backend/ops.h"
#include "core/error.h"
#include "core/timer.h"
#include "parallel/quantized_state.h"
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

}  // namespace

DataParallel::DataParallel(model::Transformer& model, const optim::AdamWConfig& adam,
                           comm::Communicator* group, const DataParallelOptions& options)
    : model_(model),
      group_(group),
      options_(options),
      layout_(unit_sizes(model), group ? group->size() : 1, group ? group->rank() : 0,
              adam.state_bits < 32 ? adam.block_size : 1) {
  PO_CHECK(options.zero_stage >= 0 && options.zero_stage <= 3, "parallel.zero_stage = ",
           options.zero_stage, " is not one of 0, 1, 2, 3");
  auto f32_or_bf16 = [](DType d) { return d == DType::kF32 || d == DType::kBF16; };
  PO_CHECK(f32_or_bf16(options.param_dtype) && f32_or_bf16(options.reduce_dtype),
           "DataParallel: parameters and reductions are fp32 or bf16");
  const int units = model.num_units();
  const int stage = options_.zero_stage;
  adam_ = std::make_unique<optim::AdamW>(
      adam, adam_ranges(model.layout(), adam, stage == 0 ? nullptr : &layout_, stage == 3),
      stage == 0 ? model.num_params() : layout_.local_numel());
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
  // (Not at context parallel: the gathered lookup rows would be added at
  // each row's local place, not at its position in the sequence.)
  defer_embedding_ = group_ != nullptr && defers_lookup(model.config(), group_->size(), options_.overlap,
                                                        model.context_split().size, stage, options_.packed_rows);
  // The tied table's lookup rows are kept for the step (tied_pair.h).
  if (model.layout().tied_trains() && model.whole()) {
    const model::Layout& ml = model.layout();
    rows_ = std::make_unique<LookupRows>(model.config().n_embd, ml.vocab_begin(), ml.vocab_real());
    rows_->reserve(options_.micro_batches * model.batch() * model.seq_len());
    model.set_tied_lookup_rows(
        [this](const float* rows, const int32_t* tokens, int64_t n) { rows_->append(rows, tokens, n); });
  }
  if (group_ == nullptr || stage == 3) return;

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

DataParallel::~DataParallel() {
  // Lent activation memory goes back before the pager does (writes from it
  // may be in flight).
  if (paged() && options_.lend_activations && model_.whole())
    model_.set_activation_lender({});
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
  constexpr auto kOnDevice = backend::Device::Direction::kDeviceToDevice;  // the model's values
  using F = optim::AdamW;
  if (paged_shards_) {  // parameter shard (and bf16 master) into the pages, padding 0
    optim::PagedState& st = *adam_->paged_state();
    std::vector<uint16_t> h;
    for (int u = 0; u < layout_.num_units(); ++u) {
      const float* src = unit_values(u) + layout_.begin(u);
      const int64_t n = layout_.owned(u);
      if (bf16()) {
        h.resize(static_cast<size_t>(n));
        ops::f32_to_bf16(h.data(), src, n);
        st.copy_in(optim::PagedState::kParam, state_offset(u), n, h.data());
        st.copy_in(F::kMaster, state_offset(u), n, src, kOnDevice);
      } else {
        st.copy_in(optim::PagedState::kParam, state_offset(u), n, src, kOnDevice);
      }
    }
    return;
  }
  const bool whole = options_.zero_stage == 0;  // every rank updates everything
  if (whole) {
    const float* full = model_.params();
    if (adam_->paged()) {
      adam_->copy_in_paged(F::kMaster, 0, model_.num_params(), full, kOnDevice);
    } else {
      master_ = tensor::Storage(static_cast<size_t>(model_.num_params()) * sizeof(float));
      backend::device_copy(master_.f32(), full, static_cast<size_t>(model_.num_params()) * sizeof(float));
    }
    return;
  }
  if (!adam_->paged())
    master_ = tensor::Storage(static_cast<size_t>(layout_.local_numel()) * sizeof(float));
  for (int u = 0; u < layout_.num_units(); ++u) {
    const float* src = unit_values(u) + layout_.begin(u);
    if (adam_->paged())
      adam_->copy_in_paged(F::kMaster, state_offset(u), layout_.owned(u), src, kOnDevice);
    else
      backend::device_copy(master_.f32() + state_offset(u), src,
                  static_cast<size_t>(layout_.owned(u)) * sizeof(float));
  }
}

// wte = H + E (tied_pair.h): every data rank's lookup rows of the step added
// once into the reduced gradient, as stored: whole at stages 0-1, this
// rank's shard of it at 2-3 (in pages when they hold it; their norm then
// counts unit 0 again).
void DataParallel::add_tied_rows() {
  if (!rows_) return;
  rows_->gather(group_);
  const model::Layout& ml = model_.layout();
  const int64_t at = ml.token_embedding().offset - model_.unit_offset(0);  // in unit 0
  const int64_t n = ml.token_embedding().numel();
  const DType dtype = bf16() ? DType::kBF16 : DType::kF32;
  if (options_.zero_stage < 2) {
    void* g = bf16() ? static_cast<void*>(units_->full_grads() + ml.token_embedding().offset)
                     : static_cast<void*>(model_.grads() + ml.token_embedding().offset);
    rows_->add_into(g, dtype, 0, n);
    rows_->clear();
    return;
  }
  const TableShard t = table_in_shard(layout_, 0, at, n);  // the table's part of this rank's shard
  if (t.hi > t.lo && !paged_shards_) {
    const int64_t off = layout_.local_offset(0) + t.first;
    void* g = bf16() ? static_cast<void*>(grad_bf16() + off) : static_cast<void*>(grad_f32() + off);
    rows_->add_into(g, dtype, t.lo, t.hi);
  } else if (t.hi > t.lo) {
    adam_->paged_state()->update(optim::PagedState::kGrad, state_offset(0) + t.first, t.hi - t.lo,
                                 [&](void* p, int64_t k, int64_t count) {
                                   rows_->add_into(p, dtype, t.lo + k, t.lo + k + count);
                                 });
  }
  rows_->clear();
  if (!paged_shards_) return;
  const auto owned = static_cast<size_t>(layout_.owned(0));
  std::vector<float> g(bf16() ? 0 : owned);
  std::vector<uint16_t> g16(bf16() ? owned : 0);
  adam_->paged_state()->copy_out(optim::PagedState::kGrad, state_offset(0), layout_.owned(0),
                                 bf16() ? static_cast<void*>(g16.data()) : static_cast<void*>(g.data()));
  unit_sq_[0] = {};
  if (bf16())
    add_counted(unit_sq_[0], 0, 0, g16.data(), layout_.owned(0));
  else
    add_counted(unit_sq_[0], 0, 0, g.data(), layout_.owned(0));
}

int64_t DataParallel::state_offset(int u) const {
  if (options_.zero_stage == 0) return model_.unit_offset(u) + layout_.begin(u);
  return layout_.local_offset(u);
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

void DataParallel::begin_step(double lr) {
  model_.zero_grads();
  step_lr_ = lr;
  lr_known_ = true;
}

float DataParallel::micro_batch(const int32_t* inputs, const int32_t* targets, float grad_scale,
                                bool last) {
  if (units_) units_->set_final_micro_batch(last);  // (paged shards take the norm as the last land)
  final_micro_ = last;  // (the activation lender lends the last one's)
  model_.set_accumulating(!last);  // the model's own tied E (no sink) is added once, at the end
  const float loss = model_.forward_backward(inputs, targets, grad_scale,
                                             last ? unit_ready() : std::function<void(int)>(),
                                             last && defer_embedding_);
  if (last) backward_done(inputs);
  return loss;
}

int64_t DataParallel::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
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
      const model::Layout& ml = model_.layout();
      const model::TensorSpec* pos = ml.position_embedding();
      char* g = bf16() ? reinterpret_cast<char*>(units_->full_grads()) : reinterpret_cast<char*>(model_.grads());
      auto at = [&](int64_t offset) { return g + static_cast<size_t>(offset) * param_esz(); };
      add_deferred_lookup(rows_ ? nullptr : at(ml.token_embedding().offset),  // (tied: add_tied_rows)
                          pos ? at(pos->offset) : nullptr, bf16() ? DType::kBF16 : DType::kF32,
                          lookup_grads_.f32(), static_cast<const int32_t*>(lookup_tokens_.data()),
                          model_.batch() * layout_.ranks(), model_.seq_len(), model_.config().n_embd,
                          ml.vocab_begin(), ml.vocab_real());
    }
  }
  add_tied_rows();
  if (early_ && lr_known_) {  // the pages not updated in the backward (at least unit 0's)
    PO_ASSERT(lr == step_lr_, "DataParallel: step(", lr, ") after set_step_lr(", step_lr_, ")");
    const double norm = bf16() ? full_grad_norm(units_->full_grads()) : full_grad_norm(model_.grads());
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
    const double norm = full_grad_norm(grads);
    auto* params = static_cast<uint16_t*>(stored_params());
    adam_->apply_mixed(master_.f32(), grads, false, params, lr, adam_->clip_scale(norm));
    units_->zero_full_grads();
    if (stage == 1 && group_ != nullptr) gather_params();
    return norm;
  }
  // The full reduced gradient is here: its norm needs no data-parallel
  // communication (tensor parallel adds the other shards'), and this rank's
  // shard of it feeds the update.
  const double norm = full_grad_norm(model_.grads());
  if (stage == 0) {
    adam_->apply(model_.params(), model_.grads(), lr, adam_->clip_scale(norm));
    return norm;
  }
  for (int u = 0; u < layout_.num_units(); ++u) copy_grad_shard(u);
  adam_->apply(model_.params(), grad_f32(), lr, adam_->clip_scale(norm));
  if (group_ != nullptr) gather_params();
  return norm;
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
  add_tied_rows();
  units_->drain_gathers();  // speculative ones read the shard about to change
  comm_wait_s_ = units_->take_wait_seconds();
  wait_end_ns_ = now_ns();
  const double norm = sharded_grad_norm();
  const double clip = adam_->clip_scale(norm);
  if (early_ && lr_known_) {
    PO_ASSERT(lr == step_lr_, "DataParallel: step(", lr, ") after set_step_lr(", step_lr_, ")");
    finish_early_step(lr);
    lr_known_ = false;
    if (grad_shard_bf16_.size() > 0) backend::device_zero(grad_shard_bf16_.data(), grad_shard_bf16_.size());
    if (grad_shard_f32_.size() > 0) backend::device_zero(grad_shard_f32_.data(), grad_shard_f32_.size());
    if (options_.zero_stage == 2 && group_ != nullptr) gather_params();
    return norm;
  }
  if (bf16()) {
    adam_->apply_mixed(master_.f32(), grad_bf16(), true,
                       static_cast<uint16_t*>(stored_params()), lr, clip);
    if (grad_shard_bf16_.size() > 0) backend::device_zero(grad_shard_bf16_.data(), grad_shard_bf16_.size());
  } else {
    adam_->apply(static_cast<float*>(stored_params()), grad_f32(), lr, clip);
    if (grad_shard_f32_.size() > 0) backend::device_zero(grad_shard_f32_.data(), grad_shard_f32_.size());
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
      backend::device_copy(unit_at(u), recv_base + slot * half_recv,
                  static_cast<size_t>(model_.unit_numel(u)) * esz);
    unit_in[slot] = -1;
  };
  for (int u = 0; u < units; ++u) {
    const int slot = u & 1;
    finish_slot(slot);
    char* send = send_base + slot * half_send;
    const auto owned = static_cast<size_t>(layout_.owned(u));
    const auto stride = static_cast<size_t>(layout_.stride(u));
    backend::device_copy(send, unit_at(u) + static_cast<size_t>(layout_.begin(u)) * esz, owned * esz);
    backend::device_zero(send + owned * esz, (stride - owned) * esz);
    // In place: the send block is a copy of this rank's shard, so it does not
    // overlap the receive region it is gathered into.
    char* recv = gathers_in_place(u) ? unit_at(u) : recv_base + slot * half_recv;
    inflight[slot] = group_->iall_gather(send, recv, stride, dtype);
    unit_in[slot] = u;
  }
  finish_slot(0);
  finish_slot(1);
}

size_t DataParallel::predicted_model_state_bytes() const {
  const auto whole = static_cast<double>(model_.num_params());
  const auto shard = static_cast<double>(layout_.local_numel());
  const int s = options_.zero_stage;
  const double p = bf16() ? 2 : 4;  // parameter and gradient bytes
  double bytes = p * (s == 3 ? shard : whole) + p * (s >= 2 ? shard : whole);
  if (adam_->quantized())  // the moments as stored (this rank's shard at stages 1-3) [+ master]
    bytes += static_cast<double>(moment_bytes(model_.layout(), adam_->config(), s >= 1 ? &layout_ : nullptr)) +
             (bf16() ? 4 : 0) * (s >= 1 ? shard : whole);
  else
    bytes += (bf16() ? 12.0 : 8.0) * (s >= 1 ? shard : whole);  // [master +] m + v
  if (!bf16() && s == 1) bytes += 4 * shard;  // the shard of the reduced gradient the update reads
  return static_cast<size_t>(bytes);
}

size_t DataParallel::predicted_grad_bytes() const {
  const auto whole = static_cast<double>(model_.num_params());
  const auto shard = static_cast<double>(layout_.local_numel());
  const int s = options_.zero_stage;
  if (paged_shards_) return 0;  // ZeRO-3 paged: the gradient shard lives in the pages
  double bytes = (bf16() ? 2 : 4) * (s >= 2 ? shard : whole);
  if (!bf16() && s == 1) bytes += 4 * shard;  // the shard of the reduced gradient the update reads
  return static_cast<size_t>(bytes);
}

MemoryReport DataParallel::memory() const {
  MemoryReport r;
  r.params = model_.params_bytes() + model_.base_bytes();  // (a frozen base: with the parameters)
  // (fp32 stage 1 also holds a copy of its shard of the whole gradient.)
  r.grads = model_.grads_bytes() + grad_shard_bf16_.size() + grad_shard_f32_.size();
  r.master = master_.size();
  r.adam = adam_->state_bytes();
  if (adam_->paged()) {
    const optim::PagedState& st = *adam_->paged_state();
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
  r.buckets += lookup_tokens_.size() + lookup_grads_.size() + (rows_ ? rows_->bytes() : 0);
  r.activations = model_.activation_bytes();
  return r;
}

}  // namespace po::parallel
