"""Independent reference for PagedOptim's Renyi-DP accountant (src/privacy/rdp.h).

Rerun (deterministic, under a minute on one core; prints, writes nothing):

    /usr/bin/python3 tools/privacy_ref/rdp_ref.py

Needs only the standard library and numpy (/usr/bin/python3 has Debian's
numpy 1.24; python3-scipy is not installed here, so the quadrature is written
out below and the script runs wherever numpy does).
It computes the same quantities as the C++ by different routes:

  - Integer orders: A_a = sum_{i=0..a} C(a,i) (1-q)^(a-i) q^i exp((i^2-i)/(2 s^2))
    summed in 60-digit decimal arithmetic (exact integer binomials, Decimal exp
    and ln), no log-space tricks. RDP of one step = ln(A_a) / (a - 1).
  - Any order (fractional ones included): A_a is the Renyi moment of the mixture
    mu = (1-q) N(0, s^2) + q N(1, s^2) against mu0 = N(0, s^2),
        A_a = E_{z~mu0} [(1 + q (exp((2z-1)/(2 s^2)) - 1))^a],
    integrated numerically (composite 64-point Gauss-Legendre on panels no wider
    than s/4 over [-40 s, a + 40 s], checked against 32 points). Where A_a > e
    the integrand is summed in log space; below that, because
    E_{mu0}[exp((2z-1)/(2 s^2)) - 1] = 0, the integrand is written as
    mu0 * ((1+x)^a - 1 - a x) with x = q (exp(...) - 1), which integrates to
    A_a - 1 with no cancellation against the 1 (this keeps small-q cases to
    ~1e-12 relative). Neither route is the C++'s: that sums the two erfc
    series of Mironov, Talwar and Zhang 2019 (arXiv 1908.10530, section 3.3).
  - epsilon: classic (Mironov 2017) min_a RDP - ln(delta)/(a-1), and Balle et al.
    2020 (Opacus' get_privacy_spent) min_a RDP + ln((a-1)/a) - (ln delta + ln a)/(a-1).

The integer route and the integral are compared with each other at integer
orders (printed as "int check"); the golden numbers in tests/privacy/rdp_test.cc
are copied from this output.
"""
import math
from decimal import MAX_EMAX, MIN_EMIN, Decimal, getcontext

import numpy as np

getcontext().prec = 60
getcontext().Emax = MAX_EMAX  # exp((i^2-i)/(2 s^2)) reaches e^(3e6) at s = 0.1, a = 256
getcontext().Emin = MIN_EMIN

DEFAULT_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(12, 64)]
# tensorflow/privacy rdp_accountant_test.py test_check_composition's orders.
TF_COMPOSITION_ORDERS = [1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0,
                         14.0, 16.0, 20.0, 24.0, 28.0, 32.0, 64.0, 256.0]
# tensorflow/privacy compute_dp_sgd_privacy_lib.py's orders (the same before and after be8175b).
TF_DPSGD_ORDERS = ([1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5]
                   + [float(a) for a in range(5, 64)] + [128.0, 256.0, 512.0])


def log_a_int_decimal(q, sigma, alpha):
    """ln A_alpha for integer alpha, in 60-digit decimal arithmetic."""
    a = int(alpha)
    dq = Decimal(q)
    dp = Decimal(1) - dq
    two_s2 = 2 * Decimal(sigma) * Decimal(sigma)
    total = Decimal(0)
    for i in range(a + 1):
        total += math.comb(a, i) * dp ** (a - i) * dq ** i * (Decimal(i * i - i) / two_s2).exp()
    return total.ln()


def _h(x, alpha):
    """(1+x)^alpha - 1 - alpha*x for x > -1, without cancellation near 0 (vectorised)."""
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    small = np.abs(x) < 1e-2
    xs = x[small]
    acc = np.zeros_like(xs)
    coef = alpha * (alpha - 1) / 2.0
    p = xs * xs
    for k in range(2, 40):
        acc += coef * p
        coef *= (alpha - k) / (k + 1)
        p = p * xs
    out[small] = acc
    xl = x[~small]
    out[~small] = np.expm1(alpha * np.log1p(xl)) - alpha * xl
    return out


def _log_full_integrand(z, q, sigma, alpha):
    """ln(mu0(z) (1 + x)^alpha), x = q (exp(u) - 1), u = (2z - 1)/(2 sigma^2)."""
    s2 = sigma * sigma
    u = (2 * z - 1) / (2 * s2)
    log_mu0 = -z * z / (2 * s2) - math.log(sigma * math.sqrt(2 * math.pi))
    # ln(1 + x) = ln((1 - q) + q e^u), as a log-sum-exp of its two terms.
    a, b = np.full_like(u, math.log1p(-q)), math.log(q) + u
    m = np.maximum(a, b)
    return log_mu0 + alpha * (m + np.log(np.exp(a - m) + np.exp(b - m)))


