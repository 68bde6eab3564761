// ZeRO 2-3's reduce-scatters of one micro-batch's gradient of a unit into
// this rank's shard, in flight beside the backward (the executor's:
// pipeline_executor.h, pipeline_grad_sync.cc).
//
// Reductions complete in the order they were posted, whatever landed
// first: the shards add the same blocks in the same order as blocking ones
// would, and the accumulators held at every point do not depend on timing
// (the executor's predict counts them). A reduction completes when its
// accumulator is taken again (complete_through), at a deferred block's or
// a non-overlapped post (at once), and at the step (finish).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>

#include "comm/communicator.h"

namespace po::parallel {

class ShardReductions {
 public:
  ShardReductions() = default;
  ShardReductions(const ShardReductions&) = delete;
  ShardReductions& operator=(const ShardReductions&) = delete;

  // The sequence number the next post() takes.
  int64_t next_seq() const { return posted_; }
  // A reduction in flight, and what completes it once it has landed (adds
  // the received block into its shard, gives its accumulator back).
  // `overlapped`: left in flight beside the backward, else completed now.
  void post(comm::Work work, std::function<void()> land, bool overlapped);
  // Every reduction posted up to seq `through`, oldest first.
  void complete_through(int64_t through);
  // Moves the ones in flight on (MPI progresses inside its calls only).
  void poll();
  bool in_flight() const { return !queue_.empty(); }
  // The step's end: every one completed; the counts start over.
  void finish();

  // The last finish(): the step's reductions, those left in flight at their
  // post, and the time waited for them.
  int overlapped() const { return overlapped_last_; }
  int posted() const { return step_last_; }
  double wait_seconds() const { return wait_last_; }

 private:
  struct Reduction {
    comm::Work work;
    int64_t seq = 0;
    std::function<void()> land;
  };
  std::deque<Reduction> queue_;
  int64_t posted_ = 0;
  int step_ = 0, overlapped_ = 0, step_last_ = 0, overlapped_last_ = 0;
  double wait_s_ = 0, wait_last_ = 0;
};

}  // namespace po::parallel
