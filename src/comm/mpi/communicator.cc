// MPI backend: non-blocking MPI collectives behind Work handles (large
// reductions as rings, ring.h), with 16-bit reductions on a 16-bit wire: each
// combining step sums (or maxes) in f32 and rounds back (see communicator.h).
#include "comm/mpi/communicator.h"

#include <climits>
#include <cstdio>
#include <functional>
#include <mutex>

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

// ---- user-defined reductions of 16-bit floats --------------------------------
//
// MPI has no bf16 or f16 type: below the ring's threshold, 16-bit reductions
// run as MPI_Iallreduce / MPI_Ireduce_scatter_block on MPI_UINT16_T with one
// of these commutative user ops, which combine pairs in f32 and round back to
// nearest even (as each ring step does). One op per (dtype, op), created on
// first use (MPI is initialized by then) and freed by finalize().

namespace {

std::mutex g_ops_mutex;
MPI_Op g_ops16[2][2] = {{MPI_OP_NULL, MPI_OP_NULL}, {MPI_OP_NULL, MPI_OP_NULL}};  // [bf16?][max?]

template <typename T, float (*Widen)(T), T (*Narrow)(float), bool kIsMax>
void combine16(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  const size_t n = static_cast<size_t>(*len);
  for (size_t i = 0; i < n; ++i) {
    const float x = Widen(T{a[i]}), y = Widen(T{b[i]});
    if constexpr (kIsMax) {
      if (x > y) b[i] = a[i];
    } else {
      b[i] = Narrow(x + y).bits;
    }
  }
}

// The op combining dtype (kBF16 or kF16) elements by op (kAvg sums).
MPI_Op op16(DType dtype, ReduceOp op) {
  const int bf = dtype == DType::kBF16 ? 1 : 0, max = op == ReduceOp::kMax ? 1 : 0;
  std::lock_guard lock(g_ops_mutex);
  MPI_Op& slot = g_ops16[bf][max];
  if (slot == MPI_OP_NULL) {
    MPI_User_function* fn =
        bf ? (max ? combine16<core::bf16, core::bf16_to_f32, core::f32_to_bf16, true>
                  : combine16<core::bf16, core::bf16_to_f32, core::f32_to_bf16, false>)
           : (max ? combine16<core::f16, core::f16_to_f32, core::f32_to_f16, true>
                  : combine16<core::f16, core::f16_to_f32, core::f32_to_f16, false>);
    PO_MPI_CHECK(MPI_Op_create(fn, /*commute=*/1, &slot));
  }
  return slot;
}

// Before MPI_Finalize. Operations still in flight keep an op alive (MPI frees
// it once they complete).
void free_ops16() {
  std::lock_guard lock(g_ops_mutex);
  for (auto& row : g_ops16) {
    for (MPI_Op& op : row) {
      if (op != MPI_OP_NULL) MPI_Op_free(&op);
    }
  }
}

}  // namespace

void finalize() {
  std::lock_guard lock(g_init_mutex);
  if (!g_we_initialized) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) {
    progress::stop();
    arrivals::stop();
    free_ops16();
    MPI_Finalize();
  }
  g_we_initialized = false;
}

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

// The reduction op of an MPI call on dtype: built-in for f32, ours for 16 bits.
MPI_Op mpi_op(DType dtype, ReduceOp op) {
  return dtype == DType::kF32 ? mpi_op(op) : op16(dtype, op);
}

// kAvg's last step: x /= divisor in f32, rounded back to dtype once more for
// 16-bit types.
void divide(void* buf, DType d, size_t n, float divisor) {
  if (d == DType::kF32) {
    float* x = static_cast<float*>(buf);
    for (size_t i = 0; i < n; ++i) x[i] /= divisor;
  } else if (d == DType::kBF16) {
    uint16_t* x = static_cast<uint16_t*>(buf);
    for (size_t i = 0; i < n; ++i) {
      x[i] = core::f32_to_bf16(core::bf16_to_f32(core::bf16{x[i]}) / divisor).bits;
    }
  } else {
    uint16_t* x = static_cast<uint16_t*>(buf);
    for (size_t i = 0; i < n; ++i) {
      x[i] = core::f32_to_f16(core::f16_to_f32(core::f16{x[i]}) / divisor).bits;
    }
  }
}

