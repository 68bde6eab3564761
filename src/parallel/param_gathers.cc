// ZeRO-3's parameter gathers for each use (param_gathers.h).
#include "parallel/param_gathers.h"

#include <algorithm>

#include "core/error.h"

namespace po::parallel {

ParamGathers::ParamGathers(std::array<size_t, 2> bytes, int prefetch, Start start, Ahead ahead)
    : prefetch_(prefetch), start_(std::move(start)), ahead_(std::move(ahead)) {
  for (int k = 0; k < 2; ++k)
    for (int i = 0; i < (k == 0 ? 1 : 1 + prefetch); ++i)
      bufs_[k].push_back({tensor::Storage(bytes[static_cast<size_t>(k)])});
}

ParamGathers::~ParamGathers() {
  if (in_flight_.empty()) return;
  for (auto& kind : bufs_) (void)new std::vector<Buffer>(std::move(kind));
  (void)new std::deque<InFlight>(std::move(in_flight_));
}

void ParamGathers::begin_step() {
  recording_ = !order_known_;
  uses_ = prefetched_ = 0;
}

void ParamGathers::end_step() {
  drain();
  if (std::exchange(recording_, false)) order_known_ = true;
}

void ParamGathers::poll() {
  for (InFlight& g : in_flight_) g.work.test();
}

const void* ParamGathers::use(int stage, int u) {
  const int k = kind_of(u);
  PO_ASSERT(in_use_[k] < 0, "pipeline: unit ", u, "'s parameters asked for while unit ",
            bufs_[k][static_cast<size_t>(std::max(in_use_[k], 0))].unit, "'s are in use");
  const std::pair<int, int> key{stage, u};
  if (recording_) order_.push_back(key);
  const int n = order_known_ ? static_cast<int>(order_.size()) : 0;
  if (next_ >= n || order_[static_cast<size_t>(next_)] != key) {
    drain();  // what was prefetched is not what is asked for
    next_ = issued_ = n > 0 && order_.front() == key ? 0 : n;
  }
  size_t slot = 0;
  ++uses_;
  if (next_ < n) {
    if (!in_flight_.empty()) {
      ++prefetched_;
    } else {
      PO_ASSERT(issue(next_), "pipeline: no free buffer for unit ", u, "'s gather");
      issued_ = next_ + 1;
    }
    InFlight& g = in_flight_.front();
    PO_ASSERT(g.pos == next_, "pipeline: parameter gathers out of order");
    g.work.wait();
    slot = g.slot;
    in_flight_.pop_front();
    ++next_;
  } else {  // off the order (or no order yet): gathered alone
    auto [free, work] = start(stage, u);
    PO_ASSERT(free < bufs_[k].size(), "pipeline: no free buffer for unit ", u, "'s gather");
    work.wait();
    slot = free;
  }
  in_use_[k] = static_cast<int>(slot);
  issue_ahead();  // the next units' gathers run while this one computes
  return bufs_[k][slot].buf.data();
}

const void* ParamGathers::in_use(int u) const {
  const int k = kind_of(u);
  PO_ASSERT(in_use_[k] >= 0 && bufs_[k][static_cast<size_t>(in_use_[k])].unit == u, "pipeline: unit ", u,
            "'s parameters read before they were asked for");
  return bufs_[k][static_cast<size_t>(in_use_[k])].buf.data();
}

void ParamGathers::release(int u) {
  const int k = kind_of(u);
  PO_ASSERT(in_use_[k] >= 0, "pipeline: unit ", u, " returned but not in use");
  bufs_[k][static_cast<size_t>(in_use_[k])].unit = -1;
  in_use_[k] = -1;
  issue_ahead();  // (a buffer is free again)
}

// Unit u's gather into a free buffer of its kind, which then holds u: the
// buffer and the gather in flight, or (no buffer free) the kind's count of
// buffers and nothing started.
std::pair<size_t, comm::Work> ParamGathers::start(int stage, int u) {
  auto& bufs = bufs_[kind_of(u)];
  size_t slot = 0;
  while (slot < bufs.size() && bufs[slot].unit >= 0) ++slot;
  if (slot == bufs.size()) return {slot, comm::Work()};
  bufs[slot].unit = u;
  return {slot, start_(stage, u, bufs[slot].buf.data())};
}

// The gather of order_[pos] into a free buffer of its kind; false if none is.
bool ParamGathers::issue(int pos) {
  const auto [stage, u] = order_[static_cast<size_t>(pos)];
  auto [slot, work] = start(stage, u);
  if (slot == bufs_[kind_of(u)].size()) return false;
  in_flight_.push_back({pos, kind_of(u), slot, std::move(work)});
  return true;
}

// Up to `prefetch` gathers ahead of the next request, in order; the one
// after them is told to the owner (Ahead), so its source can come in.
void ParamGathers::issue_ahead() {
  const int n = static_cast<int>(order_.size());
  if (!order_known_ || next_ >= n) return;
  const int end = std::min(n, next_ + prefetch_);
  issued_ = std::max(issued_, next_);
  while (issued_ < end && issue(issued_)) ++issued_;
  if (ahead_ && issued_ < n) ahead_(order_[static_cast<size_t>(issued_)].first, order_[static_cast<size_t>(issued_)].second);
}

void ParamGathers::drain() {
  for (InFlight& g : in_flight_) {
    g.work.wait();
    bufs_[g.kind][g.slot].unit = -1;
  }
  in_flight_.clear();
  issued_ = next_;
}

size_t ParamGathers::bytes() const {
  size_t b = 0;
  for (const auto& kind : bufs_)
    for (const Buffer& buf : kind) b += buf.buf.size();
  return b;
}

}  // namespace po::parallel
