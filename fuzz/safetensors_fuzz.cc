// Fuzzes the safetensors header parser. Bad input may only raise
// po::core::Error; a parsed file must survive every accessor and re-serialise
// to an image that parses to the same tensors.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "checkpoint/safetensors.h"
#include "core/error.h"

using po::checkpoint::SafetensorsReader;
using po::checkpoint::StDtype;
using po::checkpoint::StTensorRef;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::optional<SafetensorsReader> parsed;
  try {
    parsed.emplace(SafetensorsReader::from_bytes(data, size, "fuzz"));
  } catch (const po::core::Error&) {
    return 0;
  }
  const SafetensorsReader& r = *parsed;
  std::vector<StTensorRef> refs;
  size_t total = 0;
  for (const auto& name : r.names()) {
    const auto& t = r.get(name);
    total += t.nbytes;
    if (t.dtype == StDtype::kF32 || t.dtype == StDtype::kF16 || t.dtype == StDtype::kBF16) {
      std::vector<float> v = r.read_f32(name, t.shape);
      if (v.size() != static_cast<size_t>(t.numel())) std::abort();
    }
    refs.push_back({t.name, t.dtype, t.shape, t.data});
  }
  if (total + 8 > size && size > 0) std::abort();  // tensors claim more than the file
  std::string img;
  try {
    img = po::checkpoint::serialize_safetensors(refs, r.metadata());
  } catch (const po::core::InvalidArgument&) {
    return 0;  // e.g. an empty tensor name: readable, but our writer refuses it
  }
  auto again = SafetensorsReader::from_bytes(img.data(), img.size(), "roundtrip");
  if (again.names() != r.names() || again.metadata() != r.metadata()) std::abort();
  for (const auto& name : r.names()) {
    const auto& a = r.get(name);
    const auto& b = again.get(name);
    if (a.dtype != b.dtype || a.shape != b.shape || a.nbytes != b.nbytes) std::abort();
    if (a.nbytes > 0 && std::memcmp(a.data, b.data, a.nbytes) != 0) std::abort();
  }
  return 0;
}
