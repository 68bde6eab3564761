// A corpus split over federated clients (split.h).
#include "data/split.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <numeric>
#include <sstream>

#include "core/error.h"
#include "core/rng.h"
#include "data/prepare.h"

namespace po::data {
namespace {

constexpr std::string_view kHeader = "pagedoptim-documents 1";
// Streams of the split's draws, apart from the data sampler's and init's.
constexpr uint64_t kIidStream = 0x5B117'11D0ull, kDirichletStream = 0x5B117'D1E1ull;

// Uniform in (0, 1) with 53 bits, element `i` of `rng`.
double uniform01(const core::Philox& rng, uint64_t i) {
  return (static_cast<double>(rng.next_u64(i) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

// A Gamma(a, 1) draw (Marsaglia and Tsang 2000; a < 1 through Gamma(a + 1)·U^(1/a)),
// its uniforms from `rng` at elements *next, *next + 1, ...
double gamma_draw(double a, const core::Philox& rng, uint64_t* next) {
  double boost = 1.0;
  if (a < 1.0) {
    boost = std::pow(uniform01(rng, (*next)++), 1.0 / a);
    a += 1.0;
  }
  const double d = a - 1.0 / 3.0, c = 1.0 / std::sqrt(9.0 * d);
  for (;;) {
    // A standard normal by Box-Muller on two uniforms.
    const double u1 = uniform01(rng, (*next)++), u2 = uniform01(rng, (*next)++);
    const double x = std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
    const double v = std::pow(1.0 + c * x, 3);
    if (v <= 0) continue;
    const double u = uniform01(rng, (*next)++);
    if (std::log(u) < 0.5 * x * x + d - d * v + d * std::log(v)) return d * v * boost;
  }
}

}  // namespace

std::string documents_path(const std::string& token_path) {
  return std::filesystem::path(token_path).replace_extension(".docs").string();
}

std::string documents_text(const std::vector<Document>& docs) {
  std::string out(kHeader);
  out += '\n';
  for (const Document& d : docs) out += std::to_string(d.begin) + ' ' + std::to_string(d.end) + ' ' + d.source + '\n';
  return out;
}

std::vector<Document> parse_documents(std::string_view text, const std::string& what, int64_t tokens) {
  std::vector<Document> docs;
  size_t line_no = 0, at = 0;
  int64_t last_end = 0;
  while (at < text.size()) {
    const size_t nl = text.find('\n', at);
    PO_CHECK(nl != std::string_view::npos, what, ": line ", line_no + 1, " has no newline (a truncated file?)");
    const std::string_view line = text.substr(at, nl - at);
    at = nl + 1;
    ++line_no;
    if (line_no == 1) {
      PO_CHECK(line == kHeader, what, ": not a documents file (its first line is not \"", kHeader, "\")");
      continue;
    }
    const std::string where = what + ": line " + std::to_string(line_no);
    // "<begin> <end> <source>", single spaces.
    const size_t s1 = line.find(' '), s2 = s1 == std::string_view::npos ? s1 : line.find(' ', s1 + 1);
    PO_CHECK(s2 != std::string_view::npos, where, ": expected \"<begin> <end> <source>\"");
    Document d;
    const auto number = [&](std::string_view t, int64_t& out, const char* name) {
      const auto r = std::from_chars(t.data(), t.data() + t.size(), out);
      PO_CHECK(r.ec == std::errc() && r.ptr == t.data() + t.size() && !t.empty() && t[0] != '-' &&
                   (t.size() == 1 || t[0] != '0'),
               where, ": ", name, " '", t, "' is not a number (decimal digits, no leading zero)");
    };
    number(line.substr(0, s1), d.begin, "begin");
    number(line.substr(s1 + 1, s2 - s1 - 1), d.end, "end");
    d.source = std::string(line.substr(s2 + 1));
    PO_CHECK(!d.source.empty() && d.source.find_first_of(" \t\r") == std::string::npos, where,
             ": the source must be one word without whitespace");
    PO_CHECK(d.begin >= last_end && d.end > d.begin, where, ": document [", d.begin, ", ", d.end,
             ") is empty or overlaps the one before (ending at ", last_end, ")");
    PO_CHECK(d.end <= tokens, where, ": document [", d.begin, ", ", d.end, ") ends past the token file's ", tokens,
             " tokens");
    last_end = d.end;
    docs.push_back(std::move(d));
  }
  PO_CHECK(line_no >= 1, what, ": empty (not a documents file)");
  return docs;
}

std::vector<Document> read_documents(const std::string& token_path, int64_t tokens) {
  const std::string path = documents_path(token_path);
  std::ifstream in(path, std::ios::binary);
  PO_CHECK(in.good(), path, ": cannot be read (data.split needs the documents file `pagedoptim prepare` writes "
           "beside ", token_path, "; prepare the corpus again)");
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  return parse_documents(text, path, tokens);
}

Split parse_split(const std::string& text, const std::string& key) {
  if (text == "none") return {};
  if (text == "iid") return {Split::Kind::kIid, 0};
  if (text == "by_source") return {Split::Kind::kBySource, 0};
  if (text.starts_with("dirichlet:")) {
    double alpha = 0;
    const char* b = text.data() + 10;
    const auto r = std::from_chars(b, text.data() + text.size(), alpha);
    PO_CHECK(r.ec == std::errc() && r.ptr == text.data() + text.size() && alpha > 0 && std::isfinite(alpha), key,
             " = \"", text, "\": dirichlet's α must be a positive number, e.g. \"dirichlet:0.5\"");
    return {Split::Kind::kDirichlet, alpha};
  }
  PO_THROW(core::InvalidArgument, key, " = \"", text,
           "\": choose \"none\", \"iid\", \"by_source\" or \"dirichlet:α\"");
}

std::string source_group(const std::string& source) {
  const std::string name = std::filesystem::path(source).filename().string();
  return is_brown_file_name(name) ? std::string("brown:") + name[1] : name;
}

std::vector<size_t> client_documents(const std::vector<Document>& docs, const Split& split, int clients, int k,
                                     uint64_t seed) {
  PO_CHECK(clients >= 1 && k >= 0 && k < clients, "data.split: client ", k, " of ", clients,
           " (federated.client_id must be below data.split_clients)");
  std::vector<size_t> out;
  if (split.kind == Split::Kind::kNone) {
    out.resize(docs.size());
    std::iota(out.begin(), out.end(), size_t{0});
    return out;
  }
  if (split.kind == Split::Kind::kIid) {
    const core::Philox rng(seed ^ kIidStream, 0);
    std::vector<std::pair<uint64_t, size_t>> order;
    for (size_t d = 0; d < docs.size(); ++d) order.emplace_back(rng.next_u64(d), d);
    std::sort(order.begin(), order.end());
    for (size_t i = static_cast<size_t>(k); i < order.size(); i += static_cast<size_t>(clients))
      out.push_back(order[i].second);
  } else {
    std::map<std::string, std::vector<size_t>> groups;  // sorted by group
    for (size_t d = 0; d < docs.size(); ++d) groups[source_group(docs[d].source)].push_back(d);
    size_t g = 0;
    for (const auto& [name, members] : groups) {
      if (split.kind == Split::Kind::kBySource) {
        if (g % static_cast<size_t>(clients) == static_cast<size_t>(k)) out.insert(out.end(), members.begin(), members.end());
      } else {
        // Shares p ~ Dirichlet(α): K Gammas normalised; document j of n goes
        // to the client whose cumulative share first passes (j + ½) / n.
        const core::Philox rng(seed ^ kDirichletStream, g);
        uint64_t next = 0;
        std::vector<double> p(static_cast<size_t>(clients));
        double total = 0;
        for (double& x : p) total += (x = gamma_draw(split.alpha, rng, &next));
        const double n = static_cast<double>(members.size());
        double cum = 0;
        size_t c = 0;
        for (size_t j = 0; j < members.size(); ++j) {
          const double at = (static_cast<double>(j) + 0.5) / n;
          while (c + 1 < p.size() && cum + p[c] / total <= at) cum += p[c++] / total;
          if (c == static_cast<size_t>(k)) out.push_back(members[j]);
        }
      }
      ++g;
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::pair<int64_t, int64_t>> document_spans(const std::vector<Document>& docs,
                                                        const std::vector<size_t>& indices) {
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (size_t i : indices) {
    const Document& d = docs[i];
    if (!spans.empty() && spans.back().second == d.begin)
      spans.back().second = d.end;
    else
      spans.emplace_back(d.begin, d.end);
  }
  return spans;
}

}  // namespace po::data
