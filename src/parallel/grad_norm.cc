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
  PO_CHECK(tensor_group_ == nullptr || !paged(),
           "parallel.tp > 1 with paged optimizer state (memory.*) is not built yet");
  uncounted_.clear();
  if (tensor_group_ != nullptr && tensor_group_->rank() > 0)
    uncounted_ = model_.layout().replicated_ranges();
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

// The uncounted elements inside this rank's shard of unit u.
double DataParallel::uncounted_shard_squares(int u) const {
  double sq = 0;
  const int64_t base = model_.layout().unit_offset(u);
  const int64_t lo = base + layout_.begin(u), hi = base + layout_.end(u);
  for (const auto& [offset, n] : uncounted_) {
    const int64_t a = std::max(lo, offset), b = std::min(hi, offset + n);
    if (a >= b) continue;
    const int64_t local = layout_.local_offset(u) + (a - lo);
    SumOfSquares acc;
    if (bf16())
      acc.add(const_cast<DataParallel*>(this)->grad_bf16() + local, b - a);
    else
      acc.add(const_cast<DataParallel*>(this)->grad_f32() + local, b - a);
    sq += acc.total();
  }
  return sq;
}

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
    } else if (bf16()) {
      SumOfSquares acc;
      acc.add(grad_bf16() + layout_.local_offset(u), layout_.stride(u));
      sq = acc.total();
    } else {
      SumOfSquares acc;
      acc.add(grad_f32() + layout_.local_offset(u), layout_.stride(u));
      sq = acc.total();
    }
    mine += sq - (uncounted_.empty() ? 0.0 : uncounted_shard_squares(u));
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
