// prepare(): see prepare.h.
#include "data/prepare.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <tuple>

#include "core/error.h"
#include "core/log.h"
#include "data/token_file.h"
#include "data/split.h"
#include "data/text_tokenizer.h"
#include "data/tokenizer.h"
#include "data/unicode.h"

namespace po::data {
namespace fs = std::filesystem;
namespace {

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) PO_THROW(core::IoError, "cannot open input ", path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) PO_THROW(core::IoError, "cannot read input ", path.string());
  return ss.str();
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\f' || c == '\v'; }

// Brown tokens that attach to the previous word / the next word.
bool attaches_left(std::string_view w) {
  static constexpr std::string_view kLeft[] = {",", ".", ";", ":", "?", "!", ")", "]", "}", "''", "'", "%", "...", "??", "!!", "?!"};
  return std::find(std::begin(kLeft), std::end(kLeft), w) != std::end(kLeft);
}
bool attaches_right(std::string_view w) { return w == "(" || w == "[" || w == "{" || w == "``" || w == "`"; }

std::string_view map_quote(std::string_view w) {
  if (w == "``" || w == "''") return "\"";
  if (w == "`") return "'";
  return w;
}

// Input files in order; directories expand to their regular files by name.
std::vector<fs::path> expand_inputs(const PrepareOptions& o) {
  std::vector<fs::path> files;
  const bool brown = o.format == "brown";
  for (const std::string& in : o.inputs) {
    std::error_code ec;
    fs::path p(in);
    if (fs::is_directory(p, ec)) {
      std::vector<fs::path> entries;
      for (const auto& e : fs::directory_iterator(p, ec)) {
        if (e.is_regular_file() && e.path().filename().string()[0] != '.') entries.push_back(e.path());
      }
      PO_CHECK(!ec, "cannot list input directory ", in, ": ", ec.message());
      std::sort(entries.begin(), entries.end());
      files.insert(files.end(), entries.begin(), entries.end());
    } else {
      PO_CHECK(fs::is_regular_file(p, ec), "input ", in, " does not exist or is not a regular file");
      files.push_back(p);
    }
  }
  if (brown) {
    std::vector<fs::path> kept;
    for (const fs::path& f : files) {
      if (is_brown_file_name(f.filename().string())) {
        kept.push_back(f);
      } else {
        PO_LOG_WARN("prepare: skipping ", f.string(), ": not a Brown corpus text (expected a name like ca01)");
      }
    }
    files.swap(kept);
  }
  PO_CHECK(!files.empty(), "prepare: no input documents");
  return files;
}

}  // namespace

std::pair<std::string, std::string> output_paths(const std::string& out_dir) {
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  PO_CHECK(!ec, "prepare: cannot create output directory ", out_dir, ": ", ec.message());
  return {(fs::path(out_dir) / "train.bin").string(), (fs::path(out_dir) / "val.bin").string()};
}

bool is_brown_file_name(std::string_view name) {
  return name.size() == 4 && name[0] == 'c' && name[1] >= 'a' && name[1] <= 'r' && name[2] >= '0' &&
         name[2] <= '9' && name[3] >= '0' && name[3] <= '9';
}

std::string brown_to_text(std::string_view tagged) {
  std::string out;
  size_t pos = 0;
  while (pos < tagged.size()) {
    size_t eol = tagged.find('\n', pos);
    if (eol == std::string_view::npos) eol = tagged.size();
    std::string_view line = tagged.substr(pos, eol - pos);
    pos = eol + 1;
    std::string sentence;
    bool glue_next = true;  // no space before the first word or after an opener
    for (size_t i = 0; i < line.size();) {
      while (i < line.size() && is_space(line[i])) ++i;
      size_t j = i;
      while (j < line.size() && !is_space(line[j])) ++j;
      if (j == i) break;
      std::string_view tok = line.substr(i, j - i);
      i = j;
      size_t slash = tok.rfind('/');
      std::string_view word = (slash == std::string_view::npos || slash == 0) ? tok : tok.substr(0, slash);
      // "Jr./np ./." and the corpus's doubled ";/. ;/." would print "Jr.." and ";;".
      if ((word == "." || word == ";" || word == ",") && !sentence.empty() && sentence.back() == word[0]) continue;
      if (!glue_next && !attaches_left(word)) sentence += ' ';
      sentence += map_quote(word);
      glue_next = attaches_right(word);
    }
    if (!sentence.empty()) {
      out += sentence;
      out += '\n';
    }
  }
  return out;
}

