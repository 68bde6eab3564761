// Llama import paths in process (train/model_setup): a llama2.c checkpoint and
// the same weights as Hugging Face safetensors build the same model and give
// the same logits, bit for bit (the RoPE row permutation at import is exact);
// each matches its own reference implementation in float64
// (tests/golden/llama_io/ref_logits.safetensors, made by
// tools/torch_ref/make_llama_io.py: llama2.c's run.c forward with interleaved
// RoPE on the unpermuted weights, and the HF math with rotate-half RoPE on the
// permuted ones) to 1e-5; BF16 and F16 files load as their F32 twin rounded.
// Cases: llama2.c legacy and version 1, tied and untied head.
#include "train/model_setup.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "../test_util.h"
#include "checkpoint/model_io.h"
#include "checkpoint/llama_weights.h"
#include "checkpoint/safetensors.h"
#include "core/bf16.h"
#include "core/f16.h"
#include "model/transformer.h"

namespace {

namespace fs = std::filesystem;
using po::checkpoint::SafetensorsReader;
using po::model::Transformer;
using po::model::TransformerConfig;

const std::string kDir = std::string(PO_SOURCE_DIR) + "/tests/golden/llama_io/";

// The HF twin of a tied llama2.c file: hf/model.safetensors without
// lm_head.weight, config.json saying tie_word_embeddings = true.
std::string tied_hf_twin(const po::test::TempDir& dir) {
  const std::string out = dir / "hf_tied";
  fs::create_directories(out);
  const auto reader = po::checkpoint::open_llama(kDir + "hf");
  std::vector<std::vector<float>> values;
  std::vector<po::checkpoint::StTensorRef> refs;
  for (const auto& t : reader->tensors()) {
    if (t.name == "lm_head.weight") continue;
    values.push_back(reader->read(t.name));
  }
  size_t i = 0;
  for (const auto& t : reader->tensors())
    if (t.name != "lm_head.weight") refs.push_back({t.name, po::checkpoint::StDtype::kF32, t.shape, values[i++].data()});
  po::checkpoint::write_safetensors_hf(out + "/model.safetensors", refs, {{"format", "pt"}});
  nlohmann::json cfg = nlohmann::json::parse(po::test::read_file(kDir + "hf/config.json"));
  cfg["tie_word_embeddings"] = true;
  po::test::write_file(out + "/config.json", cfg.dump(2) + "\n");
  return out;
}

struct Loaded {
  TransformerConfig config;
  std::unique_ptr<Transformer> model;
};

// A whole model of the file's shape (batch 1, its sequence length) holding its weights.
Loaded load(const std::string& path) {
  Loaded l;
  l.config = po::checkpoint::llama_file_config(path);
  l.config.fill_derived();
  l.model = std::make_unique<Transformer>(l.config, 1, l.config.seq_len);
  po::checkpoint::load_model_weights(path, *l.model);
  return l;
}

// Logits [T, V] of tokens[0..T) by next_token_logits (prefix recomputed for
// each position), by forward_cached one token at a time, and by
// forward_cached on the whole sequence (the last position only).
struct Logits {
  std::vector<float> recompute, cached;
  std::vector<float> whole_last;
};

Logits logits_of(Transformer& m, const std::vector<int32_t>& tokens) {
  const auto V = static_cast<size_t>(m.config().vocab_size);
  const auto T = static_cast<int64_t>(tokens.size());
  Logits out;
  out.recompute.resize(T * V);
  out.cached.resize(T * V);
  out.whole_last.resize(V);
  for (int64_t t = 0; t < T; ++t) m.next_token_logits(tokens.data(), t + 1, out.recompute.data() + t * V);
  po::model::KvCache cache = m.make_kv_cache(T);
  for (int64_t t = 0; t < T; ++t) m.forward_cached(tokens.data() + t, 1, cache, out.cached.data() + t * V);
  po::model::KvCache whole = m.make_kv_cache(T);
  m.forward_cached(tokens.data(), T, whole, out.whole_last.data());
  return out;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) d = std::max(d, std::fabs(double(a[i]) - double(b[i])));
  return d;
}

size_t count_different(const std::vector<float>& a, const std::vector<float>& b) {
  size_t n = a.size() == b.size() ? 0 : std::max(a.size(), b.size());
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) n += std::memcmp(&a[i], &b[i], 4) != 0;
  return n;
}

struct Golden {
  std::vector<int32_t> tokens;
  std::vector<float> logits;  // [T, V]
};

Golden golden(const std::string& name, int64_t V) {
  const auto f = SafetensorsReader::open(kDir + "ref_logits.safetensors");
  const auto& t = f.get("tokens");
  EXPECT_EQ(t.dtype, po::checkpoint::StDtype::kI32);
  Golden g;
  g.tokens.resize(t.nbytes / 4);
  std::memcpy(g.tokens.data(), t.data, t.nbytes);
  const auto T = static_cast<int64_t>(g.tokens.size());
  g.logits = f.read_f32(name, {T, V});
  return g;
}

