// Streaming text out of tokens, the way clients need it:
//   - never half a UTF-8 character: a character whose bytes are split over
//     tokens is released when its last byte arrives;
//   - stop sequences matched on the text, across token boundaries: text that
//     could still become a stop sequence is held back (never streamed and
//     then taken back), and a matched stop sequence is not released at all.
// The text is the tokenizer's decode() of all the tokens so far, so what is
// streamed adds up to what `pagedoptim generate` prints.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/text_tokenizer.h"

namespace po::serve {

// The length of the longest prefix of `s` that does not end inside a UTF-8
// character (an invalid byte counts as a whole character).
size_t complete_utf8_prefix(const std::string& s);

class TextStream {
 public:
  TextStream(const data::TextTokenizer& tokenizer, std::vector<std::string> stop);

  // Adds a token; returns the text it releases (maybe empty).
  std::string push(int32_t id);
  // Whether a stop sequence matched (nothing after it is released).
  bool stopped() const { return stopped_; }
  // At the end (no stop matched): the held-back text, whole characters only.
  std::string flush();
  // Everything released so far.
  const std::string& released() const { return released_; }

 private:
  const data::TextTokenizer& tok_;
  std::vector<std::string> stop_;
  std::vector<int32_t> ids_;
  std::string released_;
  bool stopped_ = false;
};

}  // namespace po::serve
