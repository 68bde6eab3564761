// Fuzzes po::core::Config::parse. Bad input may only raise po::core::Error;
// an accepted config must re-parse from its own to_toml() to the same values.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/config.h"
#include "core/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  po::core::Config c;
  try {
    c = po::core::Config::parse(text, "fuzz.toml");
  } catch (const po::core::Error&) {
    return 0;
  }
  const std::string resolved = c.to_toml();
  po::core::Config again;
  try {
    again = po::core::Config::parse(resolved, "resolved.toml");
  } catch (const po::core::Error& e) {
    std::fprintf(stderr, "to_toml() output does not re-parse: %s\n---\n%s\n", e.what(),
                 resolved.c_str());
    std::abort();
  }
  if (again.to_toml() != resolved || again.hash() != c.hash()) {
    std::fprintf(stderr, "to_toml() round trip changed the config:\n%s\n---\n%s\n",
                 resolved.c_str(), again.to_toml().c_str());
    std::abort();
  }
  return 0;
}
