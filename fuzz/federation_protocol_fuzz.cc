// Fuzzes the federation frame decoder (comm/federation_protocol.h). Bad
// input may only raise po::core::Error; an accepted frame must re-encode to
// the same bytes, and the streaming size helper must agree with the decoder
// on its length. Each input is tried as it is, with a valid checksum
// appended, and with its header's payload length set to what follows the
// header and then a checksum appended, so mutations of the payload reach its
// fields without having to keep the length and the checksum in step.
#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

#include "comm/federation_protocol.h"
#include "core/error.h"

namespace {

void check(const std::string& bytes) {
  size_t complete = 0;
  try {
    complete = po::comm::frame_size_if_complete(bytes, "fuzz");
  } catch (const po::core::Error&) {
  }
  std::optional<po::comm::Message> m;
  try {
    m.emplace(po::comm::decode_frame(bytes, "fuzz"));
  } catch (const po::core::Error&) {
    return;
  }
  if (complete != bytes.size()) std::abort();  // a whole frame the size helper did not see as one
  if (po::comm::encode(*m) != bytes) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  check(bytes);
  const uint64_t sum = XXH3_64bits(bytes.data(), bytes.size());
  bytes.append(reinterpret_cast<const char*>(&sum), sizeof sum);
  check(bytes);
  if (size >= po::comm::kFrameHeaderBytes) {
    std::string sealed(reinterpret_cast<const char*>(data), size);
    const uint64_t payload = size - po::comm::kFrameHeaderBytes;
    std::memcpy(sealed.data() + 12, &payload, sizeof payload);
    const uint64_t all = XXH3_64bits(sealed.data(), sealed.size());
    sealed.append(reinterpret_cast<const char*>(&all), sizeof all);
    check(sealed);
  }
  return 0;
}
