// SFT data: the chat templates as pieces (data/chat_format.h), `prepare
// --sft` (records to tokens and a loss mask that counts the replies alone,
// GPT-2 and Llama-2), the rows training makes of them (one example per row
// or packed, positions, truncation), and the one-line errors for bad records.
#include "data/sft.h"

#include <algorithm>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "data/chat_format.h"
#include "data/llama_tokenizer.h"
#include "data/loader.h"
#include "data/token_file.h"
#include "data/tokenizer.h"
#include "data_test_util.h"
#include "llama_test_util.h"

namespace po::data {
namespace {

using testing::ScratchDir;
using testing::write_file;
using Kind = ChatPiece::Kind;

Tokenizer& gpt2() {
  static Tokenizer t = Tokenizer::load(PO_SOURCE_DIR);
  return t;
}

std::vector<int32_t> cat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::string describe(const std::vector<ChatPiece>& pieces) {
  std::string out;
  for (const ChatPiece& p : pieces) {
    out += p.kind == Kind::kBos ? "<BOS>" : p.kind == Kind::kEos ? "<EOS>" : "[" + p.text + "]";
    out += p.train ? "*" : "";
    out += " ";
  }
  return testing::escaped(out);
}

const std::vector<ChatMessage> kChat = {{"system", "Be brief."}, {"user", " Hi "}, {"assistant", "Hello."},
                                        {"user", "Bye"}, {"assistant", "Bye!"}};

TEST(ChatFormat, TrainingPiecesMarkTheRepliesAndTheirEos) {
  EXPECT_EQ(describe(render_chat_pieces("llama2", kChat, false)),
            "<BOS> [[INST] <<SYS>>\\nBe brief.\\n<</SYS>>\\n\\n Hi [/INST]] [ Hello. ]* <EOS>* "
            "<BOS> [[INST] Bye [/INST]] [ Bye! ]* <EOS>* ");
  EXPECT_EQ(describe(render_chat_pieces("chatml", kChat, false)),
            "<BOS> [<|im_start|>system\\n] [Be brief.<|im_end|>] [\\n] [<|im_start|>user\\n] [ Hi <|im_end|>] [\\n] "
            "[<|im_start|>assistant\\n] [Hello.<|im_end|>]* [\\n] [<|im_start|>user\\n] [Bye<|im_end|>] [\\n] "
            "[<|im_start|>assistant\\n] [Bye!<|im_end|>]* <EOS>* ");
  EXPECT_EQ(describe(render_chat_pieces("plain", kChat, false)),
            "<BOS> [System: Be brief.\\n] [User:  Hi \\n] [Assistant:] [ Hello.\\n]* [User: Bye\\n] [Assistant:] "
            "[ Bye!\\n]* <EOS>* ");
}

TEST(ChatFormat, APromptEndsWithTheAssistantsOpeningAndTrainsNothing) {
  const std::vector<ChatMessage> ask(kChat.begin(), kChat.end() - 1);
  for (const char* t : {"llama2", "chatml", "plain"}) {
    const auto pieces = render_chat_pieces(t, ask, true);
    std::string text;
    for (const ChatPiece& p : pieces) text += p.text;
    EXPECT_TRUE(text.ends_with(std::string(t) == "llama2" ? "[INST] Bye [/INST]"
                               : std::string(t) == "chatml" ? "<|im_start|>assistant\n" : "Assistant:"))
        << t << ": " << testing::escaped(text);
  }
}

TEST(ChatFormat, ConversationsATemplateCannotTrainOnAreRefused) {
  const std::vector<ChatMessage> no_reply = {{"user", "Hi"}};
  for (const char* t : {"chatml", "plain"})
    EXPECT_EQ(po::test::error_of([&] { render_chat_pieces(t, no_reply, false); }),
              std::string("chat template ") + t + ": the conversation has no assistant turn to train on (at messages[0])");
  EXPECT_EQ(po::test::error_of([&] { render_chat_pieces("llama2", no_reply, false); }),
            "chat template llama2: the last message must be the assistant's (at messages[0])");
  EXPECT_EQ(po::test::error_of([&] { render_chat_pieces("llama2", {{"user", "a"}, {"user", "b"}}, false); }),
            "chat template llama2: roles must alternate user, assistant, user, ... (at messages[1])");
  EXPECT_EQ(po::test::error_of([&] { render_chat_pieces("plain", {{"robot", "a"}}, false); }),
            "chat template plain: unknown role 'robot' (expected system, user or assistant) (at messages[0])");
}

// GPT-2 (plain template, no BOS): each piece encoded, the reply's tokens and
// the closing <|endoftext|> counted, the example's first token marked.
TEST(PrepareSft, Gpt2RecordsBecomeTokensAndAMaskOfTheReplies) {
  ScratchDir dir;
  SftOptions o;
  o.input = dir.file("d.jsonl");
  write_file(o.input,
             "{\"prompt\": \"Hi\", \"completion\": \"Hello there\"}\n\n"
             "{\"messages\": [{\"role\": \"user\", \"content\": \"Sum 2+2\"}, {\"role\": \"assistant\", \"content\": \"4\"}]}\n");
  o.out_dir = dir.file("out");
  o.val_fraction = 0;
  o.tokenizer_root = PO_SOURCE_DIR;
  const SftResult r = prepare_sft(o);
  EXPECT_EQ(r.chat_template, "plain");
  EXPECT_EQ(r.train_examples, 2);
  EXPECT_EQ(r.val_examples, 0);
  Tokenizer& t = gpt2();
  std::vector<int32_t> want;
  std::vector<uint8_t> mask;
  auto add = [&](const std::string& text, uint8_t m) {
    const auto ids = t.encode(text);
    want = cat(want, ids);
    mask.insert(mask.end(), ids.size(), m);
  };
  auto eos = [&] {
    want.push_back(Tokenizer::kEndOfText);
    mask.push_back(kMaskLoss);
  };
  const size_t first0 = want.size();
  add("User: Hi\n", 0), add("Assistant:", 0), add(" Hello there\n", kMaskLoss), eos();
  const size_t first1 = want.size();
  add("User: Sum 2+2\n", 0), add("Assistant:", 0), add(" 4\n", kMaskLoss), eos();
  mask[first0] |= kMaskStart;
  mask[first1] |= kMaskStart;
  TokenFile f(r.train_path, Tokenizer::kVocabSize);
  EXPECT_EQ(std::vector<int32_t>(f.tokens().begin(), f.tokens().end()), want);
  EXPECT_EQ(read_mask_file(mask_path(r.train_path), f.size()), mask);
  EXPECT_EQ(r.train_loss_tokens, std::count(mask.begin(), mask.end(), kMaskLoss));
  EXPECT_EQ(TokenFile(r.val_path).size(), 0u);
}

// Llama-2: BOS [INST] ... [/INST] then the reply continued without the
// dummy prefix (" Hello" is "▁Hello", as one encode of the whole turn gives it).
TEST(PrepareSft, Llama2TurnsContinueWithoutTheDummyPrefix) {
  ASSERT_FALSE(testing::llama_fixture_dir().empty()) << testing::kLlamaSetupHint;
  LlamaTokenizer llama = LlamaTokenizer::from_hf_json(testing::llama_fixture_dir() + "/tokenizer.json");
  EXPECT_EQ(llama.encode_continuation(" Hello world"), llama.encode("Hello world"));
  ScratchDir dir;
  SftOptions o;
  o.input = dir.file("d.jsonl");
  write_file(o.input, "{\"prompt\": \"Hi\", \"completion\": \"Hello world\"}\n");
  o.out_dir = dir.file("out");
  o.val_fraction = 0;
  o.tokenizer = testing::llama_fixture_dir() + "/tokenizer.json";
  const SftResult r = prepare_sft(o);
  EXPECT_EQ(r.chat_template, "llama2");
  const auto inst = llama.encode("[INST] Hi [/INST]"), reply = llama.encode_continuation(" Hello world ");
  const std::vector<int32_t> want = cat(cat(cat({LlamaTokenizer::kBos}, inst), reply), {LlamaTokenizer::kEos});
  TokenFile f(r.train_path);
  EXPECT_EQ(std::vector<int32_t>(f.tokens().begin(), f.tokens().end()), want);
  std::vector<uint8_t> mask(want.size(), 0);
  mask[0] = kMaskStart;
  std::fill(mask.begin() + 1 + static_cast<std::ptrdiff_t>(inst.size()), mask.end(), kMaskLoss);
  EXPECT_EQ(read_mask_file(mask_path(r.train_path), f.size()), mask);
}

TEST(PrepareSft, BadRecordsAreOneLineErrorsNamingTheLineAndKeepOldOutputs) {
  ScratchDir dir;
  SftOptions o;
  o.input = dir.file("d.jsonl");
  o.out_dir = dir.file("out");
  o.tokenizer_root = PO_SOURCE_DIR;
  write_file(o.input, "{\"prompt\": \"a\", \"completion\": \"b\"}\n");
  o.val_fraction = 0;
  prepare_sft(o);
  const std::string before = testing::read_file(dir.file("out/train.bin"));
  const std::string in = dir.file("d.jsonl");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"prompt\": \"a\", \"completion\": \"b\"}\n{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n",
       in + ":2: the record has no assistant turn, so the loss would count none of its tokens"},
      {"{\"prompt\": \"a\"\n", in + ":1: not JSON: "},
      {"{\"prompt\": 1E888}\n", in + ":1: not JSON: "},  // a number past double's range (found by fuzz/sft_fuzz)
      {"[1, 2]\n", in + ":1: a record must be a JSON object, got array"},
      {"{\"text\": \"a\"}\n", in + ":1: a record needs \"messages\", or \"prompt\" and \"completion\""},
      {"{\"prompt\": \"a\", \"completion\": 3}\n", in + ":1: \"completion\" must be a string, got number"},
      {"{\"messages\": [{\"role\": \"assistant\"}]}\n", in + ":1: messages[0].content is missing"},
      {"{\"messages\": [{\"role\": \"bot\", \"content\": \"x\"}, {\"role\": \"assistant\", \"content\": \"y\"}]}\n",
       in + ":1: chat template plain: unknown role 'bot'"},
  };
  for (const auto& [text, message] : cases) {
    write_file(o.input, text);
    const std::string e = po::test::error_of([&] { prepare_sft(o); });
    EXPECT_EQ(e.rfind(message, 0), 0u) << "got: " << e << "\nexpected it to start with: " << message;
    EXPECT_EQ(e.find('\n'), std::string::npos) << "not one line: " << e;
  }
  EXPECT_EQ(testing::read_file(dir.file("out/train.bin")), before) << "a failed prepare changed the old output";
}

