// Model files in, out, and what they hold (model_io.h).
#include "checkpoint/model_io.h"

#include <cstring>
#include <filesystem>
#include <map>
#include <vector>

#include "checkpoint/gguf.h"
#include "checkpoint/gguf_models.h"
#include "checkpoint/gpt2_io.h"
#include "checkpoint/hf_llama.h"
#include "checkpoint/safetensors.h"
#include "core/error.h"

namespace po::checkpoint {
namespace fs = std::filesystem;

bool is_llama_weights(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) return true;
  if (fs::is_regular_file(path, ec) && is_gguf(path))
    return gguf_architecture(GgufFile::open(path)) != "gpt2";
  if (path.ends_with(".safetensors"))
    return SafetensorsReader::open(path).has("model.embed_tokens.weight");
  return !path.empty() && path != "random" && fs::is_regular_file(path, ec);
}

namespace {

// The fields a Llama file's shape and the model's config share, named once
// for both directions: fn(file's field, config's field).
template <typename Shape, typename Config, typename Fn>
void llama_fields(Shape& s, Config& m, Fn&& fn) {
  fn(s.n_layer, m.n_layer);
  fn(s.dim, m.n_embd);
  fn(s.n_head, m.n_head);
  fn(s.n_kv_head, m.n_kv_head);
  fn(s.hidden_dim, m.ffn_hidden);
  fn(s.vocab_size, m.vocab_size);
  fn(s.max_seq_len, m.seq_len);
  fn(s.rms_norm_eps, m.norm_eps);
  fn(s.rope_theta, m.rope_theta);
  fn(s.tie_word_embeddings, m.tie_embeddings);
}

}  // namespace

model::TransformerConfig llama_file_config(const std::string& path, const LlamaOverrides& overrides) {
  const auto reader = open_llama(path, overrides);
  const LlamaShape& s = reader->shape();
  model::TransformerConfig m = model::TransformerConfig::arch_defaults("llama");
  llama_fields(s, m, [](const auto& file, auto& config) { config = file; });
  if (s.rope_scaling) {
    m.rope_scaling.factor = s.rope_scaling->factor;
    m.rope_scaling.low_freq_factor = s.rope_scaling->low_freq_factor;
    m.rope_scaling.high_freq_factor = s.rope_scaling->high_freq_factor;
    m.rope_scaling.original_max_position =
        static_cast<double>(s.rope_scaling->original_max_position_embeddings);
  }
  return m;
}

model::TransformerConfig weights_file_config(const std::string& src) {
  model::TransformerConfig m;
  if (is_llama_weights(src)) {
    m = llama_file_config(src);
  } else if (is_gguf(src)) {
    m = gguf_gpt2_config(GgufFile::open(src));
  } else {  // GPT-2 safetensors: the shapes of the file
    const auto f = SafetensorsReader::open(src);
    const std::string pre = f.has("wte.weight") ? "" : "transformer.";
    PO_CHECK(f.has(pre + "wte.weight"), src, ": neither GPT-2 (wte.weight) nor Llama "
             "(model.embed_tokens.weight) tensors");
    m = model::TransformerConfig::arch_defaults("gpt2");
    const auto& wte = f.get(pre + "wte.weight");
    const auto& wpe = f.get(pre + "wpe.weight");
    m.vocab_size = wte.shape[0];
    m.n_embd = wte.shape[1];
    m.seq_len = wpe.shape[0];
    while (f.has(pre + "h." + std::to_string(m.n_layer) + ".ln_1.weight")) ++m.n_layer;
    m.n_head = m.n_embd / 64;  // GPT-2's head size; the file does not store the count
    m.fill_derived();
  }
  return m;
}

