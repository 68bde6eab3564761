// llm.c token files: see token_file.h. The format is little-endian; this code
// assumes a little-endian host (checked at compile time).
#include "data/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include "core/error.h"

namespace po::data {
namespace {

static_assert(std::endian::native == std::endian::little, "token files are little-endian");

[[noreturn]] void throw_sys(const std::string& what, const std::string& path) {
  PO_THROW(core::IoError, what, " ", path, ": ", std::strerror(errno));
}

// write() the whole buffer, retrying EINTR and short writes.
void write_all(int fd, const void* data, size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = ::write(fd, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_sys("cannot write", path);
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

// Closes the fd and removes the temp file unless committed.
struct TempFile {
  int fd = -1;
  std::string path;
  bool committed = false;
  ~TempFile() {
    if (fd >= 0) ::close(fd);
    if (!committed && !path.empty()) ::unlink(path.c_str());
  }
};

// `head` then `body`, written to `path` atomically (temp file in the same
// directory, fsync, rename, fsync of the directory).
void write_parts_atomically(const std::string& path, const void* head, size_t head_bytes, const void* body,
                            size_t body_bytes) {
  std::filesystem::path final_path(path);
  std::filesystem::path dir = final_path.parent_path();
  if (dir.empty()) dir = ".";
  TempFile tmp;
  std::string tmp_name = ".";  // built by appends: GCC 12 warns falsely on "." + std::string
  tmp_name += final_path.filename().string();
  tmp_name += ".tmp.XXXXXX";
  tmp.path = (dir / tmp_name).string();
  tmp.fd = ::mkstemp(tmp.path.data());
  if (tmp.fd < 0) {
    std::string p = tmp.path;
    tmp.path.clear();
    throw_sys("cannot create temporary file", p);
  }
  ::fchmod(tmp.fd, 0644);
  write_all(tmp.fd, head, head_bytes, tmp.path);
  write_all(tmp.fd, body, body_bytes, tmp.path);
  if (::fsync(tmp.fd) != 0) throw_sys("cannot fsync", tmp.path);
  int fd = tmp.fd;
  tmp.fd = -1;
  if (::close(fd) != 0) throw_sys("cannot close", tmp.path);
  if (::rename(tmp.path.c_str(), path.c_str()) != 0) throw_sys("cannot rename " + tmp.path + " to", path);
  tmp.committed = true;
  // Make the rename durable; failure here is not worth failing the write for.
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

// The 256-int header and the body, written to `path` atomically.
void write_with_header(const std::string& path, int32_t magic, size_t count, const void* body,
                       size_t body_bytes) {
  PO_CHECK(count <= static_cast<size_t>(INT32_MAX), path, ": ", count,
           " tokens do not fit the header's int32 count");
  std::vector<int32_t> header(kTokenFileHeaderInts, 0);
  header[0] = magic;
  header[1] = kTokenFileVersion;
  header[2] = static_cast<int32_t>(count);
  write_parts_atomically(path, header.data(), kTokenFileHeaderBytes, body, body_bytes);
}

// The header's count after checking its size, magic and version ("token" or
// "mask" file, for messages).
int32_t header_count(std::span<const std::byte> data, std::string_view name, int32_t magic, const char* kind) {
  PO_CHECK(data.size() >= kTokenFileHeaderBytes, name, ": not a ", kind, " file: ", data.size(),
           " bytes is shorter than the ", kTokenFileHeaderBytes, "-byte header");
  int32_t header[3];
  std::memcpy(header, data.data(), sizeof(header));
  PO_CHECK(header[0] == magic, name, ": not a ", kind, " file: magic ", header[0], ", expected ", magic);
  PO_CHECK(header[1] == kTokenFileVersion, name, ": unsupported ", kind, " file version ", header[1], ", expected ",
           kTokenFileVersion);
  PO_CHECK(header[2] >= 0, name, ": negative token count ", header[2]);
  return header[2];
}

}  // namespace

void write_token_file(const std::string& path, std::span<const int32_t> tokens) {
  std::vector<uint16_t> body(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    PO_CHECK(tokens[i] >= 0 && tokens[i] <= 0xFFFF, path, ": token ", i, " has id ", tokens[i],
             ", which does not fit in uint16");
    body[i] = static_cast<uint16_t>(tokens[i]);
  }
  write_with_header(path, kTokenFileMagic, body.size(), body.data(), body.size() * sizeof(uint16_t));
}

void write_text_atomically(const std::string& path, std::string_view text) {
  write_parts_atomically(path, text.data(), text.size(), nullptr, 0);
}

void write_mask_file(const std::string& path, std::span<const uint8_t> mask) {
  write_with_header(path, kMaskFileMagic, mask.size(), mask.data(), mask.size());
}

std::string mask_path(const std::string& token_path) {
  std::filesystem::path p(token_path);
  return p.replace_extension(".mask").string();
}

std::vector<uint8_t> read_mask_file(const std::string& path, size_t tokens) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) throw_sys("cannot open mask file", path);
  std::vector<std::byte> data;
  std::byte buf[1 << 16];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), f)) > 0;) data.insert(data.end(), buf, buf + n);
  const bool bad = std::ferror(f) != 0;
  std::fclose(f);
  if (bad) throw_sys("cannot read mask file", path);
  const int32_t count = header_count(data, path, kMaskFileMagic, "mask");
  PO_CHECK(data.size() - kTokenFileHeaderBytes == static_cast<size_t>(count), path, ": header says ", count,
           " tokens but the file holds ", data.size() - kTokenFileHeaderBytes, " mask bytes");
  PO_CHECK(static_cast<size_t>(count) == tokens, path, ": masks ", count, " tokens but its token file has ",
           tokens);
  std::vector<uint8_t> mask(tokens);
  std::memcpy(mask.data(), data.data() + kTokenFileHeaderBytes, tokens);
  return mask;
}

