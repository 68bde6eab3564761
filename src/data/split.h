// A corpus split over federated clients (`data.split`; docs/diloco.md).
//
// `pagedoptim prepare` writes beside DIR/train.bin a documents file,
// DIR/train.docs: where each training document lies in the token stream and
// where it came from. Text, one document a line after a header:
//
//   pagedoptim-documents 1
//   <begin> <end> <source>
//
// begin and end token offsets (the document is [begin, end), its separator
// included), ascending and not overlapping, end at most the token count;
// source the input file's name (no whitespace). Anything else is refused
// naming the file and line.
//
// data.split picks client k's documents of data.split_clients = K
// (k = federated.client_id), from train.seed:
//   iid          the documents in an order shuffled by a counter-based RNG,
//                dealt round-robin: client k gets every K-th;
//   by_source    each source group to one client (group g, sorted, to
//                client g mod K); a Brown file's group is its genre (the
//                second letter of c[a-r]NN: 15 genres), another file's its name;
//   dirichlet:α  per source group, the clients' shares drawn from a
//                symmetric Dirichlet(α) (Hsu et al. 2019's non-IID split:
//                small α, few clients per group), the group's documents cut
//                in order by those shares.
// Every document goes to exactly one client. The client's sampler then draws
// windows only inside its documents (loader.h).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace po::data {

struct Document {
  int64_t begin = 0, end = 0;  // token offsets [begin, end)
  std::string source;          // the input file's name
  bool operator==(const Document&) const = default;
};

// "DIR/train.docs" for "DIR/train.bin".
std::string documents_path(const std::string& token_path);
std::string documents_text(const std::vector<Document>& docs);
// The documents of `text` (see above); InvalidArgument naming `what`, the
// line and what was wrong. `tokens`: the token file's length (ends beyond
// it are refused).
std::vector<Document> parse_documents(std::string_view text, const std::string& what, int64_t tokens);
std::vector<Document> read_documents(const std::string& token_path, int64_t tokens);

struct Split {
  enum class Kind { kNone, kIid, kBySource, kDirichlet } kind = Kind::kNone;
  double alpha = 0;  // dirichlet's concentration
};
// data.split's value: "none", "iid", "by_source", "dirichlet:α" (α > 0);
// InvalidArgument naming `key` otherwise.
Split parse_split(const std::string& text, const std::string& key);

// The group by_source and dirichlet split by: a Brown file name's genre
// letter ("brown:a"), any other name itself.
std::string source_group(const std::string& source);

// Indices (ascending) of client `k`'s documents of `clients`.
std::vector<size_t> client_documents(const std::vector<Document>& docs, const Split& split, int clients, int k,
                                     uint64_t seed);

// The token ranges of `docs[indices]`, adjacent ones merged.
std::vector<std::pair<int64_t, int64_t>> document_spans(const std::vector<Document>& docs,
                                                        const std::vector<size_t>& indices);

}  // namespace po::data
