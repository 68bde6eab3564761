#include "serve/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <unordered_map>

#include "core/rng.h"

namespace po::serve {
namespace {

// Philox stream of the serving sampler (any fixed constant: "PSRV").
constexpr uint64_t kStream = 0x50535256ULL;

// log Σ exp(x): float exps in a vectorisable loop (a double exp per logit
// cost ~1 ms a token at GPT-2's vocabulary, per sequence of the batch), the
// partial sums added in double.
double log_sum_exp(const float* x, int64_t n) {
  const float mx = *std::max_element(x, x + n);
  double s = 0;
  constexpr int64_t kChunk = 1024;
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    float part = 0;
    const int64_t i1 = std::min(n, i0 + kChunk);
#pragma omp simd reduction(+ : part)
    for (int64_t i = i0; i < i1; ++i) part += std::exp(x[i] - mx);
    s += part;
  }
  return mx + std::log(s);
}

// The k likeliest tokens of `logits` as (id, logit - lse), likeliest first
// (ties: the lower id).
std::vector<std::pair<int32_t, float>> likeliest(const float* logits, int64_t V, int64_t k, float lse) {
  std::vector<std::pair<int32_t, float>> top;
  if (k <= 0) return top;
  std::vector<int32_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), 0);
  k = std::min(k, V);
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  for (int64_t i = 0; i < k; ++i) top.push_back({ids[static_cast<size_t>(i)], logits[ids[static_cast<size_t>(i)]] - lse});
  return top;
}

}  // namespace

GeneratedToken score_token(const float* logits, int64_t V, int32_t id, int64_t top) {
  const auto lse = static_cast<float>(log_sum_exp(logits, V));
  GeneratedToken t;
  t.id = id;
  t.logprob = logits[id] - lse;
  t.top = likeliest(logits, V, top, lse);
  return t;
}

Choice sample_token(float* logits, int64_t V, const SamplingParams& p,
                    const std::vector<int32_t>& context, int64_t generated, uint64_t index) {
  const float logprob_base = static_cast<float>(log_sum_exp(logits, V));
  // Of the raw logits, before penalties.
  std::vector<std::pair<int32_t, float>> top = likeliest(logits, V, p.top_logprobs, logprob_base);
  std::vector<float> raw;  // the logprob is of the raw logits
  const bool penalised = p.repetition_penalty != 1.0 || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0;
  if (penalised) raw.assign(logits, logits + V);
  // Penalties: repetition over prompt and output (CTRL), frequency and
  // presence over the output (OpenAI).
  if (p.repetition_penalty != 1.0) {
    std::vector<bool> seen(static_cast<size_t>(V), false);
    for (int32_t t : context) {
      if (t < 0 || t >= V || seen[static_cast<size_t>(t)]) continue;
      seen[static_cast<size_t>(t)] = true;
      float& l = logits[t];
      l = l > 0 ? static_cast<float>(l / p.repetition_penalty) : static_cast<float>(l * p.repetition_penalty);
    }
  }
  if (p.frequency_penalty != 0.0 || p.presence_penalty != 0.0) {
    std::unordered_map<int32_t, int> counts;
    for (size_t i = context.size() - static_cast<size_t>(generated); i < context.size(); ++i) ++counts[context[i]];
    for (const auto& [t, c] : counts)
      logits[t] -= static_cast<float>(c * p.frequency_penalty + p.presence_penalty);
  }
  auto finish = [&](int32_t id) {
    const float l = penalised ? raw[static_cast<size_t>(id)] : logits[id];
    return Choice{id, l - logprob_base, std::move(top)};
  };
  if (!p.do_sample)  // greedy: the first maximum, as `generate --temperature 0`
    return finish(static_cast<int32_t>(std::max_element(logits, logits + V) - logits));
  // Candidates by descending logit (only the top k when top-k is on).
  std::vector<int32_t> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  const int64_t k = p.top_k > 0 ? std::min<int64_t>(p.top_k, V) : V;
  auto higher = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  if (k < V || p.top_p < 1.0 || p.typical_p < 1.0)
    std::partial_sort(order.begin(), order.begin() + k, order.end(), higher);
  order.resize(static_cast<size_t>(k));
  std::vector<double> prob(order.size());
  const double mx = logits[order[0]] / p.temperature;
  double sum = 0;
  for (size_t i = 0; i < order.size(); ++i) sum += prob[i] = std::exp(logits[order[i]] / p.temperature - mx);
  for (double& q : prob) q /= sum;
  size_t keep = order.size();
  if (p.top_p < 1.0) {  // the smallest head whose mass reaches top_p
    double c = 0;
    for (size_t i = 0; i < keep; ++i)
      if ((c += prob[i]) >= p.top_p) {
        keep = i + 1;
        break;
      }
  }
  order.resize(keep);
  prob.resize(keep);
  if (p.typical_p < 1.0) {  // locally typical: closest to the entropy first, until the mass reaches typical_p
    double s = 0;
    for (double q : prob) s += q;
    double h = 0;
    for (double& q : prob) {
      q /= s;
      if (q > 0) h -= q * std::log(q);
    }
    std::vector<size_t> by(keep);
    std::iota(by.begin(), by.end(), 0);
    std::stable_sort(by.begin(), by.end(), [&](size_t a, size_t b) {
      return std::abs(-std::log(prob[a]) - h) < std::abs(-std::log(prob[b]) - h);
    });
    double c = 0;
    size_t n = keep;
    for (size_t i = 0; i < by.size(); ++i)
      if ((c += prob[by[i]]) >= p.typical_p) {
        n = i + 1;
        break;
      }
    std::vector<int32_t> o2;
    std::vector<double> p2;
    std::sort(by.begin(), by.begin() + static_cast<int64_t>(n));  // back to descending logits
    for (size_t i = 0; i < n; ++i) {
      o2.push_back(order[by[i]]);
      p2.push_back(prob[by[i]]);
    }
    order = std::move(o2);
    prob = std::move(p2);
  }
  double total = 0;
  for (double q : prob) total += q;
  double u = core::Philox(p.seed, kStream).uniform(index) * total;
  for (size_t i = 0; i < order.size(); ++i)
    if ((u -= prob[i]) < 0) return finish(order[i]);
  return finish(order.back());
}

}  // namespace po::serve
