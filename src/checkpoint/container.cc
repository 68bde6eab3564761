// See container.h for the format. The writer streams sections straight from
// the caller's buffers; only the header and table of contents are built in memory.
#include "checkpoint/container.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "checkpoint/atomic_file.h"
#include "core/error.h"

namespace po::checkpoint {
namespace {

using Json = nlohmann::json;

constexpr char kMagic[8] = {'P', 'O', 'C', 'K', 'P', 'T', '\0', '\0'};
constexpr size_t kHeaderBytes = 64;
constexpr size_t kHashedHeaderBytes = 40;  // magic .. reserved
constexpr size_t kAlign = 64;
constexpr size_t kMinEntryBytes = 4 + 8 + 8 + 8;
constexpr const char* kMetadataSection = "__metadata__";

uint64_t align_up(uint64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

void put_u32(std::string& s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void put_u64(std::string& s, uint64_t v) {
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t get_le(const std::byte* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

bool all_zero(const std::byte* p, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != std::byte{0}) return false;
  return true;
}

uint64_t header_hash(const char* header, const char* toc, size_t toc_bytes) {
  XXH3_state_t* st = XXH3_createState();
  PO_ASSERT(st != nullptr, "XXH3_createState failed");
  XXH3_64bits_reset(st);
  XXH3_64bits_update(st, header, kHashedHeaderBytes);
  XXH3_64bits_update(st, toc, toc_bytes);
  uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return h;
}

}  // namespace

void ContainerWriter::check_name(const std::string& name) const {
  PO_CHECK(!name.empty(), "checkpoint container: empty section name");
  PO_CHECK(name.rfind("__", 0) != 0, "checkpoint container: section name '", name,
           "' is reserved (starts with \"__\")");
  for (const auto& s : sections_)
    PO_CHECK(s.name != name, "checkpoint container: duplicate section '", name, "'");
}

void ContainerWriter::add(const std::string& name, const void* data, size_t size) {
  check_name(name);
  PO_CHECK(size == 0 || data != nullptr, "checkpoint container: section '", name, "' has no data");
  sections_.push_back({name, data, size});
}

void ContainerWriter::add_copy(const std::string& name, std::string bytes) {
  check_name(name);
  owned_.push_back(std::make_unique<std::string>(std::move(bytes)));
  sections_.push_back({name, owned_.back()->data(), owned_.back()->size()});
}

void ContainerWriter::set_metadata(const std::string& key, const std::string& value) {
  metadata_[key] = value;
}

std::vector<ContainerWriter::Section> ContainerWriter::all_sections(std::string* metadata_json) const {
  std::vector<Section> all = sections_;
  if (!metadata_.empty()) {
    try {
      *metadata_json = Json(metadata_).dump();
    } catch (const Json::exception& e) {
      PO_THROW(core::InvalidArgument, "checkpoint container: cannot encode metadata: ", e.what());
    }
    all.push_back({kMetadataSection, metadata_json->data(), metadata_json->size()});
  }
  return all;
}

namespace {

// Header + toc + padding up to the first section; fills each section's offset.
std::string build_prefix(const std::vector<ContainerWriter::Section>& sections,
                         std::vector<uint64_t>* offsets, uint64_t* file_bytes);

}  // namespace

void ContainerWriter::write(const std::string& path) const {
  std::string meta;
  auto all = all_sections(&meta);
  std::vector<uint64_t> offsets;
  uint64_t file_bytes = 0;
  const std::string prefix = build_prefix(all, &offsets, &file_bytes);
  write_file_atomic(path, [&](AtomicFile& f) {
    f.write(prefix.data(), prefix.size());
    for (size_t i = 0; i < all.size(); ++i) {
      f.write_zeros(offsets[i] - f.size());
      if (all[i].size > 0) f.write(all[i].data, all[i].size);
    }
    PO_ASSERT(f.size() == file_bytes, "container size ", f.size(), " != planned ", file_bytes);
  });
}

std::string ContainerWriter::serialize() const {
  std::string meta;
  auto all = all_sections(&meta);
  std::vector<uint64_t> offsets;
  uint64_t file_bytes = 0;
  std::string out = build_prefix(all, &offsets, &file_bytes);
  out.reserve(file_bytes);
  for (size_t i = 0; i < all.size(); ++i) {
    out.resize(offsets[i], '\0');
    out.append(static_cast<const char*>(all[i].data), all[i].size);
  }
  return out;
}

namespace {

std::string build_prefix(const std::vector<ContainerWriter::Section>& sections,
                         std::vector<uint64_t>* offsets, uint64_t* file_bytes) {
  uint64_t toc_bytes = 0;
  for (const auto& s : sections) toc_bytes += kMinEntryBytes + s.name.size();
  uint64_t offset = align_up(kHeaderBytes + toc_bytes);
  *file_bytes = kHeaderBytes + toc_bytes;
  std::string toc;
  toc.reserve(toc_bytes);
  for (const auto& s : sections) {
    offsets->push_back(offset);
    put_u32(toc, static_cast<uint32_t>(s.name.size()));
    toc += s.name;
    put_u64(toc, offset);
    put_u64(toc, s.size);
    put_u64(toc, XXH3_64bits(s.data, s.size));
    *file_bytes = offset + s.size;
    offset = align_up(offset + s.size);
  }
  std::string header(kMagic, sizeof(kMagic));
  put_u32(header, kContainerVersion);
  put_u32(header, static_cast<uint32_t>(sections.size()));
  put_u64(header, toc_bytes);
  put_u64(header, *file_bytes);
  put_u64(header, 0);
  put_u64(header, header_hash(header.data(), toc.data(), toc.size()));
  header.resize(kHeaderBytes, '\0');
  std::string out = header + toc;
  out.resize(sections.empty() ? out.size() : (*offsets)[0], '\0');
  return out;
}

}  // namespace

ContainerReader ContainerReader::open(const std::string& path) {
  ContainerReader r;
  r.origin_ = path;
  r.file_ = MappedFile(path);
  r.parse(r.file_.data(), r.file_.size());
  return r;
}

ContainerReader ContainerReader::from_bytes(const void* data, size_t size,
                                            const std::string& origin) {
  ContainerReader r;
  r.origin_ = origin;
  r.parse(static_cast<const std::byte*>(data), size);
  return r;
}

void ContainerReader::parse(const std::byte* data, size_t size) {
  const std::string& f = origin_;
  PO_CHECK(size >= kHeaderBytes, f, ": not a checkpoint or truncated: ", size,
           " bytes, shorter than the ", kHeaderBytes, "-byte header");
  PO_CHECK(std::memcmp(data, kMagic, sizeof(kMagic)) == 0, f,
           ": not a PagedOptim checkpoint (bad magic)");
  const uint32_t version = static_cast<uint32_t>(get_le(data + 8, 4));
  PO_CHECK(version == kContainerVersion, f, ": unsupported checkpoint version ", version,
           " (this build reads ", kContainerVersion, ")");
  const uint64_t count = get_le(data + 12, 4);
  const uint64_t toc_bytes = get_le(data + 16, 8);
  const uint64_t file_bytes = get_le(data + 24, 8);
  const uint64_t stored_hash = get_le(data + 40, 8);
  PO_CHECK(all_zero(data + 48, kHeaderBytes - 48), f, ": header padding is not zero (corrupted)");
  PO_CHECK(toc_bytes <= size - kHeaderBytes, f, ": truncated: table of contents needs ",
           toc_bytes, " bytes but the file has only ", size - kHeaderBytes, " after the header");
  const char* toc = reinterpret_cast<const char*>(data + kHeaderBytes);
  PO_CHECK(header_hash(reinterpret_cast<const char*>(data), toc, toc_bytes) == stored_hash, f,
           ": header or table of contents checksum mismatch (corrupted)");
  PO_CHECK(count <= toc_bytes / kMinEntryBytes, f, ": table of contents too small for ", count,
           " sections");

  struct Entry {
    std::string name;
    uint64_t offset, size, hash;
  };
  std::vector<Entry> entries;
  const std::byte* p = data + kHeaderBytes;
  const std::byte* toc_end = p + toc_bytes;
  const uint64_t data_start = kHeaderBytes + toc_bytes;
  for (uint64_t i = 0; i < count; ++i) {
    PO_CHECK(toc_end - p >= 4, f, ": table of contents entry ", i, " is cut short");
    uint64_t len = get_le(p, 4);
    p += 4;
    PO_CHECK(static_cast<uint64_t>(toc_end - p) >= len + 24, f, ": table of contents entry ", i,
             " is cut short");
    Entry e{std::string(reinterpret_cast<const char*>(p), len), get_le(p + len, 8),
            get_le(p + len + 8, 8), get_le(p + len + 16, 8)};
    p += len + 24;
    const std::string where = core::str_cat(f, ": section '", e.name, "'");
    PO_CHECK(!e.name.empty(), f, ": table of contents entry ", i, " has an empty name");
    PO_CHECK(sections_.count(e.name) == 0, where, " appears twice");
    PO_CHECK(e.offset >= data_start, where, " starts at ", e.offset,
             ", inside the header or table of contents");
    PO_CHECK(e.offset <= size && e.size <= size - e.offset, where, " [", e.offset, ", +",
             e.size, ") extends past the end of the file (", size, " bytes): truncated");
    sections_.emplace(e.name, std::span<const std::byte>(data + e.offset, e.size));
    entries.push_back(std::move(e));
  }
  PO_CHECK(p == toc_end, f, ": table of contents has ", toc_end - p, " trailing bytes");
  PO_CHECK(file_bytes == size, f, ": file is ", size, " bytes but its header says ", file_bytes,
           size < file_bytes ? " (truncated)" : " (trailing data)");

  std::vector<const Entry*> sorted;
  for (const auto& e : entries) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(),
            [](const Entry* a, const Entry* b) { return a->offset < b->offset; });
  // Sections must not overlap, and the alignment padding between them must be
  // zero, so that every byte of the file is checked.
  uint64_t end = data_start;
  const Entry* prev = nullptr;
  for (const Entry* e : sorted) {
    PO_CHECK(prev == nullptr || e->offset >= end, f, ": section '", e->name,
             "' overlaps section '", prev ? prev->name : std::string(), "'");
    PO_CHECK(all_zero(data + end, e->offset - end), f, ": padding before section '", e->name,
             "' is not zero (corrupted)");
    end = e->offset + e->size;
    prev = e;
  }

  for (const auto& e : entries) {
    PO_CHECK(XXH3_64bits(data + e.offset, e.size) == e.hash, f, ": section '", e.name,
             "' checksum mismatch (corrupted)");
    if (e.name == kMetadataSection) continue;
    PO_CHECK(e.name.rfind("__", 0) != 0, f, ": unknown reserved section '", e.name, "'");
    names_.push_back(e.name);
  }
  if (has(kMetadataSection)) {
    auto bytes = sections_.at(kMetadataSection);
    const char* b = reinterpret_cast<const char*>(bytes.data());
    Json meta;
    try {
      meta = Json::parse(b, b + bytes.size());
    } catch (const Json::exception& e) {
      PO_THROW(core::InvalidArgument, f, ": section '__metadata__' is not valid JSON: ", e.what());
    }
    PO_CHECK(meta.is_object(), f, ": section '__metadata__' is not a JSON object");
    for (const auto& [k, v] : meta.items()) {
      PO_CHECK(v.is_string(), f, ": section '__metadata__': value of '", k, "' is not a string");
      metadata_[k] = v.get<std::string>();
    }
    sections_.erase(kMetadataSection);
  }
}

std::span<const std::byte> ContainerReader::section(const std::string& name) const {
  auto it = sections_.find(name);
  PO_CHECK(it != sections_.end(), origin_, ": missing section '", name, "'");
  return it->second;
}

void ContainerReader::read_into(const std::string& name, void* dst, size_t size) const {
  auto s = section(name);
  PO_CHECK(s.size() == size, origin_, ": section '", name, "' has ", s.size(),
           " bytes, expected ", size);
  if (size > 0) std::memcpy(dst, s.data(), size);
}

std::string ContainerReader::read_string(const std::string& name) const {
  auto s = section(name);
  return std::string(reinterpret_cast<const char*>(s.data()), s.size());
}

}  // namespace po::checkpoint
