#include "serve/generate.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "serve/sampler.h"

namespace po::serve {

std::vector<int32_t> sample(model::Transformer& model, const std::vector<int32_t>& prompt,
                            const SampleOptions& o, SampleTimes* times) {
  using Clock = std::chrono::steady_clock;
  SampleTimes t;
  PO_CHECK(!prompt.empty(), "generate: the prompt encodes to no tokens");
  PO_CHECK(o.temperature >= 0, "generate: --temperature must be >= 0, got ", o.temperature);
  PO_CHECK(o.top_k >= 0, "generate: --top-k must be >= 0, got ", o.top_k);
  const int64_t V = model.config().vocab_size, window = model.seq();
  for (int32_t t : prompt)
    PO_CHECK(t >= 0 && t < V, "generate: prompt token ", t, " is outside the vocabulary (", V, ")");
  std::vector<int32_t> context = prompt, out;
  std::vector<float> logits(static_cast<size_t>(V));
  SamplingParams p;
  p.do_sample = o.temperature > 0;
  if (p.do_sample) p.temperature = o.temperature;
  p.top_k = o.top_k;
  p.seed = o.seed;
  // The KV cache holds the window; when it is full the window slides and the
  // cache is refilled from the last window/2 tokens (positions restart at 0).
  model::KvCache cache = model.make_kv_cache(window);
  size_t fed = 0;  // context tokens whose keys and values are in the cache
  auto refill = [&] {
    const size_t keep = std::min<size_t>(context.size(), static_cast<size_t>(std::max<int64_t>(1, window / 2)));
    cache.length = 0;
    fed = context.size() - keep;
  };
  if (static_cast<int64_t>(context.size()) > window) refill();
  for (int64_t i = 0; i < o.max_new_tokens; ++i) {
    if (cache.length + static_cast<int64_t>(context.size() - fed) > window) refill();
    const int64_t n = static_cast<int64_t>(context.size() - fed);
    const auto t0 = Clock::now();
    model.forward_cached(context.data() + fed, n, cache, logits.data());
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    if (i == 0) {
      t.prompt_tokens = n;
      t.prompt_seconds = secs;
    } else {
      ++t.decoded_tokens;
      t.decode_seconds += secs;
    }
    fed = context.size();
    const int32_t next = sample_token(logits.data(), V, p, context, static_cast<int64_t>(out.size()),
                                      static_cast<uint64_t>(i)).id;
    out.push_back(next);
    context.push_back(next);
    if (next == o.stop_token) break;
  }
  if (times != nullptr) *times = t;
  return out;
}

}  // namespace po::serve