struct Case {
  const char* l2c;
  bool tied;
};
const Case kCases[] = {{"l2c_legacy.bin", false}, {"l2c_v1.bin", false},
                       {"l2c_legacy_tied.bin", true}, {"l2c_v1_tied.bin", true}};

TEST(LlamaImport, Llama2cAndItsHfTwinGiveTheSameLogits) {
  po::test::TempDir dir;
  const std::string tied_twin = tied_hf_twin(dir);
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.l2c);
    const std::string hf = c.tied ? tied_twin : kDir + "hf";
    Loaded a = load(kDir + c.l2c), b = load(hf);
    ASSERT_TRUE(po::checkpoint::is_llama_weights(kDir + c.l2c));
    EXPECT_EQ(a.config.tie_embeddings, c.tied);
    EXPECT_EQ(b.config.tie_embeddings, c.tied);
    for (auto* m : {&a.config, &b.config}) {
      EXPECT_EQ(m->arch, "llama");
      EXPECT_EQ(m->n_layer, 2);
      EXPECT_EQ(m->n_embd, 16);
      EXPECT_EQ(m->n_head, 4);
      EXPECT_EQ(m->n_kv_head, 2);
      EXPECT_EQ(m->ffn_hidden, 40);
      EXPECT_EQ(m->vocab_size, 32);
      EXPECT_EQ(m->seq_len, 8);
    }
    EXPECT_EQ(a.config.norm_eps, b.config.norm_eps);
    EXPECT_EQ(a.config.rope_theta, b.config.rope_theta);
    ASSERT_EQ(a.model->num_params(), b.model->num_params());
    EXPECT_EQ(std::memcmp(a.model->params(), b.model->params(), a.model->num_params() * 4), 0)
        << "the loaded parameters differ";
    const std::vector<int32_t> tokens = golden("hf.untied", 32).tokens;
    const Logits la = logits_of(*a.model, tokens), lb = logits_of(*b.model, tokens);
    EXPECT_EQ(count_different(la.recompute, lb.recompute), 0u)
        << "next_token_logits: max |diff| " << max_abs_diff(la.recompute, lb.recompute);
    EXPECT_EQ(count_different(la.cached, lb.cached), 0u)
        << "forward_cached: max |diff| " << max_abs_diff(la.cached, lb.cached);
    EXPECT_EQ(count_different(la.whole_last, lb.whole_last), 0u);
  }
}

TEST(LlamaImport, EachMatchesItsOwnReference) {
  po::test::TempDir dir;
  const std::string tied_twin = tied_hf_twin(dir);
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.l2c);
    const std::string suffix = c.tied ? "tied" : "untied";
    for (const auto& [path, ref] : {std::pair{kDir + c.l2c, "llama2c." + suffix},
                                    std::pair{c.tied ? tied_twin : kDir + "hf", "hf." + suffix}}) {
      SCOPED_TRACE(ref);
      Loaded l = load(path);
      const Golden g = golden(ref, l.config.vocab_size);
      const Logits got = logits_of(*l.model, g.tokens);
      const double scale = std::fabs(*std::max_element(g.logits.begin(), g.logits.end(),
                                                       [](float x, float y) { return std::fabs(x) < std::fabs(y); }));
      const double d_recompute = max_abs_diff(got.recompute, g.logits);
      const double d_cached = max_abs_diff(got.cached, g.logits);
      const auto V = static_cast<size_t>(l.config.vocab_size);
      const std::vector<float> last(g.logits.end() - static_cast<std::ptrdiff_t>(V), g.logits.end());
      std::printf("  %-20s vs %-15s max |logit| %.3f, max |diff| recompute %.3g, cached %.3g, whole %.3g\n",
                  fs::path(path).filename().c_str(), ref.c_str(), scale, d_recompute, d_cached,
                  max_abs_diff(got.whole_last, last));
      EXPECT_LE(d_recompute, 1e-5);  // |logit| up to ~7: absolute 1e-5 is ~1.5e-6 relative
      EXPECT_LE(d_cached, 1e-5);
      EXPECT_LE(max_abs_diff(got.whole_last, last), 1e-5);
    }
  }
}

TEST(LlamaImport, Bf16AndF16LoadAsTheRoundedF32Twin) {
  Loaded f32 = load(kDir + "hf/model.safetensors");
  for (const char* file : {"model_bf16.safetensors", "model_f16.safetensors"}) {
    SCOPED_TRACE(file);
    const bool bf = std::string(file).find("bf16") != std::string::npos;
    Loaded h = load(kDir + "hf/" + file);
    ASSERT_EQ(h.model->num_params(), f32.model->num_params());
    size_t bad = 0;
    for (int64_t i = 0; i < f32.model->num_params(); ++i) {
      const float x = f32.model->params()[i];
      const float want = bf ? po::core::bf16_to_f32(po::core::f32_to_bf16(x))
                            : po::core::f16_to_f32(po::core::f32_to_f16(x));
      bad += std::memcmp(&want, &h.model->params()[i], 4) != 0;
    }
    EXPECT_EQ(bad, 0u) << bad << " parameters differ from the F32 twin rounded";
  }
}

}  // namespace
