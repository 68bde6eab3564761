// Fuzzes the GGUF reader (checkpoint/gguf.h) and what reads a model and a
// tokenizer from it (checkpoint/gguf_models.h). Bad input may only raise
// po::core::Error; a file that opens must decode every tensor inside its
// bytes (ASan checks) to its element count.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "checkpoint/gguf.h"
#include "checkpoint/gguf_models.h"
#include "core/error.h"

using po::checkpoint::GgufFile;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::unique_ptr<GgufFile> f;
  try {
    f = std::make_unique<GgufFile>(GgufFile::from_bytes(data, size, "fuzz"));
  } catch (const po::core::Error&) {
    return 0;
  }
  std::vector<float> values;
  int64_t decoded = 0;
  for (const auto& t : f->tensors()) {
    if (f->data_start() + t.offset + static_cast<uint64_t>(t.bytes) > size) std::abort();
    if (decoded + t.numel > (int64_t{1} << 22)) continue;  // keep a run bounded
    values.assign(static_cast<size_t>(t.numel), 0.0f);
    f->read_f32(t, values.data());
    decoded += t.numel;
  }
  try {
    auto model = po::checkpoint::open_gguf_llama(*f);
    for (const auto& t : model->tensors())
      if (po::tensor::shape_numel(t.shape) <= (int64_t{1} << 20)) model->read(t.name);
  } catch (const po::core::Error&) {
  }
  try {
    auto tok = po::checkpoint::gguf_tokenizer(*f);
    tok->decode(tok->encode("Hello, world! \xc3\xa9"));
  } catch (const po::core::Error&) {
  }
  return 0;
}
