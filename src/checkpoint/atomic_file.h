// Crash-safe file replacement. A file is written to `<path>.tmp.<pid>` in the
// target's directory, fsynced, renamed over the target, and the directory is
// fsynced, so a reader (or a machine that loses power) sees either the old
// file or the complete new one, never a torn mix. On any failure, and when an
// AtomicFile is destroyed without commit(), the temp file is removed and the
// old target is left untouched. Errors are IoError naming the path and the
// OS reason (strerror).
#pragma once

#include <cstddef>
#include <functional>
#include <string>

namespace po::checkpoint {

// A file being written; becomes visible at `path` only on commit(). Move-only.
class AtomicFile {
 public:
  // Creates the temp file beside `path` (same directory, hence same filesystem).
  explicit AtomicFile(std::string path);
  // Removes the temp file unless committed. Never throws.
  ~AtomicFile();
  AtomicFile(AtomicFile&& o) noexcept;
  AtomicFile& operator=(AtomicFile&&) = delete;
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  // Appends `size` bytes (retries short writes and EINTR).
  void write(const void* data, size_t size);
  // Appends `size` zero bytes (alignment padding).
  void write_zeros(size_t size);
  // Bytes written so far.
  size_t size() const { return written_; }
  // fsync file, rename over the target, fsync the directory.
  void commit();

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_path_; }

 private:
  void discard() noexcept;

  std::string path_;
  std::string temp_path_;
  int fd_ = -1;
  size_t written_ = 0;
  bool committed_ = false;
};

// Writes `size` bytes to `path` atomically.
void write_file_atomic(const std::string& path, const void* data, size_t size);

// Calls `fill` with a fresh AtomicFile for `path`, then commits it. If `fill`
// throws, the temp file is removed, the old target is kept, and the exception
// propagates.
void write_file_atomic(const std::string& path, const std::function<void(AtomicFile&)>& fill);

// Replaces directory `final_dir` with the fully written directory `staged_dir`
// (same filesystem). Uses renameat2(RENAME_EXCHANGE) so the swap is atomic,
// then removes the old tree; when `final_dir` does not exist, a plain rename.
// The parent directory is fsynced.
void replace_dir_atomic(const std::string& staged_dir, const std::string& final_dir);

// Directory part of `path` ("." when it has none).
std::string parent_dir(const std::string& path);

// fsyncs directory `dir`; IoError on failure.
void fsync_dir(const std::string& dir);

}  // namespace po::checkpoint
