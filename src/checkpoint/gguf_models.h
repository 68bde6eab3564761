// Models and tokenizers in GGUF files, as llama.cpp's converters write them
// (convert_hf_to_gguf.py; names from gguf-py's tensor map):
//
//   Llama (general.architecture "llama": Llama-2/3, Mistral-style GQA)
//     token_embd.weight         model.embed_tokens.weight
//     blk.N.attn_norm.weight    model.layers.N.input_layernorm.weight
//     blk.N.attn_{q,k,v}.weight model.layers.N.self_attn.{q,k,v}_proj.weight
//     blk.N.attn_output.weight  model.layers.N.self_attn.o_proj.weight
//     blk.N.ffn_norm.weight     model.layers.N.post_attention_layernorm.weight
//     blk.N.ffn_{gate,up,down}.weight  model.layers.N.mlp.{gate,up,down}_proj.weight
//     output_norm.weight        model.norm.weight
//     output.weight             lm_head.weight (absent: tied)
//   rope_freqs.weight           Llama-3.1's RoPE scaling (recognised, written)
//   q and k rows are stored in Meta's interleaved RoPE order (the converter
//   permutes Hugging Face's); the reader undoes it, so values come out in HF's
//   order, as every LlamaReader gives them. Shape keys: llama.embedding_length,
//   .feed_forward_length, .block_count, .context_length, .attention.head_count,
//   .attention.head_count_kv, .attention.layer_norm_rms_epsilon, .rope.freq_base.
//
//   GPT-2 (general.architecture "gpt2")
//     token_embd, position_embd, blk.N.attn_norm, blk.N.attn_qkv,
//     blk.N.attn_output, blk.N.ffn_norm, blk.N.ffn_up, blk.N.ffn_down,
//     output_norm (weight and bias each); output.weight, the converter's copy
//     of token_embd, is not read (GPT-2 ties them). Linear weights are [out, in]
//     (the converter transposes Hugging Face's Conv1D), the engine's layout.
//
// Every tensor may be F32, F16, BF16, Q8_0, Q4_0, Q4_K or Q6_K; it is decoded
// to f32 as it is read (backend/block_formats.h). The readers and tokenizers
// are gguf_models.cc (no model layer: the fuzzer links them); GPT-2's loader
// and the writer gguf_model_io.cc.
#pragma once

#include <memory>
#include <set>
#include <string>

#include "backend/block_formats.h"
#include "checkpoint/gguf.h"
#include "checkpoint/llama_weights.h"
#include "data/text_tokenizer.h"
#include "model/transformer.h"

namespace po::checkpoint {

// A Llama GGUF file as a LlamaReader (format kGguf), the overrides checked
// against its metadata as for the other formats.
std::unique_ptr<LlamaReader> open_gguf_llama(const std::string& path, const LlamaOverrides& overrides = {});
std::unique_ptr<LlamaReader> open_gguf_llama(GgufFile file, const LlamaOverrides& overrides = {});

// general.architecture of the file ("llama", "gpt2", ...).
std::string gguf_architecture(const GgufFile& f);

// A GPT-2 GGUF file's shapes; and its weights into `model` (whole, of that
// shape). Errors name the file and the tensor or key.
model::TransformerConfig gguf_gpt2_config(const GgufFile& f);
void load_gpt2_gguf(const GgufFile& f, model::Transformer& model);

// The tokenizer in the file's tokenizer.ggml.* keys: "llama" (SentencePiece
// BPE: tokens, scores, token_type, bos/eos ids, add_space_prefix) or "gpt2"
// (GPT-2's byte-level BPE: tokens and merges; only GPT-2's own pre-tokenizer,
// tokenizer.ggml.pre absent or "gpt-2"). InvalidArgument naming the file and
// key when it has none or another kind.
std::unique_ptr<data::TextTokenizer> gguf_tokenizer(const GgufFile& f);

// tokenizer.ggml.* keys for `tok` (Llama: pieces, scores, types; GPT-2:
// tokens, merges), so llama.cpp can run the file without other files. A
// model's padded vocabulary (vocab_size > the tokenizer's) gets the unused
// tokens "[PAD<id>]" llama.cpp's converter adds, so the counts agree.
GgufMetadata gguf_tokenizer_keys(const data::TextTokenizer& tok, int64_t vocab_size);

// Writes `model` (whole, GPT-2 or Llama) as a GGUF file llama.cpp loads:
// the metadata of its architecture, `tokenizer` keys (gguf_tokenizer_keys),
// 2-D weights in `type` where their rows are whole blocks of it (else F32) and
// norms and biases in F32, as llama.cpp's converter does. q and k rows are
// permuted to Meta's order. Reads back (open_gguf_llama, load_gpt2_gguf) to the
// same values when `type` is F32.
void write_gguf_model(const std::string& path, const model::Transformer& model, backend::GgmlType type,
                      const GgufMetadata& tokenizer, const std::string& name);

namespace detail {

// The per-frequency divisors of Llama-3.1's RoPE scaling for a head of
// `head_dim`, as llama.cpp's converter computes rope_freqs.weight from
// config.json's rope_scaling: 1 for wavelengths under
// original/high_freq_factor, `factor` over original/low_freq_factor, and
// 1 / ((1 − smooth)/factor + smooth) between.
std::vector<double> llama3_rope_factors(const RopeScaling& r, double theta, int64_t head_dim);

// Hugging Face name -> GGUF name ("" when the architecture has no such tensor).
std::string llama_gguf_name(const std::string& hf);
std::string gpt2_gguf_name(const std::string& hf);
// The GGUF tensor `gguf` standing for `hf`, of numpy shape `shape`; an error
// naming both when it is missing or shaped otherwise.
const GgufTensorInfo& expect_tensor(const GgufFile& f, const std::string& gguf, const std::string& hf,
                                    const tensor::Shape& shape);
// Every tensor of the file is one in `read`: a tensor the reader does not know
// would otherwise be dropped silently.
void no_other_tensors(const GgufFile& f, const std::set<std::string>& read, const std::string& arch);

}  // namespace detail
}  // namespace po::checkpoint
