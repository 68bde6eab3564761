// Llama-2's SentencePiece BPE tokenizer, read from a Hugging Face
// tokenizer.json, a llama2.c tokenizer.bin or a SentencePiece tokenizer.model;
// all give the same ids for the Llama-2 vocabulary (tests/data/
// llama_tokenizer_test.cc checks the first two against the npm package
// llama-tokenizer-js, and a model spm_train makes on Brown against Debian's
// libsentencepiece, spm_encode).
//
// Encoding: the dummy prefix ("▁" before the text; not for an empty text),
// every space -> "▁" (no other normalisation: Llama-2's model uses "identity"),
// one symbol per code point, a code point that is not a piece becomes its UTF-8
// bytes as <0xNN> tokens (byte fallback), then the best adjacent pair is merged
// until none is left, ties to the leftmost. "Best" is the lowest merge rank of a
// tokenizer.json, the highest score of the merged piece in a tokenizer.bin
// (llama2.c's rule, SentencePiece's scores). Pieces that are specials (<unk>,
// <s>, </s>) or byte tokens are never the result of a merge.
// Decoding: byte tokens are raw bytes, "▁" is a space, specials are empty, and
// one leading space is stripped (the dummy prefix), as HF's decoder does.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "data/text_tokenizer.h"

namespace po::data {

class LlamaTokenizer final : public TextTokenizer {
 public:
  static constexpr int32_t kUnk = 0;  // Llama-2's ids; the files' own ids are used
  static constexpr int32_t kBos = 1;
  static constexpr int32_t kEos = 2;

  // Reads a Hugging Face tokenizer.json: model.type "BPE" with byte_fallback,
  // vocab {piece: id} dense in [0, N), merges ["a b", ...] or [["a", "b"], ...];
  // the dummy prefix from a normalizer Prepend "▁" or a Metaspace pre_tokenizer.
  // Throws InvalidArgument naming `path` and what is wrong (bad JSON, another
  // model type or layout, an id out of range, a merge of unknown pieces, a
  // missing <0xNN> piece or <s>/</s>), IoError if it cannot be read.
  static LlamaTokenizer from_hf_json(const std::string& path);
  // Reads a llama2.c tokenizer.bin: int32 max_token_length, then per piece
  // float32 score, int32 length, the bytes, until end of file (piece i has id i;
  // " " stands for "▁"; ids 1 and 2 are <s> and </s>). Throws InvalidArgument
  // naming `path` for a truncated file, a length < 0 or > max_token_length, a NaN
  // score, a duplicate or missing piece; IoError if it cannot be read.
  static LlamaTokenizer from_llama2c_bin(const std::string& path);
  // Reads a SentencePiece tokenizer.model (data/sentencepiece_model.h): a BPE
  // model with byte fallback and identity normalisation (Llama's; the dummy
  // prefix and remove_extra_whitespaces as the model says), pieces by id,
  // merges by score as in a tokenizer.bin, control, unknown and unused pieces
  // never the result of a merge, <s> and </s> where the model has them.
  // Throws InvalidArgument naming `path` for a malformed file, a unigram or
  // other non-BPE model, no byte fallback, a normaliser with a character map
  // (nmt_nfkc), user-defined pieces or a missing </s>.
  static LlamaTokenizer from_sentencepiece(const std::string& path);
  // The pieces of a GGUF file's tokenizer.ggml.* keys (llama.cpp's "llama"
  // model: SentencePiece BPE), by id, with their scores and token types
  // (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte), merged
  // by score as a tokenizer.model is. `origin` names the file in errors:
  // unequal lengths, a user-defined piece, a missing byte piece, a bos or eos
  // id outside the vocabulary.
  static LlamaTokenizer from_pieces(const std::string& origin, std::vector<std::string> pieces,
                                    const std::vector<float>& scores, const std::vector<int32_t>& types,
                                    std::optional<int32_t> bos, int32_t eos, bool dummy_prefix);

  ~LlamaTokenizer() override;
  LlamaTokenizer(LlamaTokenizer&&) noexcept;
  LlamaTokenizer& operator=(LlamaTokenizer&&) noexcept;

  std::vector<int32_t> encode(std::string_view text, std::string_view source = "<text>") override;
  std::vector<int32_t> encode_continuation(std::string_view text, std::string_view source = "<text>") override;
  std::string decode(std::span<const int32_t> ids) const override;
  std::string piece_bytes(int32_t id) const override;
  int32_t vocab_size() const override;
  std::optional<int32_t> bos_id() const override;
  int32_t eos_id() const override;
  std::string_view kind() const override { return "llama"; }

  // The SentencePiece piece of `id` ("▁the", "<0x0A>", "<s>").
  const std::string& piece(int32_t id) const;
  // Id of a piece, if it is one.
  std::optional<int32_t> piece_id(std::string_view piece) const;
  // Number of pairs that can merge.
  size_t merge_count() const;
  // Each piece's SentencePiece score, by id: the file's scores, or for a
  // tokenizer.json (merge ranks) minus the best rank that makes the piece
  // (-1e9 for pieces no merge makes), which merges in the same order. For GGUF.
  std::vector<float> piece_scores() const;
  // GGUF's token type of `id`: 1 normal, 2 unknown (<unk>), 3 control, 6 byte.
  int32_t piece_type(int32_t id) const;
  // Whether encode() puts "▁" before the text.
  bool dummy_prefix() const;

  struct Impl;  // the vocabulary and merge table; opaque outside llama_tokenizer.cc

 private:
  explicit LlamaTokenizer(std::unique_ptr<Impl> impl);
  std::vector<int32_t> encode_with(std::string_view text, std::string_view source, bool dummy_prefix);
  std::unique_ptr<Impl> impl_;
};

}  // namespace po::data
