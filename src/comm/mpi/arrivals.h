// Who did not arrive: the diagnosis behind a collective timeout.
//
// A collective that times out is only half an answer; the user needs to know
// which ranks never entered it. MPI cannot say (a pending collective is opaque),
// so every rank keeps, per group, the sequence number of the last collective it
// issued there, and answers questions about it on a private control channel (a
// duplicate of the world communicator) while it waits in any operation. On a
// timeout the waiting rank asks each member of the group for its count and
// waits a short grace period for answers:
//   - a member whose count reached ours arrived (it waits with us);
//   - a member whose count is lower is behind (it is named, with the last
//     operation it did issue on the group);
//   - a member that does not answer is stopped, dead, or busy outside
//     communication (a hang in compute looks the same from outside).
// Answers cost one MPI_Iprobe every 64 polls of a waiting operation; nothing
// is sent unless a timeout happens. Point-to-point operations are not counted
// (their peers are named by the operation itself).
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace po::comm::mpi::arrivals {

// Opens the control channel over `world` (idempotent; the first call wins).
// Collective over `world`. Must run before any Group is made.
void start(MPI_Comm world);
// Frees the control channel (before MPI_Finalize); later calls are no-ops.
void stop();

// Answers pending questions from other ranks; cheap when there are none.
void service();

class Group {
 public:
  // `comm` is the group's communicator, `name` its name (the same on every
  // member: it identifies the group on the control channel).
  Group(MPI_Comm comm, std::string name);
  // Records that this rank issues the group's next collective, `what`.
  // Returns its sequence number (1, 2, ...).
  uint64_t issue(const std::string& what);
  // Text naming the members that did not arrive at collective `seq`, asking
  // them and waiting at most `grace` for answers. Empty when everyone arrived
  // or the control channel is closed.
  std::string diagnose(uint64_t seq, std::chrono::milliseconds grace) const;

 private:
  uint64_t id_ = 0;             // hash of the name
  std::string name_;
  int rank_ = 0;                // this rank in the group
  std::vector<int> control_;    // group rank -> rank on the control channel
};

}  // namespace po::comm::mpi::arrivals
