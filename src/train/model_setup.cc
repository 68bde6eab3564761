#include "train/model_setup.h"

#include <cstring>
#include <filesystem>
#include <optional>
#include <sstream>

#include "checkpoint/gguf_models.h"
#include "checkpoint/llama_weights.h"
#include "checkpoint/model_io.h"
#include "checkpoint/peft.h"
#include "core/error.h"

namespace po::train {
namespace fs = std::filesystem;
namespace {

std::optional<int64_t> int_key(const core::Config* c, const char* key) {
  if (c == nullptr || !c->is_set(key) || c->get_int(key) <= 0) return std::nullopt;
  return c->get_int(key);
}

std::optional<double> float_key(const core::Config* c, const char* key) {
  if (c == nullptr || !c->is_set(key) || c->get_float(key) <= 0) return std::nullopt;
  return c->get_float(key);
}

// The explicitly set model.* keys over `m`.
void apply_overrides(const core::Config& config, model::TransformerConfig& m) {
  auto over = [&](const char* key, int64_t& field) {
    if (auto v = int_key(&config, key)) field = *v;
  };
  // Fields derived from overridden ones follow them unless set too: a preset's
  // MLP width from its n_embd, its kv heads from its heads (multi-head stays
  // multi-head; a grouped preset keeps its kv heads).
  if (int_key(&config, "model.n_embd") && !int_key(&config, "model.ffn_hidden")) m.ffn_hidden = 0;
  if (int_key(&config, "model.n_head") && !int_key(&config, "model.n_kv_head") &&
      m.n_kv_head == m.n_head)
    m.n_kv_head = 0;
  over("model.n_layer", m.n_layer);
  over("model.n_embd", m.n_embd);
  over("model.n_head", m.n_head);
  over("model.n_kv_head", m.n_kv_head);
  over("model.ffn_hidden", m.ffn_hidden);
  over("model.vocab_size", m.vocab_size);
  over("model.seq_len", m.seq_len);
  if (auto v = float_key(&config, "model.norm_eps")) m.norm_eps = *v;
  if (auto v = float_key(&config, "model.rope_theta")) m.rope_theta = *v;
  auto choice = [&](const char* key, const char* a, const char* b) -> int {
    if (!config.is_set(key) || config.get_string(key).empty()) return -1;
    const std::string v = config.get_string(key);
    PO_CHECK(v == a || v == b, key, " = '", v, "': expected '", a, "' or '", b, "'");
    return v == a ? 0 : 1;
  };
  if (int c = choice("model.norm", "layernorm", "rmsnorm"); c >= 0)
    m.norm = c == 0 ? model::Norm::kLayerNorm : model::Norm::kRMSNorm;
  if (int c = choice("model.positions", "learned", "rope"); c >= 0)
    m.positions = c == 0 ? model::Positions::kLearned : model::Positions::kRope;
  if (int c = choice("model.mlp", "gelu", "swiglu"); c >= 0) {
    const auto mlp = c == 0 ? model::Mlp::kGeluTanh : model::Mlp::kSwiGLU;
    if (mlp != m.mlp && !config.is_set("model.ffn_hidden")) m.ffn_hidden = 0;  // re-derive
    m.mlp = mlp;
  }
  if (config.is_set("model.bias")) m.bias = config.get_bool("model.bias");
  if (config.is_set("model.tie_embeddings")) m.tie_embeddings = config.get_bool("model.tie_embeddings");
  if (config.is_set("model.rope_scaling_factor")) {
    m.rope_scaling.factor = config.get_float("model.rope_scaling_factor");
    m.rope_scaling.low_freq_factor = config.get_float("model.rope_low_freq_factor");
    m.rope_scaling.high_freq_factor = config.get_float("model.rope_high_freq_factor");
    m.rope_scaling.original_max_position =
        static_cast<double>(config.get_int("model.rope_original_max_position"));
  }
}

checkpoint::LlamaOverrides llama_overrides(const core::Config* c) {
  checkpoint::LlamaOverrides o;
  o.dim = int_key(c, "model.n_embd");
  o.hidden_dim = int_key(c, "model.ffn_hidden");
  o.n_layer = int_key(c, "model.n_layer");
  o.n_head = int_key(c, "model.n_head");
  o.n_kv_head = int_key(c, "model.n_kv_head");
  o.vocab_size = int_key(c, "model.vocab_size");
  o.max_seq_len = int_key(c, "model.seq_len");
  o.rms_norm_eps = float_key(c, "model.norm_eps");
  o.rope_theta = float_key(c, "model.rope_theta");
  if (c != nullptr && c->is_set("model.tie_embeddings"))
    o.tie_word_embeddings = c->get_bool("model.tie_embeddings");
  return o;
}

}  // namespace


model::TransformerConfig llama_file_config(const std::string& path, const core::Config* config) {
  return checkpoint::llama_file_config(path, llama_overrides(config));
}

model::WeightQuant weight_quant(const core::Config& config) {
  const std::string q = config.get_string("model.quant");
  if (q.empty() || q == "none") return model::WeightQuant::kNone;
  PO_CHECK(q == "nf4" || q == "int8", "model.quant = '", q, "': expected 'nf4', 'int8' or 'none'");
  return q == "nf4" ? model::WeightQuant::kNf4 : model::WeightQuant::kInt8;
}

model::LoraConfig lora_config(const core::Config& config, const std::string& arch) {
  const std::string& from = config.get_string("lora.init");
  model::LoraConfig l;
  if (!from.empty()) {  // a PEFT adapter's own settings
    l = checkpoint::read_peft_config(from);
    // (The other lora.* keys are the adapter's; a stored run config lists them all.)
    PO_CHECK(config.get_int("lora.r") == 0 || config.get_int("lora.r") == l.r, "lora.r = ",
             config.get_int("lora.r"), " but lora.init = '", from, "' holds an adapter of r = ", l.r);
    return l;
  }
  l.r = config.get_int("lora.r");
  if (l.r == 0) return l;
  l.alpha = config.get_float("lora.alpha");
  l.rslora = config.get_bool("lora.rslora");
  l.dora = config.get_bool("lora.dora");
  l.dropout = config.get_float("lora.dropout");
  PO_CHECK(l.dropout < 1.0, "lora.dropout = ", l.dropout, ": must be below 1");
  PO_CHECK(l.dropout == 0.0 || !l.dora, "lora.dropout = ", l.dropout,
           " with lora.dora = true is not built yet (PEFT's DoRA then runs the base on the dropped input too); "
           "use lora.dropout = 0 with DoRA");
  std::istringstream targets(config.get_string("lora.targets"));
  for (std::string t; targets >> t;) l.targets.push_back(t);
  if (l.targets.empty())  // PEFT's defaults for the family
    l.targets = arch == "gpt2" ? std::vector<std::string>{"c_attn"}
                               : std::vector<std::string>{"q_proj", "v_proj"};
  return l;
}

void load_base_and_adapters(const core::Config& config, model::Transformer& model, uint64_t seed) {
  PO_CHECK(model.layout().adapters(), "load_base_and_adapters: the model has no adapters");
  const std::string& init = config.get_string("model.init");
  if (init == "random") {
    model.init_random(seed);
  } else {
    checkpoint::load_model_weights(init, model);
    if (model.config().quant != model::WeightQuant::kNone) model.quantize_base();
    model.init_adapters(seed);
  }
  const std::string& from = config.get_string("lora.init");
  if (!from.empty()) checkpoint::read_peft_adapter(from, model);
}

model::TransformerConfig resolve_model_config(const core::Config& config) {
  const std::string init = config.get_string("model.init");
  model::TransformerConfig m;
  if (init != "random" && checkpoint::is_llama_weights(init)) {
    m = llama_file_config(init, &config);  // the file's shape, the keys checked against it
  } else if (init != "random" && checkpoint::is_gguf(init)) {
    m = checkpoint::gguf_gpt2_config(checkpoint::GgufFile::open(init));  // the file's shape
  } else {
    m = model::TransformerConfig::preset(config.get_string("model.preset"));
    const std::string arch = config.get_string("model.arch");
    if (!arch.empty() && arch != m.arch) {  // the preset's shapes, another architecture's defaults
      model::TransformerConfig d = model::TransformerConfig::arch_defaults(arch);
      d.n_layer = m.n_layer;
      d.n_embd = m.n_embd;
      d.n_head = m.n_head;
      d.vocab_size = m.vocab_size;
      d.seq_len = m.seq_len;
      m = d;
    }
  }
  apply_overrides(config, m);
  m.activation_checkpointing = config.get_bool("model.activation_checkpointing");
  m.bf16_activations = config.get_string("train.precision") == "bf16";
  m.sequence_parallel = config.get_bool("parallel.sequence_parallel");
  m.lora = lora_config(config, m.arch);
  m.quant = weight_quant(config);
  if (config.is_set("model.moe_experts")) m.moe.experts = config.get_int("model.moe_experts");
  if (config.is_set("model.moe_top_k")) m.moe.top_k = config.get_int("model.moe_top_k");
  if (config.is_set("model.moe_ffn_hidden")) m.moe.ffn_hidden = config.get_int("model.moe_ffn_hidden");
  if (const std::string r = config.get_string("model.moe_router"); r != "softmax_topk") {
    PO_CHECK(r == "softmax_topk_raw", "model.moe_router = '", r,
             "': expected 'softmax_topk' (Mixtral) or 'softmax_topk_raw' (Qwen2-MoE, norm_topk_prob = false)");
    m.moe.router = model::moe::Router::kSoftmaxTopKRaw;
  }
  m.moe.aux_loss = config.get_float("train.moe_aux_loss");
  m.moe.z_loss = config.get_float("train.moe_z_loss");
  m.moe.step_sequences = config.get_int("train.batch_size");
  m.fill_derived();
  m.validate();
  return m;
}

void store_resolved_model(core::Config& config, const model::TransformerConfig& m) {
  const std::string origin = "the resolved model";
  auto set = [&](const char* key, const std::string& v) { config.set_text(key, v, origin); };
  auto num = [](int64_t v) { return std::to_string(v); };
  auto real = [](double v) {  // a TOML float that reads back to the same double
    std::ostringstream os;
    os.precision(17);
    os << v;
    std::string t = os.str();
    if (t.find_first_of(".e") == std::string::npos) t += ".0";
    return t;
  };
  set("model.arch", m.arch);
  set("model.n_layer", num(m.n_layer));
  set("model.n_embd", num(m.n_embd));
  set("model.n_head", num(m.n_head));
  set("model.n_kv_head", num(m.n_kv_head));
  set("model.ffn_hidden", num(m.ffn_hidden));
  set("model.vocab_size", num(m.vocab_size));
  set("model.seq_len", num(m.seq_len));
  set("model.norm", m.norm == model::Norm::kLayerNorm ? "layernorm" : "rmsnorm");
  set("model.norm_eps", real(m.norm_eps));
  set("model.positions", m.positions == model::Positions::kLearned ? "learned" : "rope");
  set("model.rope_theta", real(m.rope_theta));
  set("model.mlp", m.mlp == model::Mlp::kGeluTanh ? "gelu" : "swiglu");
  set("model.bias", m.bias ? "true" : "false");
  set("model.tie_embeddings", m.tie_embeddings ? "true" : "false");
  set("model.rope_scaling_factor", real(m.rope_scaling.factor));
  set("model.rope_low_freq_factor", real(m.rope_scaling.low_freq_factor));
  set("model.rope_high_freq_factor", real(m.rope_scaling.high_freq_factor));
  set("model.rope_original_max_position",
      num(static_cast<int64_t>(m.rope_scaling.original_max_position)));
  set("model.moe_experts", num(m.moe.experts));
  set("model.moe_top_k", num(m.moe.top_k));
  set("model.moe_ffn_hidden", num(m.moe.ffn_hidden));
  set("model.moe_router", m.moe.router == model::moe::Router::kSoftmaxTopK ? "softmax_topk" : "softmax_topk_raw");
  if (m.lora.on() && config.get_string("lora.init").empty()) {  // the targets as resolved
    std::string targets;
    for (const std::string& t : m.lora.targets) targets += (targets.empty() ? "" : " ") + t;
    set("lora.targets", targets);
  }
}



}  // namespace po::train
