// ZeRO 2-3's reduce-scatters in flight, completed in post order (shard_reductions.h).
#include "parallel/shard_reductions.h"

#include <utility>

#include "core/timer.h"

namespace po::parallel {

void ShardReductions::post(comm::Work work, std::function<void()> land, bool overlapped) {
  const int64_t seq = posted_++;
  ++step_;
  queue_.push_back({std::move(work), seq, std::move(land)});
  if (!overlapped) return complete_through(seq);
  ++overlapped_;
}

void ShardReductions::complete_through(int64_t through) {
  core::Timer wait;
  while (!queue_.empty() && queue_.front().seq <= through) {
    Reduction& r = queue_.front();
    r.work.wait();
    r.land();
    queue_.pop_front();
  }
  wait_s_ += wait.seconds();
}

void ShardReductions::poll() {
  for (Reduction& r : queue_) r.work.test();
}

void ShardReductions::finish() {
  complete_through(posted_ - 1);
  wait_last_ = std::exchange(wait_s_, 0.0);
  overlapped_last_ = std::exchange(overlapped_, 0);
  step_last_ = std::exchange(step_, 0);
}

}  // namespace po::parallel
