// Fuzzes po::plan::parse_cluster (the `plan --cluster FILE.toml` format). Bad
// input may only raise po::core::Error; an accepted cluster has every number
// finite and in the ranges the planner divides by.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "plan/presets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  po::plan::ClusterSpec c;
  try {
    c = po::plan::parse_cluster(text, "fuzz.toml");
  } catch (const po::core::Error&) {
    return 0;
  }
  const bool ok = c.nodes >= 1 && c.devices_per_node >= 1 && c.device_memory > 0 &&
                  std::isfinite(c.device_memory) && c.peak_flops_bf16 > 0 && c.peak_flops_fp32 > 0 &&
                  c.intra_bw > 0 && c.inter_bw > 0 && c.host_bw > 0 && c.efficiency > 0 &&
                  c.efficiency <= 1 && std::isfinite(c.overhead) && std::isfinite(c.host_memory);
  if (!ok) {
    std::fprintf(stderr, "accepted a cluster the planner cannot use:\n%s\n", text.c_str());
    std::abort();
  }
  return 0;
}