def _integrand(z, q, sigma, alpha):
    """mu0(z) * h(q (exp(u) - 1)): integrates to A_alpha - 1. Used only where A is small."""
    s2 = sigma * sigma
    u = (2 * z - 1) / (2 * s2)
    log_mu0 = -z * z / (2 * s2) - math.log(sigma * math.sqrt(2 * math.pi))
    x = q * np.expm1(np.minimum(u, 700.0))
    out = np.empty_like(z)
    big = np.abs(x) >= 1e-2
    out[~big] = np.exp(log_mu0[~big]) * _h(x[~big], alpha)
    # Away from x = 0 there is no cancellation to avoid: (1+x)^alpha in log space.
    lf = _log_full_integrand(z[big], q, sigma, alpha)
    lm = log_mu0[big]
    out[big] = np.exp(lf) - np.exp(lm) - alpha * q * (np.exp(lm + u[big]) - np.exp(lm))
    return out


def _nodes(q, sigma, alpha, npts):
    """Composite Gauss-Legendre nodes and weights covering both Gaussians' mass."""
    lo, hi = -40.0 * sigma - 1.0, alpha + 40.0 * sigma + 1.0
    z0 = sigma * sigma * math.log(1 / q - 1) + 0.5 if 0 < q < 1 else 0.0
    cuts = sorted({lo, hi, 0.0, 0.5, 1.0, alpha} | ({z0} if lo < z0 < hi else set()))
    width = sigma / 4.0
    edges = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        n = max(1, int(math.ceil((b - a) / width)))
        edges.extend(np.linspace(a, b, n + 1)[:-1])
    edges.append(hi)
    edges = np.array(edges)
    nodes, weights = np.polynomial.legendre.leggauss(npts)
    mid = 0.5 * (edges[1:] + edges[:-1])
    half = 0.5 * (edges[1:] - edges[:-1])
    z = (mid[:, None] + half[:, None] * nodes[None, :]).ravel()
    w = (half[:, None] * weights[None, :]).ravel()
    return z, w


def log_a_integral(q, sigma, alpha, npts=64):
    """ln A_alpha by composite Gauss-Legendre quadrature."""
    z, w = _nodes(q, sigma, alpha, npts)
    # The whole moment in log space first: accurate enough once A is well above 1.
    lt = np.log(w) + _log_full_integrand(z, q, sigma, alpha)
    m = lt.max()
    log_a = m + math.log(math.fsum(np.exp(lt - m)))
    if log_a > 1.0:
        return log_a
    # Otherwise integrate A - 1 itself, so a tiny RDP keeps its relative precision.
    prod = w * _integrand(z, q, sigma, alpha)
    order = np.argsort(np.abs(prod))  # small terms first
    return math.log1p(math.fsum(prod[order]))


def rdp_step(q, sigma, alpha, route="auto"):
    """RDP of one sampled-Gaussian step at order alpha."""
    if q == 0:
        return 0.0
    if sigma == 0:
        return math.inf
    if q == 1:
        return alpha / (2 * sigma * sigma)
    if route == "decimal" or (route == "auto" and float(alpha).is_integer()):
        return float(log_a_int_decimal(q, sigma, alpha)) / (alpha - 1)
    return log_a_integral(q, sigma, alpha) / (alpha - 1)


def rdp_total(parts, orders):
    """parts: list of (q, sigma, steps). Returns total RDP at every order."""
    return [sum(t * rdp_step(q, s, a) for q, s, t in parts) for a in orders]


def eps_classic(orders, rdp, delta):
    best = min(((r - math.log(delta) / (a - 1), a) for a, r in zip(orders, rdp)))
    return best


def eps_balle(orders, rdp, delta):
    best = min(((r + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1), a)
                for a, r in zip(orders, rdp)))
    return best