PrepareResult prepare(const PrepareOptions& o) {
  PO_CHECK(o.format == "text" || o.format == "brown", "prepare: unknown format '", o.format,
           "' (expected text or brown)");
  PO_CHECK(o.val_fraction >= 0.0 && o.val_fraction < 1.0, "prepare: val_fraction must be in [0, 1), got ",
           o.val_fraction);
  PO_CHECK(!o.out_dir.empty(), "prepare: no output directory");
  PO_CHECK(!o.inputs.empty(), "prepare: no inputs");
  const std::vector<fs::path> files = expand_inputs(o);
  const std::unique_ptr<TextTokenizer> tokenizer =
      o.tokenizer.empty() ? std::make_unique<Tokenizer>(Tokenizer::load(o.tokenizer_root)) : load_tokenizer(o.tokenizer);
  PO_CHECK(tokenizer->vocab_size() <= kTokenFileMaxVocab, "prepare: tokenizer ", o.tokenizer, " has ",
           tokenizer->vocab_size(), " ids, more than the ", kTokenFileMaxVocab, " a uint16 token file can hold");
  const std::optional<int32_t> bos = tokenizer->bos_id();

  const double f = o.val_fraction;
  auto val_count_before = [f](size_t d) { return static_cast<int64_t>(std::floor(static_cast<double>(d) * f + 1e-9)); };
  const bool whole_documents = val_count_before(files.size()) >= 1;
  std::vector<int32_t> train, val;
  std::vector<Document> docs;  // the training documents (data.split: split.h)
  PrepareResult r;
  for (size_t d = 0; d < files.size(); ++d) {
    const std::string name = files[d].string();
    std::string text = read_file(files[d]);
    // Check the raw bytes so the offset refers to the file, not the detokenised text.
    const size_t bad = utf8_find_invalid(text);
    PO_CHECK(bad == text.size(), name, ": invalid UTF-8 at byte offset ", bad);
    if (o.format == "brown") text = brown_to_text(text);
    const bool to_val = whole_documents && val_count_before(d + 1) > val_count_before(d);
    std::vector<int32_t>& dst = to_val ? val : train;
    std::vector<int32_t> ids = tokenizer->encode(text, name);
    const int64_t begin = static_cast<int64_t>(dst.size());
    if (bos) dst.push_back(*bos);  // Llama: BOS opens a document
    dst.insert(dst.end(), ids.begin(), ids.end());
    if (!bos) dst.push_back(tokenizer->eos_id());  // GPT-2: <|endoftext|> closes it
    if (!to_val) docs.push_back({begin, static_cast<int64_t>(dst.size()), files[d].filename().string()});
    ++(to_val ? r.val_documents : r.train_documents);
  }
  if (!whole_documents && f > 0.0) {
    // Too few documents to hold some out whole: the tail of the token stream is val.
    const size_t n_val = static_cast<size_t>(std::ceil(static_cast<double>(train.size()) * f));
    val.assign(train.end() - static_cast<std::ptrdiff_t>(n_val), train.end());
    train.resize(train.size() - n_val);
    const int64_t n = static_cast<int64_t>(train.size());
    std::erase_if(docs, [n](const Document& x) { return x.begin >= n; });
    if (!docs.empty()) docs.back().end = std::min(docs.back().end, n);
  }
  PO_CHECK(!train.empty(), "prepare: the split leaves no training tokens");

  std::tie(r.train_path, r.val_path) = output_paths(o.out_dir);
  write_token_file(r.train_path, train);
  write_token_file(r.val_path, val);
  // Sources are file names: one word each (split.h's format).
  for (Document& x : docs) std::replace_if(x.source.begin(), x.source.end(), [](char c) { return std::isspace(static_cast<unsigned char>(c)); }, '_');
  write_text_atomically(documents_path(r.train_path), documents_text(docs));
  r.train_tokens = static_cast<int64_t>(train.size());
  r.val_tokens = static_cast<int64_t>(val.size());
  PO_LOG_INFO("prepare: ", files.size(), " documents -> ", r.train_path, " (", r.train_tokens, " tokens, ",
              r.train_documents, " documents), ", r.val_path, " (", r.val_tokens, " tokens, ", r.val_documents,
              " documents)");
  return r;
}

}  // namespace po::data
