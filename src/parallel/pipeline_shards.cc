// Where a unit's ZeRO 2-3 shards live (pipeline_executor.h): the gradient
// shard (ZeRO 2-3) and the stored parameter shard (ZeRO-3) of each chunk's
// units, and of a tied head's replica of unit 0, in memory, or with paged
// state at ZeRO-3 over dp > 1 in the pages of the AdamW over them, beside
// its m, v and master (ZeRO-Infinity).
// The arithmetic is the same either way (add_block, cut at page boundaries),
// so paging changes no bit.
#include "parallel/pipeline_executor.h"
#include "parallel/pipeline_executor_state.h"

#include <vector>

#include "backend/device.h"
#include "core/error.h"
#include "parallel/grad_norm.h"
#include "parallel/unit_blocks.h"

namespace po::parallel {
using namespace executor_detail;  // its helpers and names (pipeline_executor_state.h)

namespace {
optim::PagedState::Field field(bool params) { return params ? optim::PagedState::kParam : optim::PagedState::kGrad; }
void add_squares(SumOfSquares& sq, bool bf16, int64_t flat, const void* x, int64_t n,
                 const std::vector<std::pair<int64_t, int64_t>>& uncounted) {
  if (bf16)
    add_counted_flat(sq, flat, static_cast<const uint16_t*>(x), n, uncounted);
  else
    add_counted_flat(sq, flat, static_cast<const float*>(x), n, uncounted);
}
}  // namespace

PipelineExecutor::UnitShard PipelineExecutor::shard_of(Chunk& c, int u, bool params) {
  if (c.holds(u)) return {params ? &c.params : &c.grads, c.shard.get(), u - c.first, c.adam.get(), params, u, true};
  PO_ASSERT(u == 0 && layout_.tied_trains(), "pipeline chunk ", c.stage, ": unit ", u, " not held");
  if (c.replica())
    return {params ? &c.rep_params : &c.rep_grads, c.rep_shard.get(), 0, c.rep_adam.get(), params, 0, false};
  Chunk& e = chunk_of_stage(0);  // the embedding's chunk on this rank (zbv)
  return {params ? &e.params : &e.grads, e.shard.get(), 0, e.adam.get(), params, 0, true};
}

void PipelineExecutor::shard_out(const UnitShard& s, int64_t lo, int64_t n, void* dst, Direction d) {
  const int64_t at = s.layout->local_offset(s.index) + lo;
  if (paged_shards_) return s.adam->paged_state()->copy_out(field(s.params), at, n, dst, d);
  backend::compute_device().copy(dst, s.at(stored_esz()) + static_cast<size_t>(lo) * stored_esz(),
                                 static_cast<size_t>(n) * stored_esz(), d);
}

void PipelineExecutor::shard_in(const UnitShard& s, int64_t lo, int64_t n, const void* src, Direction d) {
  const int64_t at = s.layout->local_offset(s.index) + lo;
  if (paged_shards_) return s.adam->paged_state()->copy_in(field(s.params), at, n, src, d);
  backend::compute_device().copy(s.at(stored_esz()) + static_cast<size_t>(lo) * stored_esz(), src,
                                 static_cast<size_t>(n) * stored_esz(), d);
}

// One reduced block of a micro-batch's gradient of the unit (a stride of
// `dtype` values) added into its shard as stored. Paged, piece by piece as
// the pages hold it; the step's last add of a unit also sums its counted
// squares then (SumOfSquares takes a range in pieces: the same bits as the
// whole shard's at the step).
void PipelineExecutor::add_into_shard(const UnitShard& g, const void* block, DType dtype, bool final) {
  const DType stored = bf16_ ? DType::kBF16 : DType::kF32;
  const int64_t stride = g.layout->stride(g.index);
  if (!paged_shards_) {
    add_block(g.at(stored_esz()), stored, block, dtype, stride);
    if (final && g.counted) unit_landed(g.unit);
    return;
  }
  const size_t esz = dtype == DType::kBF16 ? sizeof(uint16_t) : sizeof(float);
  SumOfSquares sq;
  const int64_t flat = layout_.unit_offset(g.unit) + g.layout->begin(g.index);
  g.adam->paged_state()->update(
      optim::PagedState::kGrad, g.layout->local_offset(g.index), stride, [&](void* ptr, int64_t first, int64_t count) {
        add_block(ptr, stored, static_cast<const char*>(block) + static_cast<size_t>(first) * esz, dtype, count);
        if (final) add_squares(sq, bf16_, flat + first, ptr, count, uncounted_);
      });
  if (final && g.counted) {
    paged_sq_[static_cast<size_t>(g.unit)] = sq.total();
    unit_landed(g.unit);
  }
}

// ZeRO 2-3: unit u's gradient shard is final (its last reduction is in).
void PipelineExecutor::unit_landed(int u) {
  for (auto& c : chunks_)
    if (c->holds(u)) early_unit_final(*c, u);
}

// Unit u's counted squares read out of its gradient shard's pages (the tied
// pair adds into unit 0 after the unit's last reduction).
void PipelineExecutor::shard_squares(int u) {
  for (auto& c : chunks_) {
    if (!c->holds(u)) continue;
    const UnitShard g = shard_of(*c, u, false);
    const int64_t stride = g.layout->stride(g.index);
    std::vector<char> shard(static_cast<size_t>(stride) * stored_esz());
    g.adam->paged_state()->copy_out(optim::PagedState::kGrad, g.layout->local_offset(g.index), stride, shard.data());
    SumOfSquares sq;
    add_squares(sq, bf16_, layout_.unit_offset(u) + g.layout->begin(g.index), shard.data(), stride, uncounted_);
    paged_sq_[static_cast<size_t>(u)] = sq.total();
  }
}

}  // namespace po::parallel
