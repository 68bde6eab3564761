// Unicode support for the GPT-2 pretokeniser: strict UTF-8 decoding and the
// character classes of the reference regex (JS \p{L}, \p{N}, \s). The class
// tables (unicode_tables.cc) are generated from node itself, so classification
// agrees with the reference tokenizer code point for code point.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace po::data {

// What the pretokenisation pattern distinguishes.
enum class CharClass : uint8_t { kLetter, kNumber, kSpace, kOther };

// Class of one code point (any value; out-of-range values are kOther).
CharClass char_class(char32_t cp);

// Decodes one UTF-8 sequence at s[pos]. On success stores the code point and
// its length in bytes (1..4) and returns true; returns false for a malformed,
// overlong, surrogate or out-of-range sequence, or one cut off by the end.
bool utf8_decode(std::string_view s, size_t pos, char32_t* cp, int* len);

// Byte offset of the first invalid UTF-8 sequence in s, or s.size() if valid.
size_t utf8_find_invalid(std::string_view s);

namespace detail {
struct CodeRange {
  char32_t first, last;  // inclusive
};
extern const CodeRange kLetterRanges[];
extern const size_t kLetterRangeCount;
extern const CodeRange kNumberRanges[];
extern const size_t kNumberRangeCount;
extern const CodeRange kSpaceRanges[];
extern const size_t kSpaceRangeCount;
}  // namespace detail

}  // namespace po::data
