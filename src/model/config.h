// Shapes and architecture of the one decoder-only transformer. GPT-2 and Llama
// are configurations of it: `arch` picks the defaults (norm, positions, MLP,
// biases, tied head), and every field can override them. A config is validated
// once; the parameter layout (model/layout.h), activation sizes and FLOPs are
// derived from it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/moe.h"

namespace po::model {

enum class Norm { kLayerNorm, kRMSNorm };     // LayerNorm with bias (GPT-2) | RMSNorm (Llama)
enum class Positions { kLearned, kRope };     // learned wpe (GPT-2) | rotary (Llama)
enum class Mlp { kGeluTanh, kSwiGLU };        // GELU-tanh (GPT-2) | SwiGLU (Llama)
// How a frozen base's block linear weights are stored (model.quant, QLoRA):
// f32 | NF4 with double-quantized scales | int8 per row (model/quant_weight.h).
enum class WeightQuant { kNone, kNf4, kInt8 };

// Llama-3.1's RoPE frequency scaling (rope_scaling.rope_type = "llama3").
struct RopeScalingConfig {
  double factor = 0.0;  // 0: off
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_position = 8192.0;
};

// Low-rank adapters on the blocks' linear layers (the [lora] section): with
// r > 0 every parameter of the model is frozen (the base) and each targeted
// linear learns h = W0·x + s·B·A·x, s = alpha / r (alpha / sqrt(r) under
// rsLoRA), A [r, in], B [out, r] = 0 at the start (PEFT's math). DoRA adds a
// magnitude m per output row: h = b + m ⊙ (W0·x + s·B·A·x) / ‖W0 + s·B·A‖,
// the row norm detached from the graph.
struct LoraConfig {
  int64_t r = 0;  // 0: no adapters, every parameter trains
  double alpha = 8.0;
  bool rslora = false;
  bool dora = false;
  // PEFT's lora_dropout: the adapters' input x·mask/(1-p) while training
  // (parts.h: AdapterDropout); 0: none.
  double dropout = 0.0;
  // Hugging Face module names (q_proj k_proj v_proj o_proj gate_proj up_proj
  // down_proj; GPT-2: c_attn attn.c_proj c_fc mlp.c_proj).
  std::vector<std::string> targets;
  bool on() const { return r > 0; }
  double scale() const;
};

struct TransformerConfig {
  std::string arch = "gpt2";  // "gpt2" | "llama": the defaults below
  int64_t n_layer = 0;
  int64_t n_embd = 0;
  int64_t n_head = 0;
  int64_t n_kv_head = 0;   // grouped-query attention; n_head = multi-head, 1 = multi-query
  int64_t ffn_hidden = 0;  // MLP width F: 4·C for GELU; SwiGLU has gate and up of F each
  int64_t vocab_size = 0;
  int64_t seq_len = 0;     // maximum sequence length (rows of wpe, RoPE table)
  // Width of one attention head; 0: n_embd / n_head. A tensor-parallel shard
  // (shard()) fixes it, since its n_head is a slice of the model's.
  int64_t head_size = 0;
  Norm norm = Norm::kLayerNorm;
  double norm_eps = 1e-5;
  Positions positions = Positions::kLearned;
  double rope_theta = 10000.0;
  RopeScalingConfig rope_scaling;
  Mlp mlp = Mlp::kGeluTanh;
  bool bias = true;            // biases on the linear layers (and LayerNorm's bias)
  bool tie_embeddings = true;  // the LM head multiplies by the token embedding
  bool activation_checkpointing = false;
  // Activations saved for the backward are stored in bf16 (train.precision =
  // "bf16"): half the bytes; the kernels still compute in f32.
  bool bf16_activations = false;
  // parallel.sequence_parallel: with a tensor-parallel split (tp > 1) the
  // norm and residual regions hold B·T/tp rows per rank (Korthikanti et al.
  // 2022); nothing at tp = 1.
  bool sequence_parallel = false;
  // Built to generate only (forward_cached, forward_paged): the activations
  // are one block's tensors, reused by every block, and the head's norm; no
  // saved activations, no backward buffers. Not a config key: the serving
  // and generating commands set it.
  bool inference = false;
  LoraConfig lora;
  // A mixture-of-experts MLP (model/moe.h) in every block instead of the
  // dense one (model.moe_*; experts = 0: dense). Each expert is a SwiGLU of
  // `ffn_hidden` (0: the model's), a row goes to `top_k` of them; the
  // losses' coefficients are train.moe_aux_loss and train.moe_z_loss.
  struct Moe {
    int64_t experts = 0;
    int64_t top_k = 2;
    int64_t ffn_hidden = 0;
    moe::Router router = moe::Router::kSoftmaxTopK;
    double aux_loss = 0.0, z_loss = 0.0;
    // The step's sequences (train.batch_size): the losses' scales, 1/S and
    // 1/(S·T); 0: the micro-batch's (a model run alone).
    int64_t step_sequences = 0;
    bool on() const { return experts > 0; }
    int64_t hidden(int64_t dense) const { return ffn_hidden > 0 ? ffn_hidden : dense; }
  } moe;
  // model.quant: the frozen base's block linear weights quantized at load
  // (QLoRA); needs adapters (lora.r > 0). Embeddings, head and norms stay f32.
  WeightQuant quant = WeightQuant::kNone;

