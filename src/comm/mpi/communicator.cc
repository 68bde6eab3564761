// MPI backend: non-blocking MPI collectives behind Work handles (large f32
// reductions as rings, ring.h), with 16-bit reductions widened to f32 in pooled
// scratch buffers (see communicator.h).
#include "comm/mpi/communicator.h"

#include <climits>
#include <cstdio>
#include <functional>
#include <mutex>
#include <vector>

#include "comm/mpi/arrivals.h"
#include "comm/mpi/check.h"
#include "comm/mpi/topology.h"
#include "comm/mpi/progress.h"
#include "comm/mpi/ring.h"
#include "core/bf16.h"
#include "core/error.h"
#include "core/f16.h"

namespace po::comm::mpi {

using tensor::DType;

namespace detail {

[[noreturn]] void throw_mpi_error(int code, const char* call, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) std::snprintf(text, sizeof text, "code %d", code);
  std::string rank = "?";
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) {
    int r = 0;
    if (MPI_Comm_rank(MPI_COMM_WORLD, &r) == MPI_SUCCESS) rank = std::to_string(r);
  }
  PO_THROW(core::CommError, "MPI call `", call, "` failed at ", file, ":", line, " on rank ", rank,
           ": ", text);
}

}  // namespace detail

// ---- process lifecycle -----------------------------------------------------

namespace {

std::mutex g_init_mutex;
bool g_we_initialized = false;
bool g_have_level = false;
ThreadLevel g_level = ThreadLevel::kFunneled;

}  // namespace

const char* thread_level_name(ThreadLevel level) {
  return level == ThreadLevel::kMultiple ? "MPI_THREAD_MULTIPLE" : "MPI_THREAD_FUNNELED";
}

ThreadLevel init() {
  std::lock_guard lock(g_init_mutex);
  if (g_have_level) return g_level;
  int initialized = 0;
  PO_MPI_CHECK(MPI_Initialized(&initialized));
  int provided = MPI_THREAD_SINGLE;
  if (initialized) {
    PO_MPI_CHECK(MPI_Query_thread(&provided));
  } else {
    PO_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
    g_we_initialized = true;
    // Errors on the predefined communicators (e.g. arguments MPI cannot tie
    // to a communicator) come back as codes too, not as an abort.
    PO_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
    PO_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_SELF, MPI_ERRORS_RETURN));
  }
  if (provided < MPI_THREAD_FUNNELED) {
    PO_THROW(core::CommError, "MPI provides thread level ", provided,
             ", below MPI_THREAD_FUNNELED which PagedOptim needs");
  }
  g_level = provided >= MPI_THREAD_MULTIPLE ? ThreadLevel::kMultiple : ThreadLevel::kFunneled;
  g_have_level = true;
  return g_level;
}

ThreadLevel thread_level() {
  std::lock_guard lock(g_init_mutex);
  PO_ASSERT(g_have_level, "mpi::thread_level() before mpi::init()");
  return g_level;
}

void finalize() {
  std::lock_guard lock(g_init_mutex);
  if (!g_we_initialized) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) {
    progress::stop();
    arrivals::stop();
    MPI_Finalize();
  }
  g_we_initialized = false;
}

// ---- scratch buffers for 16-bit reductions ---------------------------------

class ScratchPool {
 public:
  // A buffer of at least n floats: a free one large enough, else the largest
  // free one grown (so the pool converges to a few buffers of the peak size).
  std::vector<float> acquire(size_t n) {
    std::lock_guard lock(mutex_);
    size_t pick = free_.size();
    for (size_t i = 0; i < free_.size(); ++i) {
      if (free_[i].size() >= n) { pick = i; break; }
      if (pick == free_.size() || free_[i].size() > free_[pick].size()) pick = i;
    }
    std::vector<float> v;
    if (pick < free_.size()) {
      v = std::move(free_[pick]);
      free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(pick));
    }
    if (v.size() < n) v.resize(n);
    return v;
  }
  void release(std::vector<float> v) {
    std::lock_guard lock(mutex_);
    free_.push_back(std::move(v));
  }

 private:
  std::mutex mutex_;
  std::vector<std::vector<float>> free_;
};

namespace {

bool is_16bit_float(DType d) { return d == DType::kBF16 || d == DType::kF16; }

MPI_Datatype mpi_type(DType d) {
  switch (d) {
    case DType::kF32: return MPI_FLOAT;
    case DType::kBF16: case DType::kF16: case DType::kU16: return MPI_UINT16_T;
    case DType::kI32: return MPI_INT32_T;
  }
  PO_THROW(core::InvalidArgument, "unsupported dtype ", static_cast<int>(d));
}

MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::kMax ? MPI_MAX : MPI_SUM; }

