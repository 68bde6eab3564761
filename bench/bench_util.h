// Timing helper shared by the C++ benchmarks: best-of wall time after a warm-up.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <vector>

namespace po::bench {

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Best wall time of op() after one warm-up call: at least `min_runs` runs,
// then more until ~1 s was spent or `max_runs` is reached.
template <typename F>
double best_time(F op, int min_runs, int max_runs) {
  op();
  double best = 1e30, spent = 0.0;
  for (int r = 0; r < min_runs || (spent < 1.0 && r < max_runs); r++) {
    const double t0 = now_seconds();
    op();
    const double dt = now_seconds() - t0;
    best = std::min(best, dt);
    spent += dt;
  }
  return best;
}

// Memory bandwidth in GB/s: a STREAM triad (c = a + 0.5·b, 12 bytes per
// element) over 768 MiB of arrays, far past the last-level cache, on the
// OpenMP threads set; best of 3-8 runs.
inline double triad_gbs() {
  const size_t n = (768u << 20) / sizeof(float) / 3;
  std::vector<float> a(n, 1.0f), b(n, 2.0f), c(n, 0.0f);
  const double t = best_time(
      [&] {
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; ++i) c[i] = a[i] + 0.5f * b[i];
      },
      3, 8);
  return 3.0 * static_cast<double>(n) * sizeof(float) / t / 1e9;
}

}  // namespace po::bench
