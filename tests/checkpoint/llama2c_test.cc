// llama2.c checkpoints: legacy and version-1 files written by llama2.c's own
// export logic (tools/torch_ref/make_llama_io.py) read to the same HF-named
// tensors as their HF twin (wq/wk permuted by llama2.c's hf_export); the RoPE
// row permutation on known values; every bad header and size rejected in one
// line naming the file.
#include "checkpoint/llama2c.h"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <fstream>
#include <sstream>

#include "checkpoint/hf_llama.h"
#include "core/error.h"
#include "test_dir.h"

namespace po::checkpoint {
namespace {

using testing::ScratchDir;

const std::string kDir = std::string(PO_SOURCE_DIR) + "/tests/golden/llama_io/";

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const core::Error& e) {
    return e.what();
  }
  return "<no error>";
}

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << (haystack)

void put_i32(std::string& s, size_t at, int32_t v) { std::memcpy(s.data() + at, &v, 4); }

// The HF twin's tensors; a tied file's twin has no lm_head.
void expect_same_as_hf_twin(const std::string& file, bool tied) {
  auto l2c = open_llama(kDir + file);
  auto hf = HfLlamaReader::open(kDir + "hf");
  EXPECT_EQ(l2c->shape().tie_word_embeddings, tied) << file;
  EXPECT_EQ(l2c->tensors().size(), hf->tensors().size() - (tied ? 1 : 0)) << file;
  for (const auto& t : l2c->tensors()) {
    const std::vector<float> a = l2c->read(t.name);
    const std::vector<float> b = hf->read(t.name == "lm_head.weight" && tied ? "model.embed_tokens.weight" : t.name);
    ASSERT_EQ(a.size(), b.size()) << file << " " << t.name;
    size_t diff = 0;
    for (size_t i = 0; i < a.size(); ++i) diff += a[i] != b[i];
    EXPECT_EQ(diff, 0u) << file << ": " << t.name << " differs in " << diff << " of " << a.size()
                        << " values from the HF twin";
  }
}

TEST(Llama2c, LegacyAndV1ReadAsTheirHfTwin) {
  expect_same_as_hf_twin("l2c_legacy.bin", false);
  expect_same_as_hf_twin("l2c_legacy_tied.bin", true);
  expect_same_as_hf_twin("l2c_v1.bin", false);
  expect_same_as_hf_twin("l2c_v1_tied.bin", true);
}

TEST(Llama2c, HeaderAndShape) {
  auto legacy = Llama2cReader::open(kDir + "l2c_legacy.bin");
  EXPECT_EQ(legacy->format(), LlamaFormat::kLlama2cLegacy);
  EXPECT_EQ(legacy->header().header_bytes, 28u);
  EXPECT_FALSE(legacy->header().shared_classifier);  // negative vocab_size
  auto v1 = Llama2cReader::open(kDir + "l2c_v1_tied.bin");
  EXPECT_EQ(v1->format(), LlamaFormat::kLlama2cV1);
  EXPECT_EQ(v1->header().header_bytes, 256u);
  const LlamaShape& s = v1->shape();
  EXPECT_EQ(s.dim, 16);
  EXPECT_EQ(s.hidden_dim, 40);
  EXPECT_EQ(s.n_layer, 2);
  EXPECT_EQ(s.n_head, 4);
  EXPECT_EQ(s.n_kv_head, 2);
  EXPECT_EQ(s.vocab_size, 32);
  EXPECT_EQ(s.max_seq_len, 8);
  EXPECT_EQ(s.rms_norm_eps, 1e-5);
  EXPECT_EQ(s.rope_theta, 10000.0);
  EXPECT_TRUE(s.tie_word_embeddings);
  EXPECT_FALSE(s.rope_scaling.has_value());
}

