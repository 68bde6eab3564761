// AdamW over a flat parameter buffer split into tensors, with decoupled weight
// decay only on tensors marked `decay` and global-norm gradient clipping.
// State (m, v) is flat with the same offsets as the parameters, so a shard or
// page of state is the same slice as the shard of parameters (later issues).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/codebook.h"
#include "backend/ops.h"
#include "memory/pager.h"
#include "optim/paged_state.h"
#include "tensor/tensor.h"

namespace po::optim {

// Read from a run's keys at the edge (train/optim_keys.h).
struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double grad_clip = 1.0;  // 0 disables clipping
  // optim.state_bits: 32, or the moments of the ranges marked `quantized`
  // stored blockwise in 8 bits (bitsandbytes' dynamic maps) or 4 (torchao's
  // maps), with an fp32 absmax per `block_size` elements (backend/quant_map.h).
  int state_bits = 32;
  int64_t block_size = 256;
  // optim.state_bits_exclude: tensor names, or "token_embedding" and "head"
  // (an untied head), whose moments stay 32-bit; as are tensors of fewer
  // than kMinQuantizedNumel elements (bitsandbytes' min_8bit_size).
  std::string state_bits_exclude = "token_embedding head";
  // optim.name = "sgd": plain SGD, p ← p·(1 − lr·wd) − lr·g (decoupled
  // decay as AdamW's; no momentum). It keeps AdamW's layout (m and v
  // allocated, paged and checkpointed, zeros), so every path runs it
  // unchanged; a stateless schema is future work (docs/diloco.md).
  bool sgd = false;
};
inline constexpr int64_t kMinQuantizedNumel = 4096;

// Blocks of quantized state a range of n elements starting `unit_offset`
// into its unit cuts into (ParamRange: the unit's grid of `block`).
int64_t quant_blocks(int64_t n, int64_t block, int64_t unit_offset);
// Bytes of Adam's two moments for such a range: 8 per element at 32 bits;
// codes and one fp32 absmax per block for each moment when quantized.
int64_t moment_bytes(const AdamWConfig& c, bool quantized, int64_t n, int64_t unit_offset);

// A contiguous range of the flat buffer that is one tensor (or, sharded, the
// part of one tensor this rank owns).
struct ParamRange {
  int64_t offset = 0;        // in the parameter buffer
  int64_t numel = 0;
  bool decay = false;
  int64_t state_offset = -1; // in m, v and sharded gradients; -1: same as offset
  // Quantized moments (AdamWConfig::state_bits < 32): whether this range's
  // tensor has them, and the range's first element's offset in its unit.
  // Blocks lie on the unit's grid of block_size elements, cut at tensor
  // edges: a block is [k·B, (k+1)·B) ∩ tensor, so a ZeRO cut at a multiple
  // of B never splits one and the blocks do not depend on the layout.
  bool quantized = false;
  int64_t unit_offset = 0;
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
  //
  // Quantized moments page as they are stored: the pages' elements are the
  // state's, each unit's block grid moved onto the pages' (paged_at(): the
  // identity at ZeRO 1-3, whose shards are cut on the grid; at ZeRO-0 each
  // unit is shifted up to the next grid line), so a page, a multiple of
  // optim.block_size elements, never splits a block. m and v are codes with
  // two fp32 scales per grid block (StateField::cut_blocks: the part of a
  // block before a tensor's end keeps the second), the master beside them;
  // the fp32 m and v of the 32-bit tensors lie in side pages
  // (PagedState::Layout::side) at their compact offsets. The update is the
  // in-memory one cut at page boundaries (block-wise within a page): the
  // same bits.
  void enable_paging(const memory::PagerOptions& options, const PagedState::Layout& layout);
  bool paged() const { return paged_ != nullptr; }
  // The pages' layout for `layout` (the caller's shards and master): its
  // schema and side state as enable_paging makes them, and the elements
  // they hold (the state's; more where units are shifted onto the grid,
  // fewer where the 32-bit ranges take no place).
  PagedState::Layout paged_layout(const PagedState::Layout& layout) const;
  int64_t paged_numel(const PagedState::Layout& layout) const { return paged_coordinates(layout).numel; }
  // Where state element x lies in the pages' elements, and the first and
  // last state page holding state elements [lo, lo + n), n > 0.
  int64_t paged_at(int64_t x) const;
  std::pair<size_t, size_t> pages_of(int64_t lo, int64_t n) const;
  // Elements [lo, lo + n) of an element-wise field of the pages (the
  // master, the shards), in state coordinates, out of / into host buffers.
  void copy_out_paged(PagedState::Field f, int64_t lo, int64_t n, void* dst,
                      backend::Device::Direction d = backend::Device::Direction::kDeviceToHost);
  void copy_in_paged(PagedState::Field f, int64_t lo, int64_t n, const void* src,
                     backend::Device::Direction d = backend::Device::Direction::kHostToDevice);
  // Bytes of the moments as stored (codes and one scale per block for the
  // quantized ranges, 8 per element for the rest): the ledger's count.
  int64_t moment_bytes() const;
  // What the ledger counts for the state enable_paging(..., layout) pages:
  // the moments as stored, the master and the shards, over the state's
  // elements (the pages themselves hold a little more at 8 and 4 bits: a
  // second scale per block, codes for the 32-bit tensors' elements).
  int64_t ledger_paged_bytes(const PagedState::Layout& layout) const;
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
  size_t state_bytes() const { return m_.size() + v_.size() + quant_bytes(); }
  // Quantized moments (config().state_bits < 32): m() and v() are refused;
  // checkpoints read and write the moments as fp32 values, elements
  // [lo, lo + n) of the state (kind kAdamM or kAdamV). A quantized block's
  // values are its decoded ones, value × absmax; write_moment recovers the
  // codes and absmax that decode to exactly the values given (a checkpoint
  // of this build: the run resumes bit for bit) and quantizes a block that
  // no codes decode to (a 32-bit checkpoint's moments). It takes whole
  // blocks and returns how many it had to quantize.
  bool quantized() const { return config_.state_bits < 32; }
  void read_moment(StateKind kind, int64_t lo, int64_t n, float* dst) const;
  int64_t write_moment(StateKind kind, int64_t lo, int64_t n, const float* src);