int to_int(size_t count, const char* what) {
  PO_CHECK(count <= static_cast<size_t>(INT_MAX), what, ": count ", count,
           " elements exceeds the MPI backend's limit of ", INT_MAX, " per call");
  return static_cast<int>(count);
}

void check_reducible(DType d, const char* what) {
  PO_CHECK(d == DType::kF32 || is_16bit_float(d), what, ": reductions support F32, BF16 and F16, not ",
           tensor::dtype_name(d));
}

void widen(const void* src, DType d, float* dst, size_t n) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
  if (d == DType::kBF16) {
    for (size_t i = 0; i < n; ++i) dst[i] = core::bf16_to_f32(core::bf16{s[i]});
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = core::f16_to_f32(core::f16{s[i]});
  }
}

// Rounds back to 16 bits once; divisor > 1 for avg.
void narrow(const float* src, DType d, void* dst, size_t n, float divisor) {
  uint16_t* o = static_cast<uint16_t*>(dst);
  if (d == DType::kBF16) {
    for (size_t i = 0; i < n; ++i) o[i] = core::f32_to_bf16(src[i] / divisor).bits;
  } else {
    for (size_t i = 0; i < n; ++i) o[i] = core::f32_to_f16(src[i] / divisor).bits;
  }
}

void divide(float* x, size_t n, float divisor) {
  for (size_t i = 0; i < n; ++i) x[i] /= divisor;
}

// One or two MPI requests, an optional finishing step run once on completion,
// and the scratch buffer (returned to its pool when the op is destroyed).
class MpiPendingOp final : public PendingOp {
 public:
  MpiPendingOp() { progress::op_started(); }
  ~MpiPendingOp() override {
    progress::op_finished();
    if (pool_) pool_->release(std::move(scratch_));
  }
  bool poll() override {
    if ((++polls_ & 63) == 0) arrivals::service();  // peers diagnosing a timeout ask us
    // Every ring operation in flight advances while we wait, ours or not (ring.h).
    if (ring_) {
      if (!ring_->progress()) return false;
    } else {
      ring::progress_all();
    }
    int flag = 0;
    PO_MPI_CHECK(MPI_Testall(n_, requests_, &flag, MPI_STATUSES_IGNORE));
    if (!flag) return false;
    if (finish_) {
      auto f = std::move(finish_);
      finish_ = nullptr;
      f();
    }
    return true;
  }
  MPI_Request* add_request() {
    PO_ASSERT(n_ < 2);
    return &requests_[n_++];
  }
  float* take_scratch(std::shared_ptr<ScratchPool> pool, size_t n) {
    pool_ = std::move(pool);
    scratch_ = pool_->acquire(n);
    return scratch_.data();
  }
  void set_finish(std::function<void()> f) { finish_ = std::move(f); }
  // A large f32 reduction run as a ring (ring.h) instead of an MPI request.
  void set_ring(std::unique_ptr<ring::RingOp> op) { ring_ = std::move(op); }
  // A collective: counted on its group, so a timeout can name who is missing.
  void track(std::shared_ptr<arrivals::Group> group, uint64_t seq) {
    group_ = std::move(group);
    seq_ = seq;
  }
  std::string explain_timeout() override {
    return group_ ? group_->diagnose(seq_, std::chrono::seconds(2)) : std::string();
  }

 private:
  std::shared_ptr<arrivals::Group> group_;
  uint64_t seq_ = 0;
  unsigned polls_ = 0;
  MPI_Request requests_[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  int n_ = 0;
  std::function<void()> finish_;
  std::shared_ptr<ScratchPool> pool_;
  std::vector<float> scratch_;
  std::unique_ptr<ring::RingOp> ring_;
};

// Whether a reduction of `floats` f32 elements in total takes the ring.
bool takes_ring(const std::shared_ptr<ring::Channel>& channel, size_t floats) {
  return channel != nullptr && floats * sizeof(float) >= ring::kMinBytes;
}

// The Work of a collective, counted on its group's arrivals.
Work tracked(std::unique_ptr<MpiPendingOp> pending, const std::shared_ptr<arrivals::Group>& group,
             std::string what, Duration timeout) {
  pending->track(group, group->issue(what));
  return Work(std::move(pending), std::move(what), timeout);
}

}  // namespace

// ---- communicator ----------------------------------------------------------

std::unique_ptr<MpiCommunicator> MpiCommunicator::create_world(const MpiOptions& options) {
  init();
  MPI_Comm comm = MPI_COMM_NULL;
  PO_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
  return std::unique_ptr<MpiCommunicator>(new MpiCommunicator(comm, options.name, options.timeout));
}

