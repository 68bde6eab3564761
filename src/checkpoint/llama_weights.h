// Llama-architecture weights in Hugging Face terms, whatever file they came
// from: the shape (config.json's fields) and every tensor under its HF name in
// HF's [out, in] layout, as fp32, with rotate-half RoPE (q_proj and k_proj rows
// in HF's order). Legend: C hidden_size, F intermediate_size, L layers, NH
// attention heads, NKV key/value heads, hs = C / NH, V vocabulary.
//
//   model.embed_tokens.weight                        [V, C]
//   model.layers.N.input_layernorm.weight            [C]
//   model.layers.N.self_attn.q_proj.weight           [NH*hs, C]
//   model.layers.N.self_attn.{k,v}_proj.weight       [NKV*hs, C]
//   model.layers.N.self_attn.o_proj.weight           [C, NH*hs]
//   model.layers.N.post_attention_layernorm.weight   [C]
//   model.layers.N.mlp.{gate,up}_proj.weight         [F, C]
//   model.layers.N.mlp.down_proj.weight              [C, F]
//   model.norm.weight                                [C]
//   lm_head.weight                                   [V, C] (absent when tied)
//
// Readers (hf_llama.h, llama2c.h) know the shape and the tensor list once
// opened and read values on demand, so a caller with one flat allocation copies
// each tensor straight into place. Overrides: a field the file states must be
// equal in the caller's overrides (else an InvalidArgument naming the config key
// and the file's tensor or key); a field the file cannot state (the head count
// of a bare safetensors file, llama2.c's norm eps) is taken from the overrides,
// else from the format's default.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/nf4.h"
#include "tensor/tensor.h"

namespace po::checkpoint {

// Llama-3.1 RoPE frequency scaling (config.json "rope_scaling" with rope_type "llama3").
struct RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
  bool operator==(const RopeScaling&) const = default;
};

struct LlamaShape {
  int64_t dim = 0;          // C, hidden_size
  int64_t hidden_dim = 0;   // F, intermediate_size
  int64_t n_layer = 0;      // L, num_hidden_layers
  int64_t n_head = 0;       // NH, num_attention_heads
  int64_t n_kv_head = 0;    // NKV, num_key_value_heads
  int64_t vocab_size = 0;   // V
  int64_t max_seq_len = 0;  // max_position_embeddings (llama2.c: seq_len)
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  std::optional<RopeScaling> rope_scaling;

  int64_t head_dim() const { return n_head > 0 ? dim / n_head : 0; }
  bool operator==(const LlamaShape&) const = default;
};

// The caller's configuration (the engine's model.* keys), each optional.
struct LlamaOverrides {
  std::optional<int64_t> dim;          // model.n_embd
  std::optional<int64_t> hidden_dim;   // model.ffn_hidden
  std::optional<int64_t> n_layer;      // model.n_layer
  std::optional<int64_t> n_head;       // model.n_head
  std::optional<int64_t> n_kv_head;    // model.n_kv_head
  std::optional<int64_t> vocab_size;   // model.vocab_size
  // model.seq_len: may be at most the file's value (training on shorter
  // sequences than the model was made for is normal).
  std::optional<int64_t> max_seq_len;
  std::optional<double> rms_norm_eps;  // model.norm_eps
  std::optional<double> rope_theta;    // model.rope_theta
  std::optional<bool> tie_word_embeddings;  // model.tie_embeddings
};

struct LlamaTensorInfo {
  std::string name;
  tensor::Shape shape;
};

// The tensors of a Llama of shape `s` in a fixed order: embedding; per layer
// input_layernorm, q, k, v, o, post_attention_layernorm, gate, up, down; final
// norm; lm_head unless tied.
std::vector<LlamaTensorInfo> llama_tensor_infos(const LlamaShape& s);

// InvalidArgument "ORIGIN: ..." when `s` cannot be a model: a non-positive
// size, hidden_size % heads != 0, heads % kv heads != 0, an odd head size
// (RoPE rotates pairs), or sizes whose element counts overflow int64.
void llama_shape_check(const LlamaShape& s, const std::string& origin);

// One tensor's fp32 values.
struct LlamaTensor {
  tensor::Shape shape;
  std::vector<float> values;
};

// A whole model in memory.
struct LlamaWeights {
  LlamaShape shape;
  std::map<std::string, LlamaTensor> tensors;  // HF names, HF layout
};

