// Fuzzes the DiLoCo side file parser (checkpoint/outer_file.h). Bad input may
// only raise po::core::Error; an accepted file must re-serialise to the same
// bytes. Each input is tried as it is and with a valid checksum appended, so
// mutations reach the structure behind the checksum.
#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

#include "checkpoint/outer_file.h"
#include "core/error.h"

namespace {

void check(const std::string& bytes) {
  std::optional<po::checkpoint::OuterFile> f;
  try {
    f.emplace(po::checkpoint::parse_outer_file(bytes, "fuzz"));
  } catch (const po::core::Error&) {
    return;
  }
  if (po::checkpoint::outer_file_bytes(*f) != bytes) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  check(bytes);
  const uint64_t sum = XXH3_64bits(bytes.data(), bytes.size());
  bytes.append(reinterpret_cast<const char*>(&sum), sizeof sum);
  check(bytes);
  return 0;
}
