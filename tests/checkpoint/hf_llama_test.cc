// Hugging Face Llama import and export: the safetensors library's own byte
// vectors; a file written as the library writes it (tools/torch_ref/
// st_writer.py) imports and exports back byte-identical; BF16/F16 twins give
// the F32 values after rounding; a directory with an index of 2 shards; the
// shape from config.json, from tensors plus overrides; every inconsistency a
// one-line error naming the file, tensor or key.
#include "checkpoint/hf_llama.h"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/bf16.h"
#include "core/error.h"
#include "core/f16.h"
#include "test_dir.h"

namespace po::checkpoint {
namespace {

using testing::ScratchDir;
using Json = nlohmann::json;
namespace fs = std::filesystem;

const std::string kHf = std::string(PO_SOURCE_DIR) + "/tests/golden/llama_io/hf/";

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void spit(const std::string& path, const std::string& s) {
  std::ofstream(path, std::ios::binary) << s;
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

Json fixture_config() { return Json::parse(slurp(kHf + "config.json")); }

LlamaWeights fixture() { return load_llama(kHf); }

// Writes `w`'s tensors (minus `drop`, plus `extra`) as one file with our
// writer, and `config` beside it unless null; returns the directory.
std::string write_dir(const ScratchDir& d, const std::string& name, const LlamaWeights& w,
                      const Json& config, const std::string& drop = "",
                      const std::vector<StTensorRef>& extra = {}) {
  const std::string dir = d.file(name);
  fs::create_directories(dir);
  std::vector<StTensorRef> refs;
  for (const auto& [n, t] : w.tensors)
    if (n != drop) refs.push_back({n, StDtype::kF32, t.shape, t.values.data()});
  for (const auto& e : extra) refs.push_back(e);
  write_safetensors(dir + "/model.safetensors", refs);
  if (!config.is_null()) spit(dir + "/config.json", config.dump(2));
  return dir;
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

TEST(HfSafetensors, ReproducesTheLibrarysTestVectors) {
  // safetensors/src/tensor.rs: test_serialization, test_empty,
  // test_serialization_forced_alignement.
  const float f[6] = {0, 1, 2, 3, 4, 5};
  const std::string data(reinterpret_cast<const char*>(f), 24);
  const std::string h1 = R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})";
  EXPECT_EQ(serialize_safetensors_hf({{"attn.0", StDtype::kF32, {1, 2, 3}, f}}),
            le64(64) + h1 + data);
  const std::string h2 = R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})";
  EXPECT_EQ(serialize_safetensors_hf({{"attn0", StDtype::kF32, {1, 1, 2, 3}, f}}),
            le64(72) + h2 + "       " + data);
  EXPECT_EQ(serialize_safetensors_hf({}), le64(8) + "{}      ");
  EXPECT_EQ(serialize_safetensors_hf({}, {{"framework", "pt"}}),
            le64(40) + R"({"__metadata__":{"framework":"pt"}})" + "     ");
}

TEST(HfSafetensors, OrdersByDtypeThenName) {
  const uint64_t big[1] = {7};
  const float small[1] = {1};
  const uint16_t half[1] = {2};
  const std::string img = serialize_safetensors_hf({{"b", StDtype::kF32, {1}, small},
                                                    {"z", StDtype::kBF16, {1}, half},
                                                    {"a", StDtype::kF32, {1}, small},
                                                    {"c", StDtype::kI64, {1}, big}});
  auto r = SafetensorsReader::from_bytes(img.data(), img.size(), "mem");
  EXPECT_EQ(r.names(), (std::vector<std::string>{"c", "a", "b", "z"}));
  EXPECT_HAS(img, R"({"c":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},"a":)");
  EXPECT_HAS(error_of([&] {
               serialize_safetensors_hf({{"a", StDtype::kF32, {1}, small}, {"a", StDtype::kBF16, {1}, half}});
             }),
             "duplicate tensor name 'a'");
}