// A legacy file whose every float is its own index within its array, wq's and
// wk's rows all equal to the row number.
std::string synthetic_legacy(int dim, int hidden, int layers, int heads, int kv, int vocab, int seq) {
  std::string s(28, '\0');
  const int32_t h[7] = {dim, hidden, layers, heads, kv, vocab, seq};
  std::memcpy(s.data(), h, 28);
  const int hs = dim / heads;
  auto add = [&](int64_t rows, int64_t cols, bool row_valued) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        float v = row_valued ? static_cast<float>(r) : static_cast<float>(r * cols + c);
        s.append(reinterpret_cast<const char*>(&v), 4);
      }
  };
  add(vocab, dim, false);                                            // embedding
  for (int l = 0; l < layers; ++l) add(1, dim, false);               // rms_att
  for (int l = 0; l < layers; ++l) add(dim, dim, true);              // wq
  for (int l = 0; l < layers; ++l) add(kv * hs, dim, true);          // wk
  for (int l = 0; l < layers; ++l) add(kv * hs, dim, false);         // wv
  for (int l = 0; l < layers; ++l) add(dim, dim, false);             // wo
  for (int l = 0; l < layers; ++l) add(1, dim, false);               // rms_ffn
  for (int l = 0; l < 3 * layers; ++l) add(hidden, dim, false);      // w1, w2, w3
  add(1, dim, false);                                                // rms_final
  add(2 * seq, hs / 2, false);                                       // freq_cis
  return s;
}

TEST(Llama2c, RopePermutationOnKnownValues) {
  const int dim = 24, heads = 4, kv = 2, hs = dim / heads;
  const std::string img = synthetic_legacy(dim, 8, 1, heads, kv, 5, 3);
  auto r = Llama2cReader::from_bytes(img.data(), img.size(), "mem.bin");
  const auto q = r->read("model.layers.0.self_attn.q_proj.weight");
  const auto k = r->read("model.layers.0.self_attn.k_proj.weight");
  const auto v = r->read("model.layers.0.self_attn.v_proj.weight");
  // HF row h*hs + s*(hs/2) + i holds llama2.c row h*hs + 2*i + s.
  for (int h = 0; h < heads; ++h)
    for (int s = 0; s < 2; ++s)
      for (int i = 0; i < hs / 2; ++i) {
        const int to = h * hs + s * (hs / 2) + i, from = h * hs + 2 * i + s;
        EXPECT_EQ(q[static_cast<size_t>(to * dim + 5)], from) << "q row " << to;
        if (h < kv) {
          EXPECT_EQ(k[static_cast<size_t>(to * dim)], from) << "k row " << to;
        }
      }
  // Head 0 of q: rows 0..5 come from llama2.c rows 0, 2, 4, 1, 3, 5.
  const float head0[6] = {0, 2, 4, 1, 3, 5};
  for (int row = 0; row < 6; ++row) EXPECT_EQ(q[static_cast<size_t>(row * dim)], head0[row]);
  // v is not rotated: unchanged.
  for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(v[i], static_cast<float>(i));
  // w1 -> gate, w3 -> up, w2 -> down: the arrays follow in that file order.
  EXPECT_EQ(r->read("model.layers.0.mlp.gate_proj.weight").size(), 8u * dim);
}

TEST(Llama2c, TruncatedAndOversizedFiles) {
  const std::string img = slurp(kDir + "l2c_legacy.bin");
  std::string cut = img.substr(0, img.size() - 4);
  std::string e = error_of([&] { Llama2cReader::from_bytes(cut.data(), cut.size(), "cut.bin"); });
  EXPECT_HAS(e, "cut.bin: truncated llama2.c checkpoint");
  EXPECT_HAS(e, core::str_cat("needs ", img.size(), " bytes, the file has ", img.size() - 4));
  std::string longer = img + std::string(8, '\0');
  EXPECT_HAS(error_of([&] { Llama2cReader::from_bytes(longer.data(), longer.size(), "long.bin"); }),
             "long.bin: llama2.c checkpoint has 8 bytes more than the");
  EXPECT_HAS(error_of([&] { Llama2cReader::from_bytes(img.data(), 3, "tiny.bin"); }),
             "tiny.bin: truncated llama2.c checkpoint: 3 bytes");
  const std::string v1 = slurp(kDir + "l2c_v1.bin");
  EXPECT_HAS(error_of([&] { Llama2cReader::from_bytes(v1.data(), 100, "v1.bin"); }),
             "v1.bin: truncated llama2.c checkpoint: expected a 256-byte version header, file has 100");
  // A missing file is an IoError.
  EXPECT_THROW(Llama2cReader::open(kDir + "no-such.bin"), core::IoError);
}

