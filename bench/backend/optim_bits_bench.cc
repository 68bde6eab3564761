// The AdamW step at 32, 8 and 4 bits of state (optim.state_bits) in RAM,
// against the memory bandwidth measured in the same run (a STREAM triad over
// arrays much larger than the last-level cache). Each step's GB/s counts the
// bytes it must move at least: parameters read and written (fp32), the
// gradient read, each moment's codes read and written and its block absmax
// read and written:
//   32 bits: 4 + 4 + 4 + 2·(4 + 4)           = 28 bytes per element
//    8 bits: 4 + 4 + 4 + 2·(1 + 1) + 4·4/256 ≈ 16.06
//    4 bits: 4 + 4 + 4 + 2·(0.5 + 0.5) + 4·4/128 ≈ 14.13
// (what bf16 parameters and gradients would save is the same at every width).
//   optim_bits_bench [THREADS=2] [MILLIONS=16]
// Prints a table and one JSON line per width.
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "backend/quant_map.h"
#include "../bench_util.h"

namespace ops = po::backend::cpu;
using po::backend::QuantMap;

namespace {

std::vector<float> random_floats(size_t n, float scale, uint64_t seed) {
  std::vector<float> v(n);
  uint64_t s = seed;
  for (float& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = scale * (static_cast<float>(s >> 40) / static_cast<float>(1 << 24) - 0.5f);
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const int64_t n = (argc > 2 ? std::atoll(argv[2]) : 16) << 20;
  ops::set_num_threads(threads);
  const double bw = po::bench::triad_gbs();
  const double dn = static_cast<double>(n);
  std::vector<float> p = random_floats(static_cast<size_t>(n), 0.1f, 1);
  const std::vector<float> g = random_floats(static_cast<size_t>(n), 0.01f, 2);
  struct Row {
    int bits;
    double bytes, seconds;
  };
  std::vector<Row> rows;
  {
    std::vector<float> m(p.size(), 0.0f), v(p.size(), 0.0f);
    int64_t t = 0;
    const double s = po::bench::best_time(
        [&] {
          ops::adamw_update(p.data(), g.data(), m.data(), v.data(), n, 1e-3f, 0.9f, 0.95f, 1e-8f,
                            0.1f, 1.0f, ++t);
        },
        3, 20);
    rows.push_back({32, dn * 28, s});
  }
  for (int bits : {8, 4}) {
    const int64_t block = bits == 8 ? 256 : 128;
    const int64_t code_bytes = n * bits / 8, blocks = (n + block - 1) / block;
    std::vector<uint8_t> m(static_cast<size_t>(code_bytes), 0), v(m.size(), 0);
    std::vector<float> am(static_cast<size_t>(blocks), 0.0f), av(am.size(), 0.0f);
    ops::QuantMoments q{m.data(), am.data(), v.data(), av.data(),
                        &po::backend::codebook(bits == 8 ? QuantMap::kSigned8 : QuantMap::kSigned4),
                        &po::backend::codebook(bits == 8 ? QuantMap::kUnsigned8 : QuantMap::kUnsigned4),
                        block, 0};
    int64_t t = 0;
    const double s = po::bench::best_time(
        [&] {
          ops::adamw_update_quant(p.data(), g.data(), nullptr, nullptr, &q, n, 1e-3f, 0.9f, 0.95f,
                                  1e-8f, 0.1f, 1.0f, ++t);
        },
        3, 20);
    rows.push_back({bits, dn * 12 + 4.0 * static_cast<double>(code_bytes) + 16.0 * static_cast<double>(blocks), s});
  }
  std::printf("optim_bits_bench: %d threads, %lld M elements, memory bandwidth (triad) %.1f GB/s\n",
              threads, static_cast<long long>(n >> 20), bw);
  std::printf("%-6s %12s %10s %9s %10s %12s\n", "bits", "bytes/elem", "ms", "GB/s", "of triad",
              "Melem/s");
  for (const Row& r : rows) {
    const double gbs = r.bytes / r.seconds / 1e9;
    std::printf("%-6d %12.2f %10.2f %9.1f %9.0f%% %12.0f\n", r.bits, r.bytes / dn, r.seconds * 1e3, gbs,
                100.0 * gbs / bw, dn / r.seconds / 1e6);
    std::printf("{\"bench\":\"optim_bits\",\"bits\":%d,\"ms\":%.3f,\"gbs\":%.2f,\"triad_gbs\":%.2f,"
                "\"melem_per_s\":%.1f}\n",
                r.bits, r.seconds * 1e3, gbs, bw, dn / r.seconds / 1e6);
  }
  return 0;
}
