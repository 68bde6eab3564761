// Llama-2 SentencePiece BPE: see llama_tokenizer.h. Both file formats are read
// into one table of pairs (left id, right id) -> (priority, merged id), lower
// priority first: a tokenizer.json's merge rank, or minus a tokenizer.bin's
// score of the merged piece. Encoding is then one algorithm for both.
#include "data/llama_tokenizer.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <queue>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/sentencepiece_model.h"
#include "data/unicode.h"

namespace po::data {
namespace {

constexpr std::string_view kSpacePiece = "\xE2\x96\x81";  // U+2581 "▁"

std::string read_binary_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) PO_THROW(core::IoError, "cannot open tokenizer file ", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) PO_THROW(core::IoError, "cannot read tokenizer file ", path);
  return ss.str();
}

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

std::string byte_piece(int b) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "<0x%02X>", b);
  return buf;
}

std::string replace_all(std::string_view s, std::string_view from, std::string_view to) {
  std::string out;
  for (size_t pos = 0;;) {
    size_t hit = s.find(from, pos);
    out.append(s.substr(pos, hit == std::string_view::npos ? std::string_view::npos : hit - pos));
    if (hit == std::string_view::npos) return out;
    out.append(to);
    pos = hit + from.size();
  }
}

enum class PieceKind : uint8_t { kNormal, kSpecial, kByte };

struct Merge {
  double priority;  // lower merges first
  int32_t result;
};

}  // namespace

struct LlamaTokenizer::Impl {
  std::string path;
  std::vector<std::string> pieces;
  std::vector<PieceKind> kinds;
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> ids;
  std::array<int32_t, 256> byte_ids{};
  std::unordered_map<uint64_t, Merge> merges;
  int32_t bos = kBos, eos = kEos;
  bool dummy_prefix = true;
  bool squeeze_spaces = false;  // SentencePiece's remove_extra_whitespaces

  // Fills ids, kinds and byte_ids from pieces; `specials` are the ids that are
  // not text. Throws naming the file for a duplicate piece or a missing byte.
  void index(const std::vector<int32_t>& specials) {
    const auto n = static_cast<int32_t>(pieces.size());
    ids.reserve(pieces.size());
    kinds.assign(pieces.size(), PieceKind::kNormal);
    for (int32_t id = 0; id < n; ++id) {
      auto [it, fresh] = ids.emplace(pieces[id], id);
      PO_CHECK(fresh, path, ": piece '", pieces[id], "' appears twice (ids ", it->second, " and ", id, ")");
    }
    for (int32_t id : specials) kinds[id] = PieceKind::kSpecial;
    for (int b = 0; b < 256; ++b) {
      auto it = ids.find(byte_piece(b));
      PO_CHECK(it != ids.end(), path, ": no byte piece ", byte_piece(b), " (byte fallback needs all 256)");
      byte_ids[b] = it->second;
      kinds[it->second] = PieceKind::kByte;
    }
  }

  std::optional<int32_t> normal_id(std::string_view piece) const {
    auto it = ids.find(piece);
    if (it == ids.end() || kinds[it->second] != PieceKind::kNormal) return std::nullopt;
    return it->second;
  }
};

