// AdamW over a flat parameter buffer split into tensors, with decoupled weight
// decay only on tensors marked `decay` and global-norm gradient clipping.
// State (m, v) is flat with the same offsets as the parameters, so a shard or
// page of state is the same slice as the shard of parameters (later issues).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "memory/pager.h"
#include "optim/paged_state.h"
#include "tensor/tensor.h"

namespace po::optim {

struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double grad_clip = 1.0;  // 0 disables clipping
};

// A contiguous range of the flat buffer that is one tensor (or, sharded, the
// part of one tensor this rank owns).
struct ParamRange {
  int64_t offset = 0;        // in the parameter buffer
  int64_t numel = 0;
  bool decay = false;
  int64_t state_offset = -1; // in m, v and sharded gradients; -1: same as offset
  int64_t state() const { return state_offset < 0 ? offset : state_offset; }
};

// Where a paged update finds what the pages do not hold, as apply() and
// apply_mixed() take it: fp32 parameters (by range offset) and gradients
// (by state offset), or bf16 gradients (by state or range offset) and the
// bf16 parameters written from the master (by range offset).
struct OutsidePages {
  float* params = nullptr;
  const float* grads_state = nullptr;
  const uint16_t* grads_bf16 = nullptr;
  bool grads_by_state = false;
  uint16_t* params_out = nullptr;
};

class AdamW {
 public:
  // Its fields in the pages (adamw_schema's order).
  static constexpr PagedState::Field kM = 0, kV = 1, kMaster = 2;
  // The field holding a kind of state in the pages, by its schema name: the
  // moments, and for the parameters the fp32 master (a bf16 run's).
  static constexpr PagedState::Field paged_field(StateKind k) {
    return k == StateKind::kParams ? kMaster : adamw_schema(true).find(state_kind_field(k).name);
  }

  // `num_params` sizes the state (m, v): the whole model, or for a ZeRO shard
  // the rank's local shard buffer (ranges then carry state_offset).
  AdamW(const AdamWConfig& config, std::vector<ParamRange> ranges, int64_t num_params);

  // Global L2 norm of grads (double accumulation).
  static double grad_norm(const float* grads, int64_t n);

  // Clips (scale = clip / (norm + 1e-6) when below 1, as torch's clip_grad_norm_)
  // and applies one update at learning rate lr. Returns the pre-clip norm.
  double step(float* params, const float* grads, double lr);

  // The pieces of step() for sharded state, where the norm is a sum over
  // ranks: the squared L2 norm of grads[0, n) (double accumulation); the
  // clipping factor for a global norm; one update at lr with gradients in
  // STATE coordinates (grads[state_offset ...]) scaled by clip_scale.
  static double sum_squares(const float* grads, int64_t n);
  double clip_scale(double norm) const;
  void apply(float* params, const float* grads_state, double lr, double clip_scale);
  // Mixed precision: the fp32 master weights `master` (state coordinates;
  // ignored when paged with the master in the pages)
  // take the update from bf16 gradients (at state_offset when
  // `grads_by_state`, else at offset) and the rounded result is written to
  // the bf16 parameters `params_out` at offset.
  void apply_mixed(float* master, const uint16_t* grads, bool grads_by_state,
                   uint16_t* params_out, double lr, double clip_scale);

  // Moves m and v (and what `layout` adds: the fp32 master of apply_mixed
  // when its schema is adamw_schema(true), the parameter and gradient
  // shards) into pages; before the first step.
  // With parameters (gradients) in the pages, apply*() ignore their params
  // (grads) argument and use the pages' fields.
  void enable_paging(const memory::PagerOptions& options, const PagedState::Layout& layout);
  bool paged() const { return paged_ != nullptr; }
  using OutsidePages = optim::OutsidePages;
  // Pages can be updated one at a time as their gradients become final (no
  // clipping: the scale is known): begin_paged_step() once per step, then
  // update_page() for every page.
  void begin_paged_step();
  void update_page(size_t page, double lr, double clip_scale, const OutsidePages& outside = {});
  const AdamWConfig& config() const { return config_; }
  PagedState* paged_state() { return paged_.get(); }

  int64_t steps_taken() const { return t_; }
  void set_steps_taken(int64_t t) { t_ = t; }
  // In memory only (null once paged). m and v are allocated at the first
  // use (or allocate_state()), so that a run that pages them never holds
  // them whole.
  float* m();
  float* v();
  void allocate_state();
  int64_t num_params() const { return n_; }
  size_t state_bytes() const { return m_.size() + v_.size(); }

 private:
  AdamWConfig config_;
  std::vector<ParamRange> ranges_;
  int64_t n_;
  int64_t t_ = 0;
  // Ranges sorted by state offset (the paged update walks pages in order).
  std::vector<ParamRange> by_state_;
  // One piece [a, a + n) of range r inside a page (view `at`), the rest
  // found `outside`: the paged update's arithmetic.
  void update_piece(const ParamRange& r, int64_t a, int64_t n, const PagedState::View& at,
                    const OutsidePages& outside, double lr, double scale);
  // The paged apply()/apply_mixed(): a sweep over every state page.
  void apply_paged(const OutsidePages& outside, double lr, double scale);
  tensor::Storage m_, v_;
  std::unique_ptr<PagedState> paged_;
};

}  // namespace po::optim
