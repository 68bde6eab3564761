// Helpers shared by the data-layer tests: a scratch directory removed at the
// end of the test, and whole-file read/write.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "../test_util.h"

namespace po::data::testing {

// The suite's scratch directory and file helpers (tests/test_util.h).
using ScratchDir = po::test::TempDir;
using po::test::read_file;
using po::test::write_file;

inline std::string escaped(const std::string& s, size_t max_chars = 400) {
  std::string out;
  for (unsigned char c : s.substr(0, max_chars)) {
    if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '\r') out += "\\r";
    else if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else out += static_cast<char>(c);
  }
  if (s.size() > max_chars) out += "...";
  return out;
}

// The varied text set of the tokenizer tests: English, whitespace runs,
// digits, punctuation, accents, CJK, emoji, contractions, and pairs that hit
// the GPT-2 reference's comma-key quirk.
inline std::vector<std::string> varied_texts() {
  return {
      "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times; "
      "it was the age of wisdom, it was the age of foolishness.\n",
      "   leading spaces and trailing spaces   ",
      "tabs\tand\t\ttabs\n\nnewlines\r\n  \n mixed \t \n",
      "multiple     spaces between   words     \n\n\n",
      "  a", " ", "\n", "   ", "\t\ta", "a \tb", "a\t b", "", "x\n\n  y\n \n",
      "123 4567890123456789 3.14159 1,000,000 0x1F 2024-05-20 ½ ² ٣٤٥ Ⅻ 1st 22nd 3rd4th",
      "12345678901234567890123456789012345678901234567890123456789012345678901234567890",
      "Hello!!! What?!... (nested [brackets] {braces}) --- \"double\" @#$%^&*_+=~`|\\<>/ ,,, ;;; ...",
      "café naïve résumé Ñandú über Straße Ångström ćevapi CAFÉ e\u0301 a\u0308 ñ ü é",
      "日本語のテキスト、中文文本。한국어 텍스트 ひらがな カタカナ",
      "I \u2764\ufe0f \U0001F355! \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 family "
      "\U0001F3F3\ufe0f\u200d\U0001F308 flag \U0001F44D\U0001F3FD thumbs \U0001F600\U0001F600",
      "it's don't they're we've I'm you'll he'd IT'S DON'T THEY'RE 'S 'T 'Re 'll'd 's't ' s '' x'sy",
      "a\u00a0b\u2003c\u3000d\u2028e\ufeff f\u000b g\u000c h \u0085 i\u200bj \u1680k \u205fl",
      "\"quoted\", 'single' ``brown'' -- dash — em – en … ellipsis «guillemets» ¿qué? ¡sí!",
      "int main() {\n    return 0;\n}\n\tfor (int i = 0; i < n; ++i) x[i] += y[i];  // comment\n",
      "mixed: snake_case CamelCase _under_ a1b2 5g6 x2 <|endoftext|> end \u00e9\u00e9\u00e9123abc",
      "Ελληνικά кириллица עברית العربية हिन्दी ไทย",
      "',\" \"],\" \"}, '\" \",\"\" ],[ \",\",\",\" ,,\"",  // pairs that hit the reference's comma-key quirk
  };
}

}  // namespace po::data::testing
