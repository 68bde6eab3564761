#include "model/config.h"

#include <cmath>
#include <map>

#include "core/error.h"
#include "model/layout.h"

namespace po::model {
namespace {

// Published shapes. Llama rows: n_layer, C, heads, kv heads, F, vocab, seq,
// theta, eps, tied. The TinyStories models (llama2.c) are tied; Llama 2/3 are not.
struct Preset {
  const char* arch;
  int64_t n_layer, n_embd, n_head, n_kv_head, ffn_hidden, vocab_size, seq_len;
  double rope_theta = 10000.0, norm_eps = 1e-5;
  bool tied = true;
  int64_t experts = 0, top_k = 0;  // a mixture of experts (ffn_hidden: an expert's)
};

const std::map<std::string, Preset>& presets() {
  static const std::map<std::string, Preset> p = {
      {"gpt2-tiny", {"gpt2", 2, 128, 4, 4, 512, 50257, 128}},
      {"gpt2-mini", {"gpt2", 4, 256, 4, 4, 1024, 50257, 128}},
      {"bench-small", {"gpt2", 6, 384, 6, 6, 1536, 50257, 256}},
      {"gpt2-124M", {"gpt2", 12, 768, 12, 12, 3072, 50257, 1024}},
      {"gpt2-medium", {"gpt2", 24, 1024, 16, 16, 4096, 50257, 1024}},
      {"gpt2-large", {"gpt2", 36, 1280, 20, 20, 5120, 50257, 1024}},
      {"gpt2-xl", {"gpt2", 48, 1600, 25, 25, 6400, 50257, 1024}},
      {"gpt3-175b", {"gpt2", 96, 12288, 96, 96, 49152, 50257, 2048}},  // Brown et al. 2020
      {"llama-tiny", {"llama", 2, 128, 4, 2, 352, 50257, 128}},
      // llama-tiny's attention, 4 SwiGLU experts of 128 (top 2) in every block.
      {"moe-tiny", {"llama", 2, 128, 4, 2, 128, 50257, 128, 10000.0, 1e-5, false, 4, 2}},
      {"llama-mini", {"llama", 4, 256, 4, 2, 704, 50257, 128}},
      {"llama-124M", {"llama", 12, 768, 12, 12, 2048, 50257, 1024}},  // 123.6M, gpt2-124M's size
      {"stories15M", {"llama", 6, 288, 6, 6, 768, 32000, 256}},
      {"stories42M", {"llama", 8, 512, 8, 8, 1376, 32000, 1024}},
      {"stories110M", {"llama", 12, 768, 12, 12, 2048, 32000, 1024}},
      {"llama2-7b", {"llama", 32, 4096, 32, 32, 11008, 32000, 4096, 10000.0, 1e-5, false}},
      {"llama2-13b", {"llama", 40, 5120, 40, 40, 13824, 32000, 4096, 10000.0, 1e-5, false}},
      {"llama2-70b", {"llama", 80, 8192, 64, 8, 28672, 32000, 4096, 10000.0, 1e-5, false}},
      {"llama3-8b", {"llama", 32, 4096, 32, 8, 14336, 128256, 8192, 500000.0, 1e-5, false}},
      {"llama3-70b", {"llama", 80, 8192, 64, 8, 28672, 128256, 8192, 500000.0, 1e-5, false}},
  };
  return p;
}

}  // namespace

TransformerConfig TransformerConfig::arch_defaults(const std::string& arch) {
  TransformerConfig c;
  c.arch = arch;
  if (arch == "gpt2") return c;  // the field defaults are GPT-2's
  PO_CHECK(arch == "llama", "model.arch: unknown architecture '", arch, "' (known: gpt2, llama)");
  c.norm = Norm::kRMSNorm;
  c.positions = Positions::kRope;
  c.mlp = Mlp::kSwiGLU;
  c.bias = false;
  c.tie_embeddings = false;
  return c;
}

TransformerConfig TransformerConfig::preset(const std::string& name) {
  auto it = presets().find(name);
  if (it == presets().end()) {
    std::string names;
    for (const auto& [k, v] : presets()) names += (names.empty() ? "" : ", ") + k;
    PO_THROW(core::InvalidArgument, "model.preset: unknown preset '", name, "' (known: ", names,
             ")");
  }
  const Preset& p = it->second;
  TransformerConfig c = arch_defaults(p.arch);
  c.n_layer = p.n_layer;
  c.n_embd = p.n_embd;
  c.n_head = p.n_head;
  c.n_kv_head = p.n_kv_head;
  c.ffn_hidden = p.ffn_hidden;
  c.vocab_size = p.vocab_size;
  c.seq_len = p.seq_len;
  if (c.arch == "llama") {
    c.rope_theta = p.rope_theta;
    c.norm_eps = p.norm_eps;
    c.tie_embeddings = p.tied;
  }
  c.moe.experts = p.experts;
  if (p.experts > 0) c.moe.top_k = p.top_k;
  return c;
}

std::vector<std::string> TransformerConfig::preset_names() {
  std::vector<std::string> out;
  for (const auto& [k, v] : presets()) out.push_back(k);
  return out;
}

void TransformerConfig::fill_derived() {
  if (n_kv_head == 0) n_kv_head = n_head;
  if (ffn_hidden == 0 && n_embd > 0) {
    // GELU: 4C. SwiGLU: two thirds of 4C (same parameter count), rounded up
    // to a multiple of 32 as llama2.c does (stories15M: 288 -> 768).
    ffn_hidden = mlp == Mlp::kGeluTanh ? 4 * n_embd : (8 * n_embd / 3 + 31) / 32 * 32;
  }
}

double LoraConfig::scale() const {
  return rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / static_cast<double>(r);
}

void TransformerConfig::validate() const {
  if ((n_kv_head == 0 || ffn_hidden == 0) && n_head >= 1) return resolved().validate();
  PO_CHECK(n_layer >= 1, "model.n_layer must be >= 1, got ", n_layer);
  PO_CHECK(n_embd >= 1, "model.n_embd must be >= 1, got ", n_embd);
  PO_CHECK(n_head >= 1, "model.n_head must be >= 1, got ", n_head);
  PO_CHECK(head_size > 0 || n_embd % n_head == 0, "model.n_head = ", n_head,
           " must divide model.n_embd = ", n_embd);
  PO_CHECK(n_kv_head >= 1 && n_head % n_kv_head == 0, "model.n_kv_head = ", n_kv_head,
           " must divide model.n_head = ", n_head, " (grouped-query attention)");
  PO_CHECK(ffn_hidden >= 1, "model.ffn_hidden must be >= 1, got ", ffn_hidden);
  PO_CHECK(vocab_size >= 2 && vocab_size <= (int64_t{1} << 24),
           "model.vocab_size must be in [2, 16777216], got ", vocab_size);
  PO_CHECK(seq_len >= 1, "model.seq_len must be >= 1, got ", seq_len);
  PO_CHECK(norm_eps > 0 && norm_eps < 1, "model.norm_eps must be in (0, 1), got ", norm_eps);
  PO_CHECK(positions != Positions::kRope || head_dim() % 2 == 0, "model.n_embd / model.n_head = ",
           head_dim(), " must be even for RoPE");
  PO_CHECK(positions != Positions::kRope || rope_theta > 1, "model.rope_theta must be > 1, got ",
           rope_theta);
  PO_CHECK(rope_scaling.factor == 0 ||
               (rope_scaling.factor >= 1 && rope_scaling.high_freq_factor > rope_scaling.low_freq_factor &&
                rope_scaling.low_freq_factor > 0 && rope_scaling.original_max_position >= 1),
           "model.rope_scaling: factor >= 1, 0 < low_freq_factor < high_freq_factor and "
           "original_max_position >= 1 are needed, got factor ",
           rope_scaling.factor, ", low ", rope_scaling.low_freq_factor, ", high ",
           rope_scaling.high_freq_factor, ", original ", rope_scaling.original_max_position);
  if (moe.on()) {
    PO_CHECK(moe.experts >= 2, "model.moe_experts = ", moe.experts, ": a mixture needs at least 2 experts");
    PO_CHECK(moe.top_k >= 1 && moe.top_k <= moe.experts, "model.moe_top_k = ", moe.top_k,
             " must be in [1, model.moe_experts = ", moe.experts, "]");
    PO_CHECK(moe.ffn_hidden >= 0, "model.moe_ffn_hidden must be >= 0, got ", moe.ffn_hidden);
    PO_CHECK(mlp == Mlp::kSwiGLU && !bias, "model.moe_experts: the experts are SwiGLU without biases "
             "(model.mlp = swiglu, model.bias = false); this model has ", mlp == Mlp::kSwiGLU ? "biases" : "GELU");
    PO_CHECK(!lora.on() && quant == WeightQuant::kNone,
             "model.moe_experts with adapters (lora.r) or model.quant is not built yet");
    PO_CHECK(!inference, "model.moe_experts: serving and generating a mixture of experts is not built yet "
             "(docs/moe.md)");
    PO_CHECK(!bf16_activations, "model.moe_experts with train.precision = bf16 is not built yet: use fp32");
    PO_CHECK(moe.aux_loss >= 0 && moe.z_loss >= 0, "train.moe_aux_loss and train.moe_z_loss must be >= 0, got ",
             moe.aux_loss, " and ", moe.z_loss);
  }
  PO_CHECK(quant == WeightQuant::kNone || lora.on(), "model.quant = ",
           quant == WeightQuant::kNf4 ? "nf4" : "int8",
           " quantizes a frozen base: it needs adapters (lora.r > 0, QLoRA); a full fine-tune trains "
           "f32 weights");
}

TransformerConfig TransformerConfig::shard(int64_t tp) const {
  TransformerConfig c = resolved();
  c.validate();
  PO_CHECK(tp >= 1, "parallel.tp must be >= 1, got ", tp);
  if (tp == 1) return c;
  PO_CHECK(!c.moe.on(), "parallel.tp = ", tp, " with model.moe_experts: experts split over tensor ranks are "
           "not built yet (docs/moe.md)");
  PO_CHECK(c.n_kv_head % tp == 0, "parallel.tp = ", tp, " must divide model.n_kv_head = ",
           c.n_kv_head, " (tensor parallel splits the kv heads; model.n_head = ", c.n_head, ")");
  PO_CHECK(c.ffn_hidden % tp == 0, "parallel.tp = ", tp, " must divide model.ffn_hidden = ",
           c.ffn_hidden, " (the MLP's columns)");
  c.head_size = c.head_dim();
  c.n_head /= tp;
  c.n_kv_head /= tp;
  c.ffn_hidden /= tp;
  c.vocab_size = c.padded_vocab(tp) / tp;
  return c;
}

int64_t TransformerConfig::num_params() const { return Layout(*this).num_params(); }

std::vector<int64_t> TransformerConfig::unit_numels(int64_t tp) const {
  const Layout layout(*this, {static_cast<int>(tp), 0});
  std::vector<int64_t> n;
  for (int u = 0; u < layout.num_units(); ++u) n.push_back(layout.unit_numel(u));
  return n;
}

double TransformerConfig::flops_per_token(int64_t T) const {
  if (lora.on()) {  // a frozen base: its forward and input gradients, no weight gradients
    const Layout l(*this);
    return 4.0 * static_cast<double>(l.base_num_params()) + 6.0 * static_cast<double>(l.num_params()) +
           12.0 * static_cast<double>(n_layer * n_embd * T);
  }
  double active = static_cast<double>(num_params());
  if (moe.on()) {  // a row runs its k experts of E (the router's E·C per layer counted whole)
    const moe::Shape s = {n_embd, moe.hidden(resolved().ffn_hidden), moe.experts, moe.top_k, moe.router};
    active -= static_cast<double>(n_layer * (moe.experts - moe.top_k) * s.expert_numel());
  }
  return 6.0 * active + 12.0 * static_cast<double>(n_layer * n_embd * T);
}

}  // namespace po::model
