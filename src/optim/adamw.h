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

// Adam state in pages (memory/pager.h): state page k holds, for the state
// elements [k·E, (k+1)·E), Adam m, then v, then (mixed precision) the fp32
// master. For ZeRO-3 with parameters in pages (ZeRO-Infinity), this rank's
// parameter shard and its gradient shard live in pages of their own (one
// pager and swap file each): parameter page j holds [j·Ep, (j+1)·Ep), gradient
// page j [j·Eg, (j+1)·Eg), Ep and Eg multiples of E, so every state page's
// elements lie in one page of each. A gather then reads parameters only,
// gradients start every step as pages of zeros that cost no I/O (the update
// discards them once consumed), and the update is the same computation cut
// at page boundaries (it is element-wise).
class PagedAdamState {
 public:
  enum class Field { kM = 0, kV = 1, kMaster = 2, kParam = 3, kGrad = 4 };
  struct Layout {
    bool master = false;     // fp32 master weights (bf16 runs)
    size_t param_bytes = 0;  // parameter shard: 0 (not paged), 4 (fp32) or 2 (bf16)
    size_t grad_bytes = 0;   // gradient shard: likewise
    size_t state_bytes() const { return 8 + (master ? 4 : 0); }
    size_t element_bytes() const { return state_bytes() + param_bytes + grad_bytes; }
  };
  // A page's fields at element lo (null where the layout has none).
  struct View {
    float* m = nullptr;
    float* v = nullptr;
    float* master = nullptr;
    void* param = nullptr;
    void* grad = nullptr;
  };
  // How `numel` elements are cut into pages of `page_bytes`: the state pages,
  // then (when paged) the parameter and the gradient pages.
  struct Geometry {
    int64_t state_elements = 0, param_elements = 0, grad_elements = 0;  // per page (0: none)
    size_t state_pages = 0, param_pages = 0, grad_pages = 0;
    size_t pages() const { return state_pages + param_pages + grad_pages; }
  };
  static Geometry geometry(int64_t numel, size_t page_bytes, const Layout& layout);
  // The fewest compute frames the pagers work with together.
  static size_t min_compute_frames(const Geometry& g, int prefetch);

  // options.compute_frames and host_frames are for all pages: they are split
  // between the kinds of pages in proportion to their numbers (each keeping
  // its minimum).
  PagedAdamState(int64_t numel, const Layout& layout, const memory::PagerOptions& options);
  int64_t numel() const { return n_; }
  int64_t elements_per_page() const { return geo_.state_elements; }
  const Geometry& geometry() const { return geo_; }
  const Layout& layout() const { return layout_; }
  bool with_master() const { return layout_.master; }
  size_t field_bytes(Field f) const;
  // fn(lo, hi, view) for every state page in the pager's order, its
  // parameter and gradient pieces resident alongside. `consumes_grads`: fn
  // zeroes the page's gradients (an update); a gradient page all of whose
  // elements were consumed is discarded (zeros, no I/O).
  void for_each_page(const std::function<void(int64_t lo, int64_t hi, const View& view)>& fn,
                     bool consumes_grads = false);
  // The same for one state page, outside the sweep (written back).
  void visit_page(size_t page, const std::function<void(int64_t lo, int64_t hi, const View& view)>& fn,
                  bool consumes_grads = false);
  size_t state_pages() const { return geo_.state_pages; }
  // Elements [offset, offset + n) of a field, out of / into the pages
  // (field_bytes(f) each).
  void copy_out(Field f, int64_t offset, int64_t n, void* dst);
  void copy_in(Field f, int64_t offset, int64_t n, const void* src);
  // fn(ptr, first, count) on each page-resident piece of [offset, offset + n)
  // of a field, in order, the piece written back (read-modify-write).
  void update(Field f, int64_t offset, int64_t n,
              const std::function<void(void* ptr, int64_t first, int64_t count)>& fn);
  // Starts bringing the pages holding [offset, offset + n) of field f into
  // the compute tier.
  void prefetch(Field f, int64_t offset, int64_t n);

  // All pagers together: traffic since the last call, pages per tier, frames.
  memory::PagerStats take_stats();
  size_t resident(memory::Tier t) const;
  size_t page_bytes() const { return state_->page_bytes(); }
  size_t compute_frames() const;
  size_t host_frames() const;
  // The swap file of the state, parameter or gradient pages (null: none).
  const memory::NvmeStore* store(Field f) const { return pager_of(f).store(); }
  memory::Pager& pager() { return *state_; }  // the state pages'
  // Elements per state page of `layout` in pages of `page_bytes` (a multiple
  // of 16, so that every field starts 64-byte aligned).
  static int64_t page_elements(size_t page_bytes, const Layout& layout);

 private:
  const memory::Pager& pager_of(Field f) const;
  memory::Pager& pager_of(Field f) { return const_cast<memory::Pager&>(std::as_const(*this).pager_of(f)); }
  int64_t elements_of(Field f) const;  // per page of f's pager
  size_t field_offset(Field f) const;  // bytes from its page's start
  // Runs fn with state page `page`'s view, its parameter and gradient fields
  // from the pages holding them (made resident, written back).
  void with_shards(size_t page, char* data, bool consumes_grads,
                   const std::function<void(int64_t, int64_t, const View&)>& fn);
  // fn(ptr, first, count) on each page-resident piece of a field's range;
  // `dirty`: the pieces are written back.
  void for_each_piece(Field f, int64_t offset, int64_t n, bool dirty,
                      const std::function<void(char* ptr, int64_t first, int64_t count)>& fn);
  int64_t n_;
  Layout layout_;
  Geometry geo_;
  std::unique_ptr<memory::Pager> state_;          // m, v [, master]
  std::unique_ptr<memory::Pager> params_, grads_; // ZeRO-Infinity's shards, or null
  std::vector<int64_t> consumed_;                 // per gradient page: elements consumed this step
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

  // Moves m and v (and what `layout` adds: the fp32 master of apply_mixed,
  // the parameter and gradient shards) into pages; before the first step.
  // With parameters (gradients) in the pages, apply*() ignore their params
  // (grads) argument and use the pages' fields.
  void enable_paging(const memory::PagerOptions& options, const PagedAdamState::Layout& layout);
  bool paged() const { return paged_ != nullptr; }
  using OutsidePages = optim::OutsidePages;
  // Pages can be updated one at a time as their gradients become final (no
  // clipping: the scale is known): begin_paged_step() once per step, then
  // update_page() for every page.
  void begin_paged_step();
  void update_page(size_t page, double lr, double clip_scale, const OutsidePages& outside = {});
  const AdamWConfig& config() const { return config_; }
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
  // One piece [a, a + n) of range r inside a page (view `at`), the rest
  // found `outside`: the paged update's arithmetic.
  void update_piece(const ParamRange& r, int64_t a, int64_t n, const PagedAdamState::View& at,
                    const OutsidePages& outside, double lr, double scale);
  // The paged apply()/apply_mixed(): a sweep over every state page.
  void apply_paged(const OutsidePages& outside, double lr, double scale);
  tensor::Storage m_, v_;
  std::unique_ptr<PagedAdamState> paged_;
};

}  // namespace po::optim
