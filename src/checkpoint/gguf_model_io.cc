#include "checkpoint/gguf_models.h"

#include <algorithm>
#include <set>

#include "core/error.h"

namespace po::checkpoint {

using backend::GgmlType;
using detail::expect_tensor;
using detail::gpt2_gguf_name;
using detail::llama_gguf_name;
using detail::no_other_tensors;

model::TransformerConfig gguf_gpt2_config(const GgufFile& f) {
  const std::string arch = gguf_architecture(f);
  PO_CHECK(arch == "gpt2", f.origin(), ": general.architecture = '", arch, "', not 'gpt2'");
  model::TransformerConfig m = model::TransformerConfig::arch_defaults("gpt2");
  m.n_layer = f.get_int("gpt2.block_count");
  PO_CHECK(m.n_layer >= 1 && m.n_layer <= static_cast<int64_t>(f.tensors().size()) / 12, f.origin(),
           ": gpt2.block_count = ", m.n_layer, " but the file holds ", f.tensors().size(), " tensors");
  m.n_embd = f.get_int("gpt2.embedding_length");
  m.n_head = f.get_int("gpt2.attention.head_count");
  m.seq_len = f.get_int("gpt2.context_length");
  m.ffn_hidden = f.find_int("gpt2.feed_forward_length").value_or(4 * m.n_embd);
  m.norm_eps = f.find_float("gpt2.attention.layer_norm_epsilon").value_or(1e-5);
  const GgufTensorInfo* embd = f.find_tensor("token_embd.weight");
  PO_CHECK(embd != nullptr && embd->ne.size() == 2, f.origin(), ": no 2-D tensor token_embd.weight (the embedding)");
  m.vocab_size = embd->ne[1];
  m.fill_derived();
  return m;
}

void load_gpt2_gguf(const GgufFile& f, model::Transformer& model) {
  PO_CHECK(model.whole(), "loading weights needs a whole model");
  std::set<std::string> read = {"output.weight"};  // the converter's copy of the tied embedding
  for (const model::TensorSpec& p : model.param_infos()) {
    const std::string g = gpt2_gguf_name(p.name);
    PO_CHECK(!g.empty(), f.origin(), ": the model's tensor '", p.name, "' has no GGUF name");
    f.read_f32(expect_tensor(f, g, p.name, p.shape), model.params() + p.offset);
    read.insert(g);
  }
  no_other_tensors(f, read, "GPT-2");
}

namespace {

// llama.cpp's general.file_type (llama_ftype) for a file of `type` weights.
uint32_t file_type(GgmlType type) {
  switch (type) {
    case GgmlType::kF32: return 0;
    case GgmlType::kF16: return 1;
    case GgmlType::kQ4_0: return 2;
    case GgmlType::kQ8_0: return 7;
    case GgmlType::kBF16: return 32;
    case GgmlType::kQ4_K: return 15;  // Q4_K_M
    case GgmlType::kQ6_K: return 18;
  }
  return 0;
}

}  // namespace

void write_gguf_model(const std::string& path, const model::Transformer& model, GgmlType type,
                      const GgufMetadata& tokenizer, const std::string& name) {
  PO_CHECK(model.whole(), "write_gguf_model needs a whole model");
  const model::TransformerConfig& c = model.config();
  const bool llama = c.arch == "llama";
  PO_CHECK(!llama || (c.norm == model::Norm::kRMSNorm && c.positions == model::Positions::kRope &&
                      c.mlp == model::Mlp::kSwiGLU && !c.bias),
           "export: GGUF's llama architecture has RMSNorm, RoPE, SwiGLU and no biases; this model.arch = llama "
           "overrides one of them");
  const std::string a = c.arch;
  const auto u32 = [](int64_t v) { return GgufValue::u32(static_cast<uint32_t>(v)); };
  GgufMetadata kv = {{"general.architecture", GgufValue::str(a)},
                     {"general.name", GgufValue::str(name)},
                     {"general.file_type", GgufValue::u32(file_type(type))}};
  if (type != GgmlType::kF32 && type != GgmlType::kF16 && type != GgmlType::kBF16)
    kv.emplace_back("general.quantization_version", GgufValue::u32(2));
  kv.emplace_back(a + ".context_length", u32(c.seq_len));
  kv.emplace_back(a + ".embedding_length", u32(c.n_embd));
  kv.emplace_back(a + ".feed_forward_length", u32(c.ffn_hidden));
  kv.emplace_back(a + ".block_count", u32(c.n_layer));
  kv.emplace_back(a + ".attention.head_count", u32(c.n_head));
  if (llama) {
    kv.emplace_back("llama.attention.head_count_kv", u32(c.n_kv_head));
    kv.emplace_back("llama.attention.layer_norm_rms_epsilon", GgufValue::f32(static_cast<float>(c.norm_eps)));
    kv.emplace_back("llama.rope.freq_base", GgufValue::f32(static_cast<float>(c.rope_theta)));
    kv.emplace_back("llama.rope.dimension_count", u32(c.n_embd / c.n_head));
    kv.emplace_back("llama.vocab_size", u32(c.vocab_size));
  } else {
    kv.emplace_back("gpt2.attention.layer_norm_epsilon", GgufValue::f32(static_cast<float>(c.norm_eps)));
  }
  kv.insert(kv.end(), tokenizer.begin(), tokenizer.end());

  std::vector<GgufTensorOut> out;
  const float* params = model.params();
  for (const model::TensorSpec& t : model.param_infos()) {
    const std::string g = llama ? llama_gguf_name(t.name) : gpt2_gguf_name(t.name);
    PO_CHECK(!g.empty(), "export: the model's tensor '", t.name, "' has no GGUF name");
    GgufTensorOut o{g, {t.shape.rbegin(), t.shape.rend()}, GgmlType::kF32, {}};
    if (t.shape.size() == 2 && t.shape[1] % backend::ggml_block_elems(type) == 0) o.type = type;
    const float* src = params + t.offset;
    const int64_t heads = t.name.ends_with("q_proj.weight")   ? c.n_head
                          : t.name.ends_with("k_proj.weight") ? c.n_kv_head
                                                              : 0;
    const tensor::Shape shape = t.shape;
    o.fill = [src, heads, shape](float* dst) {
      if (heads > 0) return detail::hf_to_interleaved_rows(src, dst, shape[0], shape[1], heads);
      std::copy(src, src + tensor::shape_numel(shape), dst);
    };
    out.push_back(std::move(o));
    if (!llama && t.name == "wte.weight") {  // llama.cpp's GPT-2 reads the tied head as output.weight
      GgufTensorOut head = out.back();
      head.name = "output.weight";
      out.push_back(std::move(head));
    }
  }
  if (llama && c.rope_scaling.factor > 0) {  // Llama-3.1: the factors, as llama.cpp's converter writes them
    const RopeScaling r{c.rope_scaling.factor, c.rope_scaling.low_freq_factor, c.rope_scaling.high_freq_factor,
                        static_cast<int64_t>(c.rope_scaling.original_max_position)};
    const int64_t head_dim = c.n_embd / c.n_head;
    std::vector<double> factors = detail::llama3_rope_factors(r, c.rope_theta, head_dim);
    out.push_back({"rope_freqs.weight", {head_dim / 2}, GgmlType::kF32, [factors](float* d) {
                     for (size_t i = 0; i < factors.size(); ++i) d[i] = static_cast<float>(factors[i]);
                   }});
    kv.emplace_back("llama.rope.scaling.original_context_length", u32(r.original_max_position_embeddings));
    // Not keys llama.cpp reads (it reads the factors): they let a reader tell
    // a setting other than the published one from its factors.
    kv.emplace_back("llama.rope.scaling.low_freq_factor", GgufValue::f32(static_cast<float>(r.low_freq_factor)));
    kv.emplace_back("llama.rope.scaling.high_freq_factor", GgufValue::f32(static_cast<float>(r.high_freq_factor)));
  }
  write_gguf(path, kv, out);
}

}  // namespace po::checkpoint