 private:
  AdamWConfig config_;
  std::vector<ParamRange> ranges_;
  int64_t n_;
  int64_t t_ = 0;
  // Range indices sorted by state offset (the paged update walks pages in
  // order).
  std::vector<size_t> by_state_;
  // The pages' coordinates: each range's first element and its length
  // there (by ranges_ index), and where they move whole stretches of the
  // state (quantized paging at ZeRO-0: state elements from `from` on lie
  // `delta` further). With quantized moments and nothing else per element
  // in the pages (no master, no shards) the 32-bit ranges take no place
  // there (length 0): their moments are all in the side pages, and the
  // range is updated with the page its place falls in.
  struct Shift {
    int64_t from = 0, delta = 0;
  };
  struct PagedCoordinates {
    std::vector<int64_t> start, len;
    std::vector<Shift> shifts;
    int64_t numel = 0;
  };
  PagedCoordinates paged_coordinates(const PagedState::Layout& layout) const;
  PagedCoordinates coords_;  // enable_paging's
  // fn(pages' element, elements done, count) for each piece of state
  // elements [lo, lo + n) that one shift moves whole (copy_in/out_paged).
  void for_each_unshifted(int64_t lo, int64_t n, const std::function<void(int64_t, int64_t, int64_t)>& fn) const;
  // One update's operands for a range's elements from one on: the
  // parameter (fp32) or the master (bf16), the fp32 or bf16 gradient, the
  // bf16 parameter written from the master.
  struct Operands {
    float* p = nullptr;
    const float* g = nullptr;
    const uint16_t* gb = nullptr;
    uint16_t* out = nullptr;
    Operands operator+(int64_t k) const {
      return {p + k, g ? g + k : nullptr, gb ? gb + k : nullptr, out ? out + k : nullptr};
    }
  };
  // The update of n elements: fp32 m and v, or quantized ones (q).
  void update_elements(const ParamRange& r, const Operands& x, float* m, float* v,
                       const backend::cpu::QuantMoments* q, int64_t n, double lr, double scale) const;
  // Range i's elements [a, a + n) in the pages' coordinates, inside the
  // page [lo, ...) whose view is `page`, the rest found `outside`: the
  // paged update.
  void update_piece(size_t i, int64_t a, int64_t n, int64_t lo, const PagedState::View& page,
                    const OutsidePages& outside, double lr, double scale);
  // Quantized moments in pages: a block of range i, `x0` elements into the
  // range and `len` long: fn(m codes, m scale, v codes, v scale) on its
  // page (written back when `dirty`).
  void paged_block(size_t i, int64_t x0, int64_t len, bool dirty,
                   const std::function<void(uint8_t*, float*, uint8_t*, float*)>& fn) const;
  std::array<StateField, 3> paged_fields_{};  // the quantized pages' schema
  // The paged apply()/apply_mixed(): a sweep over every state page.
  void apply_paged(const OutsidePages& outside, double lr, double scale);
  tensor::Storage m_, v_;
  std::unique_ptr<PagedState> paged_;

  // Quantized moments: each range's state in one of two compact stores, the
  // 32-bit ranges' m and v (fp32), the quantized ranges' codes and block
  // absmaxes; Slot i says where range i's lies.
  struct Slot {
    bool quantized = false;
    int64_t at = 0;      // fp32 element, or code byte
    int64_t blocks = 0;  // first block's absmax (quantized)
    int64_t first = 0;   // elements before the range's first grid line (0: none)
  };
  std::vector<Slot> slots_;  // by ranges_ index
  // The stores, in one compute-tier allocation (as m_ and v_ are), back to
  // back with no padding: fp32 m and v, then the absmaxes of m and v, then
  // the codes of m and v.
  tensor::Storage quant_;  // allocated at the first use (allocate_state), never when paged
  int64_t f32_numel_ = 0, code_bytes_ = 0, blocks_ = 0;
  float *f_m_ = nullptr, *f_v_ = nullptr, *q_ma_ = nullptr, *q_va_ = nullptr;
  uint8_t *q_m_ = nullptr, *q_v_ = nullptr;
  size_t quant_bytes() const { return quant_.size(); }
  void plan_quantized();
  void allocate_quantized();
  // The codebook of m (true) or v at this config's width.
  const backend::Codebook& moment_map(bool m) const;
  // fn(range index, its overlap [a, b) with state elements [lo, lo + n)).
  template <typename Fn>
  void overlapping(int64_t lo, int64_t n, Fn fn) const;
  void apply_quantized(float* params, const float* grads_state, float* master,
                       const uint16_t* grads_bf16, bool grads_by_state, uint16_t* params_out,
                       double lr, double scale);
};

}  // namespace po::optim
