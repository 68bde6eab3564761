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

int tag_upper_bound(MPI_Comm comm) {
  void* attr = nullptr;
  int flag = 0;
  PO_MPI_CHECK(MPI_Comm_get_attr(comm, MPI_TAG_UB, &attr, &flag));
  return flag ? *static_cast<int*>(attr) : 32767;
}

}  // namespace po::comm::mpi
