// One MPI world from processes that no mpirun started (torchrun, a shell loop,
// a test), each with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.
//
// How (OpenMPI 4.1): every process meets the others through the TCP
// rendezvous (comm/rendezvous.h). Rank 0 starts `ompi-server` (openmpi-bin),
// the name service OpenMPI needs for MPI_Comm_connect/accept between
// processes of different jobs, and sends its URI to all; each process puts it
// in OMPI_MCA_pmix_server_uri and calls MPI_Init as a singleton. Rank 0 opens
// an MPI port and sends its name; then the group grows one rank at a time:
// for k = 1 .. N-1 the group so far calls MPI_Comm_accept while rank k calls
// MPI_Comm_connect, and MPI_Intercomm_merge makes them one intracommunicator.
// OpenMPI needs the connects one at a time (concurrent ones on one port hang),
// so rank 0 signals each turn through the rendezvous. MPI_Comm_split with
// key = RANK orders the result; once every rank holds it, ompi-server stops.
//
// MPI_COMM_WORLD stays each process's singleton: use the returned
// communicator, never MPI_COMM_WORLD, for the group. The rendezvous steps
// have `timeout`; the MPI steps (connect, accept, merge) have none, so a
// process that dies in the middle of the join can leave the others waiting.
#pragma once

#include <memory>
#include <string>

#include "comm/env.h"
#include "comm/mpi/communicator.h"

namespace po::comm::mpi {

// The world of the processes described by `env`:
//   - mpirun, srun --mpi=pmix, or no launcher: MpiCommunicator::create_world();
//   - torchrun-style (LaunchSource::kTorchrun) with WORLD_SIZE > 1: the join
//     above, whose communicator has rank() == env.rank.
// `timeout` bounds the rendezvous: the arrival of every rank and each
// exchange. `options` names the world and sets its operations' timeout.
// `fingerprint` must be equal on every rank (e.g. a config hash); ranks that
// differ are an InvalidArgument naming them (checked in the torchrun-style
// join only; under mpirun compare it over the communicator). Must run before
// anything else initializes MPI in this process (core::Internal otherwise).
std::unique_ptr<MpiCommunicator> join_world_from_env(const LaunchEnv& env, Duration timeout,
                                                     const MpiOptions& options = {},
                                                     const std::string& fingerprint = "");

}  // namespace po::comm::mpi
