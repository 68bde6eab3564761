// Autoregressive sampling: temperature, top-k, and a counter-based RNG so the
// same seed gives the same text. Feeds each new token through the model's
// contiguous KV cache (Transformer::forward_cached); when the cache is full
// the window slides (generate.cc). Serving has its own paged cache and
// sampler (serve/); issue 36 makes them one.
#pragma once

#include <cstdint>
#include <vector>

#include "model/transformer.h"

namespace po::train {

struct SampleOptions {
  int64_t max_new_tokens = 64;
  double temperature = 1.0;  // 0 = greedy
  int64_t top_k = 40;        // 0 = whole vocabulary
  uint64_t seed = 1337;
  int32_t stop_token = -1;   // stop after emitting this id (-1: never)
};

// Returns the new tokens (prompt excluded). `model` must have batch 1.
std::vector<int32_t> sample(model::Transformer& model, const std::vector<int32_t>& prompt,
                            const SampleOptions& options);

}  // namespace po::train
