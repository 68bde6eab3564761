// NCCL backend of the Communicator interface: collectives between GPUs, one
// CUDA device per rank. Built only where CMake finds the CUDA toolkit and NCCL
// (cmake/nccl.cmake; targets that link po_comm_nccl see PO_HAVE_NCCL=1).
//
// Creation: NcclCommunicator::create(bootstrap, device) is collective over a
// host-memory bootstrap group (normally the MPI world). Every rank first checks
// its CUDA device; the ranks agree (a max-allreduce of a failure flag on the
// bootstrap) so that a rank without a usable device makes every rank throw
// core::CommError instead of leaving the others blocked in NCCL init. Rank 0
// then makes the ncclUniqueId, the bootstrap broadcasts it, and every rank
// calls ncclCommInitRank with its bootstrap rank. The caller picks `device`
// (normally the local rank); create() restores the caller's current device.
// Init and split() (ncclCommSplit) are blocking and have no timeout, like
// MPI_Comm_split.
//
// Buffers are device memory on `device`. Every operation is enqueued on the
// communicator's own non-blocking CUDA stream (stream()), in call order, and
// returns a Work whose poll() is cudaEventQuery on an event recorded after the
// operation, also checking ncclCommGetAsyncError so that a failed peer turns
// into core::CommError instead of a silent hang. Inputs must be ready before
// the call: the caller synchronizes the stream that produced them, or makes
// stream() wait on an event of that stream (cudaStreamWaitEvent). Outputs are
// ready for every stream once the Work has completed.
//
// 16-bit sums and averages (bf16, f16) keep the interface's contract on the
// GPU: a kernel widens each rank's input into an f32 scratch buffer, NCCL sums
// f32, and a kernel rounds back once (dividing by size() first for avg; f32 avg
// is likewise an NCCL sum then an f32 divide, not ncclAvg, which pre-scales
// each input and so rounds differently). NCCL's own 16-bit sum would round
// every partial sum to 16 bits. 16-bit max runs natively in 16 bits: max is
// exact, so the result is the same with half the traffic. Scratch comes from a
// per-communicator CUDA memory pool, allocated and freed in stream order
// (cudaMallocFromPoolAsync / cudaFreeAsync) and never returned to the driver,
// so the steady state makes no cudaMalloc; the pool keeps its peak (up to
// 2 x the 16-bit buffer plus one block, in f32) outside the memory budgets.
//
// Point to point: NCCL has no tags and matches a pair's sends and receives in
// call order, and an unmatched ncclSend blocks the stream. So isend/irecv are
// batched: they are launched together in one ncclGroupStart/End when one of
// their Works is first tested or waited on, or when the next other operation
// is issued. An exchange written as isend + irecv + wait (as with MPI) then
// works; tags must be >= 0 and are not used for matching. barrier() is an
// allreduce of one float; all_to_all is one group of sends and receives.
//
// Failures: NCCL and CUDA errors become core::CommError naming the call, the
// group, the rank and the device (PO_NCCL_CHECK, comm/nccl/check.h). A wait
// that times out throws core::Timeout (Work::wait); the communicator is then
// unusable and abort() (ncclCommAbort) frees it without waiting for peers;
// pending and later operations throw core::CommError. The destructor calls
// ncclCommDestroy when the communicator is healthy and idle, and
// ncclCommAbort otherwise (pending work, an asynchronous error, or stack
// unwinding), so that a destructor never blocks on peers that may be gone.
//
// Thread safety: one thread at a time per communicator, abort() included.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <memory>
#include <string>

#include "comm/communicator.h"

namespace po::comm::nccl {

struct NcclOptions {
  std::string name;                             // empty: the bootstrap group's name
  Duration timeout = std::chrono::minutes(10);  // parallel.timeout default
};

namespace detail {
struct NcclState;
}  // namespace detail

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `bootstrap` (see the file comment); rank and size are the
  // bootstrap's. Throws core::CommError when `device` is not a usable CUDA
  // device on some rank, or when NCCL fails.
  static std::unique_ptr<NcclCommunicator> create(Communicator& bootstrap, int device,
                                                  const NcclOptions& options = {});
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override;
  int size() const override;
  const std::string& name() const override;
  Duration timeout() const override { return timeout_; }
  // The CUDA device of every buffer, and the stream every operation runs on.
  int device() const;
  cudaStream_t stream() const;
  // The underlying NCCL communicator (nullptr after abort()).
  ncclComm_t handle() const;

  // Aborts the NCCL communicator (ncclCommAbort): in-flight operations end,
  // pending Works and later calls throw core::CommError. Idempotent.
  void abort() noexcept;
  bool aborted() const;

  Work iallreduce(void* buf, size_t count, tensor::DType dtype, ReduceOp op) override;
  Work ireduce_scatter(const void* send, void* recv, size_t recv_count, tensor::DType dtype,
                       ReduceOp op) override;
  Work iall_gather(const void* send, void* recv, size_t send_count, tensor::DType dtype) override;
  Work ibroadcast(void* buf, size_t count, tensor::DType dtype, int root) override;
  Work isend(const void* buf, size_t count, tensor::DType dtype, int peer, int tag) override;
  Work irecv(void* buf, size_t count, tensor::DType dtype, int peer, int tag) override;
  Work iall_to_all(const void* send, void* recv, size_t count_per_rank,
                   tensor::DType dtype) override;
  Work ibarrier() override;
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name = "") override;

 private:
  NcclCommunicator(ncclComm_t comm, std::string name, Duration timeout, int device);
  std::string describe(const std::string& op) const;
  void check_peer(int peer, const char* what) const;
  // Enqueues `body` on the stream (after any batched p2p calls) and returns a
  // Work that completes when everything enqueued so far has.
  template <typename Body>
  Work launch(const std::string& op, Body&& body);
  Work queue_p2p(bool is_send, const void* buf, size_t count, tensor::DType dtype, int peer,
                 int tag, const std::string& op);

  std::shared_ptr<detail::NcclState> state_;  // shared with pending Works
  Duration timeout_;
};

}  // namespace po::comm::nccl
