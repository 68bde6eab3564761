// PO_MPI_CHECK: the one place MPI error codes become exceptions. Our
// communicators use MPI_ERRORS_RETURN, so a failing call returns a code that
// this macro turns into core::CommError with the call text, file:line, the
// MPI_COMM_WORLD rank and MPI's own error string.
#pragma once

#include <mpi.h>

namespace po::comm::mpi::detail {
[[noreturn]] void throw_mpi_error(int code, const char* call, const char* file, int line);
}  // namespace po::comm::mpi::detail

#define PO_MPI_CHECK(call)                                                          \
  do {                                                                              \
    const int po_mpi_rc_ = (call);                                                  \
    if (po_mpi_rc_ != MPI_SUCCESS)                                                  \
      ::po::comm::mpi::detail::throw_mpi_error(po_mpi_rc_, #call, __FILE__, __LINE__); \
  } while (0)