namespace {

// ---- tokenizer.json -------------------------------------------------------

using nlohmann::json;

const json& member(const json& j, const char* key, const std::string& where, const std::string& path) {
  PO_CHECK(j.is_object() && j.contains(key), path, ": ", where, " has no \"", key, "\"");
  return j.at(key);
}

// Whether the HF normaliser / pre-tokeniser add the dummy prefix; throws for a
// layout this tokenizer does not implement.
bool hf_dummy_prefix(const json& root, const std::string& path) {
  bool prefix = false;
  const json* norm = root.contains("normalizer") ? &root["normalizer"] : nullptr;
  if (norm != nullptr && !norm->is_null()) {
    std::vector<json> steps = norm->value("type", "") == "Sequence" ? norm->value("normalizers", std::vector<json>{})
                                                                     : std::vector<json>{*norm};
    for (const json& s : steps) {
      const std::string type = s.value("type", "");
      const bool prepend = type == "Prepend" && s.value("prepend", "") == kSpacePiece;
      const bool spaces = type == "Replace" && s.contains("pattern") && s["pattern"].value("String", "") == " " &&
                          s.value("content", "") == kSpacePiece;  // what encode() always does
      PO_CHECK(prepend || spaces, path, ": normalizer step '", s.dump(),
               "' is not Llama-2's (Prepend \"\xE2\x96\x81\", Replace \" \" -> \"\xE2\x96\x81\")");
      prefix = prefix || prepend;
    }
  }
  const json* pre = root.contains("pre_tokenizer") ? &root["pre_tokenizer"] : nullptr;
  if (pre != nullptr && !pre->is_null()) {
    // The newer HF layout: no normaliser, Metaspace("▁", prepend_scheme first, split false).
    PO_CHECK(pre->value("type", "") == "Metaspace" && pre->value("replacement", "") == kSpacePiece &&
                 !pre->value("split", true),
             path, ": pre_tokenizer '", pre->dump(), "' is not supported (expected null or Metaspace without split)");
    const std::string scheme = pre->value("prepend_scheme", pre->value("add_prefix_space", true) ? "always" : "never");
    prefix = scheme != "never";
  }
  return prefix;
}

void hf_read_merges(LlamaTokenizer::Impl& m, const json& merges, const std::string& path) {
  PO_CHECK(merges.is_array(), path, ": model.merges is not an array");
  m.merges.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const json& e = merges[rank];
    std::string a, b;
    if (e.is_string()) {
      const std::string s = e.get<std::string>();
      const size_t sp = s.find(' ');
      PO_CHECK(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos, path, ": model.merges[", rank,
               "] '", s, "' is not two pieces separated by one space");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else {
      PO_CHECK(e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string(), path, ": model.merges[",
               rank, "] is neither \"a b\" nor [\"a\", \"b\"]");
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    }
    auto ia = m.ids.find(a), ib = m.ids.find(b);
    PO_CHECK(ia != m.ids.end() && ib != m.ids.end(), path, ": model.merges[", rank, "] '", a, " ", b,
             "' names a piece that is not in the vocab");
    std::optional<int32_t> result = m.normal_id(a + b);
    PO_CHECK(result.has_value(), path, ": model.merges[", rank, "] '", a, " ", b, "' makes '", a + b,
             "', which is not an ordinary piece of the vocab");
    m.merges.emplace(pair_key(ia->second, ib->second), Merge{static_cast<double>(rank), *result});
  }
}

std::unique_ptr<LlamaTokenizer::Impl> parse_hf_json(const std::string& path) {
  auto m = std::make_unique<LlamaTokenizer::Impl>();
  m->path = path;
  json root;
  try {
    root = json::parse(read_binary_file(path));
  } catch (const json::exception& e) {
    PO_THROW(core::InvalidArgument, path, ": not valid JSON: ", e.what());
  }
  try {
    const json& model = member(root, "model", "the file", path);
    const std::string type = model.value("type", "");
    PO_CHECK(type == "BPE", path, ": model.type is '", type,
             "', expected 'BPE' (a SentencePiece BPE tokenizer such as Llama-2's)");
    PO_CHECK(model.value("byte_fallback", false), path,
             ": model.byte_fallback is not true (a byte-level BPE such as GPT-2's is read from encoder.json and "
             "vocab.bpe, not tokenizer.json)");
    const json& vocab = member(model, "vocab", "model", path);
    PO_CHECK(vocab.is_object() && !vocab.empty(), path, ": model.vocab is not a non-empty {piece: id} object");
    const auto n = static_cast<int64_t>(vocab.size());
    m->pieces.assign(static_cast<size_t>(n), std::string());
    std::vector<bool> seen(static_cast<size_t>(n), false);
    for (const auto& [piece, id_json] : vocab.items()) {
      PO_CHECK(id_json.is_number_integer(), path, ": model.vocab: the id of piece '", piece, "' is not an integer");
      const int64_t id = id_json.get<int64_t>();
      PO_CHECK(id >= 0 && id < n, path, ": model.vocab: id ", id, " of piece '", piece, "' is out of range [0, ", n,
               ")");
      PO_CHECK(!seen[id], path, ": model.vocab: id ", id, " is given to two pieces");
      seen[id] = true;
      m->pieces[id] = piece;
    }
    std::vector<int32_t> specials;
    if (root.contains("added_tokens")) {
      for (const json& t : root["added_tokens"]) {
        const int64_t id = t.value("id", int64_t{-1});
        PO_CHECK(id >= 0 && id < n, path, ": added_tokens: id ", id, " of '", t.value("content", ""),
                 "' is out of range [0, ", n, ")");
        PO_CHECK(m->pieces[id] == t.value("content", ""), path, ": added_tokens: id ", id, " is '",
                 t.value("content", ""), "' but the vocab has '", m->pieces[id], "'");
        specials.push_back(static_cast<int32_t>(id));
      }
    }
    for (const char* s : {"<unk>", "<s>", "</s>"}) {
      auto it = vocab.find(s);
      PO_CHECK(it != vocab.end(), path, ": model.vocab has no '", s, "'");
      specials.push_back(it->get<int32_t>());
    }
    m->bos = vocab["<s>"].get<int32_t>();
    m->eos = vocab["</s>"].get<int32_t>();
    m->index(specials);
    hf_read_merges(*m, member(model, "merges", "model", path), path);
    m->dummy_prefix = hf_dummy_prefix(root, path);
  } catch (const json::exception& e) {
    PO_THROW(core::InvalidArgument, path, ": unexpected tokenizer.json layout: ", e.what());
  }
  return m;
}

// ---- tokenizer.bin --------------------------------------------------------

// Every split of a normal piece into two normal pieces is a merge that makes
// it, priority -score: llama2.c merges any adjacent pair whose concatenation
// is a piece, best score first, as SentencePiece's BPE encoder does.
void add_score_merges(LlamaTokenizer::Impl& m, const std::vector<float>& scores) {
  const auto n = static_cast<int32_t>(m.pieces.size());
  for (int32_t id = 0; id < n; ++id) {
    if (m.kinds[id] != PieceKind::kNormal) continue;
    const std::string& p = m.pieces[id];
    for (size_t k = 1; k < p.size(); ++k) {
      if ((static_cast<unsigned char>(p[k]) & 0xC0) == 0x80) continue;  // inside a code point
      std::optional<int32_t> a = m.normal_id(std::string_view(p).substr(0, k));
      std::optional<int32_t> b = m.normal_id(std::string_view(p).substr(k));
      if (a && b) m.merges.emplace(pair_key(*a, *b), Merge{-static_cast<double>(scores[id]), id});
    }
  }
}

std::unique_ptr<LlamaTokenizer::Impl> parse_llama2c_bin(const std::string& path) {
  auto m = std::make_unique<LlamaTokenizer::Impl>();
  m->path = path;
  const std::string data = read_binary_file(path);
  PO_CHECK(data.size() >= 4, path, ": truncated tokenizer.bin: ", data.size(),
           " bytes, less than the 4-byte max_token_length header");
  int32_t max_len;
  std::memcpy(&max_len, data.data(), 4);
  PO_CHECK(max_len > 0 && max_len < (1 << 20), path, ": impossible max_token_length ", max_len,
           " (not a llama2.c tokenizer.bin?)");
  std::vector<float> scores;
  for (size_t pos = 4; pos < data.size();) {
    const size_t id = m->pieces.size();
    PO_CHECK(data.size() - pos >= 8, path, ": truncated at piece ", id, " (byte offset ", pos, "): ",
             data.size() - pos, " bytes left, a record needs 8 for its score and length");
    float score;
    int32_t len;
    std::memcpy(&score, data.data() + pos, 4);
    std::memcpy(&len, data.data() + pos + 4, 4);
    pos += 8;
    PO_CHECK(len >= 0, path, ": piece ", id, " has negative length ", len);
    PO_CHECK(len <= max_len, path, ": piece ", id, " has length ", len, ", more than max_token_length ", max_len);
    PO_CHECK(!std::isnan(score), path, ": piece ", id, " has a NaN score");
    PO_CHECK(data.size() - pos >= static_cast<size_t>(len), path, ": truncated in piece ", id, ": length ", len,
             " but ", data.size() - pos, " bytes left");
    std::string bytes = data.substr(pos, static_cast<size_t>(len));
    pos += static_cast<size_t>(len);
    // llama2.c's export writes "▁" as " " and <s>, </s> as "\n<s>\n", "\n</s>\n".
    if (id == LlamaTokenizer::kBos) bytes = "<s>";
    else if (id == LlamaTokenizer::kEos) bytes = "</s>";
    else bytes = replace_all(bytes, " ", kSpacePiece);
    m->pieces.push_back(std::move(bytes));
    scores.push_back(score);
  }
  PO_CHECK(m->pieces.size() > LlamaTokenizer::kEos, path, ": ", m->pieces.size(),
           " pieces; a Llama vocabulary starts with <unk>, <s>, </s>");
  m->index({LlamaTokenizer::kUnk, LlamaTokenizer::kBos, LlamaTokenizer::kEos});
  add_score_merges(*m, scores);
  return m;
}

// ---- tokenizer.model (SentencePiece) ---------------------------------------

std::unique_ptr<LlamaTokenizer::Impl> parse_sentencepiece(const std::string& path) {
  const SentencePieceModel sp = parse_sentencepiece_model(read_binary_file(path), path);
  PO_CHECK(sp.model_type == 2, path, ": a ", sp.model_type == 1 ? "unigram" : "non-BPE",
           " SentencePiece model (trainer_spec.model_type ", sp.model_type,
           "); only BPE models (Llama's) are read");
  PO_CHECK(sp.byte_fallback, path, ": trainer_spec.byte_fallback is false; only byte-fallback models (Llama's) are read");
  PO_CHECK(sp.charsmap_bytes == 0, path, ": normalizer '", sp.normalizer,
           "' (a precompiled character map) is not built; only identity normalisation (Llama's) is read");
  PO_CHECK(sp.escape_whitespaces, path, ": normalizer_spec.escape_whitespaces is false; only models that write spaces as ",
           kSpacePiece, " are read");
  auto m = std::make_unique<LlamaTokenizer::Impl>();
  m->path = path;
  m->dummy_prefix = sp.add_dummy_prefix;
  m->squeeze_spaces = sp.remove_extra_whitespaces;
  std::vector<float> scores;
  std::vector<int32_t> specials;
  using T = SentencePieceModel::Type;
  for (const SentencePieceModel::Piece& p : sp.pieces) {
    const auto id = static_cast<int32_t>(m->pieces.size());
    PO_CHECK(p.type != T::kUserDefined, path, ": piece ", id, " '", p.text,
             "' is user-defined; user-defined pieces are not built");
    if (p.type == T::kControl || p.type == T::kUnknown || p.type == T::kUnused) specials.push_back(id);
    if (p.text == "<s>") m->bos = id;
    if (p.text == "</s>") m->eos = id;
    m->pieces.push_back(p.text);
    scores.push_back(p.score);
  }
  PO_CHECK(std::find(specials.begin(), specials.end(), m->eos) != specials.end() &&
               m->eos < static_cast<int32_t>(m->pieces.size()) && m->pieces[m->eos] == "</s>",
           path, ": no control piece </s>");
  m->index(specials);
  add_score_merges(*m, scores);
  return m;
}

}  // namespace

