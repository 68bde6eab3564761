// libFuzzer entry point for the token-file parser (data/token_file.h). Any
// input must either parse into tokens that agree with the size and vocabulary,
// or be rejected with InvalidArgument; any other exception or crash is a bug.
// Build: clang++ -fsanitize=fuzzer,address, link po_data (po_core, nlohmann_json).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "data/token_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // mmap'd files are page-aligned; give the parser the same alignment.
  std::vector<uint64_t> aligned((size + 7) / 8);
  if (size > 0) std::memcpy(aligned.data(), data, size);
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(aligned.data()), size);
  // Alternate between no vocabulary check (0) and GPT-2's vocabulary.
  const int32_t vocab = size > 4 && (data[4] & 1) ? 50257 : 0;
  try {
    std::span<const uint16_t> tokens = po::data::parse_token_file(bytes, "fuzz-input", vocab);
    if (po::data::kTokenFileHeaderBytes + tokens.size() * sizeof(uint16_t) != size) std::abort();
    for (uint16_t t : tokens) {
      if (vocab > 0 && t >= vocab) std::abort();
    }
  } catch (const po::core::InvalidArgument&) {
    // Rejected input: expected.
  }
  return 0;
}