TEST(Llama2c, ImpossibleHeaders) {
  const std::string img = slurp(kDir + "l2c_legacy.bin");
  auto with = [&](size_t field, int32_t v) {
    std::string s = img;
    put_i32(s, field * 4, v);
    return error_of([&] { Llama2cReader::from_bytes(s.data(), s.size(), "bad.bin"); });
  };
  EXPECT_HAS(with(0, 0), "bad.bin: impossible llama2.c header: dim = 0 must be positive");
  EXPECT_HAS(with(1, -3), "hidden_dim = -3 must be positive");
  EXPECT_HAS(with(2, 0), "n_layers = 0 must be positive");
  EXPECT_HAS(with(4, 0), "n_kv_heads = 0 must be positive");
  EXPECT_HAS(with(6, 0), "seq_len = 0 must be positive");
  EXPECT_HAS(with(5, 0), "vocab_size = 0 must be positive");
  EXPECT_HAS(with(3, 5), "dim = 16 is not divisible by n_heads = 5");
  EXPECT_HAS(with(4, 3), "n_heads = 4 is not divisible by n_kv_heads = 3");
  EXPECT_HAS(with(3, 16), "head size 1 (dim / n_heads) is odd");
  EXPECT_HAS(with(5, INT32_MIN), "vocab_size = -2147483648 is out of range");
  {  // Sizes whose byte count overflows 64 bits.
    std::string s = img;
    put_i32(s, 0, 1 << 30);
    put_i32(s, 4, INT32_MAX);
    put_i32(s, 8, INT32_MAX);
    put_i32(s, 12, 2);
    put_i32(s, 16, 2);
    EXPECT_HAS(error_of([&] { Llama2cReader::from_bytes(s.data(), s.size(), "big.bin"); }),
               "overflow a 64-bit byte count");
  }
  {  // Large but representable sizes: a truncation, not a crash.
    std::string s = img;
    put_i32(s, 0, 4096);
    put_i32(s, 3 * 4, 32);
    put_i32(s, 4 * 4, 8);
    EXPECT_HAS(error_of([&] { Llama2cReader::from_bytes(s.data(), s.size(), "big.bin"); }),
               "big.bin: truncated llama2.c checkpoint");
  }
  std::string v1 = slurp(kDir + "l2c_v1.bin");
  put_i32(v1, 4, 2);
  EXPECT_HAS(error_of([&] { Llama2cReader::from_bytes(v1.data(), v1.size(), "q8.bin"); }),
             "q8.bin: llama2.c checkpoint version 2 is not supported");
  v1 = slurp(kDir + "l2c_v1.bin");
  v1[8 + 28] = 7;
  EXPECT_HAS(error_of([&] { Llama2cReader::from_bytes(v1.data(), v1.size(), "flag.bin"); }),
             "flag.bin: header shared_classifier = 7 is not 0 or 1");
}

TEST(Llama2c, Overrides) {
  const std::string path = kDir + "l2c_v1.bin";
  LlamaOverrides ov;
  ov.n_head = 4;
  ov.n_kv_head = 2;
  ov.rms_norm_eps = 1e-6;  // the file states none: the caller's wins
  ov.rope_theta = 500000.0;
  ov.max_seq_len = 4;      // lowering is allowed
  auto r = open_llama(path, ov);
  EXPECT_EQ(r->shape().rms_norm_eps, 1e-6);
  EXPECT_EQ(r->shape().rope_theta, 500000.0);
  EXPECT_EQ(r->shape().max_seq_len, 4);

  LlamaOverrides heads;
  heads.n_head = 2;
  EXPECT_HAS(error_of([&] { open_llama(path, heads); }),
             "l2c_v1.bin: model.n_head = 2 but the header has n_heads = 4");
  LlamaOverrides tie;
  tie.tie_word_embeddings = true;
  EXPECT_HAS(error_of([&] { open_llama(path, tie); }),
             "model.tie_embeddings = true but the file holds a separate classifier");
  LlamaOverrides longer;
  longer.max_seq_len = 16;
  EXPECT_HAS(error_of([&] { open_llama(path, longer); }),
             "model.seq_len = 16 but the header has seq_len = 8 (it may be lowered, not raised)");
  LlamaOverrides ffn;
  ffn.hidden_dim = 64;
  EXPECT_HAS(error_of([&] { open_llama(path, ffn); }),
             "model.ffn_hidden = 64 but the header has hidden_dim = 40");
}

TEST(Llama2c, ReadRejectsUnknownNames) {
  auto r = open_llama(kDir + "l2c_v1_tied.bin");
  EXPECT_HAS(error_of([&] { r->read("lm_head.weight"); }), "the model has no tensor 'lm_head.weight'");
}

}  // namespace
}  // namespace po::checkpoint
