// Where the ranks of an MPI communicator sit: how many share this node.
#pragma once

#include <mpi.h>

namespace po::comm::mpi {

// Ranks of `comm` on this node (MPI_COMM_TYPE_SHARED), this one included.
// Collective over `comm`.
int ranks_on_this_node(MPI_Comm comm);

}  // namespace po::comm::mpi
