#include "model/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/ops.h"
#include "core/error.h"

namespace po::model::moe {
namespace ops = po::backend::cpu;

namespace {

// The slots (row t, slot j) in expert-major order: expert e's rows are
// [begin[e], begin[e + 1]), in row order; pos[t·k + j] is the slot's place
// in that order and row[place] its row.
struct Dispatch {
  std::vector<int64_t> begin;
  int32_t* pos;  // [R·k]
  int32_t* row;  // [R·k]
  int64_t n;     // R·k
};

Dispatch dispatch(const int32_t* chosen, int64_t R, int64_t k, int64_t E, const Work& w) {
  Dispatch d{{}, w.pos, w.row, R * k};
  d.begin.assign(static_cast<size_t>(E + 1), 0);
  for (int64_t i = 0; i < R * k; ++i) ++d.begin[static_cast<size_t>(chosen[i] + 1)];
  for (int64_t e = 0; e < E; ++e) d.begin[static_cast<size_t>(e + 1)] += d.begin[static_cast<size_t>(e)];
  std::vector<int64_t> next(d.begin.begin(), d.begin.end() - 1);
  for (int64_t t = 0; t < R; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t p = next[static_cast<size_t>(chosen[t * k + j])]++;
      d.pos[t * k + j] = static_cast<int32_t>(p);
      d.row[p] = static_cast<int32_t>(t);
    }
  return d;
}

// The rows of x in expert-major order: xg[place] = x[row[place]].
void gather(float* xg, const float* x, const Dispatch& d, int64_t C) {
  for (int64_t p = 0; p < d.n; ++p)
    std::memcpy(xg + p * C, x + static_cast<int64_t>(d.row[p]) * C, static_cast<size_t>(C) * sizeof(float));
}

const float* gate_up(const Shape& s, const float* experts, int64_t e) { return experts + e * s.expert_numel(); }
const float* down(const Shape& s, const float* experts, int64_t e) {
  return experts + e * s.expert_numel() + 2 * s.F * s.C;
}
float* gate_up(const Shape& s, float* experts, int64_t e) { return experts + e * s.expert_numel(); }
float* down(const Shape& s, float* experts, int64_t e) { return experts + e * s.expert_numel() + 2 * s.F * s.C; }

// Per sequence of T rows, the slots routed to each expert: counts[σ·E + i].
std::vector<int64_t> sequence_counts(const Shape& s, const int32_t* chosen, int64_t R, int64_t T) {
  std::vector<int64_t> counts(static_cast<size_t>(R / T * s.E), 0);
  for (int64_t t = 0; t < R; ++t)
    for (int64_t j = 0; j < s.k; ++j) ++counts[static_cast<size_t>(t / T * s.E + chosen[t * s.k + j])];
  return counts;
}

}  // namespace

Work Work::carve(const Shape& s, int64_t R, float* f) {
  const int64_t RK = R * s.k;
  Work w;
  w.xg = f;
  w.dy = w.xg + RK * s.C;
  w.dact = w.dy + RK * s.C;
  w.dh = w.dact + RK * s.F;
  w.dlog = w.dh + RK * 2 * s.F;
  w.dw = w.dlog + R * s.E;
  w.pos = reinterpret_cast<int32_t*>(w.dw + RK);
  w.row = w.pos + RK;
  return w;
}

Saved Saved::carve(const Shape& s, int64_t R, float* f, int32_t* i) {
  Saved v;
  v.probs = f;
  v.lse = v.probs + R * s.E;
  v.weight = v.lse + R;
  v.h = v.weight + R * s.k;
  v.act = v.h + R * s.k * 2 * s.F;
  v.y = v.act + R * s.k * s.F;
  v.chosen = i;
  return v;
}

void forward(const Shape& s, float* out, const float* x, const Weights& w, int64_t R, const Saved& v,
             const Work& work, const Losses& losses, Stats* stats) {
  const int64_t C = s.C, F = s.F, E = s.E, k = s.k;
  PO_ASSERT(k >= 1 && k <= E, "moe: top ", k, " of ", E, " experts");
  // The router's probabilities (f32 softmax) and logsumexp, the k largest.
  ops::matmul_forward(v.probs, x, w.router, nullptr, R, C, E);
  std::vector<char> taken(static_cast<size_t>(E));
  for (int64_t t = 0; t < R; ++t) {
    float* p = v.probs + t * E;
    float m = p[0];
    for (int64_t i = 1; i < E; ++i) m = std::max(m, p[i]);
    double sum = 0;
    for (int64_t i = 0; i < E; ++i) sum += std::exp(static_cast<double>(p[i] - m));
    const double lse = m + std::log(sum);
    v.lse[t] = static_cast<float>(lse);
    for (int64_t i = 0; i < E; ++i) p[i] = static_cast<float>(std::exp(static_cast<double>(p[i]) - lse));
    std::fill(taken.begin(), taken.end(), 0);
    double chosen_sum = 0;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t i = 0; i < E; ++i)
        if (!taken[static_cast<size_t>(i)] && (best < 0 || p[i] > p[best])) best = i;  // ties: the lower expert
      taken[static_cast<size_t>(best)] = 1;
      v.chosen[t * k + j] = static_cast<int32_t>(best);
      v.weight[t * k + j] = p[best];
      chosen_sum += p[best];
    }
    if (s.router == Router::kSoftmaxTopK)
      for (int64_t j = 0; j < k; ++j) v.weight[t * k + j] = static_cast<float>(v.weight[t * k + j] / chosen_sum);
  }
  // Each expert on its rows, in row order.
  const Dispatch d = dispatch(v.chosen, R, k, E, work);
  gather(work.xg, x, d, C);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t b = d.begin[static_cast<size_t>(e)], n = d.begin[static_cast<size_t>(e + 1)] - b;
    if (n == 0) continue;  // (exact: nothing to compute)
    ops::matmul_forward(v.h + b * 2 * F, work.xg + b * C, gate_up(s, w.experts, e), nullptr, n, C, 2 * F);
    ops::swiglu_forward(v.act + b * F, v.h + b * 2 * F, n, F);
    ops::matmul_forward(v.y + b * C, v.act + b * F, down(s, w.experts, e), nullptr, n, F, C);
  }
  // Each row's experts, weighted, in slot order.
  for (int64_t t = 0; t < R; ++t) {
    float* o = out + t * C;
    for (int64_t j = 0; j < k; ++j) {
      const float wt = v.weight[t * k + j];
      const float* y = v.y + static_cast<int64_t>(d.pos[t * k + j]) * C;
      if (j == 0)
        for (int64_t c = 0; c < C; ++c) o[c] = wt * y[c];
      else
        for (int64_t c = 0; c < C; ++c) o[c] += wt * y[c];
    }
  }
  if (stats == nullptr) return;
  stats->tokens.assign(static_cast<size_t>(E), 0);
  for (int64_t e = 0; e < E; ++e)
    stats->tokens[static_cast<size_t>(e)] = d.begin[static_cast<size_t>(e + 1)] - d.begin[static_cast<size_t>(e)];
  stats->aux = stats->z = 0;
  if (losses.aux > 0) {
    PO_ASSERT(losses.T > 0 && R % losses.T == 0, "moe: ", R, " rows are not whole sequences of ", losses.T);
    const std::vector<int64_t> counts = sequence_counts(s, v.chosen, R, losses.T);
    double sum = 0;
    for (int64_t q = 0; q < R / losses.T; ++q)
      for (int64_t i = 0; i < E; ++i) {
        double P = 0;
        for (int64_t t = q * losses.T; t < (q + 1) * losses.T; ++t) P += v.probs[t * E + i];
        const double f = static_cast<double>(counts[static_cast<size_t>(q * E + i)]) / static_cast<double>(losses.T * k);
        sum += f * P / static_cast<double>(losses.T);
      }
    stats->aux = losses.aux * static_cast<double>(E) * losses.seq_scale * sum;
  }
  if (losses.z > 0) {
    double sum = 0;
    for (int64_t t = 0; t < R; ++t) sum += static_cast<double>(v.lse[t]) * v.lse[t];
    stats->z = losses.z * losses.row_scale * sum;
  }
}