// Examples of 3, 2, 4, 1 and 7 tokens (the reply: each example's last two
// tokens, when it has them) in rows of T = 6.
struct Examples {
  ScratchDir dir;
  std::string path = dir.file("t.bin");
  std::vector<uint8_t> mask;
  TokenFile file;
  Examples() {
    std::vector<int32_t> tokens;
    for (int len : {3, 2, 4, 1, 7}) {
      for (int k = 0; k < len; ++k) {
        tokens.push_back(static_cast<int32_t>(100 * len + k));
        mask.push_back(static_cast<uint8_t>((k == 0 ? kMaskStart : 0) | (k > 0 && k >= len - 2 ? kMaskLoss : 0)));
      }
    }
    write_token_file(path, tokens);
    write_mask_file(mask_path(path), mask);
    file = TokenFile(path);
  }
};

struct Row {
  std::vector<int32_t> in, tg, pos;
};
Row row(const SftExamples& s, int64_t r) {
  Row out{std::vector<int32_t>(6), std::vector<int32_t>(6), std::vector<int32_t>(6)};
  s.fill_row(r, out.in.data(), out.tg.data(), out.pos.data());
  return out;
}

TEST(SftExamples, OneExamplePerRowPaddedAndCut) {
  Examples e;
  const SftExamples s(e.file, read_mask_file(mask_path(e.path), e.file.size()), 6, false);
  EXPECT_EQ(s.examples(), 5);
  EXPECT_EQ(s.rows(), 5);
  EXPECT_EQ(s.truncated(), 1);
  const Row r0 = row(s, 0);  // 300 301 302, the reply 301 302: the last token has no target
  EXPECT_EQ(r0.in, (std::vector<int32_t>{300, 301, 302, 0, 0, 0}));
  EXPECT_EQ(r0.tg, (std::vector<int32_t>{301, 302, -1, -1, -1, -1}));
  EXPECT_EQ(r0.pos, (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  const Row r4 = row(s, 4);  // 700 .. 706 cut to 6 inputs; the last input's target 706 is the reply's
  EXPECT_EQ(r4.in, (std::vector<int32_t>{700, 701, 702, 703, 704, 705}));
  EXPECT_EQ(r4.tg, (std::vector<int32_t>{-1, -1, -1, -1, 705, 706}));
}

TEST(SftExamples, PackedRowsHoldWholeExamplesAtTheirOwnPositions) {
  Examples e;
  const SftExamples s(e.file, read_mask_file(mask_path(e.path), e.file.size()), 6, true);
  EXPECT_EQ(s.rows(), 3);  // [3, 2], [4, 1], [7 cut to 6]
  const Row r0 = row(s, 0);
  EXPECT_EQ(r0.in, (std::vector<int32_t>{300, 301, 302, 200, 201, 0}));
  EXPECT_EQ(r0.tg, (std::vector<int32_t>{301, 302, -1, 201, -1, -1}));
  EXPECT_EQ(r0.pos, (std::vector<int32_t>{0, 1, 2, 0, 1, 0}));
  const Row r1 = row(s, 1);
  EXPECT_EQ(r1.in, (std::vector<int32_t>{400, 401, 402, 403, 100, 0}));
  EXPECT_EQ(r1.tg, (std::vector<int32_t>{-1, 402, 403, -1, -1, -1}));
  EXPECT_EQ(r1.pos, (std::vector<int32_t>{0, 1, 2, 3, 0, 0}));
}

TEST(SftExamples, TheSamplerCountsTheTargetsItFills) {
  Examples e;
  const SftExamples s(e.file, read_mask_file(mask_path(e.path), e.file.size()), 6, true);
  const BatchSampler b(e.file, 6, 7, &s);
  for (int64_t step = 0; step < 5; ++step) {
    std::vector<int32_t> in(8 * 6), tg(8 * 6), pos(8 * 6);
    b.fill(step, 0, 8, in.data(), tg.data(), pos.data());
    EXPECT_EQ(b.counted_targets(step, 0, 8), std::count_if(tg.begin(), tg.end(), [](int32_t t) { return t >= 0; }))
        << "step " << step;
    EXPECT_GE(b.offset(step, 3), 0);
    EXPECT_LT(b.offset(step, 3), s.rows());
  }
}

TEST(SftExamples, AMaskThatCountsNothingIsRefused) {
  Examples e;
  std::vector<uint8_t> none(e.mask.size(), 0);
  none[0] = kMaskStart;
  EXPECT_EQ(po::test::error_of([&] { SftExamples(e.file, none, 6, false); }),
            mask_path(e.path) + ": the mask counts no token: the loss would be over nothing");
  std::vector<uint8_t> short_mask(e.mask.begin(), e.mask.end() - 1);
  write_mask_file(mask_path(e.path), short_mask);
  EXPECT_EQ(po::test::error_of([&] { read_mask_file(mask_path(e.path), e.file.size()); }),
            mask_path(e.path) + ": masks 16 tokens but its token file has 17");
}

}  // namespace
}  // namespace po::data
