// The Communicator interface: collectives over one process group, the same for
// every backend (mpi/ now, nccl/ and the single-node transport later).
//
// Units: every `count` is in ELEMENTS of `dtype`, never bytes. Buffers are
// caller-owned and must stay valid (and untouched) until the operation has
// completed: for blocking calls until they return, for the i* calls until the
// returned Work has completed. Send and receive buffers of one call must not
// overlap. Every rank of the group calls a collective with the same
// arguments (counts, dtype, op, root) in the same order.
//
// Reductions accept f32, bf16 and f16. 16-bit reductions move 16-bit elements
// (2 bytes each on the wire, as NCCL does): every reducing step widens both
// operands to f32, combines them and rounds back, so a sum over n ranks carries
// up to n-1 roundings; avg divides the sum at the end (one more rounding). The
// NCCL backend is the exception for now: it widens to f32 and rounds once.
// Data movement (all_gather, broadcast, send/recv, all_to_all) accepts every DType.
//
// Blocking calls wait at most timeout() and then throw core::Timeout naming the
// operation and group; the operation stays pending (a collective cannot be
// cancelled), so after a timeout the group is unusable and the run should end.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "tensor/tensor.h"

namespace po::comm {

using Duration = std::chrono::milliseconds;

// Waits that never time out.
inline constexpr Duration kNoTimeout = Duration::max();

enum class ReduceOp : uint8_t { kSum, kAvg, kMax };
const char* reduce_op_name(ReduceOp op);

// The operations a Communicator counts (Traffic).
enum class CommOp : uint8_t {
  kAllReduce, kReduceScatter, kAllGather, kBroadcast, kSend, kRecv, kAllToAll, kBarrier
};
inline constexpr int kNumCommOps = 8;
const char* comm_op_name(CommOp op);  // "allreduce", "reduce_scatter", ...

// What a communicator was asked to move since it was made: per operation the
// calls and the payload bytes, counted when an operation is issued, as
// nccl-tests sizes them (the buffer, not what a ring puts on the wire):
// allreduce and broadcast count·esize, reduce_scatter the whole input
// (size()·recv_count·esize), all_gather the whole output
// (size()·send_count·esize), all_to_all size()·count_per_rank·esize,
// send/recv count·esize. Wire bytes per rank follow from the algorithm:
// a ring moves 2(n-1)/n of an allreduce's payload, (n-1)/n of the others'.
// The planner (plan/planner.h) predicts these counters exactly.
struct Traffic {
  uint64_t calls[kNumCommOps] = {};
  uint64_t bytes[kNumCommOps] = {};
  uint64_t calls_of(CommOp op) const { return calls[static_cast<int>(op)]; }
  uint64_t bytes_of(CommOp op) const { return bytes[static_cast<int>(op)]; }
  // This minus an earlier snapshot.
  Traffic since(const Traffic& earlier) const;
};

// Backend half of a pending operation; only backends implement it.
class PendingOp {
 public:
  virtual ~PendingOp() = default;
  // Makes progress; returns true once complete, after finishing touches (for
  // 16-bit reductions: the conversion back into the caller's buffer).
  virtual bool poll() = 0;
  // Called once when a wait times out: what the backend knows about why (for
  // collectives, the ranks that did not arrive). Empty when nothing.
  virtual std::string explain_timeout() { return {}; }
};

// Move-only handle of a non-blocking operation. A default Work is complete.
// Dropping a pending Work waits for it (up to its default timeout; after that
// the operation is leaked with an error logged, since destructors never throw),
// except while an exception unwinds: then it is leaked at once, because the
// run is ending and the wait could take another full timeout.
class Work {
 public:
  Work() = default;
  // `what` names the operation and group for timeout messages.
  Work(std::unique_ptr<PendingOp> op, std::string what, Duration default_timeout);
  Work(Work&& other) noexcept = default;
  Work& operator=(Work&& other) noexcept;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;
  ~Work();

