// The tokenizer interface the engine holds (prepare, generate): text -> ids ->
// text, the vocabulary size and the special ids a document boundary uses.
// Implemented by GPT-2's byte-level BPE (data/tokenizer.h) and Llama-2's
// SentencePiece BPE (data/llama_tokenizer.h); load_tokenizer() picks one by file.
//
// Invariants every implementation keeps: encode() adds no special token (the
// caller places BOS/EOS, see bos_id()/eos_id()); every id encode() returns is in
// [0, vocab_size()); decode(encode(x)) == x for valid UTF-8 x (Llama: unless x
// contains "▁" U+2581, which the normaliser cannot tell from a space).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace po::data {

class TextTokenizer {
 public:
  virtual ~TextTokenizer() = default;

  // Token ids of `text`, without special tokens; special-token text such as
  // "<s>" or "<|endoftext|>" is ordinary text. Invalid UTF-8 throws
  // InvalidArgument naming `source` and the byte offset. Not thread-safe.
  virtual std::vector<int32_t> encode(std::string_view text, std::string_view source = "<text>") = 0;
  // Token ids of `text` as it continues ids already encoded (SFT's chat
  // pieces, data/chat_format.h): Llama's dummy prefix is left out, so
  // "[INST] hi [/INST]" then " hello" give "▁hello", not "▁▁hello". GPT-2's
  // byte-level BPE has none: encode().
  virtual std::vector<int32_t> encode_continuation(std::string_view text,
                                                   std::string_view source = "<text>") {
    return encode(text, source);
  }
  // Text of `ids` (bytes; may end in an incomplete UTF-8 sequence if the ids
  // do). Throws InvalidArgument for an id outside [0, vocab_size()).
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  // Bytes one token stands for when it is not the first of a text (Llama: "▁"
  // as a space, a byte token as its byte, specials empty), for streaming output.
  virtual std::string piece_bytes(int32_t id) const = 0;

  virtual int32_t vocab_size() const = 0;
  // The id that starts each document (Llama: <s> = 1); none for GPT-2.
  virtual std::optional<int32_t> bos_id() const = 0;
  // The end-of-text id (GPT-2: <|endoftext|> = 50256, also its document
  // separator; Llama: </s> = 2).
  virtual int32_t eos_id() const = 0;
  // "gpt2" or "llama", for messages.
  virtual std::string_view kind() const = 0;

 protected:
  TextTokenizer() = default;
  TextTokenizer(const TextTokenizer&) = default;
  TextTokenizer(TextTokenizer&&) = default;
  TextTokenizer& operator=(const TextTokenizer&) = default;
  TextTokenizer& operator=(TextTokenizer&&) = default;
};

// Loads the tokenizer `path` names:
//   ""                               GPT-2, found as find_tokenizer_files("") does
//   a file *.json                    a Hugging Face tokenizer.json (Llama-2 layout),
//                                    except encoder.json: GPT-2, with vocab.bpe beside it
//   a file *.bin                     a llama2.c tokenizer.bin
//   vocab.bpe                        GPT-2, with encoder.json beside it
//   a directory                      its tokenizer.json, else its tokenizer.bin, else
//                                    GPT-2's files in it (see find_tokenizer_files)
// Throws InvalidArgument (a missing path, an unknown kind of file, a malformed
// file: one line naming the file and what is wrong) or IoError (unreadable).
std::unique_ptr<TextTokenizer> load_tokenizer(const std::string& path = "");

}  // namespace po::data
