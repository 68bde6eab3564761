// Rényi-DP of the sampled Gaussian mechanism (see rdp.h for the model).
//
// Everything is summed in log space, so no term overflows however small σ or
// large α is: a sum is kept as (m, s) meaning e^m·s, m the largest log term
// seen. Where RDP is tiny (small q, large σ) A_α is 1 plus a few parts in
// 10^10, and ln(A_α) taken of a sum of A_α keeps only the digits above the
// rounding of the 1 (TF Privacy and Opacus lose everything below
// 1e-16/(A_α − 1) that way). So the series sum A_α − 1 directly, each term
// less its share of the binomial expansion of ((1 − q) + q)^α = 1, and
// ln(A_α) = log1p(A_α − 1). Against tools/privacy_ref/rdp_ref.py one step's
// RDP then agrees to 1e-13 relative at integer orders and 3e-11 at fractional
// ones (q != 1/2), for q down to 1e-9 and σ from 0.02 to 1000.
#include "privacy/rdp.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <numbers>
#include <utility>

#include "core/error.h"

namespace po::privacy {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNan = std::numeric_limits<double>::quiet_NaN();

void check_q(double q) {
  PO_CHECK(q >= 0.0 && q <= 1.0, "privacy.sample_rate must be in [0, 1], got ", q);
}
void check_sigma(double sigma) {
  PO_CHECK(sigma >= 0.0, "privacy.noise_multiplier must be >= 0, got ", sigma);
}
void check_order(double order) {
  PO_CHECK(order > 1.0, "privacy.order must be > 1, got ", order);
}
void check_delta(double delta) {
  PO_CHECK(delta > 0.0 && delta < 1.0, "privacy.delta must be in (0, 1), got ", delta);
}
void check_steps(int64_t steps) { PO_CHECK(steps >= 0, "privacy.steps must be >= 0, got ", steps); }

// ε of one order's RDP (rdp.h's Conversion), log_delta = ln δ.
double convert(double rdp, double order, double log_delta, Conversion conversion) {
  if (conversion == Conversion::kClassic) return rdp - log_delta / (order - 1.0);
  return rdp + std::log1p(-1.0 / order) - (log_delta + std::log(order)) / (order - 1.0);
}

// Σ sign_k·e^{l_k} held as e^m·s: m the largest l_k so far, so nothing overflows.
struct LogSum {
  double m = -kInf, s = 0.0;
  // Returns the factor the earlier partial sums were rescaled by (1 if none).
  double add(double l, double sign) {
    if (l == -kInf) return 1.0;
    if (l <= m) {
      s += sign * std::exp(l - m);
      return 1.0;
    }
    const double f = std::exp(m - l);
    s = s * f + sign;
    m = l;
    return f;
  }
  double log_value() const { return s > 0.0 ? m + std::log(s) : -kInf; }
};

// ln(e^x − 1) for x > 0, without overflow for large x.
double log_expm1(double x) { return x > 30.0 ? x + std::log1p(-std::exp(-x)) : std::log(std::expm1(x)); }

// ln(1 + e^l): ln(A) from ln(A − 1).
double log1p_exp(double l) { return l > 36.0 ? l + std::log1p(std::exp(-l)) : std::log1p(std::exp(l)); }

// ln(erfc(x)/2), also where erfc(x) underflows (x > 26) or is within an ulp of 2.
double log_half_erfc(double x) {
  if (x < 0.0) return std::log1p(-0.5 * std::erfc(-x));
  if (x < 20.0) return std::log(0.5 * std::erfc(x));
  // erfc(x) = e^{−x²}/(x√π)·Σ_k (−1)^k (2k−1)!!/(2x²)^k; at x >= 20 eight terms reach 1e-17.
  const double r = 1.0 / (2.0 * x * x);
  double term = 1.0, sum = 1.0;
  for (int k = 1; k <= 8; ++k) {
    term *= -(2.0 * k - 1.0) * r;
    sum += term;
  }
  return -x * x - std::log(x) - 0.5 * std::log(std::numbers::pi) + std::log(0.5 * sum);
}

// ln(A_α − 1) for integer α >= 2, 0 < q < 1: the exact binomial expansion
//   A_α = Σ_{i=0..α} C(α,i) (1−q)^{α−i} q^i e^{(i²−i)/(2σ²)}
// less Σ_i C(α,i) (1−q)^{α−i} q^i = 1, termwise: every term of the difference
// carries expm1((i²−i)/(2σ²)) >= 0, and those of i = 0, 1 vanish.
double log_a_minus_1_int(double q, double sigma, int64_t alpha) {
  const double log_q = std::log(q), log_1mq = std::log1p(-q), two_s2 = 2.0 * sigma * sigma;
  const double lg_alpha = std::lgamma(static_cast<double>(alpha) + 1.0);
  LogSum sum;
  for (int64_t i = 2; i <= alpha; ++i) {
    const double di = static_cast<double>(i), dj = static_cast<double>(alpha - i);
    const double log_binom = lg_alpha - std::lgamma(di + 1.0) - std::lgamma(dj + 1.0);
    const double x = (di * di - di) / two_s2;
    if (x == 0.0) continue;  // σ = ∞
    sum.add(log_binom + di * log_q + dj * log_1mq + log_expm1(x), 1.0);
  }
  return sum.log_value();
}

// Past i = α the fractional series alternate, their terms shrinking smoothly
// but only like i^{−α−2} once erfc is in its Gaussian tail: the plain sum
// needs thousands of terms at α near 1 (TF Privacy stops at e^{−30} instead,
// an absolute error of 1e-13 in A). The estimate here is the last kLevels+1
// partial sums averaged pairwise kLevels times (Euler's transform for
// alternating series), which reaches double precision within about α + 20
// terms (at most 510 at α = 500.5 over q in [1e-9, 1), σ in [0.02, 1000]).
constexpr int kLevels = 8;

double euler_estimate(const std::array<double, kLevels + 1>& partial) {
  std::array<double, kLevels + 1> t = partial;
  for (int level = 1; level <= kLevels; ++level)
    for (int k = 0; k + level <= kLevels; ++k) t[k] = 0.5 * (t[k] + t[k + 1]);
  return t[0];
}

// ln(A_α) for fractional α, 0 < q < 1: Mironov et al. 2019 §3.3. Split the
// integral at z0, where (1−q)μ0 = qμ1; below it expand ((1−q)μ0 + qμ1)^α as
// a binomial series in qμ1, above it in (1−q)μ0. With j = α − i each side
// integrates in closed form:
//   below: C(α,i) q^i (1−q)^j e^{(i²−i)/(2σ²)} · erfc((i − z0)/(√2σ))/2
//   above: C(α,i) q^j (1−q)^i e^{(j²−j)/(2σ²)} · erfc((z0 − j)/(√2σ))/2
// To sum A − 1 instead, one side's terms each lose their weight C(α,i) q^i
// (1−q)^j (below, q < 1/2) or C(α,i) q^j (1−q)^i (above, q > 1/2): the
// series of ((1−q) + q)^α = 1, which converges only when its ratio q/(1−q)
// (or its inverse) is below 1. At q = 1/2 A itself is summed; RDP there is
// never tiny enough for it to matter below σ ~ 100.
double log_a_frac(double q, double sigma, double alpha) {
  const double log_q = std::log(q), log_1mq = std::log1p(-q), two_s2 = 2.0 * sigma * sigma;
  const double z0 = sigma * sigma * (log_1mq - log_q) + 0.5;
  const double inv = 1.0 / (std::numbers::sqrt2 * sigma);
  const bool minus_below = q < 0.5, minus_above = q > 0.5;
  LogSum sum;
  std::array<double, kLevels + 1> partial{};  // the last partial sums, in units of e^{sum.m}
  double log_binom = 0.0, sign = 1.0, prev = kNan;
  // Adds e^{w}·(e^{x} − 1) (minus) or e^{w + x}, times sign; returns LogSum's rescale factor.
  auto add = [&](double w, double x, bool minus) {
    if (!minus) return sum.add(w + x, sign);
    if (x == 0.0) return 1.0;
    return x > 0.0 ? sum.add(w + log_expm1(x), sign) : sum.add(w + std::log(-std::expm1(x)), -sign);
  };
  for (int64_t i = 0;; ++i) {
    const double di = static_cast<double>(i), j = alpha - di;
    double f = add(log_binom + di * log_q + j * log_1mq,
                   (di * di - di) / two_s2 + log_half_erfc((di - z0) * inv), minus_below);
    f *= add(log_binom + j * log_q + di * log_1mq,
             (j * j - j) / two_s2 + log_half_erfc((z0 - j) * inv), minus_above);
    for (int k = 0; k < kLevels; ++k) partial[k] = partial[k + 1] * f;
    partial[kLevels] = sum.s;
    prev *= f;
    if (di > alpha + kLevels + 1.0) {
      const double est = euler_estimate(partial);
      // Done when the estimate moves by less than 1e-15 of A − 1, or by less
      // than the rounding of the largest term (1 in these units).
      const double a_minus_1 = minus_below || minus_above ? est : est - std::exp(-sum.m);
      const double moved = std::fabs(est - prev);
      if (moved <= 1e-15 * std::fabs(a_minus_1) || moved <= 1e-17)
        return minus_below || minus_above ? log1p_exp(est > 0.0 ? sum.m + std::log(est) : -kInf)
                                          : sum.m + std::log(est);
      prev = est;
    }
    PO_ASSERT(i < 1000000, "fractional RDP series did not converge: q=", q, " sigma=", sigma, " order=", alpha);
    log_binom += std::log(std::fabs(alpha - di)) - std::log(di + 1.0);
    if (alpha - di < 0.0) sign = -sign;
  }
}

}  // namespace

