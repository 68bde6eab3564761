// The adapters' exports of a tiny run (tests/test_util.h's TinyTraining:
// GPT-2, 2 layers, 32 wide, vocabulary 64, 16 positions, train.seed 1337),
// checked the same way by the LoRA and the QLoRA launch tests.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "checkpoint/gpt2_io.h"
#include "checkpoint/peft.h"
#include "model/transformer.h"

#include "../test_util.h"

namespace po::test {

// `pagedoptim export RUN --adapter --out PEFT` and `export RUN --out MERGED`.
inline void export_adapter_and_merged(const std::string& run, const std::string& peft,
                                      const std::string& merged) {
  for (const std::string& args : {run + " --adapter --out " + peft, run + " --out " + merged}) {
    const auto r = run_command(std::string(PO_BINARY) + " export " + args);
    ASSERT_EQ(r.exit_code, 0) << "export " << args << "\n" << r.output;
  }
}

// The merged weights file's logits equal the run's base (train.seed's
// random init, quantized by `quant`) with the PEFT adapter on it (1e-5).
inline void expect_merged_export_logits(const std::string& peft, const std::string& merged,
                                        model::WeightQuant quant, const std::string& what) {
  model::TransformerConfig c = model::TransformerConfig::arch_defaults("gpt2");
  c.n_layer = 2, c.n_embd = 32, c.n_head = 2, c.vocab_size = 64, c.seq_len = 16;  // tiny_config's
  model::TransformerConfig adapted_config = c;
  adapted_config.lora = checkpoint::read_peft_config(peft);
  adapted_config.quant = quant;
  model::Transformer adapted(adapted_config, 1, 16), plain(c, 1, 16);
  adapted.init_random(1337);  // train.seed's base (quantized unit by unit under model.quant)
  ASSERT_EQ(adapted.base_quantized(), quant != model::WeightQuant::kNone) << what;
  checkpoint::read_peft_adapter(peft, adapted);
  checkpoint::load_gpt2_safetensors(merged, plain);
  std::vector<int32_t> tokens(16);
  for (int i = 0; i < 16; ++i) tokens[static_cast<size_t>(i)] = (i * 5 + 3) % 64;
  std::vector<float> a(64), b(64);
  adapted.next_token_logits(tokens.data(), 16, a.data());
  plain.next_token_logits(tokens.data(), 16, b.data());
  expect_close(b.data(), a, what, 1e-5);
}

}  // namespace po::test
