// Backend-neutral parts of the Communicator interface: the Work handle's
// polling wait with a deadline.
#include "comm/communicator.h"

#include <exception>
#include <thread>

#include "core/error.h"
#include "core/log.h"

namespace po::comm {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
  }
  return "?";
}

const char* comm_op_name(CommOp op) {
  switch (op) {
    case CommOp::kAllReduce: return "allreduce";
    case CommOp::kReduceScatter: return "reduce_scatter";
    case CommOp::kAllGather: return "all_gather";
    case CommOp::kBroadcast: return "broadcast";
    case CommOp::kSend: return "send";
    case CommOp::kRecv: return "recv";
    case CommOp::kAllToAll: return "all_to_all";
    case CommOp::kBarrier: return "barrier";
  }
  return "?";
}

Traffic Traffic::since(const Traffic& earlier) const {
  Traffic d;
  for (int i = 0; i < kNumCommOps; ++i) {
    d.calls[i] = calls[i] - earlier.calls[i];
    d.bytes[i] = bytes[i] - earlier.bytes[i];
  }
  return d;
}

Work::Work(std::unique_ptr<PendingOp> op, std::string what, Duration default_timeout)
    : op_(std::move(op)), what_(std::move(what)), default_timeout_(default_timeout) {}

Work& Work::operator=(Work&& other) noexcept {
  if (this != &other) {
    drop();
    op_ = std::move(other.op_);
    what_ = std::move(other.what_);
    default_timeout_ = other.default_timeout_;
  }
  return *this;
}

Work::~Work() { drop(); }

bool Work::test() {
  if (op_ && op_->poll()) op_.reset();
  return op_ == nullptr;
}

void Work::wait(Duration timeout) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  // Saturate: now + Duration::max() overflows.
  const auto deadline = timeout >= std::chrono::duration_cast<Duration>(Clock::time_point::max() - start)
                            ? Clock::time_point::max()
                            : start + timeout;
  // Spin briefly for short operations, then yield between polls so that
  // oversubscribed ranks (more ranks than cores) let their peers run.
  for (int i = 0; !test(); ++i) {
    if (i < 64) continue;
    if (Clock::now() >= deadline) {
      const std::string why = op_->explain_timeout();
      PO_THROW(core::Timeout, what_, " did not complete within ", timeout.count(), " ms",
               why.empty() ? "" : "; ", why);
    }
    std::this_thread::yield();
  }
}

void Work::drop() noexcept {
  if (op_ == nullptr) return;
  if (std::uncaught_exceptions() > 0) {
    // Unwinding from an error (often a timeout of a sibling operation): the
    // run is ending, and waiting here could take another full timeout.
    (void)op_.release();
    return;
  }
  try {
    wait();
  } catch (const std::exception& e) {
    // The buffers may still be in use by the backend: leak the operation
    // rather than free what it points to.
    PO_LOG_WARN("dropping pending ", what_, ": ", e.what(), "; operation leaked");
    (void)op_.release();
  }
}

}  // namespace po::comm
