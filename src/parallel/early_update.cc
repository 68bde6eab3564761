// Paged Adam state and the updates made during the backward: with no
// clipping, overlap on and memory.update_in_backward, a page is updated as
// soon as every unit whose gradient it holds is final, walking down with the
// backward (its reads ahead overlap the next unit's backward); step() updates
// the rest. ZeRO-3's paged shards take their gradients here, summing each
// unit's final squares as they land.
#include "parallel/data_parallel.h"

#include <algorithm>
#include <cstring>

#include "backend/device.h"
#include "backend/ops.h"
#include "core/bf16.h"
#include "core/error.h"
#include "parallel/units.h"

namespace po::parallel {
namespace ops = po::backend::cpu;
using tensor::DType;

optim::PagedState::Layout DataParallel::paging_layout() const {
  optim::PagedState::Layout layout;
  layout.schema = optim::adamw_schema(bf16());
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
  optim::PagedState* st = adam_->paged_state();
  if (options_.lend_activations && model_.whole()) {
    // Reads ahead into lent frames follow the sweep's order; early updates
    // visit pages in their own order, which reads ahead by itself.
    memory::Pager& pager = st->pager();
    const bool read_ahead = !early_;
    model_.set_activation_lender({[this, &pager, read_ahead](int r, char* base, size_t bytes) {
                                    if (!final_micro_) return false;  // (the step's last micro-batch's)
                                    pager.lend(r, base, bytes, read_ahead);
                                    return true;
                                  },
                                  [&pager](int r) { pager.claim(r); }});
  }
  if (early_) {  // which units' gradients each page holds
    page_units_.assign(st->state_pages(), 0);
    for (int u = 0; u < layout_.num_units(); ++u) {
      const auto [lo, n] = state_range(u);
      if (n == 0) continue;
      const auto [first, last] = adam_->pages_of(lo, n);
      for (size_t p = first; p <= last; ++p) ++page_units_[p];
    }
    page_waiting_ = page_units_;
    page_done_.assign(st->state_pages(), false);
    // Stage 2: a unit is final once its last micro-batch's reduce-scatter is in.
    if (options_.zero_stage == 2) units_->set_on_final([this](int u) { unit_final(u); });
  }
  if (!paged_shards_) return;
  units_->use_paged_shards(
      {[this, st](int u, void* dst) {
         st->copy_out(optim::PagedState::kParam, layout_.local_offset(u), layout_.stride(u), dst,
                      backend::Device::Direction::kDeviceToDevice);  // into a gather's send block
       },
       [this](int u, const void* block, DType dtype, bool final) {
         add_paged_grad(u, block, dtype, final);
       },
       [this, st](int u) {
         st->prefetch(optim::PagedState::kParam, layout_.local_offset(u), layout_.stride(u));
       }});
}

size_t DataParallel::lent_frames() const {
  if (!paged() || !options_.lend_activations || !model_.whole()) return 0;
  const size_t page = adam_->paged_state()->page_bytes();
  size_t n = 0;
  for (const auto& [base, bytes] : model_.activation_regions())
    n += memory::Pager::frames_in(reinterpret_cast<uintptr_t>(base), bytes, page);
  return n;
}

void DataParallel::add_paged_grad(int u, const void* block, DType dtype, bool final) {
  SumOfSquares& sq = unit_sq_[static_cast<size_t>(u)];
  adam_->paged_state()->update(
      optim::PagedState::kGrad, layout_.local_offset(u), layout_.stride(u),
      [&](void* ptr, int64_t first, int64_t count) {
        if (bf16()) {
          auto* g = static_cast<uint16_t*>(ptr);
          if (dtype == DType::kBF16)
            ops::bf16_add_bf16(g, static_cast<const uint16_t*>(block) + first, count);
          else
            ops::bf16_add_f32(g, static_cast<const float*>(block) + first, count);
          if (final) add_counted(sq, u, first, g, count);
        } else {
          auto* g = static_cast<float*>(ptr);
          if (dtype == DType::kBF16) {
            const auto* b = static_cast<const uint16_t*>(block) + first;
            for (int64_t i = 0; i < count; ++i) g[i] += core::bf16_to_f32(core::bf16{b[i]});
          } else {
            const auto* b = static_cast<const float*>(block) + first;
            for (int64_t i = 0; i < count; ++i) g[i] += b[i];
          }
          if (final) add_counted(sq, u, first, g, count);
        }
      });
  if (final && early_ && lr_known_ && !(u == 0 && rows_)) update_final_pages(u);  // (tied: unit 0 waits)
}

// Unit u's gradient shard is final: the pages that now wait for no unit are
// updated at once (no clipping, so the scale is 1), from the top down as the
// backward walks, and the pages of the unit final next start coming in, so
// their reads overlap that unit's backward.
void DataParallel::update_final_pages(int u) {
  optim::PagedState& st = *adam_->paged_state();
  const auto [lo, n] = state_range(u);
  if (n == 0) return;
  const optim::OutsidePages outside = outside_pages();
  const auto [first_page, last_page] = adam_->pages_of(lo, n);
  for (auto p = static_cast<int64_t>(last_page); p >= static_cast<int64_t>(first_page); --p) {
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
  const auto [next_first, next_last] = adam_->pages_of(next_lo, next_n);
  const auto top = static_cast<int64_t>(next_last), bottom = static_cast<int64_t>(next_first);
  const auto ahead = static_cast<int64_t>(st.pager().usable_frames() / 2);
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
  adam_->paged_state()->pager().write_behind_lent();  // behind the next forward
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
  backend::device_copy(grad_f32() + layout_.local_offset(u),
              model_.grads() + model_.unit_offset(u) + layout_.begin(u),
              static_cast<size_t>(layout_.owned(u)) * sizeof(float));
}

// Unit u's gradient is final (stages 0-2): its pages may go.
void DataParallel::unit_final(int u) {
  if (!early_ || !lr_known_) return;
  if (u == 0 && rows_) return;  // a tied table waits for the step's lookup part (add_tied_rows)
  if (options_.zero_stage == 1 && !bf16()) copy_grad_shard(u);
  update_final_pages(u);
}

}  // namespace po::parallel
