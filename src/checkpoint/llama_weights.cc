// See llama_weights.h: the tensor list of a Llama shape, its sanity checks,
// and the dispatch from a path to the reader of its format.
#include "checkpoint/llama_weights.h"

#include <sys/stat.h>

#include "checkpoint/hf_llama.h"
#include "checkpoint/gguf_models.h"
#include "checkpoint/llama2c.h"
#include "core/error.h"

namespace po::checkpoint {

std::vector<LlamaTensorInfo> llama_tensor_infos(const LlamaShape& s) {
  const int64_t C = s.dim, F = s.hidden_dim, V = s.vocab_size;
  const int64_t q_rows = s.n_head * s.head_dim(), kv_rows = s.n_kv_head * s.head_dim();
  std::vector<LlamaTensorInfo> out;
  out.reserve(static_cast<size_t>(9 * s.n_layer + 3));
  out.push_back({"model.embed_tokens.weight", {V, C}});
  for (int64_t l = 0; l < s.n_layer; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    out.push_back({p + "input_layernorm.weight", {C}});
    out.push_back({p + "self_attn.q_proj.weight", {q_rows, C}});
    out.push_back({p + "self_attn.k_proj.weight", {kv_rows, C}});
    out.push_back({p + "self_attn.v_proj.weight", {kv_rows, C}});
    out.push_back({p + "self_attn.o_proj.weight", {C, q_rows}});
    out.push_back({p + "post_attention_layernorm.weight", {C}});
    out.push_back({p + "mlp.gate_proj.weight", {F, C}});
    out.push_back({p + "mlp.up_proj.weight", {F, C}});
    out.push_back({p + "mlp.down_proj.weight", {C, F}});
  }
  out.push_back({"model.norm.weight", {C}});
  if (!s.tie_word_embeddings) out.push_back({"lm_head.weight", {V, C}});
  return out;
}

void llama_shape_check(const LlamaShape& s, const std::string& origin) {
  const std::pair<const char*, int64_t> sizes[] = {
      {"hidden_size", s.dim},           {"intermediate_size", s.hidden_dim},
      {"num_hidden_layers", s.n_layer}, {"num_attention_heads", s.n_head},
      {"num_key_value_heads", s.n_kv_head}, {"vocab_size", s.vocab_size},
      {"max_position_embeddings", s.max_seq_len}};
  for (const auto& [key, v] : sizes) PO_CHECK(v > 0, origin, ": ", key, " = ", v, " must be positive");
  PO_CHECK(s.dim % s.n_head == 0, origin, ": hidden_size ", s.dim,
           " is not divisible by num_attention_heads ", s.n_head);
  PO_CHECK(s.n_head % s.n_kv_head == 0, origin, ": num_attention_heads ", s.n_head,
           " is not divisible by num_key_value_heads ", s.n_kv_head);
  PO_CHECK(s.head_dim() % 2 == 0, origin, ": head size ", s.head_dim(),
           " (hidden_size / num_attention_heads) is odd; RoPE rotates pairs");
  // Every tensor's element count, and their sum, must fit int64 (bytes: 4x that).
  int64_t total = 0;
  auto mul = [&](int64_t a, int64_t b) {
    int64_t r = 0;
    PO_CHECK(!__builtin_mul_overflow(a, b, &r) && r <= (INT64_MAX >> 3), origin,
             ": sizes overflow (", a, " x ", b, " elements)");
    return r;
  };
  auto add = [&](int64_t v) {
    PO_CHECK(!__builtin_add_overflow(total, v, &total) && total <= (INT64_MAX >> 3), origin,
             ": sizes overflow (more than 2^60 elements in all)");
  };
  add(mul(2, mul(s.vocab_size, s.dim)));                  // embedding, classifier
  add(mul(s.n_layer, mul(4, mul(s.dim, s.dim))));         // q, k, v, o (at most C x C)
  add(mul(s.n_layer, mul(3, mul(s.dim, s.hidden_dim))));  // gate, up, down
  add(mul(s.n_layer, mul(2, s.dim)));                     // norms
  add(mul(2, mul(s.max_seq_len, s.head_dim())));          // llama2.c's freq_cis tables
  if (s.rms_norm_eps <= 0 || !(s.rms_norm_eps < 1)) {
    PO_THROW(core::InvalidArgument, origin, ": rms_norm_eps = ", s.rms_norm_eps,
             " must be in (0, 1)");
  }
  PO_CHECK(s.rope_theta > 0, origin, ": rope_theta = ", s.rope_theta, " must be positive");
  if (s.rope_scaling) {
    const RopeScaling& r = *s.rope_scaling;
    PO_CHECK(r.factor > 0 && r.low_freq_factor > 0 && r.high_freq_factor > r.low_freq_factor &&
                 r.original_max_position_embeddings > 0,
             origin, ": rope_scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and"
             " original_max_position_embeddings > 0");
  }
}

const char* llama_format_name(LlamaFormat f) {
  switch (f) {
    case LlamaFormat::kHfDirectory: return "Hugging Face directory";
    case LlamaFormat::kSafetensors: return "safetensors file";
    case LlamaFormat::kLlama2cLegacy: return "llama2.c legacy checkpoint";
    case LlamaFormat::kLlama2cV1: return "llama2.c version-1 checkpoint";
    case LlamaFormat::kGguf: return "GGUF file";
  }
  return "?";
}

std::vector<float> LlamaReader::read(const std::string& name) const {
  std::vector<float> out(static_cast<size_t>(tensor::shape_numel(shape_of(name))));
  read(name, out.data());
  return out;
}

const tensor::Shape* LlamaReader::find_shape(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &infos_[it->second].shape;
}

backend::Nf4Tensor LlamaReader::read_nf4(const std::string& name) const {
  PO_THROW(core::InvalidArgument, origin_, ": tensor '", name, "' is not stored as bitsandbytes' NF4");
}

LlamaWeights LlamaReader::load_all() const {
  LlamaWeights w;
  w.shape = shape_;
  for (const auto& t : infos_) w.tensors[t.name] = LlamaTensor{t.shape, read(t.name)};
  return w;
}

void LlamaReader::set_shape(const LlamaShape& s) {
  llama_shape_check(s, origin_);
  shape_ = s;
  infos_ = llama_tensor_infos(s);
  index_.clear();
  for (size_t i = 0; i < infos_.size(); ++i) index_[infos_[i].name] = i;
}

const tensor::Shape& LlamaReader::shape_of(const std::string& name) const {
  auto it = index_.find(name);
  PO_CHECK(it != index_.end(), origin_, ": the model has no tensor '", name, "'");
  return infos_[it->second].shape;
}

namespace {

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::unique_ptr<LlamaReader> open_llama(const std::string& path, const LlamaOverrides& overrides) {
  if (is_directory(path)) return open_hf_llama(path, overrides);
  if (ends_with(path, ".safetensors")) return open_hf_llama(path, overrides);
  if (is_gguf(path)) return open_gguf_llama(path, overrides);
  return open_llama2c(path, overrides);
}

LlamaWeights load_llama(const std::string& path, const LlamaOverrides& overrides) {
  return open_llama(path, overrides)->load_all();
}

namespace detail {

void interleaved_to_hf_rows(const void* src, float* dst, int64_t rows, int64_t cols, int64_t heads) {
  const int64_t hs = rows / heads, half = hs / 2;
  const size_t row_bytes = static_cast<size_t>(cols) * sizeof(float);
  const auto* from_rows = static_cast<const std::byte*>(src);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t s = 0; s < 2; ++s)
      for (int64_t i = 0; i < half; ++i) {
        const int64_t to = h * hs + s * half + i, from = h * hs + 2 * i + s;
        std::memcpy(dst + to * cols, from_rows + from * row_bytes, row_bytes);
      }
}

void hf_to_interleaved_rows(const float* src, float* dst, int64_t rows, int64_t cols, int64_t heads) {
  const int64_t hs = rows / heads, half = hs / 2;
  const size_t row_bytes = static_cast<size_t>(cols) * sizeof(float);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t s = 0; s < 2; ++s)
      for (int64_t i = 0; i < half; ++i)
        std::memcpy(dst + (h * hs + 2 * i + s) * cols, src + (h * hs + s * half + i) * cols, row_bytes);
}

void override_must_match(const std::string& origin, const char* key,
                         const std::optional<int64_t>& v, int64_t file_value,
                         const std::string& evidence) {
  PO_CHECK(!v || *v == file_value, origin, ": ", key, " = ", *v, " but ", evidence);
}

void override_must_match(const std::string& origin, const char* key,
                         const std::optional<double>& v, double file_value,
                         const std::string& evidence) {
  PO_CHECK(!v || *v == file_value, origin, ": ", key, " = ", *v, " but ", evidence);
}

void override_must_match(const std::string& origin, const char* key, const std::optional<bool>& v,
                         bool file_value, const std::string& evidence) {
  PO_CHECK(!v || *v == file_value, origin, ": ", key, " = ", (*v ? "true" : "false"), " but ",
           evidence);
}

void apply_seq_len_override(const std::string& origin, const std::optional<int64_t>& v,
                            int64_t* max_seq_len, const std::string& evidence) {
  if (!v) return;
  PO_CHECK(*v > 0 && *v <= *max_seq_len, origin, ": model.seq_len = ", *v, " but ", evidence,
           " (it may be lowered, not raised)");
  *max_seq_len = *v;
}

}  // namespace detail
}  // namespace po::checkpoint
