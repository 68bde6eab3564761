// The tied table's two gradient parts, declared once for every layout.
//
// A tied token table (GPT-2, TinyStories' Llamas) gets its gradient from two
// places: the LM head's weight gradient H, final at the start of a
// micro-batch's backward, and the embedding lookup's part E, the backward's
// last rows, scattered by token. One rule adds them, whatever the schedule,
// the ZeRO stage or the stage the two sit on:
//
//   H goes along the gradient path like every other gradient (accumulated
//   per micro-batch, reduced over the data group, sharded by ZeRO);
//   E never enters it: each micro-batch's lookup rows (the [B·T, C]
//   gradient at the embedding's output) and their tokens are kept over the
//   step (LookupRows), gathered over the data group at the step in rank
//   order, and added once into the reduced H: for each token, in that order,
//   e = Σ rows (f32, from zero), then wte = H + e (bf16: rounded once).
//
// So pp = 1 and a pipeline whose head and embedding sit on different stages
// add the same numbers in the same order (the embedding's rank adds E into
// the H its head's rank sends and sends the sum back), and no layout holds a
// whole f32 E table: a rank keeps its step's rows (micro-batches × B × T ×
// (C + 1) floats), and for the step its data group's.
#pragma once

#include <cstdint>

#include "comm/communicator.h"
#include "model/config.h"
#include "parallel/shard_layout.h"
#include "tensor/tensor.h"

namespace po::parallel {

class LookupRows {
 public:
  // Rows of C floats; the table's slice on this tensor-parallel rank holds
  // tokens [v0, v0 + nv) (others are skipped when adding).
  LookupRows(int64_t C, int64_t v0, int64_t nv);

  // Holds `rows` rows (and their tokens) a step in one buffer from now on,
  // so that the first step allocates nothing (0: nothing reserved).
  void reserve(int64_t rows);
  // One micro-batch's n rows and their tokens, after those already kept.
  void append(const float* rows, const int32_t* tokens, int64_t n);
  int64_t count() const { return count_; }
  // Every rank of `group`'s rows (each holds the same count), in rank order
  // (null or one rank: this rank's), ordered by token for add_into.
  void gather(comm::Communicator* group);
  // Adds E's elements [lo, hi) of this rank's table slice (row-major
  // [nv, C]) into dst[0, hi - lo), stored as `dtype`: dst = dst + e, each
  // element once (bf16: rounded once). After gather(); any number of calls
  // with disjoint ranges.
  void add_into(void* dst, tensor::DType dtype, int64_t lo, int64_t hi) const;
  // Starts the next step (keeps the buffers).
  void clear() { count_ = 0; }

  // Bytes held: this rank's rows and tokens, the gathered ones and the
  // token order, at the sizes the steps so far needed (after the first
  // step: what every step holds).
  size_t bytes() const;
  // The same from the shapes alone: `rows` rows a step on each of `ranks` ranks.
  static size_t predicted_bytes(int64_t rows, int64_t C, int ranks);

 private:
  int64_t C_, v0_, nv_;
  int64_t count_ = 0;
  tensor::Storage rows_, tokens_;          // this rank's, exactly as large as a step needs
  tensor::Storage all_rows_, all_tokens_;  // the data group's (ranks > 1)
  tensor::Storage order_;                  // int32 indices of the gathered rows, by token then rank order
  const float* rows_at_ = nullptr;         // what gather() left to add: this rank's or the group's
  const int32_t* tokens_at_ = nullptr;
  int64_t n_at_ = 0, held_ = 0;  // rows gathered; of them, in the slice (order_'s length)
};

// The table's part of a ZeRO shard: the table occupies elements [at, at + n)
// of unit `i` of `sl`; of it this rank's shard holds table elements [lo, hi)
// (none when hi == lo), starting at element `first` of the unit's shard.
struct TableShard {
  int64_t lo = 0, hi = 0, first = 0;
};
TableShard table_in_shard(const ShardLayout& sl, int i, int64_t at, int64_t n);

// The deferred embedding's rows (every data rank's last micro-batch, B rows
// of T positions, in rank order) added into the position table `wpe` and,
// when given, an untied token table `wte` (slice [v0, v0 + nv)), as stored:
// fp32 in embedding_backward's order, bf16 row by row (each row's add
// rounded). The embedding's stage adds them so at every pp.
void add_deferred_lookup(void* wte, void* wpe, tensor::DType dtype, const float* rows,
                         const int32_t* tokens, int64_t B, int64_t T, int64_t C, int64_t v0, int64_t nv);

// Whether the embedding's last micro-batch's lookup rows are deferred:
// gathered over the data group at the step and added after the reduction
// (the executor's defer_lookup): ZeRO 0-1 at dp > 1 with overlap_comm and
// cp 1, a table that trains (not a frozen base's, under adapters), and not
// with packed rows' learned positions (each token's position gradient goes
// to its own position, which the deferred rows do not know). The planner
// reads the same rule.
bool defers_lookup(const model::TransformerConfig& config, int dp, bool overlap_comm, int cp, int zero_stage,
                   bool packed_rows);

}  // namespace po::parallel
