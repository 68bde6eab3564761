// PO_NCCL_CHECK and PO_NCCL_CUDA_CHECK: the one place where NCCL result codes
// and CUDA runtime errors of the NCCL backend become exceptions. Unlike
// PO_MPI_CHECK they take a `where` string (the group, the rank in it and the
// CUDA device, e.g. "group 'world' (rank 3 of 8, CUDA device 3)"), because an
// NCCL failure says nothing useful without knowing which communicator saw it.
// A failing call throws core::CommError with the call text, file:line, `where`
// and the library's own error text (for NCCL also ncclGetLastError()).
//
// The CUDA macro is named for this backend, not PO_CUDA_CHECK, so that it
// cannot collide with backend/cuda's macro when both headers meet in one file.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

namespace po::comm::nccl::detail {
[[noreturn]] void throw_nccl_error(ncclResult_t code, const char* call, const std::string& where,
                                   const char* file, int line);
[[noreturn]] void throw_cuda_error(cudaError_t code, const char* call, const std::string& where,
                                   const char* file, int line);
}  // namespace po::comm::nccl::detail

#define PO_NCCL_CHECK(where, call)                                                         \
  do {                                                                                     \
    const ncclResult_t po_nccl_rc_ = (call);                                               \
    if (po_nccl_rc_ != ncclSuccess)                                                        \
      ::po::comm::nccl::detail::throw_nccl_error(po_nccl_rc_, #call, (where), __FILE__, __LINE__); \
  } while (0)

#define PO_NCCL_CUDA_CHECK(where, call)                                                    \
  do {                                                                                     \
    const cudaError_t po_cuda_rc_ = (call);                                                \
    if (po_cuda_rc_ != cudaSuccess)                                                        \
      ::po::comm::nccl::detail::throw_cuda_error(po_cuda_rc_, #call, (where), __FILE__, __LINE__); \
  } while (0)
