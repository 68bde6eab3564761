// Token files: round trip, atomic replacement, and every malformed-input error
// names the file.
#include "data/token_file.h"

#include <cstring>
#include <filesystem>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "data_test_util.h"

namespace po::data {
namespace {

using testing::read_file;
using testing::ScratchDir;
using testing::write_file;

std::string header_bytes(int32_t magic, int32_t version, int32_t count) {
  std::vector<int32_t> h(kTokenFileHeaderInts, 0);
  h[0] = magic, h[1] = version, h[2] = count;
  return std::string(reinterpret_cast<const char*>(h.data()), kTokenFileHeaderBytes);
}

// Expects TokenFile(path, vocab) to throw InvalidArgument whose message holds all `parts`.
void expect_error(const std::string& path, int32_t vocab, const std::vector<std::string>& parts) {
  try {
    TokenFile f(path, vocab);
    ADD_FAILURE() << "no error opening " << path;
  } catch (const core::InvalidArgument& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

TEST(TokenFile, RoundTrip) {
  ScratchDir dir;
  const std::vector<int32_t> tokens = {0, 1, 50256, 65535, 42, 7};
  write_token_file(dir.file("t.bin"), tokens);
  TokenFile f(dir.file("t.bin"), 65536);
  ASSERT_EQ(f.size(), tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) EXPECT_EQ(f[i], tokens[i]) << "token " << i;
  EXPECT_EQ(std::filesystem::file_size(dir.file("t.bin")), kTokenFileHeaderBytes + 2 * tokens.size());
  // Byte layout is llm.c's: little-endian header then uint16.
  std::string bytes = read_file(dir.file("t.bin"));
  EXPECT_EQ(bytes.substr(0, 12), header_bytes(20240520, 1, 6).substr(0, 12));
  EXPECT_EQ(static_cast<unsigned char>(bytes[kTokenFileHeaderBytes + 4]), 0x50);  // 50256 = 0xC450
  EXPECT_EQ(static_cast<unsigned char>(bytes[kTokenFileHeaderBytes + 5]), 0xC4);
  // Only the final file is left behind.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), {}), 1);

  TokenFile moved = std::move(f);
  EXPECT_EQ(moved.size(), tokens.size());
  EXPECT_EQ(f.size(), 0u);
}

TEST(TokenFile, EmptyAndReplace) {
  ScratchDir dir;
  write_token_file(dir.file("t.bin"), std::vector<int32_t>{});
  EXPECT_EQ(TokenFile(dir.file("t.bin")).size(), 0u);
  write_token_file(dir.file("t.bin"), std::vector<int32_t>{3, 4});
  EXPECT_EQ(TokenFile(dir.file("t.bin")).size(), 2u);
}

TEST(TokenFile, WriterRejectsIdsOutsideUint16AndKeepsOldFile) {
  ScratchDir dir;
  write_token_file(dir.file("t.bin"), std::vector<int32_t>{1, 2, 3});
  EXPECT_THROW(write_token_file(dir.file("t.bin"), std::vector<int32_t>{1, 65536}), core::InvalidArgument);
  EXPECT_THROW(write_token_file(dir.file("t.bin"), std::vector<int32_t>{-1}), core::InvalidArgument);
  EXPECT_EQ(TokenFile(dir.file("t.bin")).size(), 3u);
  EXPECT_THROW(write_token_file(dir.file("no/such/dir/t.bin"), std::vector<int32_t>{1}), core::IoError);
}

TEST(TokenFile, BadInputsNameTheFile) {
  ScratchDir dir;
  const std::string p = dir.file("bad.bin");
  write_file(p, "short");
  expect_error(p, 0, {p, "shorter than the 1024-byte header"});
  write_file(p, header_bytes(12345, 1, 0));
  expect_error(p, 0, {p, "magic 12345"});
  write_file(p, header_bytes(kTokenFileMagic, 2, 0));
  expect_error(p, 0, {p, "version 2"});
  write_file(p, header_bytes(kTokenFileMagic, 1, 3) + std::string(4, '\0'));
  expect_error(p, 0, {p, "header says 3 tokens"});
  write_file(p, header_bytes(kTokenFileMagic, 1, -1));
  expect_error(p, 0, {p, "negative"});
  const std::string body("\x01\x00\x02\x00\x51\xC4", 6);  // 1, 2, 50257
  write_file(p, header_bytes(kTokenFileMagic, 1, 3) + body);
  expect_error(p, 50257, {p, "token 2 has id 50257"});
  EXPECT_EQ(TokenFile(p, 50258).size(), 3u);
  EXPECT_EQ(TokenFile(p).size(), 3u);  // no vocabulary check asked for
  try {
    TokenFile f(dir.file("missing.bin"));
    ADD_FAILURE() << "no error for a missing file";
  } catch (const core::IoError& e) {
    EXPECT_NE(std::string(e.what()).find("missing.bin"), std::string::npos) << e.what();
  }
}

TEST(TokenFile, ParseFromBuffer) {
  std::string bytes = header_bytes(kTokenFileMagic, 1, 2) + std::string("\x05\x00\x06\x00", 4);
  std::vector<uint16_t> aligned((bytes.size() + 1) / 2);
  std::memcpy(aligned.data(), bytes.data(), bytes.size());
  auto tokens = parse_token_file({reinterpret_cast<const std::byte*>(aligned.data()), bytes.size()}, "buf", 7);
  ASSERT_EQ(tokens.size(), 2u);
  EXPECT_EQ(tokens[0], 5);
  EXPECT_EQ(tokens[1], 6);
  EXPECT_THROW(parse_token_file({reinterpret_cast<const std::byte*>(aligned.data()), bytes.size()}, "buf", 6),
               core::InvalidArgument);
}

}  // namespace
}  // namespace po::data
