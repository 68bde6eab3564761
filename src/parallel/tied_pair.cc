// LookupRows (tied_pair.h).
#include "parallel/tied_pair.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "backend/device.h"
#include "backend/ops.h"
#include "core/error.h"

namespace po::parallel {
namespace ops = po::backend::cpu;
using tensor::DType;

namespace {

// Grows `s` to exactly `bytes` (keeping its first `keep` bytes) when smaller.
void grow(tensor::Storage& s, size_t bytes, size_t keep) {
  if (s.size() >= bytes) return;
  tensor::Storage bigger(bytes);
  if (keep > 0) backend::device_copy(bigger.data(), s.data(), keep);
  s = std::move(bigger);
}

}  // namespace

LookupRows::LookupRows(int64_t C, int64_t v0, int64_t nv) : C_(C), v0_(v0), nv_(nv) {}

void LookupRows::reserve(int64_t rows) {
  grow(rows_, static_cast<size_t>(rows * C_) * sizeof(float), static_cast<size_t>(count_ * C_) * sizeof(float));
  grow(tokens_, static_cast<size_t>(rows) * sizeof(int32_t), static_cast<size_t>(count_) * sizeof(int32_t));
}

void LookupRows::append(const float* rows, const int32_t* tokens, int64_t n) {
  const auto row_bytes = static_cast<size_t>(C_) * sizeof(float);
  const auto have = static_cast<size_t>(count_);
  grow(rows_, (have + static_cast<size_t>(n)) * row_bytes, have * row_bytes);
  grow(tokens_, (have + static_cast<size_t>(n)) * sizeof(int32_t), have * sizeof(int32_t));
  backend::device_copy(rows_.f32() + count_ * C_, rows, static_cast<size_t>(n) * row_bytes);
  backend::from_host(static_cast<int32_t*>(tokens_.data()) + count_, tokens, static_cast<size_t>(n) * sizeof(int32_t));
  count_ += n;
}

void LookupRows::gather(comm::Communicator* group) {
  const int ranks = group != nullptr ? group->size() : 1;
  n_at_ = count_ * ranks;
  rows_at_ = rows_.f32();
  tokens_at_ = static_cast<const int32_t*>(tokens_.data());
  if (ranks > 1) {
    grow(all_rows_, static_cast<size_t>(n_at_ * C_) * sizeof(float), 0);
    grow(all_tokens_, static_cast<size_t>(n_at_) * sizeof(int32_t), 0);
    group->all_gather(tokens_.data(), all_tokens_.data(), static_cast<size_t>(count_), DType::kI32);
    group->all_gather(rows_.data(), all_rows_.data(), static_cast<size_t>(count_ * C_), DType::kF32);
    rows_at_ = all_rows_.f32();
    tokens_at_ = static_cast<const int32_t*>(all_tokens_.data());
  }
  // The rows of this slice's tokens, by token; a token's rows stay in rank
  // and micro-batch order (a stable sort).
  grow(order_, static_cast<size_t>(n_at_) * sizeof(int32_t), 0);
  auto* order = static_cast<int32_t*>(order_.data());
  held_ = 0;
  for (int64_t r = 0; r < n_at_; ++r) {
    const int64_t t = static_cast<int64_t>(tokens_at_[r]) - v0_;
    if (t >= 0 && t < nv_) order[held_++] = static_cast<int32_t>(r);
  }
  const int32_t* tok = tokens_at_;
  std::stable_sort(order, order + held_, [tok](int32_t a, int32_t b) { return tok[a] < tok[b]; });
}

void LookupRows::add_into(void* dst, DType dtype, int64_t lo, int64_t hi) const {
  if (hi <= lo || held_ == 0) return;
  const auto* order = static_cast<const int32_t*>(order_.data());
  const int32_t* tok = tokens_at_;
  // The runs of equal tokens whose table row meets [lo, hi).
  std::vector<std::pair<int64_t, int64_t>> runs;  // [first, end) in order
  const int32_t t_lo = static_cast<int32_t>(v0_ + lo / C_), t_hi = static_cast<int32_t>(v0_ + (hi - 1) / C_);
  int64_t i = std::lower_bound(order, order + held_, t_lo, [tok](int32_t r, int32_t t) { return tok[r] < t; }) - order;
  while (i < held_ && tok[order[i]] <= t_hi) {
    int64_t j = i + 1;
    while (j < held_ && tok[order[j]] == tok[order[i]]) ++j;
    runs.emplace_back(i, j);
    i = j;
  }
  const int64_t C = C_;
#pragma omp parallel
  {
    std::vector<float> e(static_cast<size_t>(C));
#pragma omp for schedule(static)
    for (size_t k = 0; k < runs.size(); ++k) {
      const auto [first, end] = runs[k];
      const int64_t row = static_cast<int64_t>(tok[order[first]]) - v0_;
      const int64_t c0 = std::max<int64_t>(lo - row * C, 0), c1 = std::min<int64_t>(hi - row * C, C);
      std::fill(e.begin() + c0, e.begin() + c1, 0.0f);
      for (int64_t q = first; q < end; ++q) {
        const float* g = rows_at_ + static_cast<int64_t>(order[q]) * C;
        for (int64_t c = c0; c < c1; ++c) e[static_cast<size_t>(c)] += g[c];
      }
      const int64_t at = row * C + c0 - lo;  // in dst
      if (dtype == DType::kBF16) {
        ops::bf16_add_f32(static_cast<uint16_t*>(dst) + at, e.data() + c0, c1 - c0);
      } else {
        float* d = static_cast<float*>(dst) + at;
        for (int64_t c = 0; c < c1 - c0; ++c) d[c] = d[c] + e[static_cast<size_t>(c0 + c)];
      }
    }
  }
}

void add_deferred_lookup(void* wte, void* wpe, DType dtype, const float* rows, const int32_t* tokens,
                         int64_t B, int64_t T, int64_t C, int64_t v0, int64_t nv) {
  if (dtype == DType::kF32)
    return ops::embedding_backward_slice(static_cast<float*>(wte), static_cast<float*>(wpe), rows, tokens, B,
                                         T, C, v0, wte != nullptr ? nv : 0);
  auto* te = static_cast<uint16_t*>(wte);
  auto* pe = static_cast<uint16_t*>(wpe);
  for (int64_t r = 0; r < B * T; ++r) {
    const float* g = rows + r * C;
    const int64_t row = static_cast<int64_t>(tokens[r]) - v0;  // this tp rank's slice only
    if (te != nullptr && row >= 0 && row < nv) ops::bf16_add_f32(te + row * C, g, C);
    if (pe != nullptr) ops::bf16_add_f32(pe + (r % T) * C, g, C);
  }
}

TableShard table_in_shard(const ShardLayout& sl, int i, int64_t at, int64_t n) {
  const int64_t a = std::max(at, sl.begin(i)), b = std::min(at + n, sl.end(i));
  return {a - at, std::max(a, b) - at, a - sl.begin(i)};
}

size_t LookupRows::bytes() const {
  return rows_.size() + tokens_.size() + all_rows_.size() + all_tokens_.size() + order_.size();
}

size_t LookupRows::predicted_bytes(int64_t rows, int64_t C, int ranks) {
  const auto n = static_cast<size_t>(rows);
  size_t b = n * static_cast<size_t>(C + 1) * sizeof(float);  // this rank's rows and tokens
  if (ranks > 1) b += n * static_cast<size_t>(ranks) * static_cast<size_t>(C + 1) * sizeof(float);
  return b + n * static_cast<size_t>(ranks) * sizeof(int32_t);  // the order
}

bool defers_lookup(const model::TransformerConfig& config, int dp, bool overlap_comm, int cp, int zero_stage,
                   bool packed_rows) {
  return dp > 1 && overlap_comm && cp == 1 && zero_stage < 2 && !config.lora.on() &&
         !(packed_rows && config.positions == model::Positions::kLearned);
}

}  // namespace po::parallel