std::unique_ptr<MpiCommunicator> MpiCommunicator::create_from(MPI_Comm comm, const MpiOptions& options) {
  init();
  PO_CHECK(comm != MPI_COMM_NULL, "MpiCommunicator::create_from: MPI_COMM_NULL");
  int inter = 0;
  PO_MPI_CHECK(MPI_Comm_test_inter(comm, &inter));
  PO_CHECK(!inter, "MpiCommunicator::create_from: an intercommunicator; merge it first");
  MPI_Comm dup = MPI_COMM_NULL;
  PO_MPI_CHECK(MPI_Comm_dup(comm, &dup));
  return std::unique_ptr<MpiCommunicator>(new MpiCommunicator(dup, options.name, options.timeout));
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::string name, Duration timeout)
    : comm_(comm), name_(std::move(name)), timeout_(timeout), pool_(std::make_shared<ScratchPool>()) {
  PO_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  PO_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  PO_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  tag_ub_ = tag_upper_bound(comm_);
  arrivals::start(comm_);  // the first communicator (the world) opens the channel
  arrivals_ = std::make_shared<arrivals::Group>(comm_, name_);
  if (size_ > 1) progress::start(comm_);  // the first multi-rank communicator (the world)
  if (size_ > 1) ring_ = std::make_shared<ring::Channel>(comm_);
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

std::string MpiCommunicator::describe(const std::string& op) const {
  return core::str_cat(op, " on group '", name_, "' (rank ", rank_, " of ", size_, ")");
}

void MpiCommunicator::check_peer(int peer, const char* what) const {
  PO_CHECK(peer >= 0 && peer < size_, what, ": rank ", peer, " is not in group '", name_,
           "' of size ", size_);
}

Work MpiCommunicator::iallreduce(void* buf, size_t count, DType dtype, ReduceOp op) {
  check_reducible(dtype, "allreduce");
  const int n = to_int(count, "allreduce");
  auto pending = std::make_unique<MpiPendingOp>();
  const float divisor = op == ReduceOp::kAvg ? static_cast<float>(size_) : 1.0f;
  if (dtype == DType::kF32) {
    if (takes_ring(ring_, count)) {
      pending->set_ring(ring::RingOp::allreduce(ring_, static_cast<float*>(buf), count, op));
    } else {
      PO_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buf, n, MPI_FLOAT, mpi_op(op), comm_,
                                  pending->add_request()));
    }
    if (op == ReduceOp::kAvg) {
      pending->set_finish([=] { divide(static_cast<float*>(buf), count, divisor); });
    }
  } else {
    float* s = pending->take_scratch(pool_, count);
    widen(buf, dtype, s, count);
    if (takes_ring(ring_, count)) {
      pending->set_ring(ring::RingOp::allreduce(ring_, s, count, op));
    } else {
      PO_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, s, n, MPI_FLOAT, mpi_op(op), comm_,
                                  pending->add_request()));
    }
    pending->set_finish([=] { narrow(s, dtype, buf, count, divisor); });
  }
  return tracked(std::move(pending), arrivals_,
              describe(core::str_cat("allreduce(", reduce_op_name(op), ", ", tensor::dtype_name(dtype),
                                     ", ", count, " elements)")),
              timeout_);
}

Work MpiCommunicator::ireduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype,
                                      ReduceOp op) {
  check_reducible(dtype, "reduce_scatter");
  const int n = to_int(recv_count, "reduce_scatter");
  auto pending = std::make_unique<MpiPendingOp>();
  const float divisor = op == ReduceOp::kAvg ? static_cast<float>(size_) : 1.0f;
  const size_t total = recv_count * static_cast<size_t>(size_);
  if (dtype == DType::kF32) {
    if (takes_ring(ring_, total)) {
      pending->set_ring(ring::RingOp::reduce_scatter(ring_, static_cast<const float*>(send),
                                                     static_cast<float*>(recv), recv_count, op));
    } else {
      PO_MPI_CHECK(MPI_Ireduce_scatter_block(send, recv, n, MPI_FLOAT, mpi_op(op), comm_,
                                             pending->add_request()));
    }
    if (op == ReduceOp::kAvg) {
      pending->set_finish([=] { divide(static_cast<float*>(recv), recv_count, divisor); });
    }
  } else {
    float* s = pending->take_scratch(pool_, total + recv_count);
    float* s_recv = s + total;
    widen(send, dtype, s, total);
    if (takes_ring(ring_, total)) {
      pending->set_ring(ring::RingOp::reduce_scatter(ring_, s, s_recv, recv_count, op));
    } else {
      PO_MPI_CHECK(MPI_Ireduce_scatter_block(s, s_recv, n, MPI_FLOAT, mpi_op(op), comm_,
                                             pending->add_request()));
    }
    pending->set_finish([=] { narrow(s_recv, dtype, recv, recv_count, divisor); });
  }
  return tracked(std::move(pending), arrivals_,
              describe(core::str_cat("reduce_scatter(", reduce_op_name(op), ", ",
                                     tensor::dtype_name(dtype), ", ", recv_count,
                                     " elements per rank)")),
              timeout_);
}