LlamaTokenizer LlamaTokenizer::from_pieces(const std::string& origin, std::vector<std::string> pieces,
                                           const std::vector<float>& scores, const std::vector<int32_t>& types,
                                           std::optional<int32_t> bos, int32_t eos, bool dummy_prefix) {
  const auto n = static_cast<int64_t>(pieces.size());
  PO_CHECK(static_cast<int64_t>(scores.size()) == n && static_cast<int64_t>(types.size()) == n, origin, ": ", n,
           " tokens but ", scores.size(), " scores and ", types.size(), " token types");
  PO_CHECK(eos >= 0 && eos < n && (!bos || (*bos >= 0 && *bos < n)), origin, ": bos/eos id (",
           bos ? std::to_string(*bos) : "none", ", ", eos, ") outside the ", n, " tokens");
  auto m = std::make_unique<Impl>();
  m->path = origin;
  m->dummy_prefix = dummy_prefix;
  m->pieces = std::move(pieces);
  if (bos) m->bos = *bos;
  m->eos = eos;
  std::vector<int32_t> specials;
  for (int32_t id = 0; id < n; ++id) {
    PO_CHECK(types[id] != 4, origin, ": token ", id, " '", m->pieces[id],
             "' is user-defined; user-defined pieces are not built");
    PO_CHECK(!std::isnan(scores[id]), origin, ": token ", id, " has a NaN score");
    if (types[id] == 2 || types[id] == 3 || types[id] == 5) specials.push_back(id);
  }
  m->index(specials);
  add_score_merges(*m, scores);
  return LlamaTokenizer(std::move(m));
}

