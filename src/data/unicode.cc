// Strict UTF-8 (RFC 3629) decoding and table-driven character classes.
#include "data/unicode.h"

#include <algorithm>
#include <array>

namespace po::data {
namespace {

bool in_ranges(const detail::CodeRange* ranges, size_t n, char32_t cp) {
  const detail::CodeRange* end = ranges + n;
  // First range whose last >= cp.
  const detail::CodeRange* it =
      std::lower_bound(ranges, end, cp, [](const detail::CodeRange& r, char32_t c) { return r.last < c; });
  return it != end && it->first <= cp;
}

CharClass classify_slow(char32_t cp) {
  if (in_ranges(detail::kLetterRanges, detail::kLetterRangeCount, cp)) return CharClass::kLetter;
  if (in_ranges(detail::kNumberRanges, detail::kNumberRangeCount, cp)) return CharClass::kNumber;
  if (in_ranges(detail::kSpaceRanges, detail::kSpaceRangeCount, cp)) return CharClass::kSpace;
  return CharClass::kOther;
}

// Latin-1 is by far the common case: answer it from a table.
const std::array<CharClass, 256>& latin1_table() {
  static const std::array<CharClass, 256> table = [] {
    std::array<CharClass, 256> t{};
    for (char32_t c = 0; c < 256; ++c) t[c] = classify_slow(c);
    return t;
  }();
  return table;
}

}  // namespace

CharClass char_class(char32_t cp) {
  if (cp < 256) return latin1_table()[cp];
  return classify_slow(cp);
}

bool utf8_decode(std::string_view s, size_t pos, char32_t* cp, int* len) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + pos;
  size_t avail = s.size() - pos;
  unsigned char b0 = p[0];
  if (b0 < 0x80) {
    *cp = b0;
    *len = 1;
    return true;
  }
  int n;
  char32_t c, min;
  if ((b0 & 0xE0) == 0xC0) {
    n = 2, c = b0 & 0x1F, min = 0x80;
  } else if ((b0 & 0xF0) == 0xE0) {
    n = 3, c = b0 & 0x0F, min = 0x800;
  } else if ((b0 & 0xF8) == 0xF0) {
    n = 4, c = b0 & 0x07, min = 0x10000;
  } else {
    return false;  // continuation byte or 0xF8..0xFF as a lead
  }
  if (avail < static_cast<size_t>(n)) return false;
  for (int i = 1; i < n; ++i) {
    if ((p[i] & 0xC0) != 0x80) return false;
    c = (c << 6) | (p[i] & 0x3F);
  }
  if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) return false;
  *cp = c;
  *len = n;
  return true;
}

size_t utf8_find_invalid(std::string_view s) {
  size_t pos = 0;
  while (pos < s.size()) {
    if (static_cast<unsigned char>(s[pos]) < 0x80) {
      ++pos;
      continue;
    }
    char32_t cp;
    int len;
    if (!utf8_decode(s, pos, &cp, &len)) return pos;
    pos += len;
  }
  return s.size();
}

}  // namespace po::data
