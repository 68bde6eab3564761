// The ring collectives' sizes (comm/mpi/ring.h), without MPI: what the
// planner needs to predict the ring's scratch.
#pragma once

#include <algorithm>
#include <cstddef>

namespace po::comm::mpi::ring {

// Messages of at least this many bytes in total (f32, or 16-bit as sent) take
// the ring; smaller ones stay with OpenMPI, whose tree algorithms have less
// latency.
inline constexpr size_t kMinBytes = size_t{1} << 20;
// Receive segment (bytes) and number of segments in flight per reducing step.
inline constexpr size_t kSegmentBytes = size_t{1} << 20;
inline constexpr int kSlots = 4;

// The scratch one ring all-reduce (reduce-scatter: `reduce_scatter`) of
// `payload` bytes over `n` ranks holds while in flight: its receive
// segments, and a reduce-scatter's partial sums, one block each; 0 for a
// collective too small to take the ring.
inline double scratch_bytes(bool reduce_scatter, double payload, int n) {
  if (n <= 1 || payload < static_cast<double>(kMinBytes)) return 0;
  double b = kSlots * static_cast<double>(kSegmentBytes);
  if (reduce_scatter) b += std::min(n - 2, 2) * payload / n;
  return b;
}

}  // namespace po::comm::mpi::ring
