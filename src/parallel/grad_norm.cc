// The global gradient norm (grad_norm.h): per unit a
// SumOfSquares in double, the ranks' sums all-gathered as doubles and added
// in rank order, so every rank gets the same value.
#include "parallel/grad_norm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"

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

}  // namespace po::parallel
