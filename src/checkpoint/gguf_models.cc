#include "checkpoint/gguf_models.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <utility>

#include "core/error.h"
#include "data/llama_tokenizer.h"
#include "data/tokenizer.h"

namespace po::checkpoint {
namespace {

using backend::GgmlType;

// "model.layers.N.REST" / "h.N.REST" -> ("N", "REST"); nullopt otherwise.
std::optional<std::pair<std::string, std::string>> layer_of(const std::string& name, const std::string& prefix) {
  if (name.rfind(prefix, 0) != 0) return std::nullopt;
  const size_t dot = name.find('.', prefix.size());
  if (dot == std::string::npos) return std::nullopt;
  return std::make_pair(name.substr(prefix.size(), dot - prefix.size()), name.substr(dot + 1));
}

using NameMap = std::vector<std::pair<const char*, const char*>>;

std::string mapped(const std::string& hf, const NameMap& whole, const std::string& layer_prefix,
                   const NameMap& per_layer) {
  for (const auto& [a, b] : whole)
    if (hf == a) return b;
  if (auto l = layer_of(hf, layer_prefix))
    for (const auto& [a, b] : per_layer)
      if (l->second == a) return "blk." + l->first + "." + b;
  return "";
}

}  // namespace

namespace detail {

std::vector<double> llama3_rope_factors(const RopeScaling& r, double theta, int64_t head_dim) {
  const double orig = static_cast<double>(r.original_max_position_embeddings);
  const double low_wavelen = orig / r.low_freq_factor, high_wavelen = orig / r.high_freq_factor;
  std::vector<double> out;
  for (int64_t i = 0; i < head_dim; i += 2) {
    const double freq = 1.0 / std::pow(theta, static_cast<double>(i) / static_cast<double>(head_dim));
    const double wavelen = 2 * M_PI / freq;
    if (wavelen < high_wavelen) {
      out.push_back(1.0);
    } else if (wavelen > low_wavelen) {
      out.push_back(r.factor);
    } else {
      const double smooth = (orig / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
      out.push_back(1.0 / ((1 - smooth) / r.factor + smooth));
    }
  }
  return out;
}

std::string llama_gguf_name(const std::string& hf) {
  static const NameMap whole = {{"model.embed_tokens.weight", "token_embd.weight"},
                                {"model.norm.weight", "output_norm.weight"},
                                {"lm_head.weight", "output.weight"}};
  static const NameMap per_layer = {{"input_layernorm.weight", "attn_norm.weight"},
                                    {"self_attn.q_proj.weight", "attn_q.weight"},
                                    {"self_attn.k_proj.weight", "attn_k.weight"},
                                    {"self_attn.v_proj.weight", "attn_v.weight"},
                                    {"self_attn.o_proj.weight", "attn_output.weight"},
                                    {"post_attention_layernorm.weight", "ffn_norm.weight"},
                                    {"mlp.gate_proj.weight", "ffn_gate.weight"},
                                    {"mlp.up_proj.weight", "ffn_up.weight"},
                                    {"mlp.down_proj.weight", "ffn_down.weight"}};
  return mapped(hf, whole, "model.layers.", per_layer);
}

std::string gpt2_gguf_name(const std::string& hf) {
  static const NameMap whole = {{"wte.weight", "token_embd.weight"}, {"wpe.weight", "position_embd.weight"},
                                {"ln_f.weight", "output_norm.weight"}, {"ln_f.bias", "output_norm.bias"}};
  static const NameMap per_layer = {
      {"ln_1.weight", "attn_norm.weight"},       {"ln_1.bias", "attn_norm.bias"},
      {"attn.c_attn.weight", "attn_qkv.weight"}, {"attn.c_attn.bias", "attn_qkv.bias"},
      {"attn.c_proj.weight", "attn_output.weight"}, {"attn.c_proj.bias", "attn_output.bias"},
      {"ln_2.weight", "ffn_norm.weight"},        {"ln_2.bias", "ffn_norm.bias"},
      {"mlp.c_fc.weight", "ffn_up.weight"},      {"mlp.c_fc.bias", "ffn_up.bias"},
      {"mlp.c_proj.weight", "ffn_down.weight"},  {"mlp.c_proj.bias", "ffn_down.bias"}};
  return mapped(hf, whole, "h.", per_layer);
}

const GgufTensorInfo& expect_tensor(const GgufFile& f, const std::string& gguf, const std::string& hf,
                                    const tensor::Shape& shape) {
  const GgufTensorInfo* t = f.find_tensor(gguf);
  PO_CHECK(t != nullptr, f.origin(), ": no tensor '", gguf, "' (", hf, ")");
  PO_CHECK(t->shape() == shape, f.origin(), ": tensor '", gguf, "' (", hf, ") has shape ",
           tensor::shape_str(t->shape()), ", the model needs ", tensor::shape_str(shape));
  return *t;
}

void no_other_tensors(const GgufFile& f, const std::set<std::string>& read, const std::string& arch) {
  for (const GgufTensorInfo& t : f.tensors())
    PO_CHECK(read.count(t.name) > 0, f.origin(), ": tensor '", t.name, "' is not part of a ", arch,
             " model as this engine reads it");
}

}  // namespace detail

namespace {

using detail::expect_tensor;
using detail::llama_gguf_name;
using detail::no_other_tensors;

std::string architecture_of(const GgufFile& f) {
  const GgufValue* v = f.find("general.architecture");
  PO_CHECK(v != nullptr && v->type == GgufType::kString, f.origin(),
           ": no metadata general.architecture (a string naming the model)");
  return v->value.get<std::string>();
}

// Llama-3.1's RoPE scaling from the per-frequency factors llama.cpp's
// converter stores in rope_freqs.weight (it writes no scaling keys): the
// factor is their largest, and the factors must be those of the published
// setting (low_freq_factor 1, high_freq_factor 4, original context
// llama.rope.scaling.original_context_length or 8192; this engine's export
// also writes low_freq_factor and high_freq_factor keys), else an error
// naming the tensor (another setting cannot be told from the factors alone).
RopeScaling rope_scaling_of(const GgufFile& f, const GgufTensorInfo& t, const LlamaShape& s) {
  const int64_t half = s.n_head > 0 ? s.dim / s.n_head / 2 : 0;
  PO_CHECK(t.ne.size() == 1 && t.ne[0] == half, f.origin(), ": tensor rope_freqs.weight has ", t.numel,
           " factors, the head size ", 2 * half, " needs ", half);
  std::vector<float> got(static_cast<size_t>(t.numel));
  f.read_f32(t, got.data());
  RopeScaling r;
  r.factor = *std::max_element(got.begin(), got.end());
  r.original_max_position_embeddings = f.find_int("llama.rope.scaling.original_context_length").value_or(8192);
  // (Written by this engine's export, which may hold another setting.)
  r.low_freq_factor = f.find_float("llama.rope.scaling.low_freq_factor").value_or(1.0);
  r.high_freq_factor = f.find_float("llama.rope.scaling.high_freq_factor").value_or(4.0);
  const std::vector<double> want = detail::llama3_rope_factors(r, s.rope_theta, 2 * half);
  for (int64_t i = 0; i < half; ++i)
    PO_CHECK(std::fabs(got[i] - want[i]) <= 1e-4 * want[i], f.origin(), ": rope_freqs.weight[", i, "] = ", got[i],
             " but Llama-3.1's scaling (factor ", r.factor, ", low ", r.low_freq_factor, ", high ", r.high_freq_factor,
             ", original context ",
             r.original_max_position_embeddings, ") gives ", want[i], ": another setting is not read");
  return r;
}

class GgufLlamaReader final : public LlamaReader {
 public:
  GgufLlamaReader(GgufFile file, const LlamaOverrides& ov)
      : LlamaReader(LlamaFormat::kGguf, file.origin()), file_(std::move(file)) {
    const GgufFile& f = file_;
    const std::string& o = f.origin();
    const std::string arch = architecture_of(f);
    PO_CHECK(arch == "llama", o, ": general.architecture = '", arch, "'; a Llama GGUF says 'llama'",
             arch == "gpt2" ? " (GPT-2 files load as GPT-2)" : "");
    const auto expert_count = f.find_int("llama.expert_count");
    PO_CHECK(!expert_count || *expert_count == 0, o, ": llama.expert_count = ", expert_count.value_or(0),
             ": a mixture of experts (Mixtral) is not built yet");
    if (const GgufValue* t = f.find("llama.rope.scaling.type"))
      PO_CHECK(t->type == GgufType::kString && t->value.get<std::string>() == "none", o,
               ": metadata llama.rope.scaling.type = ", t->value.dump(),
               ": linear and YaRN RoPE scaling are not built (Llama-3.1's rope_freqs.weight is)");
    const auto key = [&](const char* k, int64_t v) { return core::str_cat("metadata llama.", k, " = ", v); };
    LlamaShape s;
    s.dim = f.get_int("llama.embedding_length");
    s.hidden_dim = f.get_int("llama.feed_forward_length");
    s.n_layer = f.get_int("llama.block_count");
    // Nine tensors a block: a count the tensor table cannot hold is a lie
    // (refused before a list of its tensors is made).
    PO_CHECK(s.n_layer >= 1 && s.n_layer <= static_cast<int64_t>(f.tensors().size()) / 9, o,
             ": llama.block_count = ", s.n_layer, " but the file holds ", f.tensors().size(), " tensors");
    s.n_head = f.get_int("llama.attention.head_count");
    s.n_kv_head = f.find_int("llama.attention.head_count_kv").value_or(s.n_head);
    s.max_seq_len = f.get_int("llama.context_length");
    const GgufTensorInfo* embd = f.find_tensor("token_embd.weight");
    PO_CHECK(embd != nullptr && embd->ne.size() == 2, o, ": no 2-D tensor token_embd.weight (the embedding)");
    s.vocab_size = embd->ne[1];
    s.tie_word_embeddings = f.find_tensor("output.weight") == nullptr;
    if (auto rot = f.find_int("llama.rope.dimension_count"); rot && s.n_head > 0)
      PO_CHECK(*rot == s.dim / s.n_head, o, ": llama.rope.dimension_count = ", *rot, " but the head size is ",
               s.dim / s.n_head, ": partial rotary embeddings are not built");
    detail::override_must_match(o, "model.n_embd", ov.dim, s.dim, key("embedding_length", s.dim));
    detail::override_must_match(o, "model.ffn_hidden", ov.hidden_dim, s.hidden_dim,
                                key("feed_forward_length", s.hidden_dim));
    detail::override_must_match(o, "model.n_layer", ov.n_layer, s.n_layer, key("block_count", s.n_layer));
    detail::override_must_match(o, "model.n_head", ov.n_head, s.n_head, key("attention.head_count", s.n_head));
    detail::override_must_match(o, "model.n_kv_head", ov.n_kv_head, s.n_kv_head,
                                key("attention.head_count_kv", s.n_kv_head));
    detail::override_must_match(o, "model.vocab_size", ov.vocab_size, s.vocab_size,
                                core::str_cat("token_embd.weight has ", s.vocab_size, " rows"));
    detail::override_must_match(o, "model.tie_embeddings", ov.tie_word_embeddings, s.tie_word_embeddings,
                                s.tie_word_embeddings ? "the file has no output.weight" : "the file has output.weight");
    detail::apply_seq_len_override(o, ov.max_seq_len, &s.max_seq_len, key("context_length", s.max_seq_len));
    // Stored as f32: an override agrees when it rounds to the same float.
    const auto real = [&](const char* cfg, const std::optional<double>& over, const char* k, double dflt) {
      const std::optional<double> v = f.find_float(std::string("llama.") + k);
      if (!v) return over.value_or(dflt);
      PO_CHECK(!over || static_cast<float>(*over) == static_cast<float>(*v), o, ": ", cfg, " = ", *over,
               " but metadata llama.", k, " = ", *v);
      return *v;
    };
    s.rms_norm_eps = real("model.norm_eps", ov.rms_norm_eps, "attention.layer_norm_rms_epsilon", 1e-5);
    s.rope_theta = real("model.rope_theta", ov.rope_theta, "rope.freq_base", 10000.0);
    if (const GgufTensorInfo* freqs = f.find_tensor("rope_freqs.weight")) s.rope_scaling = rope_scaling_of(f, *freqs, s);
    set_shape(s);
    std::set<std::string> read = {"rope_freqs.weight"};
    for (const LlamaTensorInfo& t : tensors()) {
      const std::string g = llama_gguf_name(t.name);
      expect_tensor(f, g, t.name, t.shape);
      read.insert(g);
    }
    no_other_tensors(f, read, "Llama");
  }

