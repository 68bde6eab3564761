// The declared parameter layout: every tensor of the decoder, once. Name,
// shape, unit, initialisation rule, weight-decay flag and tensor-parallel
// partition are all here, and a block's parts (model/parts.h), which declare
// its tensors; the model, the ZeRO shards, the pager, the planner and the
// checkpoints read this and nothing else.
//
// Units: 0 = embedding (token table, and the position table where positions
// are learned), 1..L = blocks, L+1 = final norm (and the LM head when it is not
// tied). Tensors of a unit are consecutive, units are consecutive, so a ZeRO
// shard or a page is a contiguous slice of one unit. Tensors that one GEMM
// reads together are declared next to each other in [out, in] layout, so
// their concatenation along the output dimension is one weight: Llama's
// q_proj | k_proj | v_proj and gate_proj | up_proj, GPT-2's fused c_attn.
//
// Element i of tensor k initialises from Philox(seed, k) at counter i, so any
// split of a tensor starts from the values of the unsplit one.
//
// Adapters (TransformerConfig::lora): the model's own tensors are then the
// frozen base, laid out exactly as without adapters but in a space of their
// own (base_tensors(), base_unit_offset()); tensors(), the units and
// num_params() are the trainable adapters alone (A, B, DoRA's magnitude per
// adapted module, in each block's unit; the embedding and head units hold
// none). Everything that trains, shards, pages or checkpoints parameters
// reads tensors() and sees the adapters; the model reads both.
//
// Tensor parallel (TensorSplit): a layout can be one tp rank's. Its tensors
// then have the shapes that rank holds (TensorSpec::shape; global_shape is
// the whole tensor's) and its offsets and units are that rank's flat
// buffers; global_runs() maps each held element to its index in the whole
// tensor. Every tp rank's units have the same sizes and its replicated
// tensors the same offsets, so dp shards cut every tp rank alike.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "model/config.h"
#include "model/parts.h"
#include "model/tensor_spec.h"
#include "tensor/tensor.h"

namespace po::model {

// One step of a training micro-batch, in the order the one-stage schedule runs
// them. The model's forward_backward executes this list, ZeRO-3 prefetches
// along the units it touches, and the planner replays it.
struct Step {
  enum Kind { kEmbedForward, kBlockForward, kHead, kBlockBackward, kEmbedBackward } kind;
  int layer = -1;  // blocks: 0..L-1
};

// Which tensor-parallel rank a layout, or a model, is: rank of size.
struct TensorSplit {
  int size = 1;
  int rank = 0;
};

class Layout {
 public:
  explicit Layout(const TransformerConfig& config, TensorSplit split = {});

  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  const TensorSpec& tensor(const std::string& name) const;  // throws naming it
  const TensorSpec* find(const std::string& name) const;
  int64_t num_params() const { return unit_offsets_.back(); }
  int num_units() const { return static_cast<int>(unit_offsets_.size()) - 1; }
  int64_t unit_offset(int u) const { return unit_offsets_[static_cast<size_t>(u)]; }
  int64_t unit_numel(int u) const { return unit_offset(u + 1) - unit_offset(u); }
  // Every unit's elements, in order (a ShardLayout's input).
  std::vector<int64_t> unit_numels() const;
  int head_unit() const { return num_units() - 1; }

  // The model's own tensors and their units: the frozen base when the layout
  // has adapters, else tensors() and the units above.
  bool adapters() const { return !base_offsets_.empty(); }
  const std::vector<TensorSpec>& base_tensors() const { return adapters() ? base_ : tensors_; }
  int64_t base_num_params() const { return base_unit_offset(num_units()); }
  int64_t base_unit_offset(int u) const {
    return (adapters() ? base_offsets_ : unit_offsets_)[static_cast<size_t>(u)];
  }
  int64_t base_unit_numel(int u) const { return base_unit_offset(u + 1) - base_unit_offset(u); }

  // The parts of a block, with their tensors' offsets inside the block's
  // unit (every block has the same).
  const parts::Block& block() const { return block_; }
  // The final norm, its offsets inside the head unit.
  const parts::Norm& final_norm() const { return final_norm_; }
  // The token table, the position table (null without learned positions).
  const TensorSpec& token_embedding() const { return base_tensors()[0]; }
  const TensorSpec* position_embedding() const;
  // The weight the LM head multiplies by: the token table when tied
  // (declared here, once), else lm_head.weight in the head unit.
  const TensorSpec& head() const { return base_tensors()[head_]; }
  bool tied() const { return head_ == 0; }
  // A tied table that trains: tied, without adapters (a frozen base's table
  // takes no gradient, so nothing of the tied pair is kept or summed).
  bool tied_trains() const { return tied() && !adapters(); }
  // Units whose parameters the head reads, in the order it asks for them.
  std::vector<int> head_units() const;

