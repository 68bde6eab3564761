// The training run a golden file of tools/torch_ref describes in its
// metadata (lr, min_lr, warmup_steps, steps, beta1, beta2, eps,
// weight_decay, grad_clip): its warm-up + cosine schedule and its AdamW over
// a model's declared tensors (decay on those of dim >= 2, as the scripts'
// param_groups); and the base goldens' configurations and tensors (base_config,
// read_base) for the tests built on them (LoRA, SFT).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "optim/schedule.h"

namespace po::test {

inline double meta(const checkpoint::SafetensorsReader& f, const std::string& key) {
  return std::stod(f.metadata().at(key));
}

// The base golden's model: GPT-2 (gpt2_ref) or Llama (llama_ref_kv2).
inline model::TransformerConfig base_config(const checkpoint::SafetensorsReader& f, const std::string& arch) {
  model::TransformerConfig c = model::TransformerConfig::arch_defaults(arch);
  c.n_layer = static_cast<int64_t>(meta(f, "n_layer"));
  c.n_embd = static_cast<int64_t>(meta(f, "n_embd"));
  c.n_head = static_cast<int64_t>(meta(f, "n_head"));
  c.vocab_size = static_cast<int64_t>(meta(f, "vocab_size"));
  c.seq_len = static_cast<int64_t>(meta(f, "seq_len"));
  if (arch == "llama") {
    c.n_kv_head = static_cast<int64_t>(meta(f, "n_kv_head"));
    c.ffn_hidden = static_cast<int64_t>(meta(f, "ffn_hidden"));
    c.norm_eps = meta(f, "norm_eps");
    c.rope_theta = meta(f, "rope_theta");
    c.tie_embeddings = meta(f, "tie") != 0;
  }
  return c;
}

// A base golden's tensor in the engine's layout (GPT-2's Conv1D transposed back).
inline void read_base(const checkpoint::SafetensorsReader& f, const model::TensorSpec& p, float* dst) {
  if (!p.conv1d) return f.read_f32(p.name, p.shape, dst);
  const std::vector<float> hf = f.read_f32(p.name, {p.shape[1], p.shape[0]});
  for (int64_t r = 0; r < p.shape[1]; ++r)
    for (int64_t c = 0; c < p.shape[0]; ++c) dst[c * p.shape[1] + r] = hf[r * p.shape[0] + c];
}

struct GoldenRun {
  optim::LrSchedule schedule;
  optim::AdamWConfig adam;

  explicit GoldenRun(const checkpoint::SafetensorsReader& f) {
    auto meta = [&](const std::string& key) { return std::stod(f.metadata().at(key)); };
    schedule.kind = "cosine";
    schedule.lr = meta("lr");
    schedule.min_lr = meta("min_lr");
    schedule.warmup_steps = static_cast<int64_t>(meta("warmup_steps"));
    schedule.total_steps = static_cast<int64_t>(meta("steps"));
    adam.beta1 = meta("beta1");
    adam.beta2 = meta("beta2");
    adam.eps = meta("eps");
    adam.weight_decay = meta("weight_decay");
    adam.grad_clip = meta("grad_clip");
  }
  // AdamW over the model's trainable tensors (its adapters, when it has them).
  optim::AdamW optimizer(const model::Transformer& m) const {
    std::vector<optim::ParamRange> ranges;
    for (const model::TensorSpec& p : m.param_infos()) ranges.push_back({p.offset, p.numel(), p.decay});
    return optim::AdamW(adam, ranges, m.num_params());
  }
};

}  // namespace po::test
