#include "comm/mpi/topology.h"

#include "comm/mpi/check.h"

namespace po::comm::mpi {

int ranks_on_this_node(MPI_Comm comm) {
  MPI_Comm node = MPI_COMM_NULL;
  PO_MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int n = 1;
  const int rc = MPI_Comm_size(node, &n);
  MPI_Comm_free(&node);
  PO_MPI_CHECK(rc);
  return n;
}

}  // namespace po::comm::mpi
