// AdamW over a flat parameter buffer split into tensors, with decoupled weight
// decay only on tensors marked `decay` and global-norm gradient clipping.
// State (m, v) is flat with the same offsets as the parameters, so a shard or
// page of state is the same slice as the shard of parameters (later issues).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "memory/pager.h"
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

// Adam state in pages (memory/pager.h): page k holds, for the state elements
// [k·E, (k+1)·E), Adam m, then v, then (mixed precision) the fp32 master,
// E floats each — so one page is everything the update of those elements
// reads and writes, and the update is the same computation cut at page
// boundaries (it is element-wise).
class PagedAdamState {
 public:
  enum class Field { kM = 0, kV = 1, kMaster = 2 };
  PagedAdamState(int64_t numel, bool with_master, const memory::PagerOptions& options);
  int64_t numel() const { return n_; }
  int64_t elements_per_page() const { return e_; }
  bool with_master() const { return fields_ == 3; }
  // fn(lo, hi, m, v, master) for every page in the pager's order; the
  // pointers address element lo (master null without one).
  void for_each_page(const std::function<void(int64_t lo, int64_t hi, float* m, float* v,
                                              float* master)>& fn);
  void copy_out(Field f, int64_t offset, int64_t n, float* dst);
  void copy_in(Field f, int64_t offset, int64_t n, const float* src);
  memory::Pager& pager() { return *pager_; }
  const memory::Pager& pager() const { return *pager_; }
  // Bytes of one page for `with_master` state, elements per page.
  static int64_t page_elements(size_t page_bytes, bool with_master) {
    return static_cast<int64_t>(page_bytes / (sizeof(float) * (with_master ? 3 : 2)));
  }

 private:
  int64_t n_, e_;
  int fields_;
  std::unique_ptr<memory::Pager> pager_;
};

class AdamW {
 public:
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

  // Moves m and v (and, `with_master`, the fp32 master of apply_mixed) into
  // pages; m and v must still be zero (before the first step or a load).
  void enable_paging(const memory::PagerOptions& options, bool with_master);
  bool paged() const { return paged_ != nullptr; }
  PagedAdamState* paged_state() { return paged_.get(); }

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
  tensor::Storage m_, v_;
  std::unique_ptr<PagedAdamState> paged_;
};

}  // namespace po::optim
