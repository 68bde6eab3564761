// Serving adapters (--lora) in tests: a random adapter on a served model's
// shapes, and the greedy tokens of its merged model through `generate`'s
// decode, the reference a request naming the adapter must give.
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "core/rng.h"
#include "model/transformer.h"
#include "serve/generate.h"

namespace po::serve::test_adapters {

// A model with adapters on `base`'s shapes: r 4 on `targets` (DoRA if
// asked), A Kaiming-uniform and B from N(0, 0.25), so that the adapter
// changes the output; its own base a copy of `base`'s weights (for
// merged_params; serving reads the served model's).
inline std::unique_ptr<model::Transformer> random_adapter(model::Transformer& base,
                                                          const std::vector<std::string>& targets,
                                                          bool dora, uint64_t seed) {
  model::TransformerConfig c = base.config();
  c.lora.r = 4;
  c.lora.alpha = 8;
  c.lora.dora = dora;
  c.lora.targets = targets;
  auto m = std::make_unique<model::Transformer>(c, 1, c.seq_len);
  std::copy_n(base.params(), base.num_params(), m->base_params());
  m->init_adapters(seed);
  const core::Philox rng(seed, 99);
  for (const model::TensorSpec& t : m->param_infos())
    if (t.name.find("lora_B") != std::string::npos)
      for (int64_t i = 0; i < t.numel(); ++i)
        m->params()[t.offset + i] = 0.5f * rng.normal(static_cast<uint64_t>(t.offset + i));
  return m;
}

// The greedy tokens of the adapter's merged model (generate's decode).
inline std::vector<int32_t> merged_greedy(model::Transformer& adapter, const std::vector<int32_t>& prompt,
                                          int64_t n) {
  model::Transformer merged(adapter.config().base_model(), 1, adapter.config().seq_len);
  adapter.merged_params(merged.params());
  SampleOptions o;
  o.temperature = 0;
  o.max_new_tokens = n;
  return sample(merged, prompt, o);
}

}  // namespace po::serve::test_adapters