std::span<const uint16_t> parse_token_file(std::span<const std::byte> data, std::string_view name,
                                           int32_t vocab_size) {
  const int32_t count = header_count(data, name, kTokenFileMagic, "token");
  const size_t body = data.size() - kTokenFileHeaderBytes;
  PO_CHECK(body == static_cast<size_t>(count) * sizeof(uint16_t), name, ": header says ", count,
           " tokens (", static_cast<size_t>(count) * 2 + kTokenFileHeaderBytes, " bytes) but the file has ",
           data.size(), " bytes");
  const auto* tokens = reinterpret_cast<const uint16_t*>(data.data() + kTokenFileHeaderBytes);
  PO_ASSERT(reinterpret_cast<uintptr_t>(tokens) % alignof(uint16_t) == 0, "token data is misaligned");
  std::span<const uint16_t> out(tokens, static_cast<size_t>(count));
  if (vocab_size > 0) {
    for (size_t i = 0; i < out.size(); ++i) {
      if (out[i] >= vocab_size) {
        PO_THROW(core::InvalidArgument, name, ": token ", i, " has id ", out[i], ", outside the vocabulary of ",
                 vocab_size);
      }
    }
  }
  return out;
}

TokenFile::TokenFile(const std::string& path, int32_t vocab_size) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw_sys("cannot open token file", path);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int saved = errno;
    ::close(fd);
    errno = saved;
    throw_sys("cannot stat", path);
  }
  map_bytes_ = static_cast<size_t>(st.st_size);
  if (map_bytes_ > 0) {
    map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map_ == MAP_FAILED) {
      map_ = nullptr;
      int saved = errno;
      ::close(fd);
      errno = saved;
      throw_sys("cannot mmap", path);
    }
  }
  ::close(fd);
  try {
    tokens_ = parse_token_file({static_cast<const std::byte*>(map_), map_bytes_}, path, vocab_size);
  } catch (...) {
    release();
    throw;
  }
}

TokenFile::~TokenFile() { release(); }

TokenFile::TokenFile(TokenFile&& other) noexcept
    : path_(std::move(other.path_)), map_(other.map_), map_bytes_(other.map_bytes_), tokens_(other.tokens_) {
  other.map_ = nullptr;
  other.map_bytes_ = 0;
  other.tokens_ = {};
}

TokenFile& TokenFile::operator=(TokenFile&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    map_ = other.map_;
    map_bytes_ = other.map_bytes_;
    tokens_ = other.tokens_;
    other.map_ = nullptr;
    other.map_bytes_ = 0;
    other.tokens_ = {};
  }
  return *this;
}

void TokenFile::release() noexcept {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
  tokens_ = {};
}

}  // namespace po::data
