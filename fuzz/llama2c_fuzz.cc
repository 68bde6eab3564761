// Fuzzes the llama2.c checkpoint header and loader. Bad input may only raise
// po::core::Error; a file that opens must read every tensor inside its bytes
// (ASan checks) with the shapes its header implies, and its declared size must
// be exactly the input's.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "checkpoint/llama2c.h"
#include "core/error.h"

using po::checkpoint::Llama2cReader;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::unique_ptr<Llama2cReader> r;
  try {
    r = Llama2cReader::from_bytes(data, size, "fuzz");
  } catch (const po::core::Error&) {
    return 0;
  }
  if (po::checkpoint::llama2c_file_bytes(r->header()) != size) std::abort();
  // Keep a run bounded: large (valid) models are skipped after the size check.
  if (size > (size_t{64} << 20)) return 0;
  size_t floats = 0;
  for (const auto& t : r->tensors()) {
    std::vector<float> v = r->read(t.name);
    if (static_cast<int64_t>(v.size()) != po::tensor::shape_numel(t.shape)) std::abort();
    floats += v.size();
  }
  if (r->header().header_bytes + floats * 4 > size) std::abort();
  return 0;
}