std::vector<double> default_orders() {
  std::vector<double> orders;
  for (int x = 1; x < 100; ++x) orders.push_back(1.0 + x / 10.0);
  for (int a = 12; a < 64; ++a) orders.push_back(a);
  return orders;
}

double rdp_sampled_gaussian(double q, double sigma, double order) {
  check_q(q);
  check_sigma(sigma);
  check_order(order);
  if (q == 0.0 || std::isinf(sigma)) return 0.0;
  if (sigma == 0.0 || std::isinf(order)) return kInf;
  if (q == 1.0) return order / (2.0 * sigma * sigma);
  const double log_a = order == std::floor(order)
                           ? log1p_exp(log_a_minus_1_int(q, sigma, static_cast<int64_t>(order)))
                           : log_a_frac(q, sigma, order);
  return std::max(log_a, 0.0) / (order - 1.0);
}

RdpAccountant::RdpAccountant(std::vector<double> orders)
    : orders_(std::move(orders)), total_(orders_.size(), 0.0) {
  PO_CHECK(!orders_.empty(), "privacy.orders must not be empty");
  for (double a : orders_) check_order(a);
}

void RdpAccountant::add(double q, double sigma, int64_t steps) {
  check_q(q);
  check_sigma(sigma);
  check_steps(steps);
  if (steps == 0) return;
  if (runs_.empty() || runs_.back().q != q || runs_.back().sigma != sigma) {
    runs_.push_back({q, sigma, 0});
    last_step_.resize(orders_.size());
    for (size_t k = 0; k < orders_.size(); ++k) last_step_[k] = rdp_sampled_gaussian(q, sigma, orders_[k]);
  }
  runs_.back().steps += steps;
  total_steps_ += steps;
  for (size_t k = 0; k < orders_.size(); ++k) total_[k] += static_cast<double>(steps) * last_step_[k];
}

