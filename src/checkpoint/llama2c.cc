// See llama2c.h. The header is checked whole (sizes, divisibility, overflow,
// exact file size) before any offset is computed from it, so every later read
// stays inside the file.
#include "checkpoint/llama2c.h"

#include <cstring>
#include <functional>

#include "core/error.h"

namespace po::checkpoint {
namespace {

constexpr size_t kLegacyHeaderBytes = 7 * 4;

int32_t load_i32(const std::byte* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return static_cast<int32_t>(v);
}

// One stored array: `count` arrays of `numel` floats (count = L for per-layer
// weights), under `name(l)` in HF terms; rope_heads > 0 for wq / wk.
struct Array {
  std::function<std::string(int64_t)> name;  // null: skipped (freq_cis)
  int64_t count = 1;
  int64_t numel = 0;
  int64_t rope_heads = 0;
};

std::string layer_name(int64_t l, const char* suffix) {
  return "model.layers." + std::to_string(l) + "." + suffix;
}

// The arrays of the file in storage order.
std::vector<Array> file_arrays(const Llama2cHeader& h) {
  const int64_t C = h.dim, F = h.hidden_dim, L = h.n_layers, V = h.vocab_size;
  const int64_t hs = C / h.n_heads, kv = static_cast<int64_t>(h.n_kv_heads) * hs;
  auto per_layer = [](const char* suffix) {
    return [suffix](int64_t l) { return layer_name(l, suffix); };
  };
  auto fixed = [](const char* n) { return [n](int64_t) { return std::string(n); }; };
  const Array emb{fixed("model.embed_tokens.weight"), 1, V * C};
  const Array att_norm{per_layer("input_layernorm.weight"), L, C};
  const Array ffn_norm{per_layer("post_attention_layernorm.weight"), L, C};
  const Array wq{per_layer("self_attn.q_proj.weight"), L, C * C, h.n_heads};
  const Array wk{per_layer("self_attn.k_proj.weight"), L, kv * C, h.n_kv_heads};
  const Array wv{per_layer("self_attn.v_proj.weight"), L, kv * C};
  const Array wo{per_layer("self_attn.o_proj.weight"), L, C * C};
  const Array w1{per_layer("mlp.gate_proj.weight"), L, F * C};
  const Array w2{per_layer("mlp.down_proj.weight"), L, C * F};
  const Array w3{per_layer("mlp.up_proj.weight"), L, F * C};
  const Array final_norm{fixed("model.norm.weight"), 1, C};
  const Array freq{nullptr, 1, static_cast<int64_t>(h.seq_len) * (hs / 2)};
  const Array cls{fixed("lm_head.weight"), 1, V * C};
  std::vector<Array> out;
  if (h.version == 0) {
    out = {emb, att_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3, final_norm, freq, freq};
  } else {
    out = {att_norm, ffn_norm, final_norm, emb, wq, wk, wv, wo, w1, w2, w3};
  }
  if (!h.shared_classifier) out.push_back(cls);
  return out;
}

// Bytes of the file's weights, or nullopt when they overflow uint64.
std::optional<uint64_t> weight_bytes(const Llama2cHeader& h) {
  // Every size is a positive int32 here: products of two fit int64, the
  // three-factor ones are checked.
  uint64_t total = 0;
  for (const Array& a : file_arrays(h)) {
    uint64_t n = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(a.count), static_cast<uint64_t>(a.numel), &n) ||
        __builtin_mul_overflow(n, uint64_t{4}, &n) || __builtin_add_overflow(total, n, &total))
      return std::nullopt;
  }
  return total;
}

}  // namespace

