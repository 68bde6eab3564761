// GPT-2 model shapes and presets. A config is validated once; everything else
// (parameter layout, activation sizes, FLOPs) is derived from it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace po::model {

struct GPT2Config {
  int64_t n_layer = 0;
  int64_t n_embd = 0;
  int64_t n_head = 0;
  int64_t vocab_size = 0;
  int64_t seq_len = 0;  // maximum sequence length (rows of wpe)
  bool activation_checkpointing = false;
  // Activations saved for the backward are stored in bf16 (train.precision =
  // "bf16"): half the bytes; the kernels still compute in f32 (gpt2.h).
  bool bf16_activations = false;

  // Shapes of a named preset; throws InvalidArgument listing the known names.
  static GPT2Config preset(const std::string& name);
  static std::vector<std::string> preset_names();

  // Throws InvalidArgument naming the offending field (model.n_head ...).
  void validate() const;

  // Total parameters (tied head counted once).
  int64_t num_params() const;
  // Elements of each unit in GPT2's flat layout: embeddings (wte, wpe),
  // the L blocks, the final LayerNorm (the planner sizes shards from it).
  std::vector<int64_t> unit_numels() const;
  // Training FLOPs per token: 6·Ψ + 12·L·C·T (REFERENCE.md, PaLM appendix B), at sequence T.
  double flops_per_token(int64_t T) const;
};

}  // namespace po::model
