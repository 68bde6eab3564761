// Deterministic samplers: see loader.h.
#include "data/loader.h"

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "core/rng.h"

namespace po::data {
namespace {

// Separates the data stream from other users of the same seed (e.g. init).
constexpr uint64_t kDataStream = 0xDA7A5A3B1E000000ull;

void check_length(const TokenFile& file, int64_t T) {
  PO_CHECK(T >= 1, file.path(), ": sequence length must be >= 1, got ", T);
  PO_CHECK(static_cast<int64_t>(file.size()) >= T + 1, file.path(), ": has ", file.size(),
           " tokens, fewer than seq_len + 1 = ", T + 1, " needed for one sequence");
}

void copy_window(const TokenFile& file, int64_t start, int64_t T, int32_t* inputs, int32_t* targets) {
  const uint16_t* t = file.tokens().data() + start;
  for (int64_t k = 0; k < T; ++k) {
    inputs[k] = t[k];
    targets[k] = t[k + 1];
  }
}

// A window at token `at`, or SFT row `at`.
void fill_sequence(const TokenFile& file, const SftExamples* sft, int64_t at, int64_t T, int32_t* inputs,
                   int32_t* targets, int32_t* positions) {
  if (sft != nullptr) return sft->fill_row(at, inputs, targets, positions);
  copy_window(file, at, T, inputs, targets);
  if (positions != nullptr)
    for (int64_t t = 0; t < T; ++t) positions[t] = static_cast<int32_t>(t);
}

}  // namespace

BatchSampler::BatchSampler(const TokenFile& file, int64_t T, uint64_t seed, const SftExamples* sft)
    : file_(&file), T_(T), seed_(seed), sft_(sft) {
  if (sft != nullptr) {
    PO_CHECK(sft->seq_len() == T, file.path(), ": SFT rows of ", sft->seq_len(), " tokens, sequences of ", T);
    return;
  }
  check_length(file, T);
}

int64_t BatchSampler::offset(int64_t step, int64_t seq) const {
  PO_CHECK(step >= 0 && seq >= 0, "sampler: step and sequence index must be >= 0, got ", step, ", ", seq);
  core::Philox rng(seed_ ^ kDataStream, static_cast<uint64_t>(step));
  const uint64_t starts = sft_ != nullptr ? static_cast<uint64_t>(sft_->rows())
                                          : static_cast<uint64_t>(windows());  // offsets 0 .. N-T-1
  const int64_t u = static_cast<int64_t>(rng.next_u64(static_cast<uint64_t>(seq)) % starts);
  if (spans_.empty()) return u;
  const size_t s = static_cast<size_t>(std::upper_bound(first_window_.begin(), first_window_.end(), u) -
                                       first_window_.begin()) - 1;
  return spans_[s].first + (u - first_window_[s]);
}

void BatchSampler::restrict_to(std::vector<std::pair<int64_t, int64_t>> spans) {
  PO_CHECK(sft_ == nullptr, file_->path(), ": data.split over SFT examples is not built yet");
  spans_.clear();
  first_window_.clear();
  int64_t total = 0;
  for (const auto& [b, e] : spans) {
    PO_CHECK(b >= 0 && e <= static_cast<int64_t>(file_->size()) && b <= e, file_->path(), ": span [", b, ", ", e,
             ") outside its ", file_->size(), " tokens");
    if (e - b - T_ <= 0) continue;  // shorter than one window
    spans_.emplace_back(b, e);
    first_window_.push_back(total);
    total += e - b - T_;
  }
  PO_CHECK(total > 0, file_->path(), ": this data.split share holds no sequence of ", T_ + 1, " tokens");
}

int64_t BatchSampler::windows() const {
  if (spans_.empty()) return static_cast<int64_t>(file_->size()) - T_;
  return first_window_.back() + (spans_.back().second - spans_.back().first - T_);
}

void BatchSampler::fill(int64_t step, int64_t first_seq, int64_t count, int32_t* inputs, int32_t* targets,
                        int32_t* positions) const {
  PO_CHECK(count >= 0, "sampler: count must be >= 0, got ", count);
  for (int64_t i = 0; i < count; ++i)
    fill_sequence(*file_, sft_, offset(step, first_seq + i), T_, inputs + i * T_, targets + i * T_,
                  positions != nullptr ? positions + i * T_ : nullptr);
}

int64_t BatchSampler::counted_targets(int64_t step, int64_t first_seq, int64_t count) const {
  if (sft_ == nullptr) return count * T_;
  std::vector<int32_t> in(static_cast<size_t>(T_)), tg(static_cast<size_t>(T_));
  int64_t n = 0;
  for (int64_t i = 0; i < count; ++i) {
    sft_->fill_row(offset(step, first_seq + i), in.data(), tg.data(), nullptr);
    n += data::counted_targets(tg);
  }
  return n;
}

EvalSampler::EvalSampler(const TokenFile& file, int64_t T, const SftExamples* sft)
    : file_(&file), T_(T), sft_(sft) {
  if (sft != nullptr) {
    PO_CHECK(sft->seq_len() == T, file.path(), ": SFT rows of ", sft->seq_len(), " tokens, sequences of ", T);
    num_sequences_ = sft->rows();
    return;
  }
  check_length(file, T);
  num_sequences_ = (static_cast<int64_t>(file.size()) - 1) / T;
}

void EvalSampler::fill(int64_t first_seq, int64_t count, int32_t* inputs, int32_t* targets,
                       int32_t* positions) const {
  PO_CHECK(first_seq >= 0 && count >= 0, "eval sampler: first_seq and count must be >= 0, got ", first_seq, ", ",
           count);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t window = (first_seq + i) % num_sequences_;
    fill_sequence(*file_, sft_, sft_ != nullptr ? window : window * T_, T_, inputs + i * T_, targets + i * T_,
                  positions != nullptr ? positions + i * T_ : nullptr);
  }
}

}  // namespace po::data