  void read(const std::string& name, float* dst) const override {
    const tensor::Shape& shape = shape_of(name);
    const GgufTensorInfo& t = *file_.find_tensor(llama_gguf_name(name));
    const bool q = name.ends_with("q_proj.weight"), k = name.ends_with("k_proj.weight");
    if (!q && !k) return file_.read_f32(t, dst);
    std::vector<float> stored(static_cast<size_t>(t.numel));
    file_.read_f32(t, stored.data());
    detail::interleaved_to_hf_rows(stored.data(), dst, shape[0], shape[1], q ? this->shape().n_head : this->shape().n_kv_head);
  }
  using LlamaReader::read;

 private:
  GgufFile file_;
};

std::vector<std::string> strings_of(const GgufFile& f, const char* key) {
  std::vector<std::string> out;
  for (const auto& v : f.get_array(key, GgufType::kString)) out.push_back(v.get<std::string>());
  return out;
}

}  // namespace

std::unique_ptr<LlamaReader> open_gguf_llama(GgufFile file, const LlamaOverrides& overrides) {
  return std::make_unique<GgufLlamaReader>(std::move(file), overrides);
}

std::unique_ptr<LlamaReader> open_gguf_llama(const std::string& path, const LlamaOverrides& overrides) {
  return open_gguf_llama(GgufFile::open(path), overrides);
}

std::string gguf_architecture(const GgufFile& f) { return architecture_of(f); }

std::unique_ptr<data::TextTokenizer> gguf_tokenizer(const GgufFile& f) {
  const GgufValue* model = f.find("tokenizer.ggml.model");
  PO_CHECK(model != nullptr && model->type == GgufType::kString, f.origin(),
           ": no tokenizer (metadata tokenizer.ggml.model): give --tokenizer");
  const std::string kind = model->value.get<std::string>();
  std::vector<std::string> tokens = strings_of(f, "tokenizer.ggml.tokens");
  if (kind == "llama") {
    std::vector<float> scores;
    for (const auto& v : f.get_array("tokenizer.ggml.scores", GgufType::kF32)) scores.push_back(v.get<float>());
    std::vector<int32_t> types;
    for (const auto& v : f.get_array("tokenizer.ggml.token_type", GgufType::kI32)) types.push_back(v.get<int32_t>());
    std::optional<int32_t> bos;
    if (auto b = f.find_int("tokenizer.ggml.bos_token_id")) bos = static_cast<int32_t>(*b);
    const auto eos = static_cast<int32_t>(f.find_int("tokenizer.ggml.eos_token_id").value_or(2));
    bool prefix = true;
    if (const GgufValue* p = f.find("tokenizer.ggml.add_space_prefix"); p != nullptr && p->type == GgufType::kBool)
      prefix = p->value.get<bool>();
    return std::make_unique<data::LlamaTokenizer>(
        data::LlamaTokenizer::from_pieces(f.origin(), std::move(tokens), scores, types, bos, eos, prefix));
  }
  if (kind == "gpt2") {
    if (const GgufValue* pre = f.find("tokenizer.ggml.pre"); pre != nullptr && pre->type == GgufType::kString) {
      const std::string p = pre->value.get<std::string>();
      PO_CHECK(p == "gpt-2" || p == "default", f.origin(), ": tokenizer.ggml.pre = '", p,
               "': only GPT-2's own pre-tokenizer is built (Llama-3's and others' split text differently)");
    }
    const auto eos = f.find_int("tokenizer.ggml.eos_token_id").value_or(data::Tokenizer::kEndOfText);
    PO_CHECK(eos == data::Tokenizer::kEndOfText && tokens.size() > static_cast<size_t>(eos) &&
                 tokens[static_cast<size_t>(eos)] == "<|endoftext|>",
             f.origin(), ": tokenizer.ggml.eos_token_id = ", eos, ": only GPT-2's vocabulary (<|endoftext|> = ",
             data::Tokenizer::kEndOfText, ") is built for model 'gpt2'");
    return std::make_unique<data::Tokenizer>(std::move(tokens), strings_of(f, "tokenizer.ggml.merges"), f.origin());
  }
  PO_THROW(core::InvalidArgument, f.origin(), ": tokenizer.ggml.model = '", kind,
           "': only 'llama' (SentencePiece) and 'gpt2' tokenizers are built");
}

GgufMetadata gguf_tokenizer_keys(const data::TextTokenizer& tok, int64_t vocab_size) {
  GgufMetadata kv;
  nlohmann::json tokens = nlohmann::json::array(), types = nlohmann::json::array();
  const auto pad = [&](nlohmann::json* scores) {
    for (int64_t id = tok.vocab_size(); id < vocab_size; ++id) {
      tokens.push_back("[PAD" + std::to_string(id) + "]");
      types.push_back(5);  // unused
      if (scores != nullptr) scores->push_back(-1e9);
    }
  };
  if (const auto* llama = dynamic_cast<const data::LlamaTokenizer*>(&tok)) {
    nlohmann::json scores = nlohmann::json::array();
    const std::vector<float> s = llama->piece_scores();
    for (int32_t id = 0; id < llama->vocab_size(); ++id) {
      tokens.push_back(llama->piece(id));
      scores.push_back(static_cast<double>(s[static_cast<size_t>(id)]));
      types.push_back(llama->piece_type(id));
    }
    pad(&scores);
    kv.emplace_back("tokenizer.ggml.model", GgufValue::str("llama"));
    kv.emplace_back("tokenizer.ggml.tokens", GgufValue::array(GgufType::kString, std::move(tokens)));
    kv.emplace_back("tokenizer.ggml.scores", GgufValue::array(GgufType::kF32, std::move(scores)));
    kv.emplace_back("tokenizer.ggml.token_type", GgufValue::array(GgufType::kI32, std::move(types)));
    if (llama->bos_id()) kv.emplace_back("tokenizer.ggml.bos_token_id", GgufValue::u32(*llama->bos_id()));
    kv.emplace_back("tokenizer.ggml.eos_token_id", GgufValue::u32(llama->eos_id()));
    if (auto unk = llama->piece_id("<unk>")) kv.emplace_back("tokenizer.ggml.unknown_token_id", GgufValue::u32(*unk));
    kv.emplace_back("tokenizer.ggml.add_bos_token", GgufValue::boolean(llama->bos_id().has_value()));
    kv.emplace_back("tokenizer.ggml.add_space_prefix", GgufValue::boolean(llama->dummy_prefix()));
    return kv;
  }
  const auto* gpt2 = dynamic_cast<const data::Tokenizer*>(&tok);
  PO_CHECK(gpt2 != nullptr, "a tokenizer of kind '", tok.kind(), "' cannot be written to GGUF");
  for (int32_t id = 0; id < gpt2->vocab_size(); ++id) {
    tokens.push_back(gpt2->token_string(id));
    types.push_back(id == data::Tokenizer::kEndOfText ? 3 : 1);
  }
  pad(nullptr);
  nlohmann::json merges = nlohmann::json::array();
  for (const std::string& m : gpt2->merge_rules()) merges.push_back(m);
  kv.emplace_back("tokenizer.ggml.model", GgufValue::str("gpt2"));
  kv.emplace_back("tokenizer.ggml.pre", GgufValue::str("gpt-2"));
  kv.emplace_back("tokenizer.ggml.tokens", GgufValue::array(GgufType::kString, std::move(tokens)));
  kv.emplace_back("tokenizer.ggml.token_type", GgufValue::array(GgufType::kI32, std::move(types)));
  kv.emplace_back("tokenizer.ggml.merges", GgufValue::array(GgufType::kString, std::move(merges)));
  kv.emplace_back("tokenizer.ggml.bos_token_id", GgufValue::u32(data::Tokenizer::kEndOfText));
  kv.emplace_back("tokenizer.ggml.eos_token_id", GgufValue::u32(data::Tokenizer::kEndOfText));
  return kv;
}

}  // namespace po::checkpoint