enum class LlamaFormat { kHfDirectory, kSafetensors, kLlama2cLegacy, kLlama2cV1, kGguf };
const char* llama_format_name(LlamaFormat f);

// An opened checkpoint. Its shape is resolved and checked against every tensor
// when it opens; values are read on demand.
class LlamaReader {
 public:
  virtual ~LlamaReader() = default;
  LlamaFormat format() const { return format_; }
  // The path it was opened from.
  const std::string& origin() const { return origin_; }
  const LlamaShape& shape() const { return shape_; }
  // The model's tensors, llama_tensor_infos(shape()).
  const std::vector<LlamaTensorInfo>& tensors() const { return infos_; }
  // The shape of tensor `name` (HF layout); null when the model has none such.
  const tensor::Shape* find_shape(const std::string& name) const;
  // Copies tensor `name` as fp32 (HF layout) into `dst`, numel(shape) floats.
  // InvalidArgument naming the file for a name the model does not have.
  virtual void read(const std::string& name, float* dst) const = 0;
  std::vector<float> read(const std::string& name) const;
  // Whether tensor `name` is stored as bitsandbytes' NF4 (a Hugging Face
  // "-bnb-4bit" checkpoint), and then its codes as they are stored (read()
  // gives their decoded values).
  virtual bool is_nf4(const std::string& /*name*/) const { return false; }
  virtual backend::Nf4Tensor read_nf4(const std::string& name) const;
  LlamaWeights load_all() const;

 protected:
  LlamaReader(LlamaFormat format, std::string origin) : format_(format), origin_(std::move(origin)) {}
  // Sets the shape and the tensor list (after the checks).
  void set_shape(const LlamaShape& s);
  // The declared shape of `name`, or an InvalidArgument naming the file.
  const tensor::Shape& shape_of(const std::string& name) const;

 private:
  LlamaFormat format_;
  std::string origin_;
  LlamaShape shape_;
  std::vector<LlamaTensorInfo> infos_;
  std::map<std::string, size_t> index_;
};

// Opens any supported form: a directory (Hugging Face: config.json plus
// model.safetensors or model.safetensors.index.json and its shards), a
// `.safetensors` file (an adjacent config.json is used when present), a GGUF
// file (checkpoint/gguf_models.h: it starts with "GGUF"), or a llama2.c
// checkpoint (any other file: version 1 when it starts with the magic
// 0x616b3432, else the legacy header). IoError when it cannot be read,
// InvalidArgument naming the file, tensor or key when it is inconsistent.
std::unique_ptr<LlamaReader> open_llama(const std::string& path, const LlamaOverrides& overrides = {});

// Reads everything: open_llama(path, overrides)->load_all().
LlamaWeights load_llama(const std::string& path, const LlamaOverrides& overrides = {});

namespace detail {

// Meta's RoPE row order (llama2.c and GGUF files: each head's rows rotate as
// interleaved pairs 2i, 2i+1) to Hugging Face's rotate-half order, for a
// [rows, cols] f32 q or k projection of `heads` heads: HF row
// h*hs + s*(hs/2) + i comes from row h*hs + 2*i + s. `src` may be unaligned
// (a mapped file's bytes).
void interleaved_to_hf_rows(const void* src, float* dst, int64_t rows, int64_t cols, int64_t heads);
// The inverse (writers of those formats).
void hf_to_interleaved_rows(const float* src, float* dst, int64_t rows, int64_t cols, int64_t heads);

// Checks an override against what the file states: InvalidArgument
// "ORIGIN: KEY = V but EVIDENCE" when they differ. `evidence` says where the
// file states it, e.g. "config.json hidden_size = 64".
void override_must_match(const std::string& origin, const char* key,
                         const std::optional<int64_t>& override_value, int64_t file_value,
                         const std::string& evidence);
void override_must_match(const std::string& origin, const char* key,
                         const std::optional<double>& override_value, double file_value,
                         const std::string& evidence);
void override_must_match(const std::string& origin, const char* key,
                         const std::optional<bool>& override_value, bool file_value,
                         const std::string& evidence);
// model.seq_len may lower max_seq_len, not raise it.
void apply_seq_len_override(const std::string& origin, const std::optional<int64_t>& override_value,
                            int64_t* max_seq_len, const std::string& evidence);

}  // namespace detail
}  // namespace po::checkpoint
