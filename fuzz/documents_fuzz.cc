// Fuzzes data.split's documents file parser (data/split.h). Bad input may
// only raise po::core::Error; an accepted file must re-serialise to the same
// bytes, and every split of its documents must give each to one client.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/split.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::optional<std::vector<po::data::Document>> docs;
  try {
    docs.emplace(po::data::parse_documents(text, "fuzz", int64_t{1} << 40));
  } catch (const po::core::Error&) {
    return 0;
  }
  if (po::data::documents_text(*docs) != text) std::abort();
  for (const char* split : {"iid", "by_source", "dirichlet:0.3"}) {
    std::vector<int> owners(docs->size(), 0);
    for (int k = 0; k < 3; ++k)
      for (size_t d : po::data::client_documents(*docs, po::data::parse_split(split, "fuzz"), 3, k, 1)) ++owners[d];
    for (int n : owners)
      if (n != 1) std::abort();
  }
  return 0;
}
