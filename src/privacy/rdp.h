// Rényi-DP accountant for DP-SGD: the sampled Gaussian mechanism (Mironov
// 2017; Mironov, Talwar, Zhang 2019, arXiv 1908.10530), composed over steps
// and converted to (ε, δ).
//
// One step: every example joins the lot independently with probability q
// (Poisson sampling), the lot's clipped gradients are summed and Gaussian
// noise of standard deviation σ·C is added, C the clip norm; σ is the noise
// multiplier. The RDP of order α of one step is ln(A_α)/(α − 1) with
//   A_α = E_{z~μ0} [(μ(z)/μ0(z))^α],  μ0 = N(0, σ²),  μ = (1 − q)·μ0 + q·N(1, σ²).
// The bound holds for Poisson sampling only: fixed-size shuffled batches
// accounted this way are "a shortcut" (opacus#80).
//
// Rules the code keeps:
//   - RDP at one order composes by addition, so the accountant keeps the
//     total at each order and any mix of (q, σ) steps composes.
//   - Orders are > 1. ε is the smallest bound over the accountant's orders,
//     so more orders never give a larger ε.
//   - Every result is an upper bound on the true privacy loss; values are
//     held to tensorflow/privacy and Opacus to their printed digits and to an
//     independent numerical reference (tools/privacy_ref/rdp_ref.py).
//   - Bad input throws po::core::InvalidArgument naming the parameter
//     (privacy.sample_rate, privacy.noise_multiplier, ...) and its value.
#pragma once

#include <cstdint>
#include <vector>

namespace po::privacy {

// Opacus' RDPAccountant.DEFAULT_ALPHAS: 1 + x/10 for x in 1..99 (1.1 ... 10.9),
// then the integers 12 ... 63; 151 orders.
std::vector<double> default_orders();

// RDP of order `order` (> 1, +inf allowed) of ONE step of the sampled Gaussian
// mechanism with sampling rate q in [0, 1] and noise multiplier sigma >= 0.
// q = 0 gives 0; q = 1 gives order/(2σ²); σ = 0 (with q > 0) gives +inf.
// Integer orders sum the exact binomial expansion of A_α; fractional orders
// the two erfc series of Mironov et al. 2019 §3.3. Cost: about `order`
// terms either way (+10 for fractional orders); 151 orders take ~0.3 ms.
double rdp_sampled_gaussian(double q, double sigma, double order);

// How RDP converts to (ε, δ)-DP.
enum class Conversion {
  kClassic,    // Mironov 2017, Prop. 3: ε = RDP(α) − ln δ/(α − 1)
  kBalle2020,  // Balle et al. 2020, Thm. 21 (Opacus' get_privacy_spent):
               // ε = RDP(α) + ln((α − 1)/α) − (ln δ + ln α)/(α − 1); tighter
};

class RdpAccountant {
 public:
  struct Epsilon {
    double epsilon;  // >= 0, +inf when every order's RDP is infinite
    double order;    // the order that gave it; NaN when no order did (nothing spent, or all infinite)
  };

  // `orders`: the orders ε is minimised over (each > 1, at least one).
  explicit RdpAccountant(std::vector<double> orders = default_orders());

  // Records `steps` steps of sampling rate q and noise multiplier sigma.
  // Consecutive calls with the same (q, sigma) cost one vector addition.
  void add(double q, double sigma, int64_t steps = 1);

  // Total RDP of everything added, at `order` (> 1). One of orders() is a
  // lookup; any other order is computed from the recorded steps.
  double rdp(double order) const;

  // The smallest ε over orders() for which the steps so far are (ε, delta)-DP,
  // delta in (0, 1). Nothing spent (no steps, or only q = 0 steps) is ε = 0.
  Epsilon epsilon(double delta, Conversion conversion = Conversion::kBalle2020) const;

  const std::vector<double>& orders() const { return orders_; }
  int64_t steps() const { return total_steps_; }

 private:
  struct Run {
    double q, sigma;
    int64_t steps;
  };
  std::vector<double> orders_;
  std::vector<double> total_;     // total RDP at orders_[k]
  std::vector<double> last_step_; // one step's RDP of runs_.back(), at orders_[k]
  std::vector<Run> runs_;         // consecutive equal (q, sigma) merged
  int64_t total_steps_ = 0;
};

// The smallest noise multiplier (to relative 1e-10, rounded up) for which
// `steps` steps at sampling rate q are (target_eps, delta)-DP over
// default_orders(), by bisection (as Opacus' get_noise_multiplier, tighter).
// q = 0 or steps = 0 needs no noise: 0. Throws InvalidArgument when
// target_eps is not above the bound that infinite noise still gives
// (a Balle bound of about 0.1 at delta = 1e-5).
double sigma_for_epsilon(double target_eps, double delta, double q, int64_t steps,
                         Conversion conversion = Conversion::kBalle2020);

}  // namespace po::privacy
