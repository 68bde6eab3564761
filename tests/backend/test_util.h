// Helpers shared by the backend op tests: seeded random tensors, a tolerance
// check that names the first failing element and the worst one, and a
// central-difference gradient check of a scalar loss evaluated in double.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backend/ops.h"

namespace po::test {

inline std::vector<float> random_vec(size_t n, uint64_t seed, float lo = -1.0f,
                                     float hi = 1.0f) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(g);
  return v;
}

// x with every value rounded to bf16 (nearest even) and widened back.
inline std::vector<float> rounded_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> h(x.size());
  std::vector<float> w(x.size());
  backend::cpu::f32_to_bf16(h.data(), x.data(), static_cast<int64_t>(x.size()));
  backend::cpu::bf16_to_f32(w.data(), h.data(), static_cast<int64_t>(x.size()));
  return w;
}

inline std::vector<double> to_double(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// |got - want| <= rtol * (|want| + rms(want)) + atol for every element.
template <typename G, typename W>
::testing::AssertionResult all_close(const std::string& name, const G* got, const W* want,
                                     size_t n, double rtol, double atol = 0.0) {
  double ss = 0.0;
  for (size_t i = 0; i < n; i++) ss += static_cast<double>(want[i]) * want[i];
  const double rms = n ? std::sqrt(ss / n) : 0.0;
  size_t bad = 0, first = n, worst = 0;
  double worst_ratio = 0.0;
  for (size_t i = 0; i < n; i++) {
    const double g = got[i], w = want[i];
    const double tol = rtol * (std::fabs(w) + rms) + atol;
    const double diff = std::fabs(g - w);
    const double ratio = diff / (tol > 0 ? tol : 1e-300);
    if (!(diff <= tol)) {  // NaN fails too
      bad++;
      if (first == n) first = i;
    }
    if (ratio > worst_ratio || std::isnan(ratio)) {
      worst_ratio = ratio;
      worst = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  std::ostringstream os;
  os.precision(9);
  os << name << ": " << bad << " of " << n << " elements outside tolerance (rtol " << rtol
     << ", atol " << atol << ", rms " << rms << "); first " << name << "[" << first
     << "] got " << got[first] << " want " << want[first] << " (diff "
     << std::fabs(static_cast<double>(got[first]) - want[first]) << "); worst " << name << "["
     << worst << "] got " << got[worst] << " want " << want[worst] << " (" << worst_ratio
     << "x tolerance)";
  return ::testing::AssertionFailure() << os.str();
}

// Central differences of loss() w.r.t. x[idx] for every idx in `indices`,
// compared with analytic[idx]: |fd - an| <= rtol * (|fd| + scale).
inline ::testing::AssertionResult grad_check(const std::string& name, std::vector<float>& x,
                                             const std::vector<float>& analytic,
                                             const std::vector<size_t>& indices,
                                             const std::function<double()>& loss, float eps,
                                             double rtol, double scale) {
  for (size_t idx : indices) {
    const float saved = x[idx];
    x[idx] = saved + eps;
    const double lp = loss();
    x[idx] = saved - eps;
    const double lm = loss();
    x[idx] = saved;
    // The effective step is what f32 could represent.
    const double h = static_cast<double>(saved + eps) - static_cast<double>(saved - eps);
    const double fd = (lp - lm) / h;
    const double an = analytic[idx];
    if (!(std::fabs(fd - an) <= rtol * (std::fabs(fd) + scale))) {
      return ::testing::AssertionFailure()
             << name << "[" << idx << "]: analytic " << an << " vs finite difference " << fd
             << " (diff " << std::fabs(fd - an) << ", tol " << rtol * (std::fabs(fd) + scale)
             << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

// A spread of sample indices over [0, n): first, last and strided ones.
inline std::vector<size_t> sample_indices(size_t n, size_t count, uint64_t seed = 7) {
  std::vector<size_t> out{0, n - 1};
  std::mt19937_64 g(seed);
  for (size_t i = 0; i < count && i < n; i++) out.push_back(g() % n);
  return out;
}

inline double rms(const std::vector<float>& v) {
  double s = 0.0;
  for (float x : v) s += static_cast<double>(x) * x;
  return v.empty() ? 0.0 : std::sqrt(s / v.size());
}

}  // namespace po::test
