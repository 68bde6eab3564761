// The pipeline executor's state, by part, for its own files only:
// pipeline_executor.cc (the chunks and the step's actions), pipeline_vocab.cc
// (the vocabulary-parallel head's state, VocabPart), pipeline_memory.cc
// (the memory it holds, and predicts from the schedule alone) and
// pipeline_finalize.cc (the step's end).
#pragma once

#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "core/error.h"
#include "core/timer.h"
#include "model/vocab_head.h"
#include "parallel/pipeline_executor.h"
#include "parallel/shard_layout.h"
#include "parallel/tied_pair.h"
#include "parallel/unit_blocks.h"

namespace po::parallel {
namespace executor_detail {

using pipeline::Action;
using pipeline::Op;
using pipeline::Payload;
using tensor::DType;

using core::now_ns;

// (Storage is zero-filled.)
inline tensor::Storage zeroed(int64_t elements, size_t esz = sizeof(float)) {
  return tensor::Storage(static_cast<size_t>(elements) * esz);
}

inline std::vector<int64_t> unit_sizes(const model::Layout& l, int first, int last) {
  std::vector<int64_t> n;
  for (int u = first; u <= last; ++u) n.push_back(l.unit_numel(u));
  return n;
}


// Buckets of consecutive units of about bucket_bytes (esz bytes each) as
// {lowest unit, highest unit}, in the order the backward finishes them (the
// highest units first). With the embedding's lookup deferred (`defer`), unit
// 0 goes alone (the head finishes it, first), and so does unit 1: the
// backward finishes it last, so nothing can hide its sum and it should be as
// short as possible.
inline std::vector<std::pair<int, int>> bucket_units(const std::vector<int64_t>& unit_numel, size_t esz,
                                                     uint64_t bucket_bytes, bool defer) {
  std::vector<std::pair<int, int>> out;
  const uint64_t limit = std::max<uint64_t>(1, bucket_bytes);
  int hi = static_cast<int>(unit_numel.size()) - 1;
  while (hi >= 0) {
    int lo = hi;
    uint64_t bytes = static_cast<uint64_t>(unit_numel[static_cast<size_t>(lo)]) * esz;
    const int floor = !defer || hi == 0 ? 0 : hi == 1 ? 1 : 2;
    while (lo > floor && bytes < limit)
      bytes += static_cast<uint64_t>(unit_numel[static_cast<size_t>(--lo)]) * esz;
    out.emplace_back(lo, hi);
    hi = lo - 1;
  }
  return out;
}

// ZeRO 0-1 over dp > 1: the data group's sums of the chunk of units
// [first, last] (global indices), in the order the backward finishes them:
// buckets of consecutive units (bucket_units: about bucket_bytes each,
// unit 0 and unit 1 alone where the lookup is deferred), or with bf16
// gradients summed in f32 one unit each (the executor stages one unit in f32
// at a time).
inline std::vector<std::pair<int, int>> grad_buckets(const model::Layout& l, int first, int last,
                                                     const PipelineSetup& s) {
  std::vector<std::pair<int, int>> out;
  if (s.bf16 && !s.reduce_bf16) {
    for (int u = last; u >= first; --u) out.emplace_back(u, u);
    return out;
  }
  out = bucket_units(unit_sizes(l, first, last), s.bf16 ? 2 : 4, s.bucket_bytes, s.defer_lookup && first == 0);
  for (auto& [lo, hi] : out) {
    lo += first;
    hi += first;
  }
  return out;
}

// bf16 or ZeRO 2-3: an accumulator of a unit of n elements. Its f32 gradient (ZeRO 2-3:
// padded to ranks × stride, the blocks a reduce-scatter sends), then, where
// the data group reduce-scatters it (ZeRO 2-3 at dp > 1), its bf16 send
// block (parallel.reduce_dtype bf16) and its receive block of one stride:
// a reduction in flight holds all three.
struct AccLayout {
  int64_t numel = 0;   // the f32 gradient's
  size_t send_at = 0;  // the bytes where the bf16 send block starts
  size_t recv_at = 0;  // and the receive block
  size_t bytes = 0;
};
inline AccLayout acc_layout(int64_t n, const PipelineSetup& s) {
  AccLayout a;
  const bool reduced = s.zero_stage >= 2 && s.dp > 1;
  const int64_t stride = s.zero_stage >= 2 ? ShardLayout::stride_of(n, s.dp, s.shard_align()) : n;
  a.numel = s.zero_stage >= 2 ? stride * s.dp : n;
  a.send_at = a.recv_at = static_cast<size_t>(a.numel) * sizeof(float);
  if (reduced && s.reduce_bf16) a.recv_at += static_cast<size_t>(a.numel) * sizeof(uint16_t);
  a.bytes = a.recv_at + (reduced ? static_cast<size_t>(stride) * (s.reduce_bf16 ? 2 : 4) : 0);
  return a;
}

// ZeRO 2-3's reduce-scatters in flight at once beside the backward
// (parallel.overlap_comm): two hide one unit's sum behind the next unit's
// backward and bound the accumulators held.
inline constexpr int kMaxReductionsInFlight = 2;

// The accumulators of unit 0's kind (0) and of the others' (1): with ZeRO
// 2-3's reductions overlapping the backward (dp > 1, parallel.overlap_comm)
// the others' ring holds kMaxReductionsInFlight in flight and one
// accumulating; otherwise one of each kind.
inline int acc_ring(const PipelineSetup& s, int kind) {
  const bool overlap = s.zero_stage >= 2 && s.dp > 1 && s.overlap_comm;
  return kind == 1 && overlap ? kMaxReductionsInFlight + 1 : 1;
}

// What an AdamW's pages hold beside its moments (PipelineSetup::paged): the
// fp32 master of bf16 stages, and under ZeRO-3 the stored parameter and
// gradient shards.
inline optim::PagedState::Layout paged_fields(const PipelineSetup& s) {
  optim::PagedState::Layout l{.schema = optim::adamw_schema(s.bf16)};
  if (s.zero_stage == 3) l.param_bytes = l.grad_bytes = s.bf16 ? sizeof(uint16_t) : sizeof(float);
  return l;
}

// ZeRO-3 over dp > 1, or paged on one data rank: the stored parameters are
// the shards (the executor's shard_params_).
inline bool stores_shards(const PipelineSetup& s) { return s.zero_stage == 3 && (s.dp > 1 || s.paged); }

// A ZeRO-3 gather's buffer (unit 0's kind or the others', the largest unit
// n of it): ranks × stride as stored, and with paged shards over dp > 1 a
// send block of one stride the shard is copied into (on one rank it is
// copied straight into place).
inline int64_t use_buffer_numel(int64_t n, const PipelineSetup& s) {
  const int zr = s.dp;
  const int64_t stride = ShardLayout::stride_of(n, zr, s.shard_align());
  return stride * zr + (s.paged && zr > 1 ? stride : 0);
}

inline constexpr size_t kRecvWindow = StageMessages::kWindow;  // receives posted ahead of their use
inline constexpr int kPairTag = 32700;     // the tied pair's exchange (StageLink's tags stay below 30720)

// defer_lookup's rows on `rank` (each C floats and a token): the
// embedding's rank keeps its last micro-batch's and gathers every data
// rank's.
inline int64_t lookup_tail_rows(const PipelineSetup& s, int rank, bool gathered) {
  if (!s.defer_lookup || rank != s.schedule.rank_of(0)) return 0;
  const int64_t n = s.micro * s.T;
  return gathered ? n * s.dp : n;
}

// Sequence parallel over tp > 1: the norm elements (Layout::norm_ranges) of
// the units `rank`'s stages hold, staged in f32 for the step's sum over the
// tensor group (PipelineExecutor::sum_norm_rows).
// fn(b, e) for each norm's piece [b, e) of the flat elements [lo, hi), in
// the norms' order: the buffer's layout, for the sum and for its size.
template <typename Fn>
void for_each_norm_piece(const std::vector<std::pair<int64_t, int64_t>>& norms, int64_t lo, int64_t hi, Fn fn) {
  for (const auto& [at, k] : norms) {
    const int64_t b = std::max(at, lo), e = std::min(at + k, hi);
    if (b < e) fn(b, e);
  }
}

inline int64_t norm_sum_numel(const model::TransformerConfig& c, const model::Layout& layout,
                              const PipelineSetup& s, int rank) {
  if (!c.sequence_parallel || s.split.size == 1) return 0;
  const std::vector<std::pair<int64_t, int64_t>> norms = layout.norm_ranges();
  int64_t n = 0;
  for (int stage : s.schedule.stages_of(rank)) {
    const model::UnitRange r = s.stage_units[static_cast<size_t>(stage)];
    const int last = r.last < 0 ? layout.head_unit() : r.last;
    for (int u = r.first; u <= last; ++u)  // unit by unit, as sum_norm_rows lays the buffer out
      for_each_norm_piece(norms, layout.unit_offset(u), layout.unit_offset(u) + layout.unit_numel(u),
                          [&](int64_t b, int64_t e) { n += e - b; });
  }
  return n;
}

}  // namespace executor_detail

struct PipelineExecutor::Chunk {
  int stage = 0;
  int first = 0, last = 0;  // units
  int64_t base = 0, numel = 0;  // flat offset of `first`, elements held
  // Parameters and gradients as stored: fp32, or bf16 (the fp32 master then
  // exists for the ZeRO shard, `master`, unless paged).
  tensor::Storage params, grads, master;
  std::unique_ptr<LookupRows> rows;  // the tied table's lookup rows of the step (holds unit 0, tied)
  // The tied head without unit 0 on this rank: a replica of unit 0 (only its
  // token table is read, updated and summed).
  tensor::Storage rep_params, rep_grads, rep_master;
  void* unit0_params = nullptr;  // where this chunk's head reads unit 0 (as stored)
  void* unit0_grads = nullptr;
  // ZeRO: the units' (the replica's: unit 0's) shards over the data group
  // (one rank below ZeRO-1), AdamW over them, and with several ranks the
  // shard of the reduced gradient the update reads.
  std::unique_ptr<ShardLayout> shard, rep_shard;
  std::unique_ptr<optim::AdamW> adam, rep_adam;
  tensor::Storage grad_shard, rep_grad_shard;
  // With adapters (lora.r > 0): the frozen base of the chunk's units, held
  // once (its quantized tensors too) and read by every slot (share_base);
  // a tied head without the embedding reads the base token table from
  // frozen_unit0 (unit 0's base, a copy of the embedding stage's).
  std::unique_ptr<model::Transformer> frozen;
  tensor::Storage frozen_unit0;
  int sum_chunk = -1;  // ZeRO 0-1 over dp > 1: its index in the BucketSums
  std::vector<std::unique_ptr<model::Transformer>> slots;
  std::vector<int> slot_micro;  // -1: free
  std::map<int, std::vector<model::WeightGradWork>> w_queue;
  std::vector<std::vector<model::WeightGradWork>> free_works;
  size_t work_bytes = 0;  // every WeightGradWork made (the W queue at its peak)
  EarlyPages early, rep_early;  // update_in_backward: per AdamW's state page
  bool holds(int u) const { return u >= first && u <= last; }
  bool replica() const { return rep_adam != nullptr; }
};

struct PipelineExecutor::VocabPart {
  model::vocab::Pieces pieces;
  int k0 = 0, k1 = 0;          // this rank's pieces
  int64_t row0 = 0, rows = 0;  // their rows of the head's table
  float* w = nullptr;          // those rows as read ([rows, C], row0 first)
  float* dw = nullptr;         // their gradient
  tensor::Storage w_copy, dw_own;
  float* table = nullptr;      // the owner's (the head's rank): the whole table and its gradient
  float* table_grad = nullptr;
  // One micro-batch from its S to its T: the final norm's output (a message
  // buffer, or on the head's rank the last stage's slot's), the targets,
  // and per chunk of head_chunk_rows rows the pieces' logits and statistics.
  struct Held {
    int micro = -1;
    const float* x = nullptr;
    bool x_buffer = false;
    std::vector<int32_t> targets;
    tensor::Storage logits;
    std::vector<model::vocab::Stats> stats;
  };
  std::vector<std::unique_ptr<Held>> held;
  tensor::Storage scratch;  // vocab::tree_sum's: tree_height buffers of a chunk of rows
  std::vector<float*> scratch_at(int64_t chunk, int64_t C) {
    std::vector<float*> out;
    for (int h = 0; h < model::vocab::tree_height(pieces.count()); ++h)
      out.push_back(scratch.f32() + h * chunk * C);
    return out;
  }
  Held& take(int micro, int64_t rows_, int64_t chunk, int P) {
    for (auto& h : held)
      if (h->micro < 0) {
        h->micro = micro;
        return *h;
      }
    auto h = std::make_unique<Held>();
    h->targets.resize(static_cast<size_t>(rows_));
    h->logits = tensor::Storage(static_cast<size_t>(rows_ * rows) * sizeof(float));
    for (int64_t r0 = 0; r0 < rows_; r0 += chunk) {
      h->stats.emplace_back();
      h->stats.back().resize(P, std::min(chunk, rows_ - r0));
    }
    h->micro = micro;
    held.push_back(std::move(h));
    return *held.back();
  }
  Held& find(int micro) {
    for (auto& h : held)
      if (h->micro == micro) return *h;
    PO_THROW(core::Internal, "pipeline: the head's T of micro-batch ", micro, " before its S");
  }
};

}  // namespace po::parallel
