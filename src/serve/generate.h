// `pagedoptim generate`: one sequence, fed token by token through the
// model's contiguous KV cache (Transformer::forward_cached); when the cache
// is full the window slides (generate.cc). Each token is chosen by serve's
// sampler (serve/sampler.h), so a seeded `generate` picks what a `serve`
// request with the same seed, temperature and top-k picks, and greedy is the
// same first maximum. The contiguous cache is a paged cache of one block, so
// the logits come from serve's decode path (Transformer::forward_paged).
#pragma once

#include <cstdint>
#include <vector>

#include "model/transformer.h"

namespace po::serve {

struct SampleOptions {
  int64_t max_new_tokens = 64;
  double temperature = 1.0;  // 0 = greedy
  int64_t top_k = 40;        // 0 = whole vocabulary
  uint64_t seed = 1337;
  int32_t stop_token = -1;   // stop after emitting this id (-1: never)
};

// Where the time went: the prompt's forward (prefill, its tokens) and the
// rest (decode, one forward per further token; a window slide's refill
// counts here), wall-clock seconds.
struct SampleTimes {
  int64_t prompt_tokens = 0, decoded_tokens = 0;
  double prompt_seconds = 0, decode_seconds = 0;
};

// Returns the new tokens (prompt excluded). `model` must have batch 1.
std::vector<int32_t> sample(model::Transformer& model, const std::vector<int32_t>& prompt,
                            const SampleOptions& options, SampleTimes* times = nullptr);

}  // namespace po::serve
