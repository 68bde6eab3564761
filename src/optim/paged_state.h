// Optimizer state in pages (memory/pager.h), cut by its schema
// (optim/state_schema.h): state page k holds, for the state elements
// [k·E, (k+1)·E), each schema field in turn (its codes, then its block
// scales), every field starting 64-byte aligned. E is a multiple of every
// field's granule, so a page never splits a byte or a scale block.
//
// For ZeRO-3 with parameters in pages (ZeRO-Infinity), this rank's parameter
// shard and its gradient shard live in pages of their own (one pager and swap
// file each): parameter page j holds [j·Ep, (j+1)·Ep), gradient page j
// [j·Eg, (j+1)·Eg), Ep and Eg multiples of E, so every state page's elements
// lie in one page of each. A gather then reads parameters only, gradients
// start every step as pages of zeros that cost no I/O (the update discards
// them once consumed), and the update is the same computation cut at page
// boundaries (it is element-wise, or block-wise within a page).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "backend/device.h"
#include "memory/pager.h"
#include "optim/state_schema.h"

namespace po::optim {

class PagedState {
 public:
  // A field of the pages: a schema field by its index (0, 1, ...), or a shard.
  using Field = int;
  static constexpr Field kParam = -1, kGrad = -2;
  static constexpr size_t kMaxFields = 6;
  static constexpr int64_t kAlign = 64;  // bytes: where every field of a page starts

  struct Layout {
    StateSchema schema = adamw_schema(false);
    size_t param_bytes = 0;  // parameter shard: 0 (not paged), 4 (fp32) or 2 (bf16)
    size_t grad_bytes = 0;   // gradient shard: likewise
    // Side state: element-wise fp32 fields over elements of their own
    // (`side_numel`), in pages of their own. 8- and 4-bit Adam keeps there
    // the fp32 m and v of the tensors it does not quantize (optim/adamw.h).
    StateSchema side{};
    int64_t side_numel = 0;
    // Bytes of n elements' state and shards (and the side state), without
    // the pages' padding.
    int64_t bytes(int64_t n) const {
      return schema.bytes(n) + n * static_cast<int64_t>(param_bytes + grad_bytes) + side.bytes(side_numel);
    }
  };
  // Side field i (Layout::side's i-th).
  static constexpr Field side_field(int i) { return -3 - i; }
  // One schema field at an element: its codes and (with a block scale) the
  // scale of the block the element starts.
  struct FieldView {
    char* codes = nullptr;
    float* scales = nullptr;
    float* f32() const { return reinterpret_cast<float*>(codes); }
  };
  // A page's fields at element lo (null where the layout has none).
  struct View {
    std::array<FieldView, kMaxFields> field{};
    void* param = nullptr;
    void* grad = nullptr;
    float* f32(Field f) const { return field[static_cast<size_t>(f)].f32(); }
  };
  // How `numel` elements are cut into pages of `page_bytes`: the state pages,
  // then (when paged) the parameter and the gradient pages.
  struct Geometry {
    int64_t state_elements = 0, param_elements = 0, grad_elements = 0, side_elements = 0;  // per page (0: none)
    size_t state_pages = 0, param_pages = 0, grad_pages = 0, side_pages = 0;
    // Bytes from a state page's start to each schema field's codes and its
    // block scales (-1: none), as StateSchema::place() lays them out; from a
    // side page's start to each side field.
    std::array<int64_t, kMaxFields> offset{}, scales{}, side_offset{};
    size_t pages() const { return state_pages + param_pages + grad_pages + side_pages; }
  };
  static Geometry geometry(int64_t numel, size_t page_bytes, const Layout& layout);
  // The fewest compute frames the pagers work with together.
  static size_t min_compute_frames(const Geometry& g, int prefetch);

  // options.compute_frames and host_frames are for all pages: they are split
  // between the kinds of pages in proportion to their numbers (each keeping
  // its minimum).
  PagedState(int64_t numel, const Layout& layout, const memory::PagerOptions& options);
  int64_t numel() const { return n_; }
  int64_t elements_per_page() const { return geo_.state_elements; }
  const Geometry& geometry() const { return geo_; }
  const Layout& layout() const { return layout_; }
  const StateSchema& schema() const { return layout_.schema; }
  bool has(Field f) const;
  // Bytes per element of a field without block scales (the shards' and
  // whole-byte fields' element size); 0 where the layout has no such field.
  size_t field_bytes(Field f) const;
  // `view` moved on by k elements (k a multiple of every field's granule).
  View advanced(const View& view, int64_t k) const;
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
  // Elements [offset, offset + n) of a field without block scales, out of /
  // into the pages (field_bytes(f) each), through the compute device: `dst`
  // and `src` are host buffers (checkpoint staging) unless `d` says they are
  // the device's.
  void copy_out(Field f, int64_t offset, int64_t n, void* dst,
                backend::Device::Direction d = backend::Device::Direction::kDeviceToHost);
  void copy_in(Field f, int64_t offset, int64_t n, const void* src,
               backend::Device::Direction d = backend::Device::Direction::kHostToDevice);
  // fn(ptr, first, count) on each page-resident piece of [offset, offset + n)
  // of such a field, in order, the piece written back (read-modify-write).
  void update(Field f, int64_t offset, int64_t n,
              const std::function<void(void* ptr, int64_t first, int64_t count)>& fn);
  // fn(fields, first, count) on each page-resident piece of side elements
  // [offset, offset + n): fields[i] points at side field i's first element
  // of the piece (written back).
  void update_side(int64_t offset, int64_t n,
                   const std::function<void(float* const* fields, int64_t first, int64_t count)>& fn);
  // Starts bringing the pages holding [offset, offset + n) of field f into
  // the compute tier.
  void prefetch(Field f, int64_t offset, int64_t n);

  // All pagers together: traffic since the last call, pages per tier, frames.
  memory::PagerStats take_stats();
  size_t resident(memory::Tier t) const;
  size_t page_bytes() const { return state_->page_bytes(); }
  size_t compute_frames() const;
  size_t host_frames() const;
  // The swap file of the state (any schema field), parameter, gradient or
  // side pages (null: none).
  const memory::NvmeStore* store(Field f) const { return pager_of(f).store(); }
  memory::Pager& pager() { return *state_; }  // the state pages'
  const memory::Pager& pager() const { return *state_; }

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
  std::unique_ptr<memory::Pager> state_;          // the schema's fields
  std::unique_ptr<memory::Pager> params_, grads_; // ZeRO-Infinity's shards, or null
  std::unique_ptr<memory::Pager> side_;           // the side state, or null
  std::vector<int64_t> consumed_;                 // per gradient page: elements consumed this step
};

}  // namespace po::optim
