// MPI backend of the Communicator interface (OpenMPI from Debian; works under
// mpirun and under srun --mpi=pmix).
//
// Lifecycle: mpi::init() initializes MPI once per process (asking for
// MPI_THREAD_MULTIPLE, accepting MPI_THREAD_FUNNELED, recording which);
// mpi::finalize() ends it. A Session does both, RAII. Communicators own a
// duplicate of MPI_COMM_WORLD (or a split of one) with MPI_ERRORS_RETURN, so
// our traffic never mixes with other users of MPI_COMM_WORLD and MPI errors
// come back as core::CommError (PO_MPI_CHECK). Destroy communicators before
// finalize(); one destroyed after it skips MPI_Comm_free.
//
// Every operation is a non-blocking MPI call (MPI_Iallreduce, ...) completed
// by Work::wait(), so blocking calls get the same timeout as non-blocking ones.
// Except: allreduce and reduce-scatter of >= 1 MiB (as sent: 2 bytes an
// element for bf16/f16) run as a ring of point-to-point messages on a private duplicate of the
// communicator (ring.h), because OpenMPI's non-blocking versions of those two
// are 2.5-5x slower than its own blocking ones here (docs/comm.md).
//
// 16-bit reductions (bf16, f16) keep 16 bits on the wire, as NCCL does: every
// step that combines two partial results widens both to f32, sums (or maxes)
// and rounds back to 16 bits (nearest even). Large messages take the 16-bit
// ring on the caller's buffers; small ones MPI_Iallreduce /
// MPI_Ireduce_scatter_block on MPI_UINT16_T with a user-defined commutative
// MPI_Op per (dtype, op), created on first use and freed by finalize(). avg
// sums, then divides by size() in f32 and rounds once more. This halves the
// traffic of widening to f32 first, at the price of one rounding per hop: a
// sum over n ranks is within about (n-1) * 2^-8 (bf16; 2^-11 for f16) of the
// sum of |x| from the exact sum, and may depend on the reduction order (the
// ring gives every rank the same bits). Max is exact. docs/comm.md.
//
// Thread safety: one thread at a time per communicator (FUNNELED is enough);
// different communicators may be used from different threads only when
// thread_level() is kMultiple.
#pragma once

#include <mpi.h>

#include <chrono>
#include <exception>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "comm/mpi/arrivals.h"

namespace po::comm::mpi {

enum class ThreadLevel { kFunneled, kMultiple };
const char* thread_level_name(ThreadLevel level);

// Initializes MPI if nobody has (idempotent); returns the thread level granted.
ThreadLevel init();
// The level granted by init(); init() must have run.
ThreadLevel thread_level();
// Finalizes MPI if init() initialized it (idempotent; no-op otherwise).
void finalize();

// Initializes MPI; finalizes it when destroyed normally. When destroyed by an
// exception unwinding (an error on this rank) it leaves MPI as it is: peers may
// still wait for us in a collective, so MPI_Finalize could hang, whereas the
// process exiting lets the launcher (mpirun, srun) stop the job.
class Session {
 public:
  Session() : exceptions_(std::uncaught_exceptions()) { init(); }
  ~Session() {
    if (std::uncaught_exceptions() <= exceptions_) finalize();
  }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

 private:
  int exceptions_;
};

struct MpiOptions {
  std::string name = "world";
  Duration timeout = std::chrono::minutes(10);  // parallel.timeout default
};

namespace ring {
class Channel;
}  // namespace ring

class MpiCommunicator final : public Communicator {
 public:
  // A duplicate of MPI_COMM_WORLD; calls init() if needed.
  static std::unique_ptr<MpiCommunicator> create_world(const MpiOptions& options = {});
  // A duplicate of `comm`, an intracommunicator (the caller keeps and frees
  // its own handle); calls init() if needed. For worlds that are not
  // MPI_COMM_WORLD, e.g. processes joined without mpirun (mpi/join.h).
  static std::unique_ptr<MpiCommunicator> create_from(MPI_Comm comm, const MpiOptions& options = {});
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  Duration timeout() const override { return timeout_; }
  // The underlying MPI communicator (for tests and MPI-aware code).
  MPI_Comm handle() const { return comm_; }

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
  MpiCommunicator(MPI_Comm comm, std::string name, Duration timeout);
  std::string describe(const std::string& op) const;
  void check_peer(int peer, const char* what) const;

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  int tag_ub_ = 32767;  // MPI guarantees at least this
  std::string name_;
  Duration timeout_;
  std::shared_ptr<arrivals::Group> arrivals_;  // who reached which collective
  std::shared_ptr<ring::Channel> ring_;  // large reductions (ring.h); null on 1 rank
};

}  // namespace po::comm::mpi
