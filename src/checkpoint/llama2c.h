// llama2.c checkpoints (karpathy/llama2.c, export.py and run.c), read into
// Hugging Face names and layout (llama_weights.h). All values little-endian
// fp32; every weight type is stored for all layers at once ([L, ...]).
//
// Legacy (export.py legacy_export, read by run.c): seven int32 (dim,
// hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a NEGATIVE
// vocab_size means an untied classifier), then token_embedding_table [V, C],
// rms_att [L, C], wq [L, C, C], wk [L, NKV*hs, C], wv [L, NKV*hs, C], wo
// [L, C, C], rms_ffn [L, C], w1 [L, F, C], w2 [L, C, F], w3 [L, F, C],
// rms_final [C], freq_cis_real and freq_cis_imag [seq_len, hs/2] each (unused:
// RoPE is recomputed), then wcls [V, C] when untied.
//
// Version 1 (export.py version1_export): uint32 magic 0x616b3432 ("ak42"),
// int32 version = 1, the seven int32 (vocab_size positive), uint8
// shared_classifier, zeros up to 256 bytes; then rms_att [L, C], rms_ffn
// [L, C], rms_final [C], tok_embeddings [V, C], wq, wk, wv, wo, w1, w2, w3 (as
// above), then output [V, C] when not shared. Version 2 (int8 Q8_0) is refused.
//
// Mapping: w1 -> mlp.gate_proj, w3 -> mlp.up_proj, w2 -> mlp.down_proj.
// RoPE: llama2.c rotates interleaved pairs (2i, 2i+1) of each head, HF rotates
// halves (i, i + hs/2), both at frequency theta^(-2i/hs). wq and wk rows are
// permuted at import as HF's convert_llama_weights_to_hf (and llama2.c's own
// hf_export) do: HF row h*hs + s*(hs/2) + i = llama2.c row h*hs + 2*i + s,
// s in {0, 1}, i < hs/2. Attention scores, hence outputs, are unchanged.
// The files hold no norm eps or RoPE theta: llama2.c's 1e-5 and 10000 apply.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/llama_weights.h"
#include "checkpoint/mapped_file.h"

namespace po::checkpoint {

constexpr uint32_t kLlama2cMagic = 0x616b3432;
constexpr size_t kLlama2cV1HeaderBytes = 256;
constexpr double kLlama2cNormEps = 1e-5;
constexpr double kLlama2cRopeTheta = 10000.0;

struct Llama2cHeader {
  int version = 0;  // 0 = legacy
  int32_t dim = 0, hidden_dim = 0, n_layers = 0, n_heads = 0, n_kv_heads = 0;
  int32_t vocab_size = 0;  // absolute value
  int32_t seq_len = 0;
  bool shared_classifier = true;
  size_t header_bytes = 0;  // 28 (legacy) or 256
};

// Parses and checks the header of a file image of `size` bytes: the header
// itself (non-positive sizes, dim % n_heads, n_heads % n_kv_heads, odd head
// size, overflowing sizes) and that `size` is exactly what it implies.
// InvalidArgument "ORIGIN: ..." on any failure; a short file says how many bytes
// were expected and how many it has.
Llama2cHeader llama2c_parse_header(const void* data, size_t size, const std::string& origin);

// Exact file size in bytes the header implies.
uint64_t llama2c_file_bytes(const Llama2cHeader& h);

// The shape of a llama2.c model in HF terms (eps 1e-5, theta 10000).
LlamaShape llama2c_shape(const Llama2cHeader& h);

class Llama2cReader final : public LlamaReader {
 public:
  // Maps and checks `path`. IoError when it cannot be read.
  static std::unique_ptr<Llama2cReader> open(const std::string& path,
                                             const LlamaOverrides& overrides = {});
  // An in-memory image (tests, fuzzing); NOT copied: it must outlive the reader.
  static std::unique_ptr<Llama2cReader> from_bytes(const void* data, size_t size,
                                                   const std::string& origin,
                                                   const LlamaOverrides& overrides = {});
  const Llama2cHeader& header() const { return header_; }
  void read(const std::string& name, float* dst) const override;
  using LlamaReader::read;

 private:
  struct Slot {
    uint64_t offset = 0;  // bytes from the file start
    int64_t rope_heads = 0;  // > 0: wq/wk, rows permuted per head
  };
  Llama2cReader(const std::string& origin, const Llama2cHeader& h);
  void init(const std::byte* data, size_t size, const LlamaOverrides& overrides);

  MappedFile file_;
  const std::byte* data_ = nullptr;
  Llama2cHeader header_;
  std::map<std::string, Slot> slots_;
};

std::unique_ptr<LlamaReader> open_llama2c(const std::string& path,
                                          const LlamaOverrides& overrides = {});

}  // namespace po::checkpoint
