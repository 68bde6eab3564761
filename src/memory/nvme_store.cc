#include "memory/nvme_store.h"

#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "core/timer.h"
#include "core/log.h"
#include "core/signal_stack.h"

namespace po::memory {
namespace {

// ---- swap files removed on SIGINT / SIGTERM ---------------------------------
// A fixed table the handler can read without allocating.
constexpr int kMaxFiles = 64;
constexpr size_t kPathMax = 1024;
char g_paths[kMaxFiles][kPathMax];
std::atomic<bool> g_used[kMaxFiles];
struct sigaction g_previous[2];
std::once_flag g_install_once;

void on_signal(int sig) {
  for (int i = 0; i < kMaxFiles; ++i)
    if (g_used[i].load()) unlink(g_paths[i]);
  const struct sigaction& prev = g_previous[sig == SIGINT ? 0 : 1];
  if (prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN && !(prev.sa_flags & SA_SIGINFO)) {
    prev.sa_handler(sig);
    return;
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

void install_handler() {
  std::call_once(g_install_once, [] {
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_ONSTACK;  // (core/signal_stack.h)
    sigaction(SIGINT, &sa, &g_previous[0]);
    sigaction(SIGTERM, &sa, &g_previous[1]);
  });
}

int register_path(const std::string& path) {
  PO_CHECK(path.size() < kPathMax, "swap file path too long: ", path);
  for (int i = 0; i < kMaxFiles; ++i) {
    bool expected = false;
    if (g_used[i].load()) continue;
    std::memcpy(g_paths[i], path.c_str(), path.size() + 1);
    if (g_used[i].compare_exchange_strong(expected, true)) return i;
  }
  PO_THROW(core::Internal, "more than ", kMaxFiles, " swap files open at once");
}

void unregister_path(const std::string& path) {
  for (int i = 0; i < kMaxFiles; ++i)
    if (g_used[i].load() && path == g_paths[i]) g_used[i].store(false);
}

}  // namespace

const char* tier_name(Tier t) {
  switch (t) {
    case Tier::kCompute: return "compute";
    case Tier::kHost: return "host";
    case Tier::kNvme: return "nvme";
  }
  return "?";
}

struct NvmeStore::Ring {
  io_uring ring{};
  ~Ring() { io_uring_queue_exit(&ring); }
};

NvmeStore::NvmeStore(const std::string& dir, const std::string& name, size_t slots,
                     size_t slot_bytes, const NvmeOptions& options)
    : slots_(slots), slot_bytes_(slot_bytes), options_(options) {
  PO_CHECK(slot_bytes > 0 && slot_bytes % 4096 == 0, "NvmeStore: slot size ", slot_bytes,
           " is not a positive multiple of 4096");
  PO_CHECK(options.queue_depth >= 1, "memory.queue_depth = ", options.queue_depth, " must be >= 1");
  PO_CHECK(options.block_bytes >= 4096 && options.block_bytes % 4096 == 0, "memory.block_size = ",
           options.block_bytes, " must be a multiple of 4096");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  PO_CHECK(std::filesystem::is_directory(dir, ec), "memory.nvme_dir = '", dir,
           "': not a directory and cannot be created");
  path_ = (std::filesystem::path(dir) / name).string();
  install_handler();
  register_path(path_);
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_DIRECT, 0600);
  if (fd_ < 0 && errno == EINVAL) {  // a file system without O_DIRECT (tmpfs)
    direct_ = false;
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  }
  if (fd_ < 0) {
    const int e = errno;
    unregister_path(path_);
    PO_THROW(core::IoError, path_, ": cannot create the swap file (nvme tier): ", std::strerror(e));
  }
  const auto total = static_cast<off_t>(slots * slot_bytes);
  if (total > 0) {
    const int r = posix_fallocate(fd_, 0, total);
    if (r != 0) {
      ::close(fd_);
      ::unlink(path_.c_str());
      unregister_path(path_);
      PO_THROW(core::IoError, path_, ": cannot preallocate ", total,
               " bytes for the nvme tier: ", std::strerror(r));
    }
  }
  if (!options.force_fallback) {
    auto ring = std::make_unique<Ring>();
    const int r = io_uring_queue_init(static_cast<unsigned>(options.queue_depth), &ring->ring, 0);
    if (r == 0) {
      ring_ = std::move(ring);
    } else {
      PO_LOG_WARN("io_uring refused (", std::strerror(-r),
                  "): the nvme tier uses the pread/pwrite thread pool");
      ring.release();  // never initialised: nothing to exit
    }
  }
  if (ring_) {
    threads_.emplace_back([this] { completer(); });
  } else {
    for (int i = 0; i < options.queue_depth; ++i) threads_.emplace_back([this] { worker(); });
  }
}

NvmeStore::~NvmeStore() {
  {
    // Requests in flight read or write caller buffers: let them finish.
    std::unique_lock lock(mutex_);
    done_cv_.wait(lock, [&] {
      return ring_error_ != 0 || (inflight_ == 0 && reads_.empty() && writes_.empty());
    });
    stop_ = true;
    if (ring_ && ring_error_ == 0) {
      // The completer's stop: a no-op without a request behind it.
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_->ring);
      if (sqe != nullptr) {
        io_uring_prep_nop(sqe);
        io_uring_sqe_set_data(sqe, nullptr);
        io_uring_submit(&ring_->ring);
      }
    }
  }
  work_cv_.notify_all();
  for (auto& th : threads_) th.join();
  ring_.reset();
  if (fd_ >= 0) ::close(fd_);
  ::unlink(path_.c_str());
  unregister_path(path_);
}

std::string NvmeStore::describe(const Op& op) const {
  return core::str_cat(op.is_read ? "read" : "write", " of page slot ", op.slot, " (",
                       slot_bytes_, " bytes at offset ", op.slot * slot_bytes_, ") in ", path_,
                       " (nvme tier)");
}

NvmeStore::Ticket NvmeStore::read(size_t slot, void* buf) { return start(true, slot, buf); }

NvmeStore::Ticket NvmeStore::write(size_t slot, const void* buf) {
  return start(false, slot, const_cast<void*>(buf));
}

NvmeStore::Ticket NvmeStore::start(bool is_read, size_t slot, void* buf) {
  PO_CHECK(slot < slots_, path_, ": slot ", slot, " out of range (", slots_, " slots)");
  PO_CHECK(reinterpret_cast<uintptr_t>(buf) % 4096 == 0, path_, ": unaligned I/O buffer");
  auto op = std::make_unique<Op>();
  op->is_read = is_read;
  op->slot = slot;
  op->buf = static_cast<char*>(buf);
  op->chunks_left = (slot_bytes_ + options_.block_bytes - 1) / options_.block_bytes;
  Ticket t;
  {
    std::lock_guard lock(mutex_);
    if (ring_error_ != 0)
      PO_THROW(core::IoError, path_, ": io_uring wait failed: ", std::strerror(ring_error_));
    t = next_++;
    auto& queue = is_read ? reads_ : writes_;
    for (size_t off = 0; off < slot_bytes_; off += options_.block_bytes)
      queue.push_back({op.get(), off, std::min(options_.block_bytes, slot_bytes_ - off)});
    ops_.emplace(t, std::move(op));
    if (ring_) pump_locked();
  }
  if (!ring_) work_cv_.notify_all();
  return t;
}

void NvmeStore::finish_request(Op* op, long res, size_t len) {
  if (res < 0) {
    if (op->error == 0) op->error = static_cast<int>(-res);
  } else if (static_cast<size_t>(res) != len) {
    op->short_io = true;
  } else {
    (op->is_read ? bytes_read_ : bytes_written_) += len;
  }
  --op->chunks_left;
}

using core::now_ns;

void NvmeStore::started(bool is_read) {
  if (inflight_dir_[is_read]++ == 0) busy_since_ns_[is_read] = now_ns();
}

void NvmeStore::finished(bool is_read) {
  if (--inflight_dir_[is_read] == 0) busy_ns_[is_read] += now_ns() - busy_since_ns_[is_read];
}

double NvmeStore::busy_seconds(bool reads) {
  std::lock_guard lock(mutex_);
  int64_t ns = busy_ns_[reads];
  if (inflight_dir_[reads] > 0) ns += now_ns() - busy_since_ns_[reads];
  return static_cast<double>(ns) / 1e9;
}

bool NvmeStore::next_request(Request* r) {
  auto& queue = !reads_.empty() ? reads_ : writes_;
  if (queue.empty()) return false;
  *r = queue.front();
  queue.pop_front();
  return true;
}

void NvmeStore::pump_locked() {
  bool submitted = false;
  Request next{};
  while (inflight_ < options_.queue_depth && !(reads_.empty() && writes_.empty())) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_->ring);
    if (sqe == nullptr) break;
    next_request(&next);
    auto* r = new Request(next);
    const auto off = static_cast<off_t>(r->op->slot * slot_bytes_ + r->offset_in_slot);
    if (r->op->is_read)
      io_uring_prep_read(sqe, fd_, r->op->buf + r->offset_in_slot, static_cast<unsigned>(r->len), off);
    else
      io_uring_prep_write(sqe, fd_, r->op->buf + r->offset_in_slot, static_cast<unsigned>(r->len), off);
    io_uring_sqe_set_data(sqe, r);
    ++inflight_;
    started(r->op->is_read);
    submitted = true;
  }
  if (submitted) io_uring_submit(&ring_->ring);
}

