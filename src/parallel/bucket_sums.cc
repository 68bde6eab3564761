// ZeRO 0-1's bucketed gradient sums over the data group (bucket_sums.h).
#include "parallel/bucket_sums.h"

#include <utility>

#include "backend/ops.h"
#include "core/error.h"
#include "core/timer.h"

namespace po::parallel {
namespace ops = po::backend::cpu;
using tensor::DType;

BucketSums::BucketSums(Config config) : config_(config) {
  PO_ASSERT(config_.data != nullptr, "bucket sums without a data group");
  if (config_.bf16 && !config_.reduce_bf16 && config_.staging_numel > 0)
    staging_ = tensor::Storage(static_cast<size_t>(config_.staging_numel) * sizeof(float));
}

BucketSums::~BucketSums() {
  if (!sums_.empty()) (void)new tensor::Storage(std::move(staging_));
}

int BucketSums::add_chunk(void* grads, int first, std::vector<Bucket> buckets,
                          const std::function<int64_t(int)>& offset) {
  Chunk c;
  c.grads = static_cast<char*>(grads);
  c.first = first;
  int last = first;
  for (const Bucket& b : buckets) last = std::max(last, b.hi);
  c.bucket_of.assign(static_cast<size_t>(last - first + 1), 0);
  for (size_t b = 0; b < buckets.size(); ++b) {
    c.at.push_back(offset(buckets[b].lo) - offset(first));
    c.numel.push_back(offset(buckets[b].hi + 1) - offset(buckets[b].lo));
    for (int u = buckets[b].lo; u <= buckets[b].hi; ++u) c.bucket_of[static_cast<size_t>(u - first)] = static_cast<int>(b);
  }
  c.buckets = std::move(buckets);
  chunks_.push_back(std::move(c));
  reset();
  return static_cast<int>(chunks_.size()) - 1;
}

// A step's start: no bucket started, no unit finished.
void BucketSums::reset() {
  for (Chunk& c : chunks_) {
    c.started.assign(c.buckets.size(), 0);
    c.finished.assign(c.bucket_of.size(), 0);
    c.unfinished.clear();
    for (const Bucket& b : c.buckets) c.unfinished.push_back(b.hi - b.lo + 1);
  }
}

void BucketSums::unit_finished(int chunk, int u) {
  Chunk& c = chunks_[static_cast<size_t>(chunk)];
  if (u < c.first || u >= c.first + static_cast<int>(c.bucket_of.size())) return;
  for (Sum& s : sums_) s.work.test();  // (progress for the ones in flight)
  const auto i = static_cast<size_t>(u - c.first);
  if (++c.finished[i] != config_.micro_batches) return;
  const auto b = static_cast<size_t>(c.bucket_of[i]);
  if (--c.unfinished[b] > 0 || !config_.overlap || c.buckets[b].at_step) return;
  start_bucket(chunk, b);
  ++started_;
}

void BucketSums::start_bucket(int chunk, size_t b) {
  Chunk& c = chunks_[static_cast<size_t>(chunk)];
  const size_t esz = config_.bf16 ? sizeof(uint16_t) : sizeof(float);
  c.started[b] = 1;
  start(c.grads + static_cast<size_t>(c.at[b]) * esz, c.numel[b]);
  sums_.back().chunk = chunk;
  sums_.back().lo = c.buckets[b].lo;
  sums_.back().hi = c.buckets[b].hi;
}

void BucketSums::start(void* grads, int64_t n) {
  Sum s;
  comm::Communicator& data = *config_.data;
  if (!config_.bf16) {
    s.work = data.iallreduce(grads, static_cast<size_t>(n), DType::kF32, comm::ReduceOp::kSum);
  } else if (config_.reduce_bf16) {
    s.work = data.iallreduce(grads, static_cast<size_t>(n), DType::kBF16, comm::ReduceOp::kSum);
  } else {  // the previous staged sum first
    PO_ASSERT(n <= config_.staging_numel, "bucket sums: ", n, " bf16 values staged in ", config_.staging_numel);
    narrow_staged();
    ops::bf16_to_f32(staging_.f32(), static_cast<const uint16_t*>(grads), n);
    s.work = data.iallreduce(staging_.f32(), static_cast<size_t>(n), DType::kF32, comm::ReduceOp::kSum);
    s.narrow_into = static_cast<uint16_t*>(grads);
    s.n = n;
  }
  sums_.push_back(std::move(s));
}

// The sum in the staging buffer (if any), waited and rounded back into its place.
void BucketSums::narrow_staged() {
  for (Sum& s : sums_) {
    if (s.narrow_into == nullptr) continue;
    s.work.wait();
    ops::f32_to_bf16(s.narrow_into, staging_.f32(), s.n);
    s.narrow_into = nullptr;
  }
}

void BucketSums::landed(const std::function<void(int, int, int)>& f) {
  for (Sum& s : sums_) {
    if (s.chunk < 0 || s.narrow_into != nullptr || !s.work.test()) continue;
    const int chunk = std::exchange(s.chunk, -1);
    f(chunk, s.lo, s.hi);
  }
}

void BucketSums::finish(const std::vector<std::pair<void*, int64_t>>& extra) {
  core::Timer wait;
  overlapped_ = std::exchange(started_, 0);
  all_ = 0;
  for (size_t c = 0; c < chunks_.size(); ++c) {
    all_ += static_cast<int>(chunks_[c].buckets.size());
    for (size_t b = 0; b < chunks_[c].buckets.size(); ++b)
      if (!chunks_[c].started[b]) start_bucket(static_cast<int>(c), b);
  }
  for (const auto& [grads, n] : extra) start(grads, n);
  narrow_staged();
  for (Sum& s : sums_) s.work.wait();
  sums_.clear();
  wait_s_ = wait.seconds();
  reset();
}

}  // namespace po::parallel
