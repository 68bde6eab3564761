// Deterministic batches from a token file. Shape legend: T sequence length.
//
// Training: sequence i (its global index within the step's batch, over all
// data-parallel ranks and micro-batches) of step s starts at token offset
//   Philox(seed ^ kDataStream, s).next_u64(i) mod (N - T)
// of an N-token file: a pure function of (seed, step, i). Any split of a
// batch across ranks or micro-batches, and a run resumed at any step, sees
// exactly the same sequences. Sequences are sampled with replacement.
//
// Evaluation: sequence j is the j-th non-overlapping window, starting at token
// j*T, wrapping around after the last complete window.
//
// In both, targets are the inputs shifted by one token.
#pragma once

#include <cstdint>

#include "data/token_file.h"

namespace po::data {

class BatchSampler {
 public:
  // Throws InvalidArgument (naming the file) if it has fewer than T+1 tokens or T < 1.
  // `file` must outlive the sampler.
  BatchSampler(const TokenFile& file, int64_t T, uint64_t seed);

  // Token offset at which sequence `seq` of step `step` starts.
  int64_t offset(int64_t step, int64_t seq) const;

  // Sequences first_seq .. first_seq+count-1 of `step`:
  // inputs[count * T], targets[count * T], row-major by sequence.
  void fill(int64_t step, int64_t first_seq, int64_t count, int32_t* inputs, int32_t* targets) const;

  int64_t seq_len() const { return T_; }

 private:
  const TokenFile* file_;
  int64_t T_;
  uint64_t seed_;
};

class EvalSampler {
 public:
  // Throws InvalidArgument (naming the file) if it has fewer than T+1 tokens or T < 1.
  EvalSampler(const TokenFile& file, int64_t T);

  // Number of distinct non-overlapping windows: floor((N - 1) / T).
  int64_t num_sequences() const { return num_sequences_; }

  // Windows first_seq .. first_seq+count-1 (index taken mod num_sequences()):
  // inputs[count * T], targets[count * T].
  void fill(int64_t first_seq, int64_t count, int32_t* inputs, int32_t* targets) const;

  int64_t seq_len() const { return T_; }

 private:
  const TokenFile* file_;
  int64_t T_;
  int64_t num_sequences_;
};

}  // namespace po::data