Llama2cHeader llama2c_parse_header(const void* data, size_t size, const std::string& origin) {
  const auto* p = static_cast<const std::byte*>(data);
  Llama2cHeader h;
  PO_CHECK(size >= 4, origin, ": truncated llama2.c checkpoint: ", size,
           " bytes, shorter than any header");
  uint32_t magic = static_cast<uint32_t>(load_i32(p));
  if (magic == kLlama2cMagic) {
    PO_CHECK(size >= kLlama2cV1HeaderBytes, origin, ": truncated llama2.c checkpoint: expected a ",
             kLlama2cV1HeaderBytes, "-byte version header, file has ", size, " bytes");
    h.version = load_i32(p + 4);
    PO_CHECK(h.version == 1, origin, ": llama2.c checkpoint version ", h.version,
             " is not supported (only 1, fp32; version 2 is int8-quantized)");
    h.header_bytes = kLlama2cV1HeaderBytes;
    p += 8;
  } else {
    PO_CHECK(size >= kLegacyHeaderBytes, origin, ": truncated llama2.c checkpoint: expected a ",
             kLegacyHeaderBytes, "-byte header, file has ", size, " bytes");
    h.header_bytes = kLegacyHeaderBytes;
  }
  h.dim = load_i32(p);
  h.hidden_dim = load_i32(p + 4);
  h.n_layers = load_i32(p + 8);
  h.n_heads = load_i32(p + 12);
  h.n_kv_heads = load_i32(p + 16);
  int32_t vocab = load_i32(p + 20);
  h.seq_len = load_i32(p + 24);
  if (h.version == 0) {
    h.shared_classifier = vocab > 0;
    PO_CHECK(vocab != INT32_MIN, origin, ": header vocab_size = ", vocab, " is out of range");
    h.vocab_size = vocab < 0 ? -vocab : vocab;
  } else {
    h.vocab_size = vocab;
    const uint8_t shared = static_cast<uint8_t>(p[28]);
    PO_CHECK(shared <= 1, origin, ": header shared_classifier = ", int{shared}, " is not 0 or 1");
    h.shared_classifier = shared == 1;
  }
  const std::pair<const char*, int32_t> fields[] = {
      {"dim", h.dim},         {"hidden_dim", h.hidden_dim}, {"n_layers", h.n_layers},
      {"n_heads", h.n_heads}, {"n_kv_heads", h.n_kv_heads}, {"vocab_size", h.vocab_size},
      {"seq_len", h.seq_len}};
  for (const auto& [key, v] : fields)
    PO_CHECK(v > 0, origin, ": impossible llama2.c header: ", key, " = ", v, " must be positive");
  PO_CHECK(h.dim % h.n_heads == 0, origin, ": impossible llama2.c header: dim = ", h.dim,
           " is not divisible by n_heads = ", h.n_heads);
  PO_CHECK(h.n_heads % h.n_kv_heads == 0, origin, ": impossible llama2.c header: n_heads = ",
           h.n_heads, " is not divisible by n_kv_heads = ", h.n_kv_heads);
  PO_CHECK((h.dim / h.n_heads) % 2 == 0, origin, ": impossible llama2.c header: head size ",
           h.dim / h.n_heads, " (dim / n_heads) is odd; RoPE rotates pairs");
  auto bytes = weight_bytes(h);
  PO_CHECK(bytes.has_value() && *bytes <= (uint64_t{1} << 60), origin,
           ": impossible llama2.c header: the sizes (dim ", h.dim, ", hidden_dim ", h.hidden_dim,
           ", n_layers ", h.n_layers, ", vocab_size ", h.vocab_size, ", seq_len ", h.seq_len,
           ") overflow a 64-bit byte count");
  const uint64_t expected = h.header_bytes + *bytes;
  if (size < expected) {
    PO_THROW(core::InvalidArgument, origin, ": truncated llama2.c checkpoint: the header (dim ",
             h.dim, ", hidden_dim ", h.hidden_dim, ", n_layers ", h.n_layers, ", n_heads ",
             h.n_heads, ", n_kv_heads ", h.n_kv_heads, ", vocab_size ", h.vocab_size, ", seq_len ",
             h.seq_len, ", ", h.shared_classifier ? "shared" : "separate",
             " classifier) needs ", expected, " bytes, the file has ", size);
  }
  PO_CHECK(size == expected, origin, ": llama2.c checkpoint has ", size - expected,
           " bytes more than the ", expected, " its header implies");
  return h;
}

uint64_t llama2c_file_bytes(const Llama2cHeader& h) {
  auto bytes = weight_bytes(h);
  PO_ASSERT(bytes.has_value(), "llama2c_file_bytes on an unchecked header");
  return h.header_bytes + *bytes;
}

LlamaShape llama2c_shape(const Llama2cHeader& h) {
  LlamaShape s;
  s.dim = h.dim;
  s.hidden_dim = h.hidden_dim;
  s.n_layer = h.n_layers;
  s.n_head = h.n_heads;
  s.n_kv_head = h.n_kv_heads;
  s.vocab_size = h.vocab_size;
  s.max_seq_len = h.seq_len;
  s.rms_norm_eps = kLlama2cNormEps;
  s.rope_theta = kLlama2cRopeTheta;
  s.tie_word_embeddings = h.shared_classifier;
  return s;
}

