// The global gradient norm's one order, whatever the layout (data, tensor
// or pipeline parallel): per unit u, the squares of its counted elements in
// element order (a SumOfSquares: f64 lanes by element index); each unit's
// sum over the tensor group in tp rank order; then the units' sums added in
// unit order. A pipeline stage computes its own units' sums, and the
// pipeline group's all-gather puts them back in unit order, so a pipelined
// step clips by the bits of the unpipelined one.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "comm/communicator.h"

namespace po::parallel {

// A sum of squares in double that a range may be fed in pieces.
struct SumOfSquares {
  static constexpr int kLanes = 8;
  double lane[kLanes] = {};
  int64_t pos = 0;
  template <typename T>
  void add(const T* x, int64_t n);
  void skip(int64_t n) { pos += n; }  // n elements that count as zeros
  double total() const;
};

// Adds x[n], the elements at flat offsets [lo, lo + n), counting those in
// `uncounted` (sorted flat [offset, n) ranges) as zeros.
template <typename T>
void add_counted_flat(SumOfSquares& acc, int64_t lo, const T* x, int64_t n,
                      const std::vector<std::pair<int64_t, int64_t>>& uncounted);

// Each unit's sum over `group` (null: nothing to add), in rank order; every
// rank gets the same values.
void sum_units_over(std::vector<double>& unit_squares, comm::Communicator* group);

// The units' sums in unit order.
double sum_in_unit_order(const std::vector<double>& unit_squares);

}  // namespace po::parallel
