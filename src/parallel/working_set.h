// The working buffers of a data-parallel training step, counted from the
// engine's own rules before they exist: UnitBuffers' gather, work and
// accumulator pools replayed along the declared schedule
// (model::Layout::training_steps), DataParallel's gather blocks, the deferred
// embedding's lookup rows, the f32 staging of bf16 buckets and the rings'
// scratch (the data group's and, at tp > 1, the tensor group's). The
// trainer sizes the compute tier's share of pages from it and the planner
// reports it; both read this one count.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "model/config.h"

namespace po::parallel {

struct WorkingSetOptions {
  int ranks = 1;  // parallel.dp
  int64_t align = 1;  // the shard cut's alignment (ShardLayout: quantized state's block size)
  int zero_stage = 0;
  int prefetch = 1;  // parallel.prefetch
  bool bf16 = false, reduce_bf16 = false, overlap = true;
  bool paged = false;  // optimizer state in pages (ZeRO-3: parameter and gradient shards too)
  int64_t micro = 1, seq = 1, accum = 1;  // sequences per micro-batch, tokens each, micro-batches
  uint64_t bucket_bytes = 25u << 20;      // parallel.bucket_size
  int tp = 1;  // parallel.tp: the units are one tensor-parallel rank's
  bool sequence_parallel = false;  // parallel.sequence_parallel (with tp > 1)
  bool context = false;  // parallel.cp > 1 (ranks = dp × cp; no deferred embedding)
};

struct WorkingSet {
  double gathered = 0;      // gathered-unit buffers: gather and work pools, gather_params' blocks
  double accumulators = 0;  // reduce-scatter accumulators
  double lookup_rows = 0;   // the deferred embedding's gathered rows and tokens, a tied table's step rows
  double staged = 0;        // f32 staging of bf16 buckets (transient)
  double ring = 0;          // the rings' scratch, at most
  std::vector<std::pair<int, int>> buckets;  // stage 0-1 all-reduce buckets (first, last unit)
  std::vector<double> bucket_numel;
  bool defer = false;  // the embedding's reduction deferred (DataParallel)
  double buckets_bytes() const { return accumulators + lookup_rows; }
  double total() const { return gathered + accumulators + lookup_rows + staged + ring; }
};

// The ring's scratch for one reduce_scatter (or allreduce) of `payload` bytes over n ranks.
double ring_scratch(bool reduce_scatter, double payload, int n);

WorkingSet working_set(const model::TransformerConfig& config, const WorkingSetOptions& options);

}  // namespace po::parallel