// The only reader of the completion queue; submissions (here and in start())
// go through mutex_.
void NvmeStore::completer() {
  for (;;) {
    io_uring_cqe* cqe = nullptr;
    const int r = io_uring_wait_cqe(&ring_->ring, &cqe);
    if (r == -EINTR || r == -EAGAIN) continue;
    std::lock_guard lock(mutex_);
    if (r < 0) {  // the ring is unusable: every waiter hears of it
      ring_error_ = -r;
      done_cv_.notify_all();
      return;
    }
    auto* req = static_cast<Request*>(io_uring_cqe_get_data(cqe));
    const long res = cqe->res;
    io_uring_cqe_seen(&ring_->ring, cqe);
    if (req == nullptr) return;  // the destructor's stop
    finished(req->op->is_read);
    finish_request(req->op, res, req->len);
    --inflight_;
    delete req;
    pump_locked();
    done_cv_.notify_all();
  }
}

void NvmeStore::worker() {
  std::unique_lock lock(mutex_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stop_ || !(reads_.empty() && writes_.empty()); });
    Request r{};
    if (!next_request(&r)) return;  // stop_ with nothing left
    ++inflight_;
    started(r.op->is_read);
    lock.unlock();
    const auto off = static_cast<off_t>(r.op->slot * slot_bytes_ + r.offset_in_slot);
    size_t done = 0;
    long res = 0;
    while (done < r.len) {
      char* p = r.op->buf + r.offset_in_slot + done;
      const ssize_t n = r.op->is_read ? ::pread(fd_, p, r.len - done, off + static_cast<off_t>(done))
                                      : ::pwrite(fd_, p, r.len - done, off + static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        res = -errno;
        break;
      }
      if (n == 0) break;  // end of file: short
      done += static_cast<size_t>(n);
    }
    if (res == 0) res = static_cast<long>(done);
    lock.lock();
    finished(r.op->is_read);
    finish_request(r.op, res, r.len);
    --inflight_;
    done_cv_.notify_all();
  }
}

bool NvmeStore::done(Ticket t) {
  std::lock_guard lock(mutex_);
  auto it = ops_.find(t);
  return it == ops_.end() || it->second->chunks_left == 0 || ring_error_ != 0;
}

void NvmeStore::wait(Ticket t) {
  std::unique_ptr<Op> op;
  {
    std::unique_lock lock(mutex_);
    auto it = ops_.find(t);
    if (it == ops_.end()) return;
    Op* p = it->second.get();
    done_cv_.wait(lock, [&] { return p->chunks_left == 0 || ring_error_ != 0; });
    if (p->chunks_left != 0)
      PO_THROW(core::IoError, describe(*p), " failed: io_uring wait failed: ",
               std::strerror(ring_error_));
    op = std::move(it->second);
    ops_.erase(it);
  }
  if (op->error != 0)
    PO_THROW(core::IoError, describe(*op), " failed: ", std::strerror(op->error));
  if (op->short_io)
    PO_THROW(core::IoError, describe(*op), " was short (file truncated or disk full?)");
}

}  // namespace po::memory
