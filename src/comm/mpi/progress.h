// A background progress thread for the MPI backend: communication advances
// while the caller computes, not only when it polls.
//
// Neither OpenMPI's non-blocking collectives (libnbc) nor our ring operations
// (ring.h) move data unless some thread calls into MPI: without help, a
// gradient bucket issued in the middle of the backward advances one step per
// poll at the next unit boundary and most of it happens in the final wait.
// While any operation is in flight this thread calls ring::progress_all() and
// MPI_Iprobe (which runs OpenMPI's progress engine) every `interval`, and
// sleeps on a condition variable otherwise, so an idle run costs nothing.
// Needs MPI_THREAD_MULTIPLE, and is not started when the node runs more ranks
// than it has CPUs (measured: the collective tests at 8 ranks on 2 cores took
// 80 s with it, 56 s without); PO_MPI_PROGRESS=0 in the environment disables
// it (for measurements).
#pragma once

#include <mpi.h>

#include <chrono>

namespace po::comm::mpi::progress {

// Starts the thread once (idempotent); `world` is duplicated for its probes.
// Collective over `world` on first call.
void start(MPI_Comm world);
// Stops and joins it (before MPI_Finalize); idempotent.
void stop();
// An operation was issued / finished: the thread runs while the count is > 0.
void op_started();
void op_finished();
// Whether the thread is running (tests, logs).
bool running();

}  // namespace po::comm::mpi::progress
