// Facts about an MPI communicator: how many of its ranks share this node,
// which tags it accepts.
#pragma once

#include <mpi.h>

namespace po::comm::mpi {

// Ranks of `comm` on this node (MPI_COMM_TYPE_SHARED), this one included.
// Collective over `comm`.
int ranks_on_this_node(MPI_Comm comm);

// The largest tag `comm` accepts (MPI_TAG_UB; at least 32767 by the standard).
int tag_upper_bound(MPI_Comm comm);

}  // namespace po::comm::mpi
