#include "serve/detokenize.h"

#include <algorithm>

namespace po::serve {

size_t complete_utf8_prefix(const std::string& s) {
  // Look back at most 3 bytes for the lead byte of the last character.
  const size_t n = s.size();
  for (size_t back = 1; back <= std::min<size_t>(4, n); ++back) {
    const auto c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: keep looking
    const size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
    return back < len ? n - back : n;
  }
  return n;  // only continuation bytes: invalid, released as they are
}

TextStream::TextStream(const data::TextTokenizer& tokenizer, std::vector<std::string> stop)
    : tok_(tokenizer), stop_(std::move(stop)) {
  std::erase_if(stop_, [](const std::string& s) { return s.empty(); });
}

std::string TextStream::push(int32_t id) {
  if (stopped_) return {};
  ids_.push_back(id);
  const std::string all = tok_.decode(ids_);
  std::string text = all.substr(0, complete_utf8_prefix(all));
  // A stop sequence anywhere in the text not yet released (or straddling
  // its start): cut there.
  size_t cut = std::string::npos;
  for (const std::string& s : stop_) {
    const size_t from = released_.size() >= s.size() ? released_.size() - s.size() + 1 : 0;
    const size_t at = text.find(s, from);
    if (at != std::string::npos) cut = std::min(cut, at);
  }
  if (cut != std::string::npos) {
    stopped_ = true;
    text.resize(std::max(cut, released_.size()));
  } else {
    // Hold back the longest tail that is a proper prefix of a stop sequence.
    size_t hold = 0;
    for (const std::string& s : stop_)
      for (size_t k = std::min(s.size() - 1, text.size()); k > hold; --k)
        if (text.compare(text.size() - k, k, s, 0, k) == 0) {
          hold = k;
          break;
        }
    text.resize(std::max(text.size() - hold, released_.size()));
  }
  std::string out = text.substr(released_.size());
  released_ = std::move(text);
  return out;
}

std::string TextStream::flush() {
  if (stopped_) return {};
  const std::string all = tok_.decode(ids_);
  const std::string text = all.substr(0, complete_utf8_prefix(all));
  if (text.size() <= released_.size()) return {};
  std::string out = text.substr(released_.size());
  released_ = text;
  return out;
}

}  // namespace po::serve