// One or two MPI requests (or a ring operation) and an optional finishing step
// run once on completion.
class MpiPendingOp final : public PendingOp {
 public:
  MpiPendingOp() { progress::op_started(); }
  ~MpiPendingOp() override { progress::op_finished(); }
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
  void set_finish(std::function<void()> f) { finish_ = std::move(f); }
  // A large reduction run as a ring (ring.h) instead of an MPI request.
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
  std::unique_ptr<ring::RingOp> ring_;
};

// Whether a reduction of `count` elements of dtype in total takes the ring
// (the threshold is in bytes as sent: 16-bit types count 2 bytes an element).
bool takes_ring(const std::shared_ptr<ring::Channel>& channel, size_t count, DType dtype) {
  return channel != nullptr && count * tensor::dtype_size(dtype) >= ring::kMinBytes;
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
    : comm_(comm), name_(std::move(name)), timeout_(timeout) {
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
  count_op(CommOp::kAllReduce, count, dtype);
  check_reducible(dtype, "allreduce");
  const int n = to_int(count, "allreduce");
  auto pending = std::make_unique<MpiPendingOp>();
  // 16-bit types reduce on the caller's buffer too, 16 bits on the wire.
  if (takes_ring(ring_, count, dtype)) {
    pending->set_ring(ring::RingOp::allreduce(ring_, buf, count, dtype, op));
  } else {
    PO_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buf, n, mpi_type(dtype), mpi_op(dtype, op), comm_,
                                pending->add_request()));
  }
  if (op == ReduceOp::kAvg) {
    const float divisor = static_cast<float>(size_);
    pending->set_finish([=] { divide(buf, dtype, count, divisor); });
  }
  return tracked(std::move(pending), arrivals_,
              describe(core::str_cat("allreduce(", reduce_op_name(op), ", ", tensor::dtype_name(dtype),
                                     ", ", count, " elements)")),
              timeout_);
}

Work MpiCommunicator::ireduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype,
                                      ReduceOp op) {
  count_op(CommOp::kReduceScatter, recv_count * static_cast<size_t>(size()), dtype);
  check_reducible(dtype, "reduce_scatter");
  const int n = to_int(recv_count, "reduce_scatter");
  auto pending = std::make_unique<MpiPendingOp>();
  const size_t total = recv_count * static_cast<size_t>(size_);
  if (takes_ring(ring_, total, dtype)) {
    pending->set_ring(ring::RingOp::reduce_scatter(ring_, send, recv, recv_count, dtype, op));
  } else {
    PO_MPI_CHECK(MPI_Ireduce_scatter_block(send, recv, n, mpi_type(dtype), mpi_op(dtype, op), comm_,
                                           pending->add_request()));
  }
  if (op == ReduceOp::kAvg) {
    const float divisor = static_cast<float>(size_);
    pending->set_finish([=] { divide(recv, dtype, recv_count, divisor); });
  }
  return tracked(std::move(pending), arrivals_,
              describe(core::str_cat("reduce_scatter(", reduce_op_name(op), ", ",
                                     tensor::dtype_name(dtype), ", ", recv_count,
                                     " elements per rank)")),
              timeout_);
}

Work MpiCommunicator::iall_gather(const void* send, void* recv, size_t send_count, DType dtype) {
  count_op(CommOp::kAllGather, send_count * static_cast<size_t>(size()), dtype);
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
  count_op(CommOp::kBroadcast, count, dtype);
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
  count_op(CommOp::kSend, count, dtype);
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
  count_op(CommOp::kRecv, count, dtype);
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
  count_op(CommOp::kAllToAll, count_per_rank * static_cast<size_t>(size()), dtype);
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
  count_op(CommOp::kBarrier, 0, DType::kF32);
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
