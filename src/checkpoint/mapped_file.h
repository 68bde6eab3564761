// A read-only memory map of a whole file, released on destruction. Readers of
// large checkpoints parse in place instead of copying gigabytes.
#pragma once

#include <cstddef>
#include <string>

namespace po::checkpoint {

class MappedFile {
 public:
  MappedFile() = default;
  // Maps `path` read-only; IoError naming the path when it cannot be opened.
  // An empty file maps to {nullptr, 0}.
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(MappedFile&& o) noexcept;
  MappedFile& operator=(MappedFile&& o) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  void release() noexcept;

  std::string path_;
  const std::byte* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace po::checkpoint
