// Timing helper shared by the C++ benchmarks: best-of wall time after a warm-up.
#pragma once

#include <algorithm>
#include <chrono>

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

}  // namespace po::bench
