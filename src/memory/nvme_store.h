// The NVMe tier: one scratch swap file of fixed-size slots, read and written
// asynchronously with O_DIRECT on 4096-byte aligned buffers.
//
// Engine: io_uring (liburing) where the kernel allows it; each slot I/O is
// cut into `block_bytes` requests and at most `queue_depth` requests are in
// flight (DeepSpeed ZeRO-Infinity's defaults are 1 MiB and 8). Where
// io_uring_queue_init is refused (seccomp, old kernels, containers) or
// `force_fallback` is set, a pool of `queue_depth` threads does the same
// requests with pread/pwrite. Which one runs is logged at start-up.
//
// The queue keeps moving while the caller computes: with io_uring a
// completion thread takes each finished request and submits the next one at
// once (before, requests beyond the queue depth waited in user space until
// the caller next called in, so the disk sat idle through every page's
// update, and the faster the disk the longer it idled). Queued reads go
// before queued writes: a read is a page someone waits for, a write only
// frees a frame (the pager never reads a slot whose write is in flight).
//
// The file is scratch: created (O_EXCL) and preallocated (fallocate: a full
// disk fails now, not mid-step) at construction, removed at destruction and,
// through a signal handler installed with the first store, on SIGINT and
// SIGTERM before the signal's previous disposition runs. The durable copy of
// training state is the checkpoint, never the swap file.
//
// Errors (EIO, ENOSPC, a short read or write) surface at wait() as
// core::IoError naming the operation, the slot, the file and the tier.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace po::memory {

// Where a page can live.
enum class Tier : uint8_t { kCompute, kHost, kNvme };
const char* tier_name(Tier t);

struct NvmeOptions {
  int queue_depth = 8;                    // requests in flight
  size_t block_bytes = size_t{1} << 20;   // bytes per request
  bool force_fallback = false;            // pread/pwrite threads even where io_uring works
};

class NvmeStore {
 public:
  // Creates `dir`/`name` (which must not exist) holding `slots` slots of
  // `slot_bytes` (a multiple of 4096).
  NvmeStore(const std::string& dir, const std::string& name, size_t slots, size_t slot_bytes,
            const NvmeOptions& options);
  // Waits for the I/O in flight, closes and removes the file.
  ~NvmeStore();
  NvmeStore(const NvmeStore&) = delete;
  NvmeStore& operator=(const NvmeStore&) = delete;

  using Ticket = uint64_t;
  // Starts reading slot `slot` into `buf` (slot_bytes, 4096-aligned) / writing
  // `buf` to it. The buffer must stay valid until the ticket completes.
  Ticket read(size_t slot, void* buf);
  Ticket write(size_t slot, const void* buf);
  // Whether the operation is complete (never throws); wait() throws its error.
  bool done(Ticket t);
  void wait(Ticket t);

  bool uses_io_uring() const { return ring_ != nullptr; }
  bool direct() const { return direct_; }
  const std::string& path() const { return path_; }
  size_t slot_bytes() const { return slot_bytes_; }
  size_t slots() const { return slots_; }
  uint64_t bytes_read() const { return bytes_read_; }
  uint64_t bytes_written() const { return bytes_written_; }
  // Seconds during which at least one read (write) request was in flight:
  // bytes over these are the disk's bandwidth while it was busy.
  double busy_seconds(bool reads);

 private:
  struct Op {
    bool is_read = false;
    size_t slot = 0;
    char* buf = nullptr;
    size_t chunks_left = 0;
    int error = 0;        // errno of the first failed request
    bool short_io = false;
  };
  struct Request {
    Op* op;
    size_t offset_in_slot, len;
  };
  Ticket start(bool is_read, size_t slot, void* buf);
  // The next request to start (reads first), or false; under mutex_.
  bool next_request(Request* r);
  void pump_locked();       // io_uring: submits queued requests while below the queue depth
  void completer();         // io_uring: takes completions and refills the queue
  void finish_request(Op* op, long res, size_t len);
  void worker();            // fallback thread
  std::string describe(const Op& op) const;

  std::string path_;
  int fd_ = -1;
  bool direct_ = true;
  size_t slots_, slot_bytes_;
  NvmeOptions options_;
  struct Ring;
  std::unique_ptr<Ring> ring_;
  // Shared with the fallback threads (under mutex_).
  std::mutex mutex_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Request> reads_, writes_;  // requests not yet started
  std::unordered_map<Ticket, std::unique_ptr<Op>> ops_;
  Ticket next_ = 1;
  int inflight_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;  // the fallback's workers, or io_uring's completer
  int ring_error_ = 0;                // io_uring: the completer's wait failed (errno)
  // Busy time per direction (0: writes, 1: reads), under mutex_.
  int inflight_dir_[2] = {0, 0};
  int64_t busy_since_ns_[2] = {0, 0};
  int64_t busy_ns_[2] = {0, 0};
  void started(bool is_read);   // a request went to the disk
  void finished(bool is_read);  // one came back
  std::atomic<uint64_t> bytes_read_{0}, bytes_written_{0};
};

}  // namespace po::memory