void load_model_weights(const std::string& path, model::Transformer& model) {
  if (model.config().quant != model::WeightQuant::kNone && model.config().arch == "llama" &&
      is_llama_weights(path)) {
    // A quantized base, tensor by tensor: each block linear weight is
    // quantized from its own f32 values (never the whole base in f32 at
    // once), or, from a "-bnb-4bit" checkpoint under nf4, its codes are kept
    // as stored; the embedding, norms and head read as f32 into the base.
    PO_CHECK(model.whole(), "loading weights needs a whole model");
    const auto reader = open_llama(path);
    const model::WeightQuant format = model.config().quant;
    float* base = model.base_params();
    std::vector<float> one;  // one tensor's f32 values
    for (const model::TensorSpec& t : model.layout().base_tensors()) {
      PO_CHECK(reader->find_shape(t.name) != nullptr, path, ": no tensor '", t.name,
               "' (the model's layout needs it)");
      PO_CHECK(*reader->find_shape(t.name) == t.shape, path, ": tensor '", t.name, "' has shape ",
               tensor::shape_str(*reader->find_shape(t.name)), ", the model needs ", tensor::shape_str(t.shape));
      const bool block_linear = t.unit >= 1 && t.unit < model.layout().head_unit() && t.shape.size() == 2;
      if (block_linear && format == model::WeightQuant::kNf4 && reader->is_nf4(t.name)) {
        model::QuantTensor q;
        q.format = model::WeightQuant::kNf4;
        q.rows = t.shape[0];
        q.cols = t.shape[1];
        q.nf4 = reader->read_nf4(t.name);
        model.set_quantized(t, std::move(q));
      } else if (block_linear) {
        one.resize(static_cast<size_t>(t.numel()));
        reader->read(t.name, one.data());
        model.set_quantized(t, model::quantize_weight(format, one.data(), t.shape[0], t.shape[1], t.name));
      } else {
        reader->read(t.name, base + t.offset);
      }
    }
    return;
  }
  if (model.layout().adapters()) {  // into the frozen base, which is laid out as a plain model
    PO_CHECK(model.whole(), "loading weights needs a whole model");
    const model::TransformerConfig plain = model.config().weights_only().base_model();
    model::Transformer whole(plain, 1, 1);
    load_model_weights(path, whole);
    std::memcpy(model.base_params(), whole.params(),
                static_cast<size_t>(whole.num_params()) * sizeof(float));
    return;
  }
  if (model.config().arch == "gpt2" && !is_llama_weights(path)) {
    if (is_gguf(path))
      load_gpt2_gguf(GgufFile::open(path), model);
    else
      load_gpt2_safetensors(path, model);
    return;
  }
  PO_CHECK(model.whole(), "loading weights needs a whole model");
  const auto reader = open_llama(path);
  std::map<std::string, tensor::Shape> have;
  for (const auto& t : reader->tensors()) have[t.name] = t.shape;
  float* params = model.params();
  for (const model::TensorSpec& t : model.param_infos()) {
    auto it = have.find(t.name);
    PO_CHECK(it != have.end(), path, ": no tensor '", t.name, "' (the model's layout needs it)");
    PO_CHECK(it->second == t.shape, path, ": tensor '", t.name, "' has shape ",
             tensor::shape_str(it->second), ", the model needs ", tensor::shape_str(t.shape));
    reader->read(t.name, params + t.offset);
  }
}

void export_model_weights(const std::string& path, const model::Transformer& model) {
  const model::TransformerConfig& c = model.config();
  if (c.arch == "gpt2") {
    save_gpt2_safetensors(path, model);
    return;
  }
  PO_CHECK(c.norm == model::Norm::kRMSNorm && c.positions == model::Positions::kRope &&
               c.mlp == model::Mlp::kSwiGLU && !c.bias,
           "export: the Hugging Face Llama format has RMSNorm, RoPE, SwiGLU and no biases; this "
           "model.arch = llama overrides one of them");
  LlamaShape s;
  llama_fields(s, c, [](auto& file, const auto& config) { file = config; });
  if (c.rope_scaling.factor > 0)
    s.rope_scaling = RopeScaling{
        c.rope_scaling.factor, c.rope_scaling.low_freq_factor, c.rope_scaling.high_freq_factor,
        static_cast<int64_t>(c.rope_scaling.original_max_position)};
  std::vector<LlamaTensorRef> refs;
  const float* params = model.params();
  for (const model::TensorSpec& t : model.param_infos())
    refs.push_back({t.name, t.shape, params + t.offset});
  write_hf_llama(path, s, refs);
}

}  // namespace po::checkpoint