void backward(const Shape& s, float* dx, const Grads& g, const float* dout, const float* x, const Weights& w,
              int64_t R, const Saved& v, const Work& work, const Losses& losses) {
  const int64_t C = s.C, F = s.F, E = s.E, k = s.k;
  const Dispatch d = dispatch(v.chosen, R, k, E, work);
  float* const dw_ = work.dw;
  float* const dy_ = work.dy;
  // d(combine weight) of each slot, and each slot's output gradient.
  for (int64_t t = 0; t < R; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t p = d.pos[t * k + j];
      const float* y = v.y + p * C;
      const float* o = dout + t * C;
      double dot = 0;
      for (int64_t c = 0; c < C; ++c) dot += static_cast<double>(o[c]) * y[c];
      dw_[t * k + j] = static_cast<float>(dot);
      float* dy = dy_ + p * C;
      const float wt = v.weight[t * k + j];
      for (int64_t c = 0; c < C; ++c) dy[c] = wt * o[c];
    }
  // Each expert backward on its rows; its input gradients replace its dy rows.
  gather(work.xg, x, d, C);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t b = d.begin[static_cast<size_t>(e)], n = d.begin[static_cast<size_t>(e + 1)] - b;
    if (n == 0) continue;
    float* dy = dy_ + b * C;
    ops::matmul_backward(work.dact, down(s, g.experts, e), nullptr, dy, v.act + b * F, down(s, w.experts, e), n, F,
                         C);
    ops::swiglu_backward(work.dh, v.h + b * 2 * F, work.dact, n, F);
    ops::matmul_backward(dy, gate_up(s, g.experts, e), nullptr, work.dh, work.xg + b * C, gate_up(s, w.experts, e),
                         n, C, 2 * F);
  }
  // A row's input gradient: its k slots', in slot order.
  for (int64_t t = 0; t < R; ++t) {
    float* o = dx + t * C;
    for (int64_t j = 0; j < k; ++j) {
      const float* src = dy_ + static_cast<int64_t>(d.pos[t * k + j]) * C;
      if (j == 0)
        std::memcpy(o, src, static_cast<size_t>(C) * sizeof(float));
      else
        for (int64_t c = 0; c < C; ++c) o[c] += src[c];
    }
  }
  // The router: d(probabilities) from the combine weights, the balance
  // loss (its f held constant) and, through the softmax, the z-loss.
  std::vector<int64_t> counts;
  if (losses.aux > 0) counts = sequence_counts(s, v.chosen, R, losses.T);
  std::fill_n(work.dlog, R * E, 0.0f);
  for (int64_t t = 0; t < R; ++t) {
    float* dp = work.dlog + t * E;
    const float* p = v.probs + t * E;
    const float* dwt = dw_ + t * k;
    if (s.router == Router::kSoftmaxTopK) {
      double S = 0, dot = 0;
      for (int64_t j = 0; j < k; ++j) {
        S += p[v.chosen[t * k + j]];
        dot += static_cast<double>(dwt[j]) * v.weight[t * k + j];
      }
      for (int64_t j = 0; j < k; ++j) dp[v.chosen[t * k + j]] += static_cast<float>((dwt[j] - dot) / S);
    } else {
      for (int64_t j = 0; j < k; ++j) dp[v.chosen[t * k + j]] += dwt[j];
    }
    if (losses.aux > 0) {
      const double scale = losses.aux * static_cast<double>(E) * losses.seq_scale /
                           (static_cast<double>(losses.T) * static_cast<double>(losses.T * k));
      const int64_t* c = counts.data() + t / losses.T * E;
      for (int64_t i = 0; i < E; ++i) dp[i] += static_cast<float>(scale * static_cast<double>(c[i]));
    }
    double pd = 0;
    for (int64_t i = 0; i < E; ++i) pd += static_cast<double>(p[i]) * dp[i];
    const double dz = 2.0 * losses.z * losses.row_scale * v.lse[t];
    for (int64_t i = 0; i < E; ++i) dp[i] = static_cast<float>(p[i] * (dp[i] - pd + dz));
  }
  ops::matmul_backward(dx, g.router, nullptr, work.dlog, x, w.router, R, C, E, true);
}

}  // namespace po::model::moe