  // Non-blocking: true once the operation has completed.
  bool test();
  // Blocks until complete; throws core::Timeout (naming the operation) when
  // `timeout` passes first. The Work stays pending and may be waited again.
  void wait(Duration timeout);
  // wait() with the communicator's timeout.
  void wait() { wait(default_timeout_); }
  bool done() const { return op_ == nullptr; }
  const std::string& what() const { return what_; }

 private:
  void drop() noexcept;

  std::unique_ptr<PendingOp> op_;
  std::string what_;
  Duration default_timeout_ = kNoTimeout;
};

class Communicator {
 public:
  // split() color for ranks that join no sub-group (they get nullptr).
  static constexpr int kNoColor = -1;

  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Human-readable group name used in errors ("world", "world/dp0").
  virtual const std::string& name() const = 0;
  // Default timeout of blocking calls and of Work::wait().
  virtual Duration timeout() const = 0;

  // In place: buf (count elements) becomes the reduction over all ranks.
  virtual Work iallreduce(void* buf, size_t count, tensor::DType dtype, ReduceOp op) = 0;
  // send holds size() blocks of recv_count elements; block r is reduced over
  // all ranks into rank r's recv (recv_count elements).
  virtual Work ireduce_scatter(const void* send, void* recv, size_t recv_count,
                               tensor::DType dtype, ReduceOp op) = 0;
  // recv (size() * send_count elements) gets rank r's send in block r.
  virtual Work iall_gather(const void* send, void* recv, size_t send_count,
                           tensor::DType dtype) = 0;
  virtual Work ibroadcast(void* buf, size_t count, tensor::DType dtype, int root) = 0;
  virtual Work isend(const void* buf, size_t count, tensor::DType dtype, int peer, int tag) = 0;
  virtual Work irecv(void* buf, size_t count, tensor::DType dtype, int peer, int tag) = 0;
  // send and recv hold size() blocks of count_per_rank elements; send block j
  // goes to rank j, recv block j comes from rank j.
  virtual Work iall_to_all(const void* send, void* recv, size_t count_per_rank,
                           tensor::DType dtype) = 0;
  virtual Work ibarrier() = 0;

  // Every operation issued on this communicator so far (not on its splits).
  const Traffic& traffic() const { return traffic_; }

  // Collective over this group: ranks with the same color form a new group,
  // ordered by (key, rank). Ranks passing kNoColor get nullptr. `name` is the
  // new group's name (default: "<parent>/<color>").
  virtual std::unique_ptr<Communicator> split(int color, int key, const std::string& name = "") = 0;

  // Blocking forms: the i* call, then wait(timeout()).
  void allreduce(void* buf, size_t count, tensor::DType dtype, ReduceOp op) {
    iallreduce(buf, count, dtype, op).wait();
  }
  void reduce_scatter(const void* send, void* recv, size_t recv_count, tensor::DType dtype,
                      ReduceOp op) {
    ireduce_scatter(send, recv, recv_count, dtype, op).wait();
  }
  void all_gather(const void* send, void* recv, size_t send_count, tensor::DType dtype) {
    iall_gather(send, recv, send_count, dtype).wait();
  }
  void broadcast(void* buf, size_t count, tensor::DType dtype, int root) {
    ibroadcast(buf, count, dtype, root).wait();
  }
  void send(const void* buf, size_t count, tensor::DType dtype, int peer, int tag) {
    isend(buf, count, dtype, peer, tag).wait();
  }
  void recv(void* buf, size_t count, tensor::DType dtype, int peer, int tag) {
    irecv(buf, count, dtype, peer, tag).wait();
  }
  void all_to_all(const void* send, void* recv, size_t count_per_rank, tensor::DType dtype) {
    iall_to_all(send, recv, count_per_rank, dtype).wait();
  }
  void barrier() { ibarrier().wait(); }

 protected:
  // Backends call this once per issued operation.
  void count_op(CommOp op, size_t count, tensor::DType dtype) {
    traffic_.calls[static_cast<int>(op)] += 1;
    traffic_.bytes[static_cast<int>(op)] += count * tensor::dtype_size(dtype);
  }

 private:
  Traffic traffic_;
};

}  // namespace po::comm
