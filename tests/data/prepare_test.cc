// prepare(): document split, <|endoftext|> separators (GPT-2) or a leading BOS
// (Llama), the Brown format, the uint16 vocabulary limit, and errors that leave
// existing outputs alone.
#include "data/prepare.h"

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "data/split.h"
#include "data/token_file.h"
#include "data/tokenizer.h"
#include "data/llama_tokenizer.h"
#include "data_test_util.h"
#include "llama_test_util.h"

namespace po::data {
namespace {

using testing::read_file;
using testing::ScratchDir;
using testing::write_file;

Tokenizer& tokenizer() {
  static Tokenizer t = Tokenizer::load(PO_SOURCE_DIR);
  return t;
}

std::vector<int32_t> tokens_of(const std::string& path) {
  TokenFile f(path, Tokenizer::kVocabSize);
  return {f.tokens().begin(), f.tokens().end()};
}

std::vector<int32_t> doc(const std::string& text) {
  std::vector<int32_t> ids = tokenizer().encode(text);
  ids.push_back(Tokenizer::kEndOfText);
  return ids;
}

std::vector<int32_t> cat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(Prepare, TextDocumentsSplitEvenly) {
  ScratchDir dir;
  const std::vector<std::string> texts = {"First document.\n", "Second one, café.\n", "Third: 123!\n"};
  PrepareOptions o;
  for (size_t i = 0; i < texts.size(); ++i) {
    std::string name = "d";  // appended: GCC 12 warns falsely on "d" + std::string
    name += std::to_string(i) + ".txt";
    o.inputs.push_back(dir.file(name));
    write_file(o.inputs.back(), texts[i]);
  }
  o.out_dir = dir.file("out");
  o.val_fraction = 0.34;  // floor(3 * 0.34) = 1 document: the third
  o.tokenizer_root = PO_SOURCE_DIR;
  PrepareResult r = prepare(o);
  EXPECT_EQ(r.train_documents, 2);
  EXPECT_EQ(r.val_documents, 1);
  EXPECT_EQ(tokens_of(r.train_path), cat(doc(texts[0]), doc(texts[1])));
  EXPECT_EQ(tokens_of(r.val_path), doc(texts[2]));
  EXPECT_EQ(r.train_tokens, static_cast<int64_t>(tokens_of(r.train_path).size()));
  EXPECT_EQ(r.train_path, dir.file("out/train.bin"));
  // Beside it, where each training document lies (data.split: split.h).
  const int64_t first = static_cast<int64_t>(doc(texts[0]).size());
  EXPECT_EQ(read_documents(r.train_path, r.train_tokens),
            (std::vector<Document>{{0, first, "d0.txt"}, {first, r.train_tokens, "d1.txt"}}));
}

TEST(Prepare, SingleDocumentUsesTokenTail) {
  ScratchDir dir;
  PrepareOptions o;
  o.inputs = {dir.file("one.txt")};
  write_file(o.inputs[0], "one two three four five six seven eight nine ten eleven twelve thirteen fourteen");
  o.out_dir = dir.file("out");
  o.tokenizer_root = PO_SOURCE_DIR;
  PrepareResult r = prepare(o);  // default val_fraction 0.1
  std::vector<int32_t> all = doc(read_file(o.inputs[0]));
  const size_t n_val = (all.size() + 9) / 10;
  EXPECT_EQ(tokens_of(r.val_path), std::vector<int32_t>(all.end() - n_val, all.end()));
  EXPECT_EQ(tokens_of(r.train_path), std::vector<int32_t>(all.begin(), all.end() - n_val));
  // The one document, cut where val's tail begins.
  EXPECT_EQ(read_documents(r.train_path, r.train_tokens),
            (std::vector<Document>{{0, static_cast<int64_t>(all.size() - n_val), "one.txt"}}));

  o.val_fraction = 0.0;
  r = prepare(o);
  EXPECT_EQ(r.val_tokens, 0);
  EXPECT_EQ(tokens_of(r.train_path), all);
}

TEST(Prepare, BrownFormat) {
  ScratchDir dir;
  const std::string corpus = dir.file("brown");
  std::filesystem::create_directories(corpus);
  write_file(corpus + "/ca01",
             "\n\n\tThe/at jury/nn said/vbd ``/`` no/at evidence/nn ''/'' ,/, in/in Atlanta's/np$ 1/2/cd "
             "(/( sic/rb )/) race/nn ./.\n\n\n\tIt/pps ended/vbd ;/. ;/. Jr./np ./.\n");
  write_file(corpus + "/cb02", "\n\tSecond/od file/nn !/.\n");
  for (const char* junk : {"README", "CONTENTS", "cats.txt", "categories.pickle"}) {
    write_file(corpus + "/" + junk, "\x80\x81 not a brown text");  // would fail UTF-8 if read
  }
  EXPECT_EQ(brown_to_text(read_file(corpus + "/ca01")),
            "The jury said \"no evidence\", in Atlanta's 1/2 (sic) race.\nIt ended; Jr.\n");
  EXPECT_TRUE(is_brown_file_name("cr09"));
  EXPECT_FALSE(is_brown_file_name("cats.txt"));
  EXPECT_FALSE(is_brown_file_name("cz01"));

  PrepareOptions o;
  o.inputs = {corpus};
  o.format = "brown";
  o.out_dir = dir.file("out");
  o.val_fraction = 0.5;  // floor(2 * 0.5) = 1 document: the second
  o.tokenizer_root = PO_SOURCE_DIR;
  PrepareResult r = prepare(o);
  EXPECT_EQ(r.train_documents, 1);
  EXPECT_EQ(r.val_documents, 1);
  EXPECT_EQ(tokens_of(r.train_path), doc(brown_to_text(read_file(corpus + "/ca01"))));
  EXPECT_EQ(tokens_of(r.val_path), doc("Second file!\n"));
}

TEST(Prepare, InvalidUtf8IsAnErrorAndKeepsOutputs) {
  ScratchDir dir;
  PrepareOptions o;
  o.inputs = {dir.file("good.txt"), dir.file("bad.txt")};
  write_file(o.inputs[0], "fine text\n");
  write_file(o.inputs[1], "caf\xc3\x28 broken");
  o.out_dir = dir.file("out");
  o.tokenizer_root = PO_SOURCE_DIR;
  std::filesystem::create_directories(o.out_dir);
  write_token_file(o.out_dir + "/train.bin", std::vector<int32_t>{1, 2, 3});
  write_token_file(o.out_dir + "/val.bin", std::vector<int32_t>{4});
  try {
    prepare(o);
    ADD_FAILURE() << "no error for invalid UTF-8";
  } catch (const core::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("bad.txt"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("byte offset 3"), std::string::npos) << e.what();
  }
  EXPECT_EQ(tokens_of(o.out_dir + "/train.bin"), (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(tokens_of(o.out_dir + "/val.bin"), (std::vector<int32_t>{4}));
}

TEST(Prepare, BadOptions) {
  ScratchDir dir;
  PrepareOptions o;
  o.inputs = {dir.file("missing.txt")};
  o.out_dir = dir.file("out");
  o.tokenizer_root = PO_SOURCE_DIR;
  EXPECT_THROW(prepare(o), core::InvalidArgument);
  write_file(o.inputs[0], "x");
  o.val_fraction = 1.0;
  EXPECT_THROW(prepare(o), core::InvalidArgument);
  o.val_fraction = 0.1;
  o.format = "csv";
  EXPECT_THROW(prepare(o), core::InvalidArgument);
}

TEST(Prepare, LlamaTokenizerStartsDocumentsWithBos) {
  ASSERT_FALSE(testing::llama_fixture_dir().empty()) << testing::kLlamaSetupHint;
  ScratchDir dir;
  const std::vector<std::string> texts = {"First document.\n", "Second one, café.\n"};
  for (const char* file : {"tokenizer.json", "tokenizer.bin"}) {
    PrepareOptions o;
    for (size_t i = 0; i < texts.size(); ++i) {
      std::string name = "d";  // appended: GCC 12 warns falsely on "d" + std::string
      name += std::to_string(i) + ".txt";
      o.inputs.push_back(dir.file(name));
      write_file(o.inputs.back(), texts[i]);
    }
    o.out_dir = dir.file(std::string("out_") + file);
    o.val_fraction = 0.5;
    o.tokenizer = testing::llama_fixture_dir() + "/" + file;
    PrepareResult r = prepare(o);
    LlamaTokenizer llama = LlamaTokenizer::from_hf_json(testing::llama_fixture_dir() + "/tokenizer.json");
    auto llama_doc = [&](const std::string& text) { return cat({LlamaTokenizer::kBos}, llama.encode(text)); };
    TokenFile train(r.train_path, 32000), val(r.val_path, 32000);
    EXPECT_EQ(std::vector<int32_t>(train.tokens().begin(), train.tokens().end()), llama_doc(texts[0])) << file;
    EXPECT_EQ(std::vector<int32_t>(val.tokens().begin(), val.tokens().end()), llama_doc(texts[1])) << file;
    EXPECT_EQ(r.train_tokens + r.val_tokens, static_cast<int64_t>(train.size() + val.size()));
  }
}

TEST(Prepare, VocabularyOverUint16IsAnError) {
  // A llama2.c tokenizer.bin with 65537 pieces: the specials, the 256 bytes, filler.
  auto record = [](const std::string& piece) {
    std::string r(8, '\0');
    const float score = 0;
    const auto len = static_cast<int32_t>(piece.size());
    std::memcpy(r.data(), &score, 4);
    std::memcpy(r.data() + 4, &len, 4);
    return r + piece;
  };
  std::string bin(4, '\0');
  bin[0] = 16;
  for (const char* s : {"<unk>", "\n<s>\n", "\n</s>\n"}) bin += record(s);
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "<0x%02X>", b);
    bin += record(buf);
  }
  for (int i = 3 + 256; i < 65537; ++i) bin += record(std::to_string(i) + "p");
  ScratchDir dir;
  write_file(dir.file("big.bin"), bin);
  write_file(dir.file("a.txt"), "text");
  PrepareOptions o;
  o.inputs = {dir.file("a.txt")};
  o.out_dir = dir.file("out");
  o.tokenizer = dir.file("big.bin");
  try {
    prepare(o);
    ADD_FAILURE() << "no error for a 65537-id vocabulary";
  } catch (const core::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("65537 ids, more than the 65536"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("big.bin"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(o.out_dir));
}

}  // namespace
}  // namespace po::data
