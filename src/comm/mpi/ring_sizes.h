// The ring collectives' sizes (comm/mpi/ring.h), without MPI: what the
// planner needs to predict the ring's scratch.
#pragma once

#include <cstddef>

namespace po::comm::mpi::ring {

// Messages of at least this many bytes in total (f32, or 16-bit as sent) take
// the ring; smaller ones stay with OpenMPI, whose tree algorithms have less
// latency.
inline constexpr size_t kMinBytes = size_t{1} << 20;
// Receive segment (bytes) and number of segments in flight per reducing step.
inline constexpr size_t kSegmentBytes = size_t{1} << 20;
inline constexpr int kSlots = 4;

}  // namespace po::comm::mpi::ring
