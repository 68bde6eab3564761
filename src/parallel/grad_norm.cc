// The global gradient norm (grad_norm.h): per unit a
// SumOfSquares in double, the ranks' sums all-gathered as doubles and added
// in rank order, so every rank gets the same value.
#include "parallel/data_parallel.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "optim/adamw.h"
#include "parallel/grad_norm.h"

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
void SumOfSquares::add(const T* x, int64_t n) {
  int64_t i = 0;
  for (; i < n && pos % kLanes != 0; ++i, ++pos) lane[pos % kLanes] += square(x[i]);
  for (; i + kLanes <= n; i += kLanes, pos += kLanes)
    for (int j = 0; j < kLanes; ++j) lane[j] += square(x[i + j]);
  for (; i < n; ++i, ++pos) lane[pos % kLanes] += square(x[i]);
}

double SumOfSquares::total() const {
  double t = 0;
  for (double v : lane) t += v;
  return t;
}

template void SumOfSquares::add<float>(const float*, int64_t);
template void SumOfSquares::add<uint16_t>(const uint16_t*, int64_t);

template <typename T>
void add_counted_flat(SumOfSquares& acc, int64_t lo, const T* x, int64_t n,
                      const std::vector<std::pair<int64_t, int64_t>>& uncounted) {
  int64_t i = 0;  // x[0, i) is in
  for (const auto& [offset, len] : uncounted) {
    const int64_t a = std::max(lo + i, offset), b = std::min(lo + n, offset + len);
    if (a >= b) continue;
    acc.add(x + i, a - lo - i);
    acc.skip(b - a);
    i = b - lo;
  }
  acc.add(x + i, n - i);
}

template void add_counted_flat<float>(SumOfSquares&, int64_t, const float*, int64_t,
                                      const std::vector<std::pair<int64_t, int64_t>>&);
template void add_counted_flat<uint16_t>(SumOfSquares&, int64_t, const uint16_t*, int64_t,
                                         const std::vector<std::pair<int64_t, int64_t>>&);

void sum_units_over(std::vector<double>& unit_squares, comm::Communicator* group) {
  if (group == nullptr || group->size() == 1) return;
  const size_t n = unit_squares.size();
  std::vector<double> all(n * static_cast<size_t>(group->size()));
  group->all_gather(unit_squares.data(), all.data(), 2 * n, DType::kI32);  // doubles, bit-exact
  for (size_t u = 0; u < n; ++u) {
    double t = 0;
    for (int r = 0; r < group->size(); ++r) t += all[static_cast<size_t>(r) * n + u];
    unit_squares[u] = t;
  }
}

double sum_in_unit_order(const std::vector<double>& unit_squares) {
  double t = 0;
  for (double s : unit_squares) t += s;
  return t;
}

void DataParallel::set_tensor_group(comm::Communicator* group) {
  tensor_group_ = group != nullptr && group->size() > 1 ? group : nullptr;
  uncounted_.clear();
  if (tensor_group_ != nullptr && tensor_group_->rank() > 0)
    uncounted_ = model_.layout().replicated_ranges();
  std::sort(uncounted_.begin(), uncounted_.end());
}

template <typename T>
void DataParallel::add_counted(SumOfSquares& acc, int u, int64_t first, const T* x,
                               int64_t n) const {
  const int64_t lo = model_.layout().unit_offset(u) + layout_.begin(u) + first;  // flat offset
  add_counted_flat(acc, lo, x, n, uncounted_);
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

// The whole reduced gradient's per-unit sums (stages 0-1), over the tensor group.
template <typename T>
std::vector<double> DataParallel::unit_squares(const T* grads) {
  const int units = model_.num_units();
  std::vector<double> sq(static_cast<size_t>(units), 0.0);
  for (int u = 0; u < units; ++u) {
    if (!model_.holds_unit(u)) continue;
    SumOfSquares acc;
    add_counted_flat(acc, model_.layout().unit_offset(u), grads + model_.unit_offset(u),
                     model_.unit_numel(u), uncounted_);
    sq[static_cast<size_t>(u)] = acc.total();
  }
  sum_units_over(sq, tensor_group_);
  return sq;
}

template std::vector<double> DataParallel::unit_squares<float>(const float*);
template std::vector<double> DataParallel::unit_squares<uint16_t>(const uint16_t*);

template <typename T>
double DataParallel::full_grad_norm(const T* grads) {
  return std::sqrt(sum_in_unit_order(unit_squares(grads)));
}

template double DataParallel::full_grad_norm<float>(const float*);
template double DataParallel::full_grad_norm<uint16_t>(const uint16_t*);

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