double RdpAccountant::rdp(double order) const {
  check_order(order);
  for (size_t k = 0; k < orders_.size(); ++k)
    if (orders_[k] == order) return total_[k];
  double total = 0.0;
  for (const Run& r : runs_) total += static_cast<double>(r.steps) * rdp_sampled_gaussian(r.q, r.sigma, order);
  return total;
}

RdpAccountant::Epsilon RdpAccountant::epsilon(double delta, Conversion conversion) const {
  check_delta(delta);
  bool spent = false;
  for (double r : total_) spent = spent || r != 0.0;
  if (!spent) return {0.0, kNan};
  const double log_delta = std::log(delta);
  Epsilon best{kInf, kNan};
  for (size_t k = 0; k < orders_.size(); ++k) {
    const double eps = convert(total_[k], orders_[k], log_delta, conversion);
    if (eps < best.epsilon) best = {eps, orders_[k]};  // the first (lowest-index) order on a tie
  }
  best.epsilon = std::max(best.epsilon, 0.0);  // Balle's bound dips below 0 only at α > 1/(eδ)
  return best;
}

double sigma_for_epsilon(double target_eps, double delta, double q, int64_t steps, Conversion conversion) {
  PO_CHECK(target_eps > 0.0, "privacy.target_epsilon must be > 0, got ", target_eps);
  check_delta(delta);
  check_q(q);
  check_steps(steps);
  if (q == 0.0 || steps == 0) return 0.0;
  auto eps_at = [&](double sigma) {
    RdpAccountant acc;
    acc.add(q, sigma, steps);
    return acc.epsilon(delta, conversion).epsilon;
  };
  // With RDP = 0 at every order the conversion still charges its δ term.
  double floor_eps = kInf;
  for (double a : default_orders()) floor_eps = std::min(floor_eps, convert(0.0, a, std::log(delta), conversion));
  PO_CHECK(target_eps > floor_eps, "privacy.target_epsilon must be > ", floor_eps,
           " (the bound at infinite noise for privacy.delta ", delta, "), got ", target_eps);
  double lo = 0.0, hi = 1.0;
  while (eps_at(hi) > target_eps) {
    lo = hi;
    hi *= 2.0;
    PO_ASSERT(hi < 1e12, "no noise multiplier reaches epsilon ", target_eps);
  }
  while (hi - lo > 1e-10 * hi) {
    const double mid = 0.5 * (lo + hi);
    (eps_at(mid) > target_eps ? lo : hi) = mid;
  }
  return hi;
}

}  // namespace po::privacy