TEST(HfLlama, ReadsTheDirectory) {
  auto r = open_llama(kHf);
  EXPECT_EQ(r->format(), LlamaFormat::kHfDirectory);
  const LlamaShape& s = r->shape();
  EXPECT_EQ(s.dim, 16);
  EXPECT_EQ(s.hidden_dim, 40);
  EXPECT_EQ(s.n_layer, 2);
  EXPECT_EQ(s.n_head, 4);
  EXPECT_EQ(s.n_kv_head, 2);
  EXPECT_EQ(s.vocab_size, 32);
  EXPECT_EQ(s.max_seq_len, 8);
  EXPECT_EQ(s.rms_norm_eps, 1e-5);
  EXPECT_EQ(s.rope_theta, 10000.0);
  EXPECT_FALSE(s.tie_word_embeddings);
  ASSERT_EQ(r->tensors().size(), 2u * 9 + 3);
  EXPECT_EQ(r->tensors()[2].name, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(r->tensors()[3].shape, (tensor::Shape{8, 16}));  // k_proj: 2 kv heads of 4
  EXPECT_EQ(open_llama(kHf + "model.safetensors")->format(), LlamaFormat::kSafetensors);
}

TEST(HfLlama, F32ImportExportIsByteIdentical) {
  ScratchDir d;
  const LlamaWeights w = fixture();
  const std::string out = d.file("model.safetensors");
  write_hf_llama(out, w);
  const std::string a = slurp(kHf + "model.safetensors"), b = slurp(out);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_TRUE(a == b) << "export differs from the library-written file";
  // And it reads back, config.json included, to the same model.
  const LlamaWeights again = load_llama(d.path().string());
  EXPECT_EQ(again.shape, w.shape);
  for (const auto& [name, t] : w.tensors) EXPECT_EQ(again.tensors.at(name).values, t.values) << name;
  const Json cfg = Json::parse(slurp(d.file("config.json")));
  EXPECT_EQ(cfg["architectures"][0], "LlamaForCausalLM");
  EXPECT_EQ(cfg["num_key_value_heads"], 2);
  EXPECT_EQ(cfg["rms_norm_eps"], 1e-5);
}

TEST(HfLlama, Bf16AndF16GiveTheRoundedF32Values) {
  const LlamaWeights w = fixture();
  for (const char* file : {"model_bf16.safetensors", "model_f16.safetensors"}) {
    const bool bf = std::string(file).find("bf16") != std::string::npos;
    const LlamaWeights h = load_llama(kHf + file);
    EXPECT_EQ(h.shape, w.shape) << file;
    for (const auto& [name, t] : w.tensors) {
      const auto& got = h.tensors.at(name).values;
      ASSERT_EQ(got.size(), t.values.size());
      size_t bad = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        const float want = bf ? core::bf16_to_f32(core::f32_to_bf16(t.values[i]))
                              : core::f16_to_f32(core::f32_to_f16(t.values[i]));
        bad += got[i] != want;
      }
      EXPECT_EQ(bad, 0u) << file << ": " << name << ": " << bad << " values differ from rounded F32";
    }
  }
}

TEST(HfLlama, BareFileNeedsTheHeadCount) {
  ScratchDir d;
  const LlamaWeights w = fixture();
  const std::string dir = write_dir(d, "bare", w, Json());
  const std::string file = dir + "/model.safetensors";
  EXPECT_HAS(error_of([&] { open_llama(file); }),
             "model.safetensors: the number of attention heads cannot be read from the tensors: give model.n_head");
  LlamaOverrides ov;
  ov.n_head = 4;
  auto r = open_llama(file, ov);
  EXPECT_EQ(r->shape().n_kv_head, 2);  // k_proj rows / head size
  EXPECT_EQ(r->shape().n_layer, 2);
  EXPECT_EQ(r->shape().hidden_dim, 40);
  EXPECT_EQ(r->shape().rms_norm_eps, 1e-6);  // LlamaConfig's default
  EXPECT_EQ(r->shape().max_seq_len, 2048);
  ov.n_kv_head = 1;
  EXPECT_HAS(error_of([&] { open_llama(file, ov); }),
             "model.n_kv_head = 1 but model.layers.0.self_attn.k_proj.weight has 8 rows = 2 kv heads of 4");
  // Without lm_head, and no config saying otherwise, the head is tied.
  ov.n_kv_head.reset();
  const std::string tied = write_dir(d, "tied", w, Json(), "lm_head.weight");
  EXPECT_TRUE(open_llama(tied + "/model.safetensors", ov)->shape().tie_word_embeddings);
}