LlamaTokenizer::LlamaTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
LlamaTokenizer::~LlamaTokenizer() = default;
LlamaTokenizer::LlamaTokenizer(LlamaTokenizer&&) noexcept = default;
LlamaTokenizer& LlamaTokenizer::operator=(LlamaTokenizer&&) noexcept = default;

LlamaTokenizer LlamaTokenizer::from_hf_json(const std::string& path) { return LlamaTokenizer(parse_hf_json(path)); }

LlamaTokenizer LlamaTokenizer::from_llama2c_bin(const std::string& path) {
  return LlamaTokenizer(parse_llama2c_bin(path));
}

LlamaTokenizer LlamaTokenizer::from_sentencepiece(const std::string& path) {
  return LlamaTokenizer(parse_sentencepiece(path));
}

std::vector<int32_t> LlamaTokenizer::encode(std::string_view text, std::string_view source) {
  return encode_with(text, source, impl_->dummy_prefix);
}

std::vector<int32_t> LlamaTokenizer::encode_continuation(std::string_view text, std::string_view source) {
  return encode_with(text, source, false);
}

std::vector<int32_t> LlamaTokenizer::encode_with(std::string_view text, std::string_view source,
                                                 bool dummy_prefix) {
  const Impl& m = *impl_;
  const size_t bad = utf8_find_invalid(text);
  if (bad != text.size()) PO_THROW(core::InvalidArgument, source, ": invalid UTF-8 at byte offset ", bad);
  PO_CHECK(text.size() < (size_t{1} << 30), source, ": text of ", text.size(), " bytes is too large to encode at once");
  std::string squeezed;
  if (m.squeeze_spaces) {  // no leading, trailing or repeated spaces
    for (char ch : text)
      if (ch != ' ' || (!squeezed.empty() && squeezed.back() != ' ')) squeezed.push_back(ch);
    if (!squeezed.empty() && squeezed.back() == ' ') squeezed.pop_back();
    text = squeezed;
  }
  if (text.empty()) return {};
  const std::string norm = (dummy_prefix ? std::string(kSpacePiece) : std::string()) + replace_all(text, " ", kSpacePiece);

  // One symbol per code point, or its bytes where it is no piece.
  struct Symbol {
    int32_t id, prev, next;  // id -1: merged into its left neighbour
  };
  std::vector<Symbol> syms;
  syms.reserve(norm.size());
  for (size_t pos = 0; pos < norm.size();) {
    char32_t cp;
    int len;
    utf8_decode(norm, pos, &cp, &len);  // valid: checked above
    if (std::optional<int32_t> id = m.normal_id(std::string_view(norm).substr(pos, len))) {
      syms.push_back({*id, 0, 0});
    } else {
      for (int i = 0; i < len; ++i) syms.push_back({m.byte_ids[static_cast<unsigned char>(norm[pos + i])], 0, 0});
    }
    pos += static_cast<size_t>(len);
  }
  const auto n = static_cast<int32_t>(syms.size());
  for (int32_t i = 0; i < n; ++i) syms[i] = {syms[i].id, i - 1, i + 1 < n ? i + 1 : -1};

  // Candidate merges, best first; ties to the leftmost (a merged symbol keeps
  // its left part's index, so indices stay in text order).
  struct Candidate {
    double priority;
    int32_t left, right, left_id, right_id, result;
  };
  auto worse = [](const Candidate& a, const Candidate& b) {
    return a.priority > b.priority || (a.priority == b.priority && a.left > b.left);
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(worse)> queue(worse);
  auto consider = [&](int32_t left) {
    if (left < 0 || syms[left].next < 0) return;
    const int32_t right = syms[left].next;
    auto it = m.merges.find(pair_key(syms[left].id, syms[right].id));
    if (it != m.merges.end())
      queue.push({it->second.priority, left, right, syms[left].id, syms[right].id, it->second.result});
  };
  for (int32_t i = 0; i + 1 < n; ++i) consider(i);
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Symbol& l = syms[c.left];
    if (l.id != c.left_id || l.next != c.right || syms[c.right].id != c.right_id) continue;  // stale
    Symbol& r = syms[c.right];
    l.id = c.result;
    l.next = r.next;
    if (r.next >= 0) syms[r.next].prev = c.left;
    r.id = -1;
    consider(l.prev);
    consider(c.left);
  }
  std::vector<int32_t> ids;
  for (int32_t i = 0; i >= 0 && i < n; i = syms[i].next) ids.push_back(syms[i].id);
  return ids;
}

