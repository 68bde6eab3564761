// Ring reduce-scatter and allreduce for large messages of f32, bf16 or f16:
// point-to-point messages between ring neighbours on a private duplicate of
// the group's communicator, advanced by polling like every other MPI
// operation here.
//
// Why not OpenMPI's non-blocking collectives (libnbc, all that MPI_I* reaches
// in OpenMPI 4.1): MPI_Iallreduce with MPI_IN_PLACE always takes the binomial
// tree (reduce to rank 0, then broadcast: twice the traffic, one rank doing
// all the arithmetic) and mallocs a temporary as large as the message on every
// call (fresh pages on every call above glibc's 32 MiB mmap threshold);
// MPI_Ireduce_scatter_block is a binomial reduce of the WHOLE buffer to rank 0
// followed by a scatter, with no algorithm to choose. Against OpenMPI's own
// blocking collectives the engine went from 0.2-0.4x to typically 1.5x
// (allreduce) and 2.4x (reduce-scatter) with the ring (docs/benchmarks.md,
// "Collective bus bandwidth vs OpenMPI"; docs/comm.md).
//
// The ring moves the bandwidth-optimal volume, (n-1)/n of the buffer per rank
// per phase, and reduces on every rank at once. Each reducing step receives in
// segments of kSegmentBytes into kSlots reused scratch slots and reduces each
// segment while it is still in cache; sends come straight from the caller's
// buffer (or, for reduce-scatter on 3+ ranks, from a partial-sum buffer).
// Scratch comes from the channel's pool (tensor::Storage: 2 MiB pages,
// pre-faulted) and is reused, so the steady state allocates nothing.
//
// Element types: f32 travels as MPI_FLOAT and is reduced in f32. bf16 and f16
// travel as 16-bit MPI_UINT16_T (2 bytes per element, half the traffic of
// widening to f32): each reducing step widens the received values and its own
// to f32, combines them (sum or max) and rounds back to 16 bits (round to
// nearest even), as NCCL does. So a sum is rounded once per hop, n-1 times in
// all; max is exact. Segments and slots are sized in bytes whatever the type.
//
// Every rank must issue the same ring operations in the same order (true of
// collectives anyway): operations are numbered per channel, and the number and
// the step choose the message tag, so several operations may be in flight.
// An operation posts its first step when issued; later steps are posted by
// progress_all(), which every wait of an MPI operation calls: it advances ALL
// ring operations in flight, in issue order, whichever one is waited for (as
// OpenMPI's progress engine does for its own non-blocking collectives), so
// ranks may wait for their operations in different orders without deadlock.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "comm/communicator.h"
#include "comm/mpi/ring_sizes.h"
#include "tensor/tensor.h"

namespace po::comm::mpi::ring {

// kMinBytes, kSegmentBytes, kSlots: comm/mpi/ring_sizes.h.

// The private communicator of one group, the operation counter and the
// scratch pool that its ring operations share.
class Channel {
 public:
  // Collective over `comm`: duplicates it (so ring messages never match the
  // caller's own sends and receives on `comm`).
  explicit Channel(MPI_Comm comm);
  // Frees the duplicate unless MPI is already finalized.
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  MPI_Comm comm() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  // The base tag of the next operation (advances the counter).
  int next_tag_base();
  // Scratch of at least `bytes` bytes; give it back with release().
  tensor::Storage acquire(size_t bytes);
  void release(tensor::Storage s);

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  int tag_ub_ = 32767;
  uint64_t ops_ = 0;
  std::mutex mutex_;
  std::vector<tensor::Storage> free_;
};

// Advances every ring operation in flight (of every channel, from any thread;
// serialized by a lock). Cheap when there is none.
void progress_all();

// One ring collective in progress.
class RingOp {
 public:
  // Whether the ring reduces this element type (f32, bf16, f16).
  static bool supports(tensor::DType dtype);
  // In place: buf (count elements of dtype) becomes the reduction over the
  // group (reduce-scatter then all-gather, 2(n-1) steps).
  static std::unique_ptr<RingOp> allreduce(std::shared_ptr<Channel> ch, void* buf, size_t count,
                                           tensor::DType dtype, ReduceOp op);
  // send holds size() blocks of recv_count elements; recv gets block rank()
  // reduced over the group (n-1 steps). send and recv must not overlap.
  static std::unique_ptr<RingOp> reduce_scatter(std::shared_ptr<Channel> ch, const void* send,
                                                void* recv, size_t recv_count,
                                                tensor::DType dtype, ReduceOp op);
  // Returns the scratch to the pool once complete; an incomplete operation
  // (its owner gave up after a timeout) leaks it, since MPI may still write.
  ~RingOp();
  RingOp(const RingOp&) = delete;
  RingOp& operator=(const RingOp&) = delete;

  // progress_all(), then whether this operation is complete. kAvg reduces as
  // kSum (the caller divides).
  bool progress();

 private:
  friend void progress_all();
  // One step: send to the right neighbour, receive from the left. With `own`
  // set, dest = own (op) received, in segments through the scratch slots;
  // without, the message lands in dest whole. Counts are in elements.
  struct Step {
    const std::byte* send = nullptr;
    size_t send_count = 0;
    std::byte* dest = nullptr;
    const std::byte* own = nullptr;
    size_t recv_count = 0;
  };

  RingOp(std::shared_ptr<Channel> ch, tensor::DType dtype, ReduceOp op);
  // Registers the operation and posts its first step.
  static std::unique_ptr<RingOp> start(std::unique_ptr<RingOp> op);
  // Posts and completes steps while it can; true once complete. Under the
  // registry lock.
  bool advance();
  bool complete() const { return step_ == steps_.size(); }
  void post_step();
  bool advance_step();
  void post_recv(size_t seg);
  // The scratch slot of receive segment `seg`.
  std::byte* slot(size_t seg) const;

  std::shared_ptr<Channel> ch_;
  tensor::DType dtype_;
  size_t elem_ = 4;          // bytes per element
  size_t segment_ = 0;       // elements per segment (kSegmentBytes / elem_)
  MPI_Datatype mpi_type_ = MPI_FLOAT;
  ReduceOp op_;
  int tag_base_ = 0;
  std::vector<Step> steps_;
  size_t step_ = 0;
  bool posted_ = false;
  tensor::Storage scratch_;  // kSlots segments, then partial sums if any
  std::vector<MPI_Request> sends_;
  MPI_Request recvs_[kSlots] = {};
  size_t segments_ = 0;      // of the current step's receive
  size_t next_recv_ = 0;     // next segment to post a receive for
  size_t reduced_ = 0;       // segments received and reduced, in order
};

}  // namespace po::comm::mpi::ring
