// Ring reduce-scatter and allreduce over point-to-point messages (see ring.h).
//
// Block j of an n-rank ring: allreduce splits count into n blocks, the first
// count % n one element longer; reduce-scatter's blocks are recv_count each.
// Rank r sends to r+1 and receives from r-1. Reduce-scatter step s (0..n-2)
// sends the partial sum of block r-s-1 and receives the partial of block
// r-s-2, adding its own contribution; after n-1 steps block r is complete.
// All-gather step s sends block r-s and receives block r-s-1.
//
// Internally buffers are byte pointers and counts are elements of the
// operation's type (elem_ bytes each); segments are kSegmentBytes whatever
// the type, so a 16-bit segment holds twice as many elements.
#include "comm/mpi/ring.h"

#include <algorithm>
#include <climits>
#include <utility>

#include "comm/mpi/check.h"
#include "comm/mpi/topology.h"
#include "core/bf16.h"
#include "core/error.h"
#include "core/f16.h"

namespace po::comm::mpi::ring {

using tensor::DType;

namespace {

int mod(int a, int n) { return ((a % n) + n) % n; }

int to_int(size_t n) {
  PO_CHECK(n <= static_cast<size_t>(INT_MAX), "ring: message of ", n, " elements exceeds INT_MAX");
  return static_cast<int>(n);
}

// dest = a (op) b, n f32 elements; dest may alias a.
void reduce_f32(float* dest, const float* a, const float* b, size_t n, ReduceOp op) {
  if (op == ReduceOp::kMax) {
    for (size_t i = 0; i < n; ++i) dest[i] = a[i] > b[i] ? a[i] : b[i];
  } else {
    for (size_t i = 0; i < n; ++i) dest[i] = a[i] + b[i];
  }
}

// The same for 16-bit floats: widen both to f32, combine, round back to
// nearest even (max picks one of the inputs, so it is exact).
template <typename T, float (*Widen)(T), T (*Narrow)(float)>
void reduce_16(uint16_t* dest, const uint16_t* a, const uint16_t* b, size_t n, ReduceOp op) {
  if (op == ReduceOp::kMax) {
    for (size_t i = 0; i < n; ++i) {
      const float x = Widen(T{a[i]}), y = Widen(T{b[i]});
      dest[i] = x > y ? a[i] : b[i];
    }
  } else {
    for (size_t i = 0; i < n; ++i) dest[i] = Narrow(Widen(T{a[i]}) + Widen(T{b[i]})).bits;
  }
}

void reduce(DType dtype, std::byte* dest, const std::byte* a, const std::byte* b, size_t n,
            ReduceOp op) {
  auto* d16 = reinterpret_cast<uint16_t*>(dest);
  auto* a16 = reinterpret_cast<const uint16_t*>(a);
  auto* b16 = reinterpret_cast<const uint16_t*>(b);
  switch (dtype) {
    case DType::kBF16:
      return reduce_16<core::bf16, core::bf16_to_f32, core::f32_to_bf16>(d16, a16, b16, n, op);
    case DType::kF16:
      return reduce_16<core::f16, core::f16_to_f32, core::f32_to_f16>(d16, a16, b16, n, op);
    default:
      return reduce_f32(reinterpret_cast<float*>(dest), reinterpret_cast<const float*>(a),
                        reinterpret_cast<const float*>(b), n, op);
  }
}

// Ring operations in flight, in issue order, and the lock that serializes
// their progress.
std::mutex g_mutex;
std::vector<RingOp*> g_active;

}  // namespace

void progress_all() {
  std::lock_guard lock(g_mutex);
  for (size_t i = 0; i < g_active.size();) {
    if (g_active[i]->advance()) {
      g_active.erase(g_active.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
}

// ---- channel -----------------------------------------------------------------

Channel::Channel(MPI_Comm comm) {
  PO_MPI_CHECK(MPI_Comm_dup(comm, &comm_));
  PO_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  PO_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  PO_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  tag_ub_ = tag_upper_bound(comm_);
}

Channel::~Channel() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

int Channel::next_tag_base() {
  // 2n steps per operation at most; the tag space wraps after ~tag_ub/2n
  // operations, far more than can be in flight at once.
  const uint64_t stride = 2 * static_cast<uint64_t>(size_);
  const uint64_t slots = (static_cast<uint64_t>(tag_ub_) + 1) / stride;
  return static_cast<int>((ops_++ % slots) * stride);
}

tensor::Storage Channel::acquire(size_t bytes) {
  std::lock_guard lock(mutex_);
  for (size_t i = 0; i < free_.size(); ++i) {
    if (free_[i].size() >= bytes) {
      tensor::Storage s = std::move(free_[i]);
      free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
      return s;
    }
  }
  // None large enough: drop the largest (it is too small) so the pool holds
  // about as many buffers as operations in flight, each of the peak size.
  if (!free_.empty()) {
    auto largest = std::max_element(free_.begin(), free_.end(),
                                    [](const auto& a, const auto& b) { return a.size() < b.size(); });
    free_.erase(largest);
  }
  return tensor::Storage(bytes);
}

void Channel::release(tensor::Storage s) {
  std::lock_guard lock(mutex_);
  free_.push_back(std::move(s));
}

// ---- operations ----------------------------------------------------------------

bool RingOp::supports(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
}

RingOp::RingOp(std::shared_ptr<Channel> ch, DType dtype, ReduceOp op)
    : ch_(std::move(ch)),
      dtype_(dtype),
      elem_(tensor::dtype_size(dtype)),
      segment_(kSegmentBytes / elem_),
      mpi_type_(dtype == DType::kF32 ? MPI_FLOAT : MPI_UINT16_T),
      op_(op),
      tag_base_(ch_->next_tag_base()) {
  PO_CHECK(supports(dtype), "ring: reductions of ", tensor::dtype_name(dtype),
           " are not supported (F32, BF16, F16 only)");
  std::fill(std::begin(recvs_), std::end(recvs_), MPI_REQUEST_NULL);
}

RingOp::~RingOp() {
  {
    std::lock_guard lock(g_mutex);
    g_active.erase(std::remove(g_active.begin(), g_active.end(), this), g_active.end());
  }
  if (!complete()) {
    (void)new tensor::Storage(std::move(scratch_));  // leaked on purpose: see ring.h
  } else if (scratch_.size() > 0) {
    ch_->release(std::move(scratch_));
  }
}

std::unique_ptr<RingOp> RingOp::start(std::unique_ptr<RingOp> op) {
  std::lock_guard lock(g_mutex);
  if (!op->advance()) g_active.push_back(op.get());
  return op;
}

bool RingOp::progress() {
  progress_all();
  std::lock_guard lock(g_mutex);
  return complete();
}

std::unique_ptr<RingOp> RingOp::allreduce(std::shared_ptr<Channel> ch, void* buf, size_t count,
                                          DType dtype, ReduceOp op) {
  std::unique_ptr<RingOp> o(new RingOp(std::move(ch), dtype, op));
  const int n = o->ch_->size(), r = o->ch_->rank();
  const size_t q = count / static_cast<size_t>(n), rem = count % static_cast<size_t>(n);
  std::byte* const b = static_cast<std::byte*>(buf);
  const size_t e = o->elem_;
  auto at = [&](int j) { return b + (static_cast<size_t>(j) * q + std::min<size_t>(j, rem)) * e; };
  auto len = [&](int j) { return q + (static_cast<size_t>(j) < rem ? 1 : 0); };
  for (int s = 0; s + 1 < n; ++s) {  // reduce-scatter, in place
    const int out = mod(r - s - 1, n), in = mod(r - s - 2, n);
    o->steps_.push_back({at(out), len(out), at(in), at(in), len(in)});
  }
  for (int s = 0; s + 1 < n; ++s) {  // all-gather
    const int out = mod(r - s, n), in = mod(r - s - 1, n);
    o->steps_.push_back({at(out), len(out), at(in), nullptr, len(in)});
  }
  o->scratch_ = o->ch_->acquire(kSlots * kSegmentBytes);
  return start(std::move(o));
}

std::unique_ptr<RingOp> RingOp::reduce_scatter(std::shared_ptr<Channel> ch, const void* send,
                                               void* recv, size_t c, DType dtype, ReduceOp op) {
  std::unique_ptr<RingOp> o(new RingOp(std::move(ch), dtype, op));
  const int n = o->ch_->size(), r = o->ch_->rank();
  const std::byte* const in_blocks = static_cast<const std::byte*>(send);
  const size_t block = c * o->elem_;  // bytes
  // Partial sums alternate between two buffers (one is being sent while the
  // next is received into the other); the last step reduces into recv.
  const size_t partials = static_cast<size_t>(std::min(n - 2, 2));
  o->scratch_ = o->ch_->acquire(kSlots * kSegmentBytes + partials * block);
  std::byte* const base = static_cast<std::byte*>(o->scratch_.data()) + kSlots * kSegmentBytes;
  std::byte* partial[2] = {base, base + block};
  for (int s = 0; s + 1 < n; ++s) {
    const int in = mod(r - s - 2, n);
    const std::byte* out =
        s == 0 ? in_blocks + static_cast<size_t>(mod(r - 1, n)) * block : partial[(s - 1) % 2];
    std::byte* dest = s == n - 2 ? static_cast<std::byte*>(recv) : partial[s % 2];
    o->steps_.push_back({out, c, dest, in_blocks + static_cast<size_t>(in) * block, c});
  }
  return start(std::move(o));
}

std::byte* RingOp::slot(size_t seg) const {
  return static_cast<std::byte*>(scratch_.data()) + (seg % kSlots) * kSegmentBytes;
}

void RingOp::post_recv(size_t seg) {
  const Step& st = steps_[step_];
  const size_t first = seg * segment_, n = std::min(segment_, st.recv_count - first);
  PO_MPI_CHECK(MPI_Irecv(slot(seg), to_int(n), mpi_type_, mod(ch_->rank() - 1, ch_->size()),
                         tag_base_ + static_cast<int>(step_), ch_->comm(), &recvs_[seg % kSlots]));
}

void RingOp::post_step() {
  const Step& st = steps_[step_];
  const int right = mod(ch_->rank() + 1, ch_->size()), left = mod(ch_->rank() - 1, ch_->size());
  const int tag = tag_base_ + static_cast<int>(step_);
  sends_.clear();
  // The receiver of a reducing step takes the message in segments; both ends
  // know the step's kind, so they cut it the same way.
  const size_t seg = st.own ? segment_ : std::max<size_t>(st.send_count, 1);
  for (size_t first = 0; first < st.send_count; first += seg) {
    sends_.push_back(MPI_REQUEST_NULL);
    PO_MPI_CHECK(MPI_Isend(st.send + first * elem_, to_int(std::min(seg, st.send_count - first)),
                           mpi_type_, right, tag, ch_->comm(), &sends_.back()));
  }
  if (st.own) {
    segments_ = (st.recv_count + segment_ - 1) / segment_;
    reduced_ = 0;
    for (next_recv_ = 0; next_recv_ < std::min<size_t>(segments_, kSlots); ++next_recv_) {
      post_recv(next_recv_);
    }
  } else {
    segments_ = st.recv_count > 0 ? 1 : 0;
    reduced_ = 0;
    if (segments_) {
      PO_MPI_CHECK(MPI_Irecv(st.dest, to_int(st.recv_count), mpi_type_, left, tag, ch_->comm(),
                             &recvs_[0]));
    }
  }
  posted_ = true;
}

// Reduces the segments that arrived, in order, reusing their slots; true once
// the step's receive and sends are all complete.
bool RingOp::advance_step() {
  const Step& st = steps_[step_];
  while (reduced_ < segments_) {
    MPI_Request& req = recvs_[reduced_ % kSlots];
    int done = 0;
    PO_MPI_CHECK(MPI_Test(&req, &done, MPI_STATUS_IGNORE));
    if (!done) return false;
    if (st.own) {
      const size_t first = reduced_ * segment_, n = std::min(segment_, st.recv_count - first);
      reduce(dtype_, st.dest + first * elem_, st.own + first * elem_, slot(reduced_), n, op_);
      if (next_recv_ < segments_) post_recv(next_recv_++);
    }
    ++reduced_;
  }
  int done = 0;
  PO_MPI_CHECK(MPI_Testall(static_cast<int>(sends_.size()), sends_.data(), &done,
                           MPI_STATUSES_IGNORE));
  return done != 0;
}

bool RingOp::advance() {
  while (step_ < steps_.size()) {
    if (!posted_) post_step();
    if (!advance_step()) return false;
    ++step_;
    posted_ = false;
  }
  return true;
}

}  // namespace po::comm::mpi::ring
