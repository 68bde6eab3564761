// The memory bandwidth that bounds batch-1 decode: every weight is read once
// per token, so tokens/s <= bandwidth / weight bytes. Measured as a read
// sweep (a sum, the way a GEMV streams its matrix) and a STREAM triad over
// arrays much larger than the last-level cache, best of several passes.
//   mem_bandwidth [THREADS=2] [MIB=1024]
// Prints one JSON line: read_gbs, triad_gbs (triad counts 2 reads + 1 write).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const size_t mib = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 1024;
  omp_set_num_threads(threads);
  const size_t n = mib * (1u << 20) / sizeof(float) / 3;  // three arrays of the triad
  std::vector<float> a(n), b(n), c(n);
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; ++i) {  // first touch by the threads that sweep
    a[i] = 1.0f;
    b[i] = 2.0f;
    c[i] = 0.0f;
  }
  auto now = [] { return std::chrono::steady_clock::now(); };
  double best_read = 0, best_triad = 0, sink = 0;
  for (int pass = 0; pass < 6; ++pass) {
    auto t0 = now();
    // 32 independent partial sums per thread: the sweep is bound by memory,
    // not by the latency of one chain of adds.
    double s = 0;
#pragma omp parallel reduction(+ : s)
    {
      float acc[32] = {};
#pragma omp for schedule(static)
      for (size_t i = 0; i < n / 32; ++i)
        for (int j = 0; j < 32; ++j) acc[j] += a[i * 32 + j] + b[i * 32 + j];
      for (float x : acc) s += x;
    }
    double sec = std::chrono::duration<double>(now() - t0).count();
    best_read = std::max(best_read, 2.0 * n * sizeof(float) / sec / 1e9);
    sink += s;
    t0 = now();
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; ++i) c[i] = a[i] + 0.5f * b[i];
    sec = std::chrono::duration<double>(now() - t0).count();
    best_triad = std::max(best_triad, 3.0 * n * sizeof(float) / sec / 1e9);
    sink += c[n / 2];
  }
  std::printf("{\"bench\":\"mem_bandwidth\",\"threads\":%d,\"mib\":%zu,\"read_gbs\":%.2f,\"triad_gbs\":%.2f,"
              "\"sink\":%.1f}\n",
              threads, mib, best_read, best_triad, sink > 0 ? 1.0 : 0.0);
  return 0;
}