std::string LlamaTokenizer::piece_bytes(int32_t id) const {
  const Impl& m = *impl_;
  PO_CHECK(id >= 0 && id < vocab_size(), "token id ", id, " outside [0, ", vocab_size(), ")");
  switch (m.kinds[id]) {
    case PieceKind::kSpecial: return "";
    case PieceKind::kByte: return std::string(1, static_cast<char>(std::stoi(m.pieces[id].substr(3, 2), nullptr, 16)));
    case PieceKind::kNormal: break;
  }
  return replace_all(m.pieces[id], kSpacePiece, " ");
}

std::string LlamaTokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    PO_CHECK(ids[i] >= 0 && ids[i] < vocab_size(), "decode: token ", i, " has id ", ids[i], " outside [0, ",
             vocab_size(), ")");
    out += piece_bytes(ids[i]);
  }
  if (impl_->dummy_prefix && !out.empty() && out[0] == ' ') out.erase(0, 1);
  return out;
}

int32_t LlamaTokenizer::vocab_size() const { return static_cast<int32_t>(impl_->pieces.size()); }
std::optional<int32_t> LlamaTokenizer::bos_id() const { return impl_->bos; }
int32_t LlamaTokenizer::eos_id() const { return impl_->eos; }
size_t LlamaTokenizer::merge_count() const { return impl_->merges.size(); }

std::vector<float> LlamaTokenizer::piece_scores() const {
  std::vector<float> s(impl_->pieces.size(), -1e9f);
  for (const auto& [pair, merge] : impl_->merges) {
    float& score = s[static_cast<size_t>(merge.result)];
    score = std::max(score, static_cast<float>(-merge.priority));
  }
  return s;
}

int32_t LlamaTokenizer::piece_type(int32_t id) const {
  switch (impl_->kinds.at(static_cast<size_t>(id))) {
    case PieceKind::kByte: return 6;
    case PieceKind::kSpecial: return impl_->pieces[static_cast<size_t>(id)] == "<unk>" ? 2 : 3;
    default: return 1;
  }
}

bool LlamaTokenizer::dummy_prefix() const { return impl_->dummy_prefix; }

const std::string& LlamaTokenizer::piece(int32_t id) const {
  PO_CHECK(id >= 0 && id < vocab_size(), "token id ", id, " outside [0, ", vocab_size(), ")");
  return impl_->pieces[id];
}

std::optional<int32_t> LlamaTokenizer::piece_id(std::string_view p) const {
  auto it = impl_->ids.find(p);
  if (it == impl_->ids.end()) return std::nullopt;
  return it->second;
}

}  // namespace po::data
