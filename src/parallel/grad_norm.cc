// The global gradient norm over the gradient shards (stages 2-3): per unit a
// SumOfSquares in double, the ranks' sums all-gathered as doubles and added
// in rank order, so every rank gets the same value.
#include "parallel/data_parallel.h"

#include <cmath>
#include <vector>

#include "core/bf16.h"

namespace po::parallel {
using tensor::DType;

namespace {
inline double square(float x) { return static_cast<double>(x) * x; }
inline double square(uint16_t b) {
  const double d = core::bf16_to_f32(core::bf16{b});
  return d * d;
}
}  // namespace

// Element i of the range goes to lane i % kLanes: the lanes vectorise, and
// the sum is the same however the range arrives in pieces (paged and unpaged
// shards must agree bit for bit).
template <typename T>
void DataParallel::SumOfSquares::add(const T* x, int64_t n) {
  int64_t i = 0;
  for (; i < n && pos % kLanes != 0; ++i, ++pos) lane[pos % kLanes] += square(x[i]);
  for (; i + kLanes <= n; i += kLanes, pos += kLanes)
    for (int j = 0; j < kLanes; ++j) lane[j] += square(x[i + j]);
  for (; i < n; ++i, ++pos) lane[pos % kLanes] += square(x[i]);
}

double DataParallel::SumOfSquares::total() const {
  double t = 0;
  for (double v : lane) t += v;
  return t;
}

template void DataParallel::SumOfSquares::add<float>(const float*, int64_t);
template void DataParallel::SumOfSquares::add<uint16_t>(const uint16_t*, int64_t);

// The gradient shards' global norm: the per-rank sums of squares all-gathered
// as doubles and added in rank order (the same value on every rank).
double DataParallel::sharded_grad_norm() {
  // Per unit in unit order, each a SumOfSquares (paged shards add up the
  // same sums as their last gradients land).
  double mine = 0;
  for (int u = 0; u < layout_.num_units(); ++u) {
    double sq = 0;
    if (paged_shards_) {
      sq = unit_sq_[static_cast<size_t>(u)].total();
      unit_sq_[static_cast<size_t>(u)] = {};
    } else if (bf16()) {
      SumOfSquares acc;
      acc.add(grad_bf16() + layout_.local_offset(u), layout_.stride(u));
      sq = acc.total();
    } else {
      SumOfSquares acc;
      acc.add(grad_f32() + layout_.local_offset(u), layout_.stride(u));
      sq = acc.total();
    }
    mine += sq;
  }
  if (group_ != nullptr) {
    std::vector<double> all(static_cast<size_t>(layout_.ranks()));
    group_->all_gather(&mine, all.data(), 2, DType::kI32);  // doubles, bit-exact
    mine = 0;
    for (double s : all) mine += s;
  }
  return std::sqrt(mine);
}

}  // namespace po::parallel