TEST(HfLlama, IndexedDirectoryWithTwoShards) {
  ScratchDir d;
  const LlamaWeights w = fixture();
  const std::string dir = d.file("sharded");
  fs::create_directories(dir);
  std::vector<StTensorRef> one, two;
  Json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", Json::object()}};
  for (const auto& [n, t] : w.tensors) {
    const bool first = n.find("layers.1.") == std::string::npos && n != "lm_head.weight";
    (first ? one : two).push_back({n, StDtype::kF32, t.shape, t.values.data()});
    index["weight_map"][n] = first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  write_safetensors_hf(dir + "/model-00001-of-00002.safetensors", one, {{"format", "pt"}});
  write_safetensors_hf(dir + "/model-00002-of-00002.safetensors", two, {{"format", "pt"}});
  spit(dir + "/model.safetensors.index.json", index.dump(2));
  spit(dir + "/config.json", fixture_config().dump(2));
  auto r = HfLlamaReader::open(dir);
  EXPECT_EQ(r->shape(), w.shape);
  EXPECT_NE(r->file_of("lm_head.weight").origin().find("model-00002-of-00002"), std::string::npos);
  const LlamaWeights got = r->load_all();
  for (const auto& [name, t] : w.tensors) EXPECT_EQ(got.tensors.at(name).values, t.values) << name;

  // A missing shard names the shard and a tensor mapped to it.
  fs::remove(dir + "/model-00002-of-00002.safetensors");
  std::string e;
  try {
    HfLlamaReader::open(dir);
  } catch (const core::IoError& x) {
    e = x.what();
  }
  EXPECT_HAS(e, "model.safetensors.index.json: shard model-00002-of-00002.safetensors (holding '");
  EXPECT_HAS(e, "') is missing");
  // A weight map naming a tensor its shard does not hold.
  index["weight_map"]["lm_head.weight"] = "model-00001-of-00002.safetensors";
  for (auto& [n, f] : index["weight_map"].items()) f = "model-00001-of-00002.safetensors";
  spit(dir + "/model.safetensors.index.json", index.dump(2));
  EXPECT_HAS(error_of([&] { HfLlamaReader::open(dir); }),
             "model-00001-of-00002.safetensors, which has no such tensor");
  EXPECT_THROW(HfLlamaReader::open(d.file("nothing-here")), core::IoError);
}

TEST(HfLlama, ConfigDisagreeingWithTheTensors) {
  ScratchDir d;
  const LlamaWeights w = fixture();
  auto error_with = [&](const char* key, const Json& value) {
    Json c = fixture_config();
    c[key] = value;
    const std::string dir = write_dir(d, std::string("c_") + key, w, c);
    return error_of([&] { open_llama(dir); });
  };
  EXPECT_HAS(error_with("num_key_value_heads", 4),
             "config.json: num_key_value_heads = 4 but model.layers.0.self_attn.k_proj.weight has 8 rows = 2 kv heads of 4");
  EXPECT_HAS(error_with("hidden_size", 32),
             "config.json: hidden_size = 32 but model.embed_tokens.weight has 16 columns");
  EXPECT_HAS(error_with("vocab_size", 33), "config.json: vocab_size = 33 but model.embed_tokens.weight has 32 rows");
  EXPECT_HAS(error_with("intermediate_size", 48),
             "config.json: intermediate_size = 48 but model.layers.0.mlp.gate_proj.weight has 40 rows");
  EXPECT_HAS(error_with("num_hidden_layers", 3), "config.json: num_hidden_layers = 3 but the tensors have layers 0..1");
  EXPECT_HAS(error_with("num_attention_heads", 3), "hidden_size 16 is not divisible by num_attention_heads 3");
  EXPECT_HAS(error_with("head_dim", 8), "config.json: head_dim = 8 but hidden_size / num_attention_heads = 4");
  EXPECT_HAS(error_with("hidden_size", "16"), "config.json: hidden_size = \"16\" is not an integer");
  EXPECT_HAS(error_with("rope_scaling", Json{{"rope_type", "linear"}, {"factor", 2.0}}),
             "config.json: rope_scaling type \"linear\" is not supported");
  {  // untied in config.json, but no lm_head
    const std::string dir = write_dir(d, "nohead", w, fixture_config(), "lm_head.weight");
    EXPECT_HAS(error_of([&] { open_llama(dir); }),
               "config.json: tie_word_embeddings = false but lm_head.weight is missing");
  }
  {  // tied in config.json: a stored lm_head is ignored, as transformers does
    Json c = fixture_config();
    c["tie_word_embeddings"] = true;
    auto r = open_llama(write_dir(d, "tied", w, c));
    EXPECT_TRUE(r->shape().tie_word_embeddings);
    EXPECT_EQ(r->tensors().size(), 2u * 9 + 2);
  }
  {  // Llama-3.1 rope scaling
    Json c = fixture_config();
    c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                         {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
    auto r = open_llama(write_dir(d, "rs", w, c));
    ASSERT_TRUE(r->shape().rope_scaling.has_value());
    EXPECT_EQ(*r->shape().rope_scaling, (RopeScaling{8.0, 1.0, 4.0, 8192}));
    ScratchDir out;
    write_hf_llama(out.file("model.safetensors"), r->load_all());
    EXPECT_EQ(load_llama(out.path().string()).shape.rope_scaling, r->shape().rope_scaling);
  }
}

TEST(HfLlama, BadTensors) {
  ScratchDir d;
  const LlamaWeights w = fixture();
  const Json c = fixture_config();
  EXPECT_HAS(error_of([&] { open_llama(write_dir(d, "m", w, c, "model.layers.1.mlp.up_proj.weight")); }),
             "missing tensor 'model.layers.1.mlp.up_proj.weight'");
  const float bias[16] = {};
  EXPECT_HAS(error_of([&] {
               open_llama(write_dir(d, "b", w, c, "", {{"model.layers.0.self_attn.q_proj.bias", StDtype::kF32, {16}, bias}}));
             }),
             "unexpected tensor 'model.layers.0.self_attn.q_proj.bias'");
  // inv_freq buffers of older files are ignored.
  EXPECT_NO_THROW(open_llama(
      write_dir(d, "f", w, c, "", {{"model.layers.0.self_attn.rotary_emb.inv_freq", StDtype::kF32, {2}, bias}})));
  {  // An integer dtype.
    LlamaWeights v = w;
    v.tensors.erase("model.norm.weight");
    const int32_t ints[16] = {};
    EXPECT_HAS(error_of([&] {
                 open_llama(write_dir(d, "i", v, c, "", {{"model.norm.weight", StDtype::kI32, {16}, ints}}));
               }),
               "tensor 'model.norm.weight' has dtype I32; F32, BF16 or F16 expected");
  }
  {  // A misshapen tensor.
    LlamaWeights v = w;
    v.tensors["model.layers.1.mlp.down_proj.weight"].shape = {40, 16};
    EXPECT_HAS(error_of([&] { open_llama(write_dir(d, "s", v, c)); }),
               "tensor 'model.layers.1.mlp.down_proj.weight' has shape [40, 16], expected [16, 40]");
  }
  {  // A dtype the format does not know.
    std::string img = slurp(kHf + "model.safetensors");
    const size_t at = img.find("\"F32\"", img.find("model.norm.weight"));
    img.replace(at, 5, "\"Q4K\"");
    const std::string dir = d.file("u");
    fs::create_directories(dir);
    spit(dir + "/model.safetensors", img);
    EXPECT_HAS(error_of([&] { open_llama(dir); }), "model.safetensors: tensor 'model.norm.weight': unknown dtype \"Q4K\"");
  }
}

TEST(HfLlama, OverridesAgainstConfig) {
  LlamaOverrides ov;
  ov.n_kv_head = 1;
  EXPECT_HAS(error_of([&] { open_llama(kHf, ov); }), "model.n_kv_head = 1 but config.json num_key_value_heads = 2");
  ov = {};
  ov.rms_norm_eps = 1e-6;
  EXPECT_HAS(error_of([&] { open_llama(kHf, ov); }), "model.norm_eps = 1e-06 but config.json rms_norm_eps = 1e-05");
  ov = {};
  ov.dim = 32;
  EXPECT_HAS(error_of([&] { open_llama(kHf, ov); }), "model.n_embd = 32 but config.json hidden_size = 16");
  ov = {};
  ov.n_head = 4;
  ov.dim = 16;
  ov.max_seq_len = 4;
  EXPECT_EQ(open_llama(kHf, ov)->shape().max_seq_len, 4);
}

TEST(HfLlama, WriterChecksTheTensors) {
  ScratchDir d;
  LlamaWeights w = fixture();
  w.tensors.erase("model.norm.weight");
  EXPECT_HAS(error_of([&] { write_hf_llama(d.file("x.safetensors"), w); }), "missing tensor 'model.norm.weight'");
  w = fixture();
  w.tensors["extra"] = LlamaTensor{{1}, {0.f}};
  EXPECT_HAS(error_of([&] { write_hf_llama(d.file("x.safetensors"), w); }), "unexpected tensor 'extra'");
  w = fixture();
  w.shape.n_kv_head = 3;
  EXPECT_HAS(error_of([&] { write_hf_llama(d.file("x.safetensors"), w); }),
             "num_attention_heads 4 is not divisible by num_key_value_heads 3");
}

}  // namespace
}  // namespace po::checkpoint