  // The defaults of an architecture ("gpt2", "llama"), shapes unset.
  static TransformerConfig arch_defaults(const std::string& arch);
  // Shapes of a named preset; throws InvalidArgument listing the known names.
  static TransformerConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();
  // Fills the fields left 0 that follow from others (n_kv_head = n_head,
  // ffn_hidden from the MLP kind), as resolve does after overrides.
  void fill_derived();

  // Throws InvalidArgument naming the offending key (model.n_kv_head ...).
  void validate() const;

  // The same units for a model that only holds weights (built to initialise,
  // load or assemble them, with one row): no activation checkpointing and no
  // sequence-parallel row split, which would refuse one row over tp ranks.
  TransformerConfig weights_only() const {
    TransformerConfig c = *this;
    c.activation_checkpointing = false;
    c.sequence_parallel = false;
    return c;
  }

  // A fine-tune's base as a plain model (no adapters, nothing quantized): what
  // its weights are loaded into, and what a merged model is.
  TransformerConfig base_model() const {
    TransformerConfig c = *this;
    c.lora = {};
    c.quant = WeightQuant::kNone;
    return c;
  }

  // The same config with the derived fields filled (what the layout uses).
  TransformerConfig resolved() const {
    TransformerConfig c = *this;
    c.fill_derived();
    return c;
  }

  int64_t head_dim() const { return head_size > 0 ? head_size : n_embd / n_head; }

  // Vocabulary rows padded up to a multiple of tp, so that each of tp ranks
  // holds an equal slice of the token table and the head.
  int64_t padded_vocab(int64_t tp) const { return (vocab_size + tp - 1) / tp * tp; }
  // The shapes one of tp tensor-parallel ranks computes with: n_head,
  // n_kv_head and ffn_hidden divided by tp, vocab_size = padded_vocab(tp) /
  // tp, head_size fixed. Throws InvalidArgument naming parallel.tp and the
  // model.* key it does not divide.
  TransformerConfig shard(int64_t tp) const;
  // Columns of the fused q|k|v projection: (n_head + 2·n_kv_head)·head_dim.
  int64_t qkv_width() const { return (n_head + 2 * n_kv_head) * head_dim(); }
  // Columns of the MLP's first projection: F (GELU) or 2F (SwiGLU gate | up).
  int64_t fc_width() const { return mlp == Mlp::kSwiGLU ? 2 * ffn_hidden : ffn_hidden; }

  // Total parameters (a tied head counted once), from the declared layout.
  int64_t num_params() const;
  // Elements of each unit (embedding, the L blocks, final norm + head) as
  // one of tp tensor-parallel ranks holds them (Layout's TensorSplit; every
  // rank's units have the same sizes).
  std::vector<int64_t> unit_numels(int64_t tp = 1) const;
  // Training FLOPs per token: 6·Ψ + 12·L·C·T (REFERENCE.md, PaLM appendix B),
  // at sequence T, Ψ = num_params() (the convention of the GPT-2 numbers);
  // a mixture of experts counts the k experts a row runs, not all E.
  double flops_per_token(int64_t T) const;
};

}  // namespace po::model