Work MpiCommunicator::iall_gather(const void* send, void* recv, size_t send_count, DType dtype) {
  const int n = to_int(send_count, "all_gather");
  auto pending = std::make_unique<MpiPendingOp>();
  const MPI_Datatype t = mpi_type(dtype);
  PO_MPI_CHECK(MPI_Iallgather(send, n, t, recv, n, t, comm_, pending->add_request()));
  return tracked(std::move(pending), arrivals_,
              describe(core::str_cat("all_gather(", tensor::dtype_name(dtype), ", ", send_count,
                                     " elements per rank)")),
              timeout_);
}

Work MpiCommunicator::ibroadcast(void* buf, size_t count, DType dtype, int root) {
  check_peer(root, "broadcast root");
  const int n = to_int(count, "broadcast");
  auto pending = std::make_unique<MpiPendingOp>();
  PO_MPI_CHECK(MPI_Ibcast(buf, n, mpi_type(dtype), root, comm_, pending->add_request()));
  return tracked(std::move(pending), arrivals_,
              describe(core::str_cat("broadcast(", tensor::dtype_name(dtype), ", ", count,
                                     " elements, root ", root, ")")),
              timeout_);
}

Work MpiCommunicator::isend(const void* buf, size_t count, DType dtype, int peer, int tag) {
  check_peer(peer, "send");
  PO_CHECK(tag >= 0 && tag <= tag_ub_, "send: tag ", tag, " is not in [0, ", tag_ub_, "]");
  const int n = to_int(count, "send");
  auto pending = std::make_unique<MpiPendingOp>();
  PO_MPI_CHECK(MPI_Isend(buf, n, mpi_type(dtype), peer, tag, comm_, pending->add_request()));
  return Work(std::move(pending),
              describe(core::str_cat("send(", tensor::dtype_name(dtype), ", ", count,
                                     " elements, to rank ", peer, ", tag ", tag, ")")),
              timeout_);
}

Work MpiCommunicator::irecv(void* buf, size_t count, DType dtype, int peer, int tag) {
  check_peer(peer, "recv");
  PO_CHECK(tag >= 0 && tag <= tag_ub_, "recv: tag ", tag, " is not in [0, ", tag_ub_, "]");
  const int n = to_int(count, "recv");
  auto pending = std::make_unique<MpiPendingOp>();
  PO_MPI_CHECK(MPI_Irecv(buf, n, mpi_type(dtype), peer, tag, comm_, pending->add_request()));
  return Work(std::move(pending),
              describe(core::str_cat("recv(", tensor::dtype_name(dtype), ", ", count,
                                     " elements, from rank ", peer, ", tag ", tag, ")")),
              timeout_);
}

Work MpiCommunicator::iall_to_all(const void* send, void* recv, size_t count_per_rank,
                                  DType dtype) {
  const int n = to_int(count_per_rank, "all_to_all");
  auto pending = std::make_unique<MpiPendingOp>();
  const MPI_Datatype t = mpi_type(dtype);
  PO_MPI_CHECK(MPI_Ialltoall(send, n, t, recv, n, t, comm_, pending->add_request()));
  return tracked(std::move(pending), arrivals_,
              describe(core::str_cat("all_to_all(", tensor::dtype_name(dtype), ", ",
                                     count_per_rank, " elements per rank)")),
              timeout_);
}

Work MpiCommunicator::ibarrier() {
  auto pending = std::make_unique<MpiPendingOp>();
  PO_MPI_CHECK(MPI_Ibarrier(comm_, pending->add_request()));
  return tracked(std::move(pending), arrivals_, describe("barrier"), timeout_);
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key, const std::string& name) {
  PO_CHECK(color >= 0 || color == kNoColor, "split: color ", color,
           " must be >= 0 or Communicator::kNoColor");
  MPI_Comm sub = MPI_COMM_NULL;
  PO_MPI_CHECK(MPI_Comm_split(comm_, color == kNoColor ? MPI_UNDEFINED : color, key, &sub));
  if (sub == MPI_COMM_NULL) return nullptr;
  std::string sub_name = name.empty() ? core::str_cat(name_, "/", color) : name;
  return std::unique_ptr<Communicator>(new MpiCommunicator(sub, std::move(sub_name), timeout_));
}

}  // namespace po::comm::mpi