Llama2cReader::Llama2cReader(const std::string& origin, const Llama2cHeader& h)
    : LlamaReader(h.version == 0 ? LlamaFormat::kLlama2cLegacy : LlamaFormat::kLlama2cV1, origin),
      header_(h) {}

std::unique_ptr<Llama2cReader> Llama2cReader::open(const std::string& path,
                                                   const LlamaOverrides& overrides) {
  MappedFile file(path);
  Llama2cHeader h = llama2c_parse_header(file.data(), file.size(), path);
  std::unique_ptr<Llama2cReader> r(new Llama2cReader(path, h));
  r->file_ = std::move(file);
  r->init(r->file_.data(), r->file_.size(), overrides);
  return r;
}

std::unique_ptr<Llama2cReader> Llama2cReader::from_bytes(const void* data, size_t size,
                                                         const std::string& origin,
                                                         const LlamaOverrides& overrides) {
  Llama2cHeader h = llama2c_parse_header(data, size, origin);
  std::unique_ptr<Llama2cReader> r(new Llama2cReader(origin, h));
  r->init(static_cast<const std::byte*>(data), size, overrides);
  return r;
}

void Llama2cReader::init(const std::byte* data, size_t size, const LlamaOverrides& ov) {
  (void)size;
  data_ = data;
  const Llama2cHeader& h = header_;
  const std::string& f = origin();
  auto field = [](const char* key, int64_t v) { return core::str_cat("the header has ", key, " = ", v); };
  detail::override_must_match(f, "model.n_embd", ov.dim, h.dim, field("dim", h.dim));
  detail::override_must_match(f, "model.ffn_hidden", ov.hidden_dim, h.hidden_dim,
                              field("hidden_dim", h.hidden_dim));
  detail::override_must_match(f, "model.n_layer", ov.n_layer, h.n_layers,
                              field("n_layers", h.n_layers));
  detail::override_must_match(f, "model.n_head", ov.n_head, h.n_heads, field("n_heads", h.n_heads));
  detail::override_must_match(f, "model.n_kv_head", ov.n_kv_head, h.n_kv_heads,
                              field("n_kv_heads", h.n_kv_heads));
  detail::override_must_match(f, "model.vocab_size", ov.vocab_size, h.vocab_size,
                              field("vocab_size", h.vocab_size));
  detail::override_must_match(f, "model.tie_embeddings", ov.tie_word_embeddings,
                              h.shared_classifier,
                              h.shared_classifier ? "the classifier is shared with the embedding"
                                                  : "the file holds a separate classifier");
  LlamaShape s = llama2c_shape(h);
  detail::apply_seq_len_override(f, ov.max_seq_len, &s.max_seq_len, field("seq_len", h.seq_len));
  if (ov.rms_norm_eps) s.rms_norm_eps = *ov.rms_norm_eps;
  if (ov.rope_theta) s.rope_theta = *ov.rope_theta;
  set_shape(s);

  uint64_t offset = h.header_bytes;
  for (const Array& a : file_arrays(h)) {
    const uint64_t bytes = static_cast<uint64_t>(a.numel) * 4;
    for (int64_t l = 0; l < a.count; ++l, offset += bytes)
      if (a.name) slots_[a.name(l)] = Slot{offset, a.rope_heads};
  }
  PO_ASSERT(offset == size, "llama2.c layout ends at ", offset, " of ", size);
  PO_ASSERT(slots_.size() == tensors().size(), "llama2.c layout has ", slots_.size(), " tensors");
}

void Llama2cReader::read(const std::string& name, float* dst) const {
  const tensor::Shape& shape = shape_of(name);
  const Slot& slot = slots_.at(name);
  const std::byte* src = data_ + slot.offset;
  const size_t n = static_cast<size_t>(tensor::shape_numel(shape));
  if (slot.rope_heads == 0) {
    std::memcpy(dst, src, n * 4);
    return;
  }
  detail::interleaved_to_hf_rows(src, dst, shape[0], shape[1], slot.rope_heads);
}

std::unique_ptr<LlamaReader> open_llama2c(const std::string& path, const LlamaOverrides& overrides) {
  return Llama2cReader::open(path, overrides);
}

}  // namespace po::checkpoint
