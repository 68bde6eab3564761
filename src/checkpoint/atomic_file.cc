// See atomic_file.h. Every OS call is checked and EINTR retried; errors name
// the path and strerror(errno).
#include "checkpoint/atomic_file.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "core/error.h"

namespace po::checkpoint {
namespace {

[[noreturn]] void throw_errno(const std::string& what, const std::string& path, int err) {
  PO_THROW(core::IoError, what, " '", path, "': ", std::strerror(err));
}

}  // namespace

std::string parent_dir(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

void fsync_dir(const std::string& dir) {
  int fd;
  do {
    fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) throw_errno("cannot open directory", dir, errno);
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  // Some filesystems do not support fsync on directories; that is not a failure.
  if (rc != 0 && err != EINVAL && err != EROFS) throw_errno("cannot fsync directory", dir, err);
}

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  PO_CHECK(!path_.empty(), "atomic file: empty path");
  temp_path_ = core::str_cat(path_, ".tmp.", ::getpid());
  do {
    fd_ = ::open(temp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  } while (fd_ < 0 && errno == EINTR);
  if (fd_ < 0) throw_errno("cannot create temp file for", path_, errno);
}

AtomicFile::AtomicFile(AtomicFile&& o) noexcept
    : path_(std::move(o.path_)),
      temp_path_(std::move(o.temp_path_)),
      fd_(o.fd_),
      written_(o.written_),
      committed_(o.committed_) {
  o.fd_ = -1;
  o.committed_ = true;  // the moved-from object owns nothing to clean up
}

AtomicFile::~AtomicFile() {
  if (!committed_) discard();
}

void AtomicFile::discard() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!temp_path_.empty()) ::unlink(temp_path_.c_str());
  committed_ = true;
}

void AtomicFile::write(const void* data, size_t size) {
  PO_ASSERT(!committed_ && fd_ >= 0, "write after commit to ", path_);
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    // Linux writes at most ~2 GiB per call; chunk so huge sections never overflow ssize_t.
    size_t chunk = size < (size_t{1} << 30) ? size : (size_t{1} << 30);
    ssize_t n = ::write(fd_, p, chunk);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("cannot write", temp_path_, errno);
    }
    p += n;
    size -= static_cast<size_t>(n);
    written_ += static_cast<size_t>(n);
  }
}

void AtomicFile::write_zeros(size_t size) {
  static const char kZeros[4096] = {};
  while (size > 0) {
    size_t n = size < sizeof(kZeros) ? size : sizeof(kZeros);
    write(kZeros, n);
    size -= n;
  }
}

void AtomicFile::commit() {
  PO_ASSERT(!committed_ && fd_ >= 0, "double commit of ", path_);
  try {
    if (::fsync(fd_) != 0) throw_errno("cannot fsync", temp_path_, errno);
    int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0 && errno != EINTR) throw_errno("cannot close", temp_path_, errno);
    if (::rename(temp_path_.c_str(), path_.c_str()) != 0)
      throw_errno("cannot rename temp file over", path_, errno);
  } catch (...) {
    discard();
    throw;
  }
  committed_ = true;
  // The data is in place; a failed directory fsync still throws so the caller
  // knows durability is not guaranteed, but the new file is kept.
  fsync_dir(parent_dir(path_));
}

void write_file_atomic(const std::string& path, const void* data, size_t size) {
  AtomicFile f(path);
  f.write(data, size);
  f.commit();
}

void write_file_atomic(const std::string& path, const std::function<void(AtomicFile&)>& fill) {
  AtomicFile f(path);
  fill(f);
  f.commit();
}

void replace_dir_atomic(const std::string& staged_dir, const std::string& final_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(staged_dir, ec))
    PO_THROW(core::IoError, "cannot replace directory '", final_dir, "': staged '", staged_dir,
             "' is not a directory");
  if (!fs::exists(final_dir, ec)) {
    if (::rename(staged_dir.c_str(), final_dir.c_str()) != 0)
      throw_errno("cannot rename staged directory to", final_dir, errno);
  } else {
    if (::renameat2(AT_FDCWD, staged_dir.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) != 0)
      throw_errno("cannot swap staged directory with", final_dir, errno);
    // staged_dir now holds the old tree.
    fs::remove_all(staged_dir, ec);
    if (ec) PO_THROW(core::IoError, "cannot remove old directory '", staged_dir, "': ", ec.message());
  }
  fsync_dir(parent_dir(final_dir));
}

}  // namespace po::checkpoint
