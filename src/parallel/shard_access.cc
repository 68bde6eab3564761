// This rank's shards as checkpoints see them (fp32, the ShardLayout's owned
// part of each unit): pointers when the state is addressable, copies in and
// out of the pages when it is paged.
#include "parallel/data_parallel.h"

#include <cstring>
#include <optional>

#include "backend/device.h"
#include "core/error.h"
#include "parallel/units.h"

namespace po::parallel {

// Where this rank's shard of `kind` lives when it is not addressable: the
// pages' field (none: param_shard / adam_m_shard / adam_v_shard point at it).
std::optional<optim::PagedState::Field> DataParallel::paged_field(Shard kind) const {
  if (!adam_->paged()) return std::nullopt;
  // Moments, and a bf16 run's parameters (its fp32 master).
  if (kind != Shard::kParams || bf16()) return optim::AdamW::paged_field(kind);
  if (paged_shards_ && units_->sharded()) return optim::PagedState::kParam;
  return std::nullopt;
}

float* DataParallel::shard_pointer(Shard kind, int u) {
  if (kind == Shard::kParams) return param_shard(u);
  return kind == Shard::kAdamM ? adam_m_shard(u) : adam_v_shard(u);
}

void DataParallel::read_shard(Shard kind, int u, float* dst) {
  if (kind != Shard::kParams && adam_->quantized()) {  // decoded to fp32
    adam_->read_moment(kind, state_offset(u), layout_.owned(u), dst);
    return;
  }
  if (const auto f = paged_field(kind)) {
    adam_->copy_out_paged(*f, state_offset(u), layout_.owned(u), dst);
    return;
  }
  backend::to_host(dst, shard_pointer(kind, u), static_cast<size_t>(layout_.owned(u)) * sizeof(float));
}

void DataParallel::write_shard(Shard kind, int u, const float* src) {
  PO_CHECK(!(kind == Shard::kParams && paged_shards_ && units_->sharded()),
           "DataParallel::write_shard: parameters are loaded before shard_params()");
  if (kind != Shard::kParams && adam_->quantized()) {  // codes recovered, or quantized
    quantized_on_load_ += adam_->write_moment(kind, state_offset(u), layout_.owned(u), src);
    return;
  }
  if (const auto f = paged_field(kind)) {
    adam_->copy_in_paged(*f, state_offset(u), layout_.owned(u), src);
    return;
  }
  backend::from_host(shard_pointer(kind, u), src, static_cast<size_t>(layout_.owned(u)) * sizeof(float));
}

void DataParallel::write_whole_moment(Shard kind, int u, const float* src) {
  PO_ASSERT(options_.zero_stage == 0 && kind != Shard::kParams,
            "DataParallel::write_whole_moment: Adam's moments at ZeRO-0");
  const int64_t at = model_.unit_offset(u), n = model_.unit_numel(u);
  if (adam_->quantized()) {
    quantized_on_load_ += adam_->write_moment(kind, at, n, src);
    return;
  }
  if (const auto f = paged_field(kind)) {
    adam_->copy_in_paged(*f, at, n, src);
    return;
  }
  float* dst = (kind == Shard::kAdamM ? adam_->m() : adam_->v()) + at;
  backend::from_host(dst, src, static_cast<size_t>(n) * sizeof(float));
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

}  // namespace po::parallel
