// The checkpoint container: one file holding named byte sections, each
// checksummed, so a torn or corrupted checkpoint is detected on load rather
// than silently resumed from. Layout (all integers little-endian):
//
//   header (64 bytes):  magic "POCKPT\0\0" | u32 version (1) | u32 section count
//                       | u64 toc bytes | u64 file bytes | u64 reserved (0)
//                       | u64 XXH3_64(header[0, 40) ++ toc) | zero padding
//   toc:                per section: u32 name length | name | u64 offset
//                       | u64 size | u64 XXH3_64(section bytes)
//   sections:           each starting at a multiple of 64 bytes (so f32 data
//                       is aligned when the file is mapped), zero padding
//
// Metadata (small string key/values) is stored as the JSON section
// "__metadata__". Names starting with "__" are reserved. The reader maps the
// file and verifies magic, version, the toc checksum, every bound and every
// section's checksum before returning; errors name the file and the section.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "checkpoint/mapped_file.h"

namespace po::checkpoint {

inline constexpr uint32_t kContainerVersion = 1;

class ContainerWriter {
 public:
  // Adds section `name` of `size` bytes. The bytes are NOT copied: they must
  // stay valid until write() returns. Duplicate, empty or reserved ("__")
  // names are InvalidArgument.
  void add(const std::string& name, const void* data, size_t size);
  // Adds a section holding a copy of `bytes` (small values: step, RNG state, config text).
  void add_copy(const std::string& name, std::string bytes);
  // Adds a trivially copyable value (copied).
  template <typename T>
  void add_value(const std::string& name, const T& v) {
    add_copy(name, std::string(reinterpret_cast<const char*>(&v), sizeof(T)));
  }
  // Sets a metadata key (stored as the "__metadata__" JSON section).
  void set_metadata(const std::string& key, const std::string& value);

  // Writes the container to `path` atomically (atomic_file.h).
  void write(const std::string& path) const;
  // The same file image in memory (tests, fuzz seeds).
  std::string serialize() const;

  // A section as laid out by the writer (internal; public for the layout helper).
  struct Section {
    std::string name;
    const void* data;
    size_t size;
  };

 private:
  void check_name(const std::string& name) const;
  std::vector<Section> all_sections(std::string* metadata_json) const;

  std::vector<Section> sections_;
  std::vector<std::unique_ptr<std::string>> owned_;  // stable addresses for add_copy
  std::map<std::string, std::string> metadata_;
};

class ContainerReader {
 public:
  // Maps `path` and verifies it completely. IoError when it cannot be read;
  // InvalidArgument naming the file (and section) when it is corrupt.
  static ContainerReader open(const std::string& path);
  // Verifies an in-memory image; `origin` names it in errors. Not copied:
  // the bytes must outlive the reader.
  static ContainerReader from_bytes(const void* data, size_t size, const std::string& origin);

  bool has(const std::string& name) const { return sections_.count(name) != 0; }
  // The bytes of section `name`; InvalidArgument "FILE: missing section 'x'" when absent.
  std::span<const std::byte> section(const std::string& name) const;
  // Copies section `name` into `dst`, which holds exactly `size` bytes; a size
  // mismatch is InvalidArgument naming the file, section and both sizes.
  void read_into(const std::string& name, void* dst, size_t size) const;
  // Reads a section written with add_value<T>.
  template <typename T>
  T read_value(const std::string& name) const {
    T v;
    read_into(name, &v, sizeof(T));
    return v;
  }
  // Section contents as a string (config text).
  std::string read_string(const std::string& name) const;
  // Section names in file order (metadata excluded).
  const std::vector<std::string>& names() const { return names_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& origin() const { return origin_; }

 private:
  ContainerReader() = default;
  void parse(const std::byte* data, size_t size);

  std::string origin_;
  MappedFile file_;
  std::map<std::string, std::span<const std::byte>> sections_;
  std::vector<std::string> names_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace po::checkpoint
