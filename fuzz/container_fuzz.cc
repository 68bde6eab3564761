// Fuzzes the checkpoint container reader. Bad input may only raise
// po::core::Error; an accepted container must re-serialise to one that reads
// back identically. Each input is tried as is and with its checksums
// recomputed, so mutations reach the structural checks behind them.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>

#include <xxhash.h>

#include <string>

#include "checkpoint/container.h"
#include "core/error.h"

using po::checkpoint::ContainerReader;
using po::checkpoint::ContainerWriter;

namespace {

uint64_t get_le(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
void put_le64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

// Rewrites every section checksum and the header checksum that the layout in
// container.h defines, walking the table of contents as far as it is in bounds.
std::string fix_checksums(const uint8_t* data, size_t size) {
  std::string s(reinterpret_cast<const char*>(data), size);
  auto* b = reinterpret_cast<uint8_t*>(s.data());
  if (size < 64) return s;
  const uint64_t count = get_le(b + 12, 4);
  const uint64_t toc_bytes = get_le(b + 16, 8);
  if (toc_bytes > size - 64) return s;
  uint64_t at = 64;
  const uint64_t toc_end = 64 + toc_bytes;
  for (uint64_t i = 0; i < count && at + 4 <= toc_end; ++i) {
    uint64_t len = get_le(b + at, 4);
    if (len > toc_end - at - 4 || toc_end - at - 4 - len < 24) break;
    at += 4 + len;
    uint64_t off = get_le(b + at, 8), n = get_le(b + at + 8, 8);
    if (off <= size && n <= size - off) put_le64(b + at + 16, XXH3_64bits(b + off, n));
    at += 24;
  }
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  XXH3_64bits_update(st, b, 40);
  XXH3_64bits_update(st, b + 64, toc_bytes);
  put_le64(b + 40, XXH3_64bits_digest(st));
  XXH3_freeState(st);
  return s;
}

void check(const uint8_t* data, size_t size) {
  std::optional<ContainerReader> r;
  try {
    r.emplace(ContainerReader::from_bytes(data, size, "fuzz"));
  } catch (const po::core::Error&) {
    return;
  }
  ContainerWriter w;
  for (const auto& name : r->names()) {
    auto s = r->section(name);
    if (r->read_string(name).size() != s.size()) std::abort();
    w.add(name, s.data(), s.size());
  }
  for (const auto& [k, v] : r->metadata()) w.set_metadata(k, v);
  std::string img = w.serialize();
  auto again = ContainerReader::from_bytes(img.data(), img.size(), "roundtrip");
  if (again.names() != r->names() || again.metadata() != r->metadata()) std::abort();
  for (const auto& name : r->names()) {
    auto a = r->section(name);
    auto b = again.section(name);
    if (a.size() != b.size() || (a.size() > 0 && std::memcmp(a.data(), b.data(), a.size()) != 0))
      std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  check(data, size);
  const std::string fixed = fix_checksums(data, size);
  check(reinterpret_cast<const uint8_t*>(fixed.data()), fixed.size());
  return 0;
}