  const TensorSplit& split() const { return split_; }
  // The vocabulary rows this rank's token table and head hold: global rows
  // [vocab_begin, vocab_begin + vocab_rows) of which the first vocab_real are
  // real (the rest pad the vocabulary to a multiple of tp and are zero).
  int64_t vocab_begin() const { return vocab_rows_ * split_.rank; }
  int64_t vocab_rows() const { return vocab_rows_; }
  int64_t vocab_real() const;
  // Calls fn(local, global, n) for runs of n consecutive held elements of `t`
  // starting at element `local` of the held tensor and element `global` of
  // the whole one (row-major); global = -1 for padding rows. In local order.
  template <typename Fn>
  void global_runs(const TensorSpec& t, Fn&& fn) const;
  // Ranges [offset, offset + n) of the flat parameters (this layout's
  // offsets) that hold replicated tensors: on tp ranks > 0 these are copies
  // that a global reduction (the gradient norm) must not count again.
  std::vector<std::pair<int64_t, int64_t>> replicated_ranges() const;
  // Ranges [offset, offset + n) of the flat parameters holding the norms that
  // train (their weights and biases), merged where adjacent, in order (none
  // with adapters: the norms are the frozen base's). Under sequence parallel
  // a tp rank's gradient of these is its own rows' part: the executor sums
  // them over the tensor group at the step, after the data group's sums.
  std::vector<std::pair<int64_t, int64_t>> norm_ranges() const;
  // Whether the model reads `t` only through its bf16 bits when they are
  // stored (UnitHooks::params_lean): the GEMM weights of the blocks and the
  // head, and the token table (the lookup widens the rows it reads). The
  // norms, the biases and the position table are read as f32.
  static bool read_as_bf16(const TensorSpec& t);
  // Ranges [begin, end) of unit u's elements, counted from the unit's start,
  // holding the tensors not read_as_bf16, in order: what a lean widening of
  // the unit writes.
  const std::vector<std::pair<int64_t, int64_t>>& f32_read_ranges(int u) const {
    return f32_ranges_[static_cast<size_t>(u)];
  }

  // The one-stage training schedule of a micro-batch; the units' parameters
  // it asks for (the ZeRO-3 gather order) are its steps' step_units.
  std::vector<Step> training_steps() const;
  // Units whose parameters step `s` reads, in the order it asks.
  std::vector<int> step_units(const Step& s) const;

 private:
  int n_layer_;
  TensorSplit split_;
  int64_t vocab_ = 0, vocab_rows_ = 0;
  std::vector<TensorSpec> tensors_;
  std::vector<int64_t> unit_offsets_;
  parts::Block block_;
  parts::Norm final_norm_;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> f32_ranges_;  // per unit
  size_t head_ = 0;
  std::vector<TensorSpec> base_;       // with adapters: the frozen model
  std::vector<int64_t> base_offsets_;  // its unit offsets (empty: no adapters)

  void declare_adapters(const TransformerConfig& config);
};

template <typename Fn>
void Layout::global_runs(const TensorSpec& t, Fn&& fn) const {
  const int64_t tp = split_.size, r = split_.rank;
  const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
  const int64_t cols = rows == 0 ? 0 : t.numel() / rows;
  switch (t.partition) {
    case Partition::kReplicated:
      fn(int64_t{0}, int64_t{0}, t.numel());
      return;
    case Partition::kVocab:
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t g = vocab_begin() + i;
        fn(i * cols, g < vocab_ ? g * cols : int64_t{-1}, cols);
      }
      return;
    case Partition::kSplitCols: {
      const int64_t gcols = t.global_shape[1];
      for (int64_t i = 0; i < rows; ++i) fn(i * cols, i * gcols + r * cols, cols);
      return;
    }
    case Partition::kSplitRows: {
      int64_t local = 0, global_start = 0;  // first row of the part, held and whole
      for (int64_t part : t.parts) {
        for (int64_t i = 0; i < part; ++i)
          fn((local + i) * cols, (global_start + r * part + i) * cols, cols);
        local += part;
        global_start += part * tp;
      }
      return;
    }
  }
}

}  // namespace po::model