def main():
    print("# published cases")
    print("tf scalar: q=0.1 s=2 T=10 RDP(5) = %.10f  (published 0.07737)" % (10 * rdp_step(0.1, 2, 5)))
    orders = [float(a) for a in range(2, 33)]
    rdp = rdp_total([(0.01, 4, 10000)], orders)
    e, a = eps_classic(orders, rdp, 1e-5)
    eb, ab = eps_balle(orders, rdp, 1e-5)
    print("tf target delta: q=0.01 s=4 T=1e4 orders 2..32 classic eps = %.10f @ %g  (published 1.258575 @ 20);"
          " balle %.10f @ %g" % (e, a, eb, ab))
    parts = [(1e-5, 1.0, 10), (1e-4, 3.0, 4)]
    for name, ords in (("orders 2..32", orders), ("default orders", DEFAULT_ORDERS)):
        rdp = rdp_total(parts, ords)
        eb, ab = eps_balle(ords, rdp, 1e-5)
        print("opacus doctest (%s): balle eps = %.10f @ %g  (published 0.336 @ 23)" % (name, eb, ab))
    rdp = rdp_total([(1e-4, 0.4, 40000), (0.1, 2.0, 100)], TF_COMPOSITION_ORDERS)
    e, a = eps_classic(TF_COMPOSITION_ORDERS, rdp, 1e-5)
    print("tf composition: classic eps = %.10f @ %g  (published 8.509656 @ 2.5)" % (e, a))
    ords = [1.5, 2.5, 5.0, 50.0, 100.0]
    vals = rdp_total([(0.01, 2.5, 50)], ords)
    print("tf sequence q=0.01 s=2.5 T=50:", ", ".join("RDP(%g) = %.10g" % (o, v) for o, v in zip(ords, vals)),
          " (published 0.00065, 0.001085, 0.00218075, 0.023846, 167.416307 to 1e-5)")

    # tensorflow/privacy compute_dp_sgd_privacy_test.py, classic values before commit be8175b, Balle's after.
    for n, b, s, ep, d, pub in ((60000, 150, 1.3, 15, 1e-5, "0.941870567 / 0.7242234026109595 @ 19"),
                                (100000, 100, 1.0, 30, 1e-7, "1.70928734 / 1.4154988495444845 @ 13"),
                                (1e8, 1024, 0.1, 10, 1e-7, "5907984.81339406 / 5907982.31138195 @ 1.25")):
        rdp = rdp_total([(b / n, s, int(math.ceil(ep * n / b)))], TF_DPSGD_ORDERS)
        e, a = eps_classic(TF_DPSGD_ORDERS, rdp, d)
        eb, ab = eps_balle(TF_DPSGD_ORDERS, rdp, d)
        print("tf dpsgd n=%g b=%g s=%g: classic %.17g @ %g, balle %.17g @ %g  (published %s)"
              % (n, b, s, e, a, eb, ab, pub))
    ords = [0.001 * i for i in range(1001, 100000)]
    rdp = rdp_total([(1.0, 4.530877117, 1)], ords)
    print("tf gaussian q=1 s=4.530877117 delta=1e-6: balle %.12f @ %g  (published 1, places=7)"
          % eps_balle(ords, rdp, 1e-6))

    print("# MNIST: N=60000, batch 256, sigma=1.1, 60 epochs, delta=1e-5")
    variants = [
        ("q=256/60000, T=ceil(60*60000/256)=14063 (TF compute_dp_sgd_privacy)", 256 / 60000, 14063),
        ("q=256/60000, T=60*ceil(60000/256)=14100 (Opacus compute_dp_sgd_privacy script)", 256 / 60000, 14100),
        ("q=1/235, T=60*235=14100 (Opacus DPDataLoader: q = 1/len(loader))", 1 / 235, 14100),
    ]
    for name, q, t in variants:
        for oname, ords in (("default", DEFAULT_ORDERS), ("tf dpsgd", TF_DPSGD_ORDERS)):
            rdp = rdp_total([(q, 1.1, t)], ords)
            e, a = eps_classic(ords, rdp, 1e-5)
            eb, ab = eps_balle(ords, rdp, 1e-5)
            print("  %s, %s orders: classic %.10f @ %g, balle %.10f @ %g" % (name, oname, e, a, eb, ab))

    print("# golden: q=0.05 s=0.8 T=1000")
    for a in (2.0, 8.0, 32.0, 3.5, 1.25, 10.5):
        print("  RDP(%g) = %.15g" % (a, 1000 * rdp_step(0.05, 0.8, a)))
    rdp = rdp_total([(0.05, 0.8, 1000)], DEFAULT_ORDERS)
    print("  default orders delta=1e-5: classic %.12g @ %g, balle %.12g @ %g"
          % (eps_classic(DEFAULT_ORDERS, rdp, 1e-5) + eps_balle(DEFAULT_ORDERS, rdp, 1e-5)))

    print("# grid: one step, RDP at fractional orders (integral)")
    for q in (1e-4, 0.01, 0.1, 0.5, 0.9):
        for s in (0.5, 1.0, 2.0, 5.0):
            row = []
            for a in (1.1, 1.5, 2.5, 3.5, 7.3, 12.5):
                row.append("%.15g" % rdp_step(q, s, a))
            print("  q=%g s=%g: %s" % (q, s, " ".join(row)))

    print("# int check: integral vs 60-digit sum at integer orders (max relative difference)")
    worst = 0.0
    for q in (1e-4, 0.01, 0.1, 0.5, 0.9):
        for s in (0.5, 1.0, 2.0, 5.0):
            for a in (2.0, 3.0, 8.0, 20.0):
                d = rdp_step(q, s, a, route="decimal")
                i = log_a_integral(q, s, a) / (a - 1)
                worst = max(worst, abs(i - d) / d)
    print("  %.3g" % worst)
    print("# quadrature check: 64 vs 32 points at the grid's fractional orders (max relative difference)")
    worst = 0.0
    for q in (1e-4, 0.01, 0.1, 0.5, 0.9):
        for s in (0.5, 1.0, 2.0, 5.0):
            for a in (1.1, 2.5, 12.5):
                x64 = log_a_integral(q, s, a, 64)
                x32 = log_a_integral(q, s, a, 32)
                worst = max(worst, abs(x64 - x32) / abs(x64))
    print("  %.3g" % worst)


if __name__ == "__main__":
    main()
