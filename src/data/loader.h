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
//
// SFT data (data/sft.h): the same, over the examples' rows instead of
// windows: training's sequence i of step s is row Philox(seed ^ kDataStream,
// s).next_u64(i) mod R of R rows, evaluation's sequence j is row j mod R;
// targets the mask does not count are ops::kIgnoreTarget, and packed rows
// come with their tokens' positions.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "data/sft.h"
#include "data/token_file.h"

namespace po::data {

class BatchSampler {
 public:
  // Throws InvalidArgument (naming the file) if it has fewer than T+1 tokens or T < 1.
  // `file` (and `sft`, when given: rows of that file's examples) must outlive the sampler.
  BatchSampler(const TokenFile& file, int64_t T, uint64_t seed, const SftExamples* sft = nullptr);

  // Token offset at which sequence `seq` of step `step` starts (SFT: its row).
  int64_t offset(int64_t step, int64_t seq) const;

  // Sequences first_seq .. first_seq+count-1 of `step`:
  // inputs[count * T], targets[count * T], row-major by sequence; positions
  // [count * T] (packed SFT rows) when not null.
  void fill(int64_t step, int64_t first_seq, int64_t count, int32_t* inputs, int32_t* targets,
            int32_t* positions = nullptr) const;
  // Targets the loss counts in sequences first_seq .. first_seq+count-1 of
  // `step` (count · T without SFT data).
  int64_t counted_targets(int64_t step, int64_t first_seq, int64_t count) const;

  int64_t seq_len() const { return T_; }
  const SftExamples* sft() const { return sft_; }

  // data.split (split.h): windows only inside `spans`, token ranges [b, e)
  // of the file: sequence i of step s starts at window u of theirs, in
  // order, u = Philox(seed ^ kDataStream, s).next_u64(i) mod their count (a
  // span holds e − b − T windows). InvalidArgument when they hold none, or
  // with SFT data.
  void restrict_to(std::vector<std::pair<int64_t, int64_t>> spans);
  // Windows the sampler draws from (N − T without spans).
  int64_t windows() const;

 private:
  const TokenFile* file_;
  int64_t T_;
  uint64_t seed_;
  const SftExamples* sft_;
  std::vector<std::pair<int64_t, int64_t>> spans_;  // with their windows
  std::vector<int64_t> first_window_;               // the span's first window's index
};

class EvalSampler {
 public:
  // Throws InvalidArgument (naming the file) if it has fewer than T+1 tokens or T < 1.
  EvalSampler(const TokenFile& file, int64_t T, const SftExamples* sft = nullptr);

  // Number of distinct non-overlapping windows: floor((N - 1) / T).
  int64_t num_sequences() const { return num_sequences_; }

  // Windows first_seq .. first_seq+count-1 (index taken mod num_sequences()):
  // inputs[count * T], targets[count * T] (and positions, as BatchSampler's).
  void fill(int64_t first_seq, int64_t count, int32_t* inputs, int32_t* targets,
            int32_t* positions = nullptr) const;

  int64_t seq_len() const { return T_; }

 private:
  const TokenFile* file_;
  int64_t T_;
  int64_t num_sequences_;
  const SftExamples* sft_;
};

}  // namespace po::data
