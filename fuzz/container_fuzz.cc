// Fuzzes the checkpoint container reader. Bad input may only raise
// po::core::Error; an accepted container must re-serialise to one that reads
// back identically.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "checkpoint/container.h"
#include "core/error.h"

using po::checkpoint::ContainerReader;
using po::checkpoint::ContainerWriter;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::optional<ContainerReader> r;
  try {
    r.emplace(ContainerReader::from_bytes(data, size, "fuzz"));
  } catch (const po::core::Error&) {
    return 0;
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
  return 0;
}
