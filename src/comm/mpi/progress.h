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
// Needs MPI_THREAD_MULTIPLE, and starts only where every rank of the node has
// a CPU to spare (2 x ranks <= CPUs; see progress.cc for the measurements);
// PO_MPI_PROGRESS=0 in the environment disables it, =1 forces it on.
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
