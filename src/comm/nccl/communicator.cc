// NCCL backend: NCCL calls on the communicator's own stream behind event-backed
// Work handles, 16-bit sums widened to f32 on the GPU, batched point to point
// (see communicator.h).
#include "comm/nccl/communicator.h"

#include <cstdint>
#include <exception>
#include <vector>

#include "comm/nccl/check.h"
#include "comm/nccl/convert.h"
#include "core/error.h"
#include "core/log.h"

namespace po::comm::nccl {

using tensor::DType;

namespace detail {

[[noreturn]] void throw_nccl_error(ncclResult_t code, const char* call, const std::string& where,
                                   const char* file, int line) {
  // NCCL's last error text (this thread's) often names the failing peer or
  // transport; the result code alone gives only the category.
  const char* last = ncclGetLastError(nullptr);
  const std::string detail =
      last != nullptr && *last != '\0' ? core::str_cat(" (", last, ")") : std::string();
  PO_THROW(core::CommError, "NCCL call `", call, "` failed at ", file, ":", line, " on ", where,
           ": ", ncclGetErrorString(code), detail);
}

[[noreturn]] void throw_cuda_error(cudaError_t code, const char* call, const std::string& where,
                                   const char* file, int line) {
  PO_THROW(core::CommError, "CUDA call `", call, "` failed at ", file, ":", line, " on ", where,
           ": ", cudaGetErrorName(code), ": ", cudaGetErrorString(code));
}

namespace {

std::string where_text(const std::string& name, int rank, int size, int device) {
  return core::str_cat("group '", name, "' (rank ", rank, " of ", size, ", CUDA device ", device,
                       ")");
}

// Makes `device` current for a scope and restores the caller's device.
class DeviceGuard {
 public:
  DeviceGuard(int device, const std::string& where) {
    PO_NCCL_CUDA_CHECK(where, cudaGetDevice(&previous_));
    if (previous_ != device) PO_NCCL_CUDA_CHECK(where, cudaSetDevice(device));
  }
  ~DeviceGuard() { (void)cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

class Event {
 public:
  Event() = default;
  explicit Event(const std::string& where) {
    PO_NCCL_CUDA_CHECK(where, cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  ~Event() {
    if (event_ != nullptr) (void)cudaEventDestroy(event_);  // released once it has completed
  }
  Event(Event&& other) noexcept : event_(other.event_) { other.event_ = nullptr; }
  Event& operator=(Event&& other) noexcept {
    std::swap(event_, other.event_);
    return *this;
  }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

}  // namespace

// Point-to-point calls issued but not launched yet; all of them are launched
// in one NCCL group (see communicator.h).
struct P2pBatch {
  struct Call {
    bool is_send;
    void* buf;
    size_t bytes;
    int peer;
  };
  std::vector<Call> calls;
  bool launched = false;
  Event done;  // recorded after the group once launched
};

// Everything a pending Work needs after its communicator may be gone.
struct NcclState {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  cudaMemPool_t pool = nullptr;
  float* barrier_buf = nullptr;  // one f32 on the device
  int device = 0;
  int rank = 0;
  int size = 1;
  std::string name;
  std::string where;
  bool aborted = false;
  std::shared_ptr<P2pBatch> open_batch;
  // Exceptions in flight at creation: more at destruction means we are being
  // unwound by an error on this rank, when peers may never join a destroy.
  int exceptions_at_create = std::uncaught_exceptions();

  NcclState() = default;
  NcclState(const NcclState&) = delete;
  NcclState& operator=(const NcclState&) = delete;
  ~NcclState();

  void check_usable() const {
    if (aborted) PO_THROW(core::CommError, "NCCL communicator of ", where, " was aborted");
  }
  // True once `event` has completed; throws on a CUDA error, an asynchronous
  // NCCL error (a failed peer or network) or after abort().
  bool event_done(cudaEvent_t event) const;
  // Launches the open p2p batch, if any, in one NCCL group.
  void flush_p2p();
  // Records a new event on the stream, after everything enqueued so far.
  Event record() const {
    Event e(where);
    PO_NCCL_CUDA_CHECK(where, cudaEventRecord(e.get(), stream));
    return e;
  }
  void abort() noexcept;
};

NcclState::~NcclState() {
  try {
    DeviceGuard guard(device, where);
    if (comm != nullptr && !aborted) {
      ncclResult_t async = ncclSuccess;
      const bool healthy =
          ncclCommGetAsyncError(comm, &async) == ncclSuccess && async == ncclSuccess;
      const bool idle = stream == nullptr || cudaStreamQuery(stream) == cudaSuccess;
      if (healthy && idle && std::uncaught_exceptions() <= exceptions_at_create) {
        const ncclResult_t rc = ncclCommDestroy(comm);
        if (rc != ncclSuccess) {
          PO_LOG_WARN("ncclCommDestroy on ", where, " failed: ", ncclGetErrorString(rc));
        }
        comm = nullptr;
      } else {
        abort();
      }
    }
    if (barrier_buf != nullptr) (void)cudaFree(barrier_buf);
    if (pool != nullptr) (void)cudaMemPoolDestroy(pool);
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  } catch (const std::exception& e) {
    PO_LOG_WARN("destroying the NCCL communicator of ", where, ": ", e.what());
  }
}

void NcclState::abort() noexcept {
  if (aborted || comm == nullptr) {
    aborted = true;
    return;
  }
  const ncclResult_t rc = ncclCommAbort(comm);
  if (rc != ncclSuccess)
    PO_LOG_WARN("ncclCommAbort on ", where, " failed: ", ncclGetErrorString(rc));
  comm = nullptr;
  aborted = true;
}

bool NcclState::event_done(cudaEvent_t event) const {
  check_usable();
  const cudaError_t rc = cudaEventQuery(event);
  if (rc == cudaSuccess) return true;
  if (rc != cudaErrorNotReady)
    throw_cuda_error(rc, "cudaEventQuery(done)", where, __FILE__, __LINE__);
  ncclResult_t async = ncclSuccess;
  PO_NCCL_CHECK(where, ncclCommGetAsyncError(comm, &async));
  if (async != ncclSuccess && async != ncclInProgress) {
    throw_nccl_error(async, "ncclCommGetAsyncError (asynchronous error)", where, __FILE__,
                     __LINE__);
  }
  return false;
}

void NcclState::flush_p2p() {
  if (!open_batch) return;
  check_usable();
  std::shared_ptr<P2pBatch> batch = std::move(open_batch);
  open_batch.reset();
  DeviceGuard guard(device, where);
  PO_NCCL_CHECK(where, ncclGroupStart());
  try {
    for (const P2pBatch::Call& c : batch->calls) {
      if (c.is_send) {
        PO_NCCL_CHECK(where, ncclSend(c.buf, c.bytes, ncclUint8, c.peer, comm, stream));
      } else {
        PO_NCCL_CHECK(where, ncclRecv(c.buf, c.bytes, ncclUint8, c.peer, comm, stream));
      }
    }
  } catch (...) {
    (void)ncclGroupEnd();
    throw;
  }
  PO_NCCL_CHECK(where, ncclGroupEnd());
  batch->done = record();
  batch->launched = true;
}

}  // namespace detail

namespace {

using detail::NcclState;

// A Work completed by an event recorded after its operation.
class EventOp final : public PendingOp {
 public:
  EventOp(std::shared_ptr<NcclState> state, detail::Event done)
      : state_(std::move(state)), done_(std::move(done)) {}
  bool poll() override { return state_->event_done(done_.get()); }

 private:
  std::shared_ptr<NcclState> state_;
  detail::Event done_;
};

// A Work of a batched send or receive: launches the batch when first polled.
class P2pOp final : public PendingOp {
 public:
  P2pOp(std::shared_ptr<NcclState> state, std::shared_ptr<detail::P2pBatch> batch)
      : state_(std::move(state)), batch_(std::move(batch)) {}
  bool poll() override {
    // An unlaunched batch is always the open one: every launch flushes it.
    if (!batch_->launched) state_->flush_p2p();
    if (!batch_->launched) {  // its launch threw earlier; the group is broken
      PO_THROW(core::CommError, "point-to-point batch on ", state_->where, " failed to launch");
    }
    return state_->event_done(batch_->done.get());
  }

 private:
  std::shared_ptr<NcclState> state_;
  std::shared_ptr<detail::P2pBatch> batch_;
};

// f32 scratch from the communicator's pool, freed in stream order when the
// scope ends (after the kernels that use it were enqueued, or on an error).
class StreamScratch {
 public:
  StreamScratch(const NcclState& s, size_t n) : stream_(s.stream) {
    PO_NCCL_CUDA_CHECK(s.where, cudaMallocFromPoolAsync(reinterpret_cast<void**>(&ptr_),
                                                        n * sizeof(float), s.pool, s.stream));
  }
  ~StreamScratch() { (void)cudaFreeAsync(ptr_, stream_); }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  float* get() const { return ptr_; }

 private:
  float* ptr_ = nullptr;
  cudaStream_t stream_;
};

bool is_16bit_float(DType d) { return d == DType::kBF16 || d == DType::kF16; }

void check_reducible(DType d, const char* what) {
  PO_CHECK(d == DType::kF32 || is_16bit_float(d), what,
           ": reductions support F32, BF16 and F16, not ", tensor::dtype_name(d));
}

kernels::Half half_of(DType d) {
  return d == DType::kBF16 ? kernels::Half::kBF16 : kernels::Half::kF16;
}

ncclDataType_t nccl_float_type(DType d) {
  switch (d) {
    case DType::kF32: return ncclFloat32;
    case DType::kBF16: return ncclBfloat16;
    case DType::kF16: return ncclFloat16;
    default: break;
  }
  PO_THROW(core::InvalidArgument, "no NCCL floating-point type for ", tensor::dtype_name(d));
}

// Sum and avg both sum (avg divides afterwards, in f32).
ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::kMax ? ncclMax : ncclSum; }

void require_device(int device, const std::string& where) {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess) {
    (void)cudaGetLastError();  // clear it so that later CUDA calls do not report it
    PO_THROW(core::CommError, "NCCL communicator for ", where, ": no usable CUDA device ",
             "(cudaGetDeviceCount: ", cudaGetErrorName(rc), ": ", cudaGetErrorString(rc), ")");
  }
  if (count == 0) {
    PO_THROW(core::CommError, "NCCL communicator for ", where,
             ": no usable CUDA device (cudaGetDeviceCount: 0 devices)");
  }
  if (device < 0 || device >= count) {
    PO_THROW(core::CommError, "NCCL communicator for ", where, ": CUDA device ", device,
             " does not exist (", count, " device", count == 1 ? "" : "s", " present)");
  }
}

}  // namespace

// ---- creation --------------------------------------------------------------

std::unique_ptr<NcclCommunicator> NcclCommunicator::create(Communicator& bootstrap, int device,
                                                           const NcclOptions& options) {
  const std::string name = options.name.empty() ? bootstrap.name() : options.name;
  const std::string where = detail::where_text(name, bootstrap.rank(), bootstrap.size(), device);
  ncclUniqueId id{};
  std::exception_ptr local_failure;
  try {
    require_device(device, where);
    if (bootstrap.rank() == 0) PO_NCCL_CHECK(where, ncclGetUniqueId(&id));
  } catch (...) {
    local_failure = std::current_exception();
  }
  // Agree before NCCL init, which would wait forever for a rank that failed.
  float failed = local_failure ? 1.0f : 0.0f;
  bootstrap.allreduce(&failed, 1, DType::kF32, ReduceOp::kMax);
  if (local_failure) std::rethrow_exception(local_failure);
  if (failed != 0.0f) {
    PO_THROW(core::CommError, "NCCL communicator for ", where, " not created: another rank of '",
             bootstrap.name(), "' could not set up its CUDA device or NCCL id (see its error)");
  }
  static_assert(sizeof(ncclUniqueId) % sizeof(int32_t) == 0);
  bootstrap.broadcast(&id, sizeof(id) / sizeof(int32_t), DType::kI32, 0);

  detail::DeviceGuard guard(device, where);
  ncclComm_t comm = nullptr;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  PO_NCCL_CHECK(where,
                ncclCommInitRankConfig(&comm, bootstrap.size(), id, bootstrap.rank(), &config));
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(comm, name, options.timeout, device));
}

NcclCommunicator::NcclCommunicator(ncclComm_t comm, std::string name, Duration timeout, int device)
    : state_(std::make_shared<NcclState>()), timeout_(timeout) {
  NcclState& s = *state_;
  s.comm = comm;  // owned from here: ~NcclState frees it if the rest throws
  s.device = device;
  s.name = std::move(name);
  s.where = core::str_cat("group '", s.name, "' (CUDA device ", device, ")");
  PO_NCCL_CHECK(s.where, ncclCommUserRank(comm, &s.rank));
  PO_NCCL_CHECK(s.where, ncclCommCount(comm, &s.size));
  s.where = detail::where_text(s.name, s.rank, s.size, device);

  detail::DeviceGuard guard(device, s.where);
  PO_NCCL_CUDA_CHECK(s.where, cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  PO_NCCL_CUDA_CHECK(s.where, cudaMemPoolCreate(&s.pool, &props));
  uint64_t keep_all = UINT64_MAX;  // the pool keeps its peak: no cudaMalloc in the steady state
  PO_NCCL_CUDA_CHECK(s.where,
                     cudaMemPoolSetAttribute(s.pool, cudaMemPoolAttrReleaseThreshold, &keep_all));
  PO_NCCL_CUDA_CHECK(s.where, cudaMalloc(reinterpret_cast<void**>(&s.barrier_buf), sizeof(float)));
  // On our stream: a plain cudaMemset could still be running when a barrier
  // on this non-blocking stream reads the buffer.
  PO_NCCL_CUDA_CHECK(s.where, cudaMemsetAsync(s.barrier_buf, 0, sizeof(float), s.stream));
}

NcclCommunicator::~NcclCommunicator() = default;

int NcclCommunicator::rank() const { return state_->rank; }
int NcclCommunicator::size() const { return state_->size; }
const std::string& NcclCommunicator::name() const { return state_->name; }
int NcclCommunicator::device() const { return state_->device; }
cudaStream_t NcclCommunicator::stream() const { return state_->stream; }
ncclComm_t NcclCommunicator::handle() const { return state_->comm; }
void NcclCommunicator::abort() noexcept { state_->abort(); }
bool NcclCommunicator::aborted() const { return state_->aborted; }

std::string NcclCommunicator::describe(const std::string& op) const {
  return core::str_cat(op, " on ", state_->where);
}

void NcclCommunicator::check_peer(int peer, const char* what) const {
  PO_CHECK(peer >= 0 && peer < state_->size, what, ": rank ", peer, " is not in group '",
           state_->name, "' of size ", state_->size);
}

template <typename Body>
Work NcclCommunicator::launch(const std::string& op, Body&& body) {
  NcclState& s = *state_;
  s.check_usable();
  s.flush_p2p();
  detail::DeviceGuard guard(s.device, s.where);
  body(s);
  return Work(std::make_unique<EventOp>(state_, s.record()), describe(op), timeout_);
}

// ---- collectives -----------------------------------------------------------

Work NcclCommunicator::iallreduce(void* buf, size_t count, DType dtype, ReduceOp op) {
  count_op(CommOp::kAllReduce, count, dtype);
  check_reducible(dtype, "allreduce");
  const float divisor = op == ReduceOp::kAvg ? static_cast<float>(size()) : 1.0f;
  const std::string what = core::str_cat("allreduce(", reduce_op_name(op), ", ",
                                         tensor::dtype_name(dtype), ", ", count, " elements)");
  return launch(what, [&](NcclState& s) {
    if (count == 0) return;
    if (dtype == DType::kF32 || op == ReduceOp::kMax) {
      PO_NCCL_CHECK(s.where, ncclAllReduce(buf, buf, count, nccl_float_type(dtype), nccl_op(op),
                                           s.comm, s.stream));
      if (dtype == DType::kF32 && op == ReduceOp::kAvg) {
        PO_NCCL_CUDA_CHECK(s.where,
                           kernels::divide(static_cast<float*>(buf), count, divisor, s.stream));
      }
      return;
    }
    StreamScratch scratch(s, count);
    float* f = scratch.get();
    PO_NCCL_CUDA_CHECK(s.where, kernels::widen(buf, half_of(dtype), f, count, s.stream));
    PO_NCCL_CHECK(s.where, ncclAllReduce(f, f, count, ncclFloat32, ncclSum, s.comm, s.stream));
    PO_NCCL_CUDA_CHECK(s.where, kernels::narrow(f, half_of(dtype), buf, count, divisor, s.stream));
  });
}

Work NcclCommunicator::ireduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype,
                                       ReduceOp op) {
  count_op(CommOp::kReduceScatter, recv_count * static_cast<size_t>(size()), dtype);
  check_reducible(dtype, "reduce_scatter");
  const float divisor = op == ReduceOp::kAvg ? static_cast<float>(size()) : 1.0f;
  const std::string what =
      core::str_cat("reduce_scatter(", reduce_op_name(op), ", ", tensor::dtype_name(dtype), ", ",
                    recv_count, " elements per rank)");
  return launch(what, [&](NcclState& s) {
    if (recv_count == 0) return;
    if (dtype == DType::kF32 || op == ReduceOp::kMax) {
      PO_NCCL_CHECK(s.where, ncclReduceScatter(send, recv, recv_count, nccl_float_type(dtype),
                                               nccl_op(op), s.comm, s.stream));
      if (dtype == DType::kF32 && op == ReduceOp::kAvg) {
        PO_NCCL_CUDA_CHECK(
            s.where, kernels::divide(static_cast<float*>(recv), recv_count, divisor, s.stream));
      }
      return;
    }
    const size_t total = recv_count * static_cast<size_t>(s.size);
    StreamScratch scratch(s, total + recv_count);
    float* f_send = scratch.get();
    float* f_recv = f_send + total;
    PO_NCCL_CUDA_CHECK(s.where, kernels::widen(send, half_of(dtype), f_send, total, s.stream));
    PO_NCCL_CHECK(s.where, ncclReduceScatter(f_send, f_recv, recv_count, ncclFloat32, ncclSum,
                                             s.comm, s.stream));
    PO_NCCL_CUDA_CHECK(
        s.where, kernels::narrow(f_recv, half_of(dtype), recv, recv_count, divisor, s.stream));
  });
}

// Data movement is typeless: every DType moves as bytes.
Work NcclCommunicator::iall_gather(const void* send, void* recv, size_t send_count, DType dtype) {
  count_op(CommOp::kAllGather, send_count * static_cast<size_t>(size()), dtype);
  const size_t bytes = send_count * tensor::dtype_size(dtype);
  const std::string what = core::str_cat("all_gather(", tensor::dtype_name(dtype), ", ", send_count,
                                         " elements per rank)");
  return launch(what, [&](NcclState& s) {
    if (bytes == 0) return;
    PO_NCCL_CHECK(s.where, ncclAllGather(send, recv, bytes, ncclUint8, s.comm, s.stream));
  });
}

Work NcclCommunicator::ibroadcast(void* buf, size_t count, DType dtype, int root) {
  count_op(CommOp::kBroadcast, count, dtype);
  check_peer(root, "broadcast root");
  const size_t bytes = count * tensor::dtype_size(dtype);
  const std::string what = core::str_cat("broadcast(", tensor::dtype_name(dtype), ", ", count,
                                         " elements, root ", root, ")");
  return launch(what, [&](NcclState& s) {
    if (bytes == 0) return;
    PO_NCCL_CHECK(s.where, ncclBroadcast(buf, buf, bytes, ncclUint8, root, s.comm, s.stream));
  });
}

Work NcclCommunicator::iall_to_all(const void* send, void* recv, size_t count_per_rank,
                                   DType dtype) {
  count_op(CommOp::kAllToAll, count_per_rank * static_cast<size_t>(size()), dtype);
  const size_t bytes = count_per_rank * tensor::dtype_size(dtype);
  const std::string what = core::str_cat("all_to_all(", tensor::dtype_name(dtype), ", ",
                                         count_per_rank, " elements per rank)");
  return launch(what, [&](NcclState& s) {
    if (bytes == 0) return;
    const auto* in = static_cast<const uint8_t*>(send);
    auto* out = static_cast<uint8_t*>(recv);
    PO_NCCL_CHECK(s.where, ncclGroupStart());
    try {
      for (int r = 0; r < s.size; ++r) {
        const size_t off = static_cast<size_t>(r) * bytes;
        PO_NCCL_CHECK(s.where, ncclSend(in + off, bytes, ncclUint8, r, s.comm, s.stream));
        PO_NCCL_CHECK(s.where, ncclRecv(out + off, bytes, ncclUint8, r, s.comm, s.stream));
      }
    } catch (...) {
      (void)ncclGroupEnd();
      throw;
    }
    PO_NCCL_CHECK(s.where, ncclGroupEnd());
  });
}

Work NcclCommunicator::ibarrier() {
  count_op(CommOp::kBarrier, 0, DType::kF32);
  return launch("barrier", [&](NcclState& s) {
    // max of zeros stays zero: the buffer never needs resetting.
    PO_NCCL_CHECK(s.where, ncclAllReduce(s.barrier_buf, s.barrier_buf, 1, ncclFloat32, ncclMax,
                                         s.comm, s.stream));
  });
}

// ---- point to point --------------------------------------------------------

Work NcclCommunicator::queue_p2p(bool is_send, const void* buf, size_t count, DType dtype, int peer,
                                 int tag, const std::string& op) {
  check_peer(peer, is_send ? "send" : "recv");
  PO_CHECK(tag >= 0, is_send ? "send" : "recv", ": tag ", tag, " must be >= 0");
  NcclState& s = *state_;
  s.check_usable();
  const size_t bytes = count * tensor::dtype_size(dtype);
  if (bytes == 0) return Work();  // both sides skip it: nothing to match
  if (!s.open_batch) s.open_batch = std::make_shared<detail::P2pBatch>();
  s.open_batch->calls.push_back({is_send, const_cast<void*>(buf), bytes, peer});
  return Work(std::make_unique<P2pOp>(state_, s.open_batch), describe(op), timeout_);
}

Work NcclCommunicator::isend(const void* buf, size_t count, DType dtype, int peer, int tag) {
  count_op(CommOp::kSend, count, dtype);
  return queue_p2p(true, buf, count, dtype, peer, tag,
                   core::str_cat("send(", tensor::dtype_name(dtype), ", ", count,
                                 " elements, to rank ", peer, ", tag ", tag, ")"));
}

Work NcclCommunicator::irecv(void* buf, size_t count, DType dtype, int peer, int tag) {
  count_op(CommOp::kRecv, count, dtype);
  return queue_p2p(false, buf, count, dtype, peer, tag,
                   core::str_cat("recv(", tensor::dtype_name(dtype), ", ", count,
                                 " elements, from rank ", peer, ", tag ", tag, ")"));
}

// ---- groups ----------------------------------------------------------------

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key, const std::string& name) {
  PO_CHECK(color >= 0 || color == kNoColor, "split: color ", color,
           " must be >= 0 or Communicator::kNoColor");
  static_assert(Communicator::kNoColor == NCCL_SPLIT_NOCOLOR);
  NcclState& s = *state_;
  s.check_usable();
  s.flush_p2p();
  detail::DeviceGuard guard(s.device, s.where);
  ncclComm_t sub = nullptr;
  PO_NCCL_CHECK(s.where,
                ncclCommSplit(s.comm, color, key, &sub, nullptr));  // nullptr: inherit config
  if (sub == nullptr) return nullptr;
  std::string sub_name = name.empty() ? core::str_cat(s.name, "/", color) : name;
  return std::unique_ptr<Communicator>(
      new NcclCommunicator(sub, std::move(sub_name), timeout_, s.device));
}

}  // namespace po::comm::nccl
