// Choosing a request's next token from its logits, with its own parameters
// and its own random numbers: token i of a request draws from Philox keyed on
// (its seed, i), so a seeded request gives the same tokens whatever else is
// in the batch and however often it was preempted and recomputed.
#pragma once

#include <cstdint>
#include <vector>

#include "serve/types.h"

namespace po::serve {

struct Choice {
  int32_t id = 0;
  float logprob = 0;  // log-softmax of the raw logits at id
  std::vector<std::pair<int32_t, float>> top;  // p.top_logprobs best (id, logprob), best first
};

// `logits` [V] (modified: penalties, temperature); `context` the prompt and
// the tokens generated so far, of which the last `generated` are the
// output; `index` the token's index in the output.
// A prompt token's score: log-softmax of `logits` [V] at `id`, and the `top`
// likeliest tokens (id, logprob), likeliest first; no text.
GeneratedToken score_token(const float* logits, int64_t V, int32_t id, int64_t top);

Choice sample_token(float* logits, int64_t V, const SamplingParams& p,
                    const std::vector<int32_t>& context, int64_t generated, uint64_t index);

}  // namespace po::serve
