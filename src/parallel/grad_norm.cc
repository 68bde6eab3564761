// The global gradient norm over the gradient shards (stages 2-3): per unit a
// SumOfSquares in double, the ranks' sums all-gathered as doubles and added
// in rank order, so every rank gets the same value.
#include "parallel/data_parallel.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "optim/adamw.h"

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

void DataParallel::set_tensor_group(comm::Communicator* group) {
  tensor_group_ = group != nullptr && group->size() > 1 ? group : nullptr;
  uncounted_.clear();
  if (tensor_group_ != nullptr && tensor_group_->rank() > 0)
    uncounted_ = model_.layout().replicated_ranges();
  std::sort(uncounted_.begin(), uncounted_.end());
}

template <typename T>
double DataParallel::uncounted_squares(const T* grads) const {
  double sq = 0;
  for (const auto& [offset, n] : uncounted_) {
    SumOfSquares acc;
    acc.add(grads + offset, n);
    sq += acc.total();
  }
  return sq;
}

template <typename T>
void DataParallel::add_counted(SumOfSquares& acc, int u, int64_t first, const T* x,
                               int64_t n) const {
  const int64_t lo = model_.layout().unit_offset(u) + layout_.begin(u) + first;  // flat offset
  int64_t i = 0;  // x[0, i) is in
  for (const auto& [offset, len] : uncounted_) {
    const int64_t a = std::max(lo + i, offset), b = std::min(lo + n, offset + len);
    if (a >= b) continue;
    acc.add(x + i, a - lo - i);
    acc.skip(b - a);
    i = b - lo;
  }
  acc.add(x + i, n - i);
}

template void DataParallel::add_counted<float>(SumOfSquares&, int, int64_t, const float*,
                                               int64_t) const;
template void DataParallel::add_counted<uint16_t>(SumOfSquares&, int, int64_t, const uint16_t*,
                                                  int64_t) const;

// The tensor group's sum of each rank's counted squares: all-gathered as
// doubles and added in rank order, so every rank gets the same value.
double DataParallel::tensor_total(double squares) {
  if (tensor_group_ == nullptr) return squares;
  std::vector<double> all(static_cast<size_t>(tensor_group_->size()));
  tensor_group_->all_gather(&squares, all.data(), 2, DType::kI32);  // doubles, bit-exact
  double t = 0;
  for (double s : all) t += s;
  return t;
}

// The norm of the whole reduced f32 gradient (stages 0-1).
double DataParallel::full_grad_norm_f32(const float* grads) {
  const double sq = optim::AdamW::sum_squares(grads, model_.num_params());
  if (tensor_group_ == nullptr) return std::sqrt(sq);
  return std::sqrt(tensor_total(sq - uncounted_squares(grads)));
}

template double DataParallel::uncounted_squares<float>(const float*) const;
template double DataParallel::uncounted_squares<uint16_t>(const uint16_t*) const;

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
    } else {
      SumOfSquares acc;
      if (bf16())
        add_counted(acc, u, 0, grad_bf16() + layout_.local_offset(u), layout_.stride(u));
      else
        add_counted(acc, u, 0, grad_f32() + layout_.local_offset(u), layout_.stride(u));
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
  return std::sqrt(tensor_total(mine));
}

}  // namespace po::parallel
