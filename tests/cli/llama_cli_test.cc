// Llama import and export through the real binary (PO_BINARY), on the
// fixtures of tests/golden/llama_io (tools/torch_ref/make_llama_io.py):
//   - F32 Hugging Face input -> `train` (model.init, one step at lr 0) ->
//     `export` is byte-identical to the input, config.json beside it; so is a
//     direct `export` of the file;
//   - a BF16 file trains exactly as an F32 file holding its F32 twin rounded
//     to bf16 (every loss and the final weights bit for bit);
//   - `generate --temperature 0 --print-ids` on a llama2.c .bin and on its
//     HF twin (written by `export`) print the same ids;
//   - bad input: one "pagedoptim: error:" line naming the file, tensor or key,
//     a non-zero exit, no crash, no run directory.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../test_util.h"
#include "checkpoint/safetensors.h"
#include "core/bf16.h"
#include "train/run_state.h"

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using po::test::run_command;

const std::string kBin = PO_BINARY;
const std::string kDir = std::string(PO_SOURCE_DIR) + "/tests/golden/llama_io/";

// Expects failure with a single "pagedoptim: error:" line containing every needle.
void expect_clean_error(const po::test::CommandResult& r, const std::vector<std::string>& needles) {
  EXPECT_NE(r.exit_code, 0) << "expected failure, output:\n" << r.output;
  EXPECT_LT(r.exit_code, 128) << "crashed (signal " << r.exit_code - 128 << "):\n" << r.output;
  const auto pos = r.output.find("pagedoptim: error: ");
  ASSERT_NE(pos, std::string::npos) << "no error line in:\n" << r.output;
  const std::string line = r.output.substr(pos, r.output.find('\n', pos) - pos);
  for (const auto& n : needles)
    EXPECT_NE(line.find(n), std::string::npos) << "error line lacks '" << n << "': " << line;
  EXPECT_EQ(r.output.find("terminate called"), std::string::npos) << r.output;
}

void put_i32(std::string& s, size_t at, int32_t v) { std::memcpy(s.data() + at, &v, 4); }

// Token ids after "ids:" in generate's output.
std::vector<int> printed_ids(const std::string& output) {
  const auto pos = output.find("ids:");
  if (pos == std::string::npos) return {};
  std::istringstream in(output.substr(pos + 4, output.find('\n', pos) - pos - 4));
  std::vector<int> ids;
  for (int id; in >> id;) ids.push_back(id);
  return ids;
}

class LlamaCli : public ::testing::Test {
 protected:
  void SetUp() override {
    po::test::write_tokens(train_, 4000, 32);  // the fixtures' vocabulary
  }
  // A config training the model of `init` (its shape from the file) for `steps`.
  std::string config(const std::string& init, int steps, double lr) const {
    std::ostringstream os;
    os << "[model]\ninit = \"" << init << "\"\n"
       << "[train]\nbatch_size = 4\nmicro_batch_size = 2\nsteps = " << steps << "\nlr = " << lr
       << "\nmin_lr = 0\nwarmup_steps = 0\nweight_decay = " << (lr == 0 ? 0.0 : 0.1)
       << "\nthreads = 1\ncheckpoint_interval = " << steps << "\n"
       << "[data]\ntrain = \"" << train_ << "\"\n";
    return os.str();
  }
  // `train` from `init`; returns the run directory (dir_/name).
  std::string train_ok(const std::string& name, const std::string& init, int steps, double lr,
                       const std::string& extra = "") const {
    const std::string cfg = dir_ / (name + ".toml");
    po::test::write_file(cfg, config(init, steps, lr));
    const std::string run = dir_ / name;
    const auto r = run_command(kBin + " train -c " + cfg + " --set run.dir=" + run + " " + extra);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return run;
  }
  po::test::CommandResult train_fails(const std::string& init, const std::string& extra = "") const {
    const std::string cfg = dir_ / "bad.toml";
    po::test::write_file(cfg, config(init, 1, 1e-3));
    auto r = run_command(kBin + " train -c " + cfg + " --set run.dir=" + (dir_ / "bad_run") + " " + extra);
    EXPECT_FALSE(fs::exists(dir_ / "bad_run")) << "a failed start must not create the run directory";
    return r;
  }
  po::test::TempDir dir_;
  std::string train_ = dir_ / "train.bin";
};

TEST_F(LlamaCli, F32ImportExportIsByteIdentical) {
  const std::string input = po::test::read_file(kDir + "hf/model.safetensors");
  ASSERT_FALSE(input.empty());
  const Json input_cfg = Json::parse(po::test::read_file(kDir + "hf/config.json"));
  // Through a run (the HF directory and the single file as model.init), and directly.
  const std::vector<std::pair<std::string, std::string>> sources = {
      {"dir", train_ok("run_dir", kDir + "hf", 1, 0.0) + "/checkpoints/step_00000001"},
      {"file", train_ok("run_file", kDir + "hf/model.safetensors", 1, 0.0)},
      {"direct", kDir + "hf/model.safetensors"}};
  for (const auto& [name, src] : sources) {
    SCOPED_TRACE(name);
    fs::create_directories(dir_ / ("out_" + name));
    const std::string out = dir_ / ("out_" + name + "/model.safetensors");
    const auto r = run_command(kBin + " export " + src + " --out " + out);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::string got = po::test::read_file(out);
    EXPECT_EQ(got.size(), input.size());
    EXPECT_TRUE(got == input) << "export of " << src << " differs from " << kDir << "hf/model.safetensors";
    const std::string cfg_path = dir_ / ("out_" + name + "/config.json");
    ASSERT_TRUE(fs::exists(cfg_path)) << "no config.json beside the export";
    const Json cfg = Json::parse(po::test::read_file(cfg_path));
    for (const char* key : {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                            "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                            "rope_theta", "tie_word_embeddings", "model_type", "architectures"})
      EXPECT_EQ(cfg[key], input_cfg[key]) << key;
    // And the exported directory is a model again, exported to the same bytes.
    const auto again = run_command(kBin + " export " + (dir_ / ("out_" + name)) + " --out " +
                                   (dir_ / ("again_" + name + ".safetensors")));
    ASSERT_EQ(again.exit_code, 0) << again.output;
    EXPECT_TRUE(po::test::read_file(dir_ / ("again_" + name + ".safetensors")) == input);
  }
}

TEST_F(LlamaCli, Bf16FileTrainsFromTheRoundedF32Values) {
  // An F32 file holding the F32 twin rounded to bf16, with its config.json.
  fs::create_directories(dir_ / "rounded");
  const auto f32 = po::checkpoint::SafetensorsReader::open(kDir + "hf/model.safetensors");
  std::vector<std::vector<float>> values;
  for (const auto& name : f32.names()) {
    std::vector<float> v = f32.read_f32(name, f32.get(name).shape);
    for (float& x : v) x = po::core::bf16_to_f32(po::core::f32_to_bf16(x));
    values.push_back(std::move(v));
  }
  std::vector<po::checkpoint::StTensorRef> refs;
  size_t i = 0;
  for (const auto& name : f32.names())
    refs.push_back({name, po::checkpoint::StDtype::kF32, f32.get(name).shape, values[i++].data()});
  po::checkpoint::write_safetensors_hf(dir_ / "rounded/model.safetensors", refs, {{"format", "pt"}});
  fs::copy_file(kDir + "hf/config.json", dir_ / "rounded/config.json");

  const int steps = 3;
  const std::string bf16 = train_ok("bf16", kDir + "hf/model_bf16.safetensors", steps, 1e-2);
  const std::string rounded = train_ok("rounded", dir_ / "rounded/model.safetensors", steps, 1e-2);
  const std::string orig = train_ok("f32", kDir + "hf/model.safetensors", steps, 1e-2);
  const auto l_bf16 = po::test::metric(bf16, "loss", steps);
  const auto l_rounded = po::test::metric(rounded, "loss", steps);
  const auto l_orig = po::test::metric(orig, "loss", steps);
  for (int s = 0; s < steps; ++s) EXPECT_EQ(l_bf16[s], l_rounded[s]) << "step " << s;
  // The rounding matters, so the equality above says something.
  EXPECT_NE(l_bf16[0], l_orig[0]);
  std::printf("  first loss: bf16 file %.9g, rounded F32 %.9g, unrounded F32 %.9g\n", l_bf16[0],
              l_rounded[0], l_orig[0]);
  // And the trained weights agree bit for bit.
  for (const auto& run : {bf16, rounded})
    ASSERT_EQ(run_command(kBin + " export " + run + " --out " + run + "_out.safetensors").exit_code, 0);
  EXPECT_TRUE(po::test::read_file(bf16 + "_out.safetensors") ==
              po::test::read_file(rounded + "_out.safetensors"));
}

// train.steps = 0 checkpoints the starting state, so an imported model is a
// run (its export is the input, byte for byte); and the run's stored config
// names the trained shape, so export does not read model.init's file again
// (here moved away after training).
TEST_F(LlamaCli, ZeroStepRunAndMovedInitFile) {
  fs::create_directories(dir_ / "moved");
  fs::copy_file(kDir + "hf/model.safetensors", dir_ / "moved/model.safetensors");
  fs::copy_file(kDir + "hf/config.json", dir_ / "moved/config.json");
  const std::string zero = train_ok("zero", dir_ / "moved", 0, 1e-3);
  ASSERT_FALSE(po::train::list_checkpoints(zero + "/checkpoints").empty())
      << "train.steps = 0 wrote no checkpoint";
  const std::string two = train_ok("two", dir_ / "moved", 2, 1e-3);
  fs::rename(dir_ / "moved", dir_ / "elsewhere");
  for (const std::string& run : {zero, two}) {
    const auto r = run_command(kBin + " export " + run + " --out " + run + "_hf/model.safetensors");
    ASSERT_EQ(r.exit_code, 0) << run << ": export after model.init's file moved:\n" << r.output;
  }
  EXPECT_TRUE(po::test::read_file(zero + "_hf/model.safetensors") ==
              po::test::read_file(kDir + "hf/model.safetensors"))
      << "the export of a 0-step run differs from its model.init";
}

// A llama2.c legacy checkpoint (untied) with random weights, vocabulary 264,
// and a llama2.c tokenizer.bin for it: <unk>, <s>, </s>, the 256 byte pieces,
// then "▁" (written " "), "h", "i", "hi", "▁hi".
void write_generate_fixture(const std::string& model, const std::string& tokenizer) {
  const int32_t C = 16, F = 40, L = 2, NH = 4, NKV = 2, V = 264, T = 32;
  const int64_t hs = C / NH, kv = NKV * hs;
  const int64_t n = V * C + L * (C + C * C + 2 * kv * C + C * C + C + 3 * F * C) + C + 2 * T * (hs / 2) + V * C;
  std::string bytes(28, '\0');
  const int32_t header[7] = {C, F, L, NH, NKV, -V, T};
  std::memcpy(bytes.data(), header, sizeof header);
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  std::vector<float> w(static_cast<size_t>(n));
  for (float& x : w) x = normal(rng);
  bytes.append(reinterpret_cast<const char*>(w.data()), w.size() * 4);
  po::test::write_file(model, bytes);

  std::vector<std::pair<std::string, float>> pieces = {{"<unk>", 0}, {"\n<s>\n", 0}, {"\n</s>\n", 0}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    pieces.push_back({name, 0});
  }
  for (const auto& p : std::vector<std::pair<std::string, float>>{{" ", -1}, {"h", -2}, {"i", -3}, {"hi", -4}, {" hi", -5}})
    pieces.push_back(p);
  ASSERT_EQ(pieces.size(), static_cast<size_t>(V));
  std::string tok(4, '\0');
  put_i32(tok, 0, 8);
  for (const auto& [piece, score] : pieces) {
    std::string rec(8, '\0');
    std::memcpy(rec.data(), &score, 4);
    put_i32(rec, 4, static_cast<int32_t>(piece.size()));
    tok += rec + piece;
  }
  po::test::write_file(tokenizer, tok);
}

TEST_F(LlamaCli, GenerateOnLlama2cAndItsHfTwinPrintsTheSameIds) {
  const std::string bin = dir_ / "model.bin", tok = dir_ / "tokenizer.bin";
  write_generate_fixture(bin, tok);
  fs::create_directories(dir_ / "hf");
  const auto ex = run_command(kBin + " export " + bin + " --out " + (dir_ / "hf/model.safetensors"));
  ASSERT_EQ(ex.exit_code, 0) << ex.output;
  const std::string args = " --prompt 'hi hi' --tokenizer " + tok + " --temperature 0 --print-ids --max-new-tokens 12";
  std::vector<std::vector<int>> ids;
  for (const std::string& src : {bin, dir_ / "hf", dir_ / "hf/model.safetensors"}) {
    const auto r = run_command(kBin + " generate " + src + args);
    ASSERT_EQ(r.exit_code, 0) << src << ":\n" << r.output;
    ASSERT_EQ(r.output.rfind("hi hi", 0), 0u) << "the text line starts with the prompt:\n" << r.output;
    ids.push_back(printed_ids(r.output));
    ASSERT_FALSE(ids.back().empty()) << src << ": no ids printed:\n" << r.output;
    EXPECT_LE(ids.back().size(), 12u);
    for (int id : ids.back()) EXPECT_TRUE(id >= 0 && id < 264) << id;
  }
  EXPECT_EQ(ids[0], ids[1]) << "llama2.c file vs HF directory";
  EXPECT_EQ(ids[0], ids[2]) << "llama2.c file vs HF safetensors file";
  // Greedy is deterministic: a second run prints the same.
  EXPECT_EQ(printed_ids(run_command(kBin + " generate " + bin + args).output), ids[0]);
}

// A run of a Llama preset (untied, and tied by model.tie_embeddings) exports
// and generates: its stored config lists every key, defaults included, so
// model.bias = true and model.tie_embeddings = true must not be read back as
// the user's choice (cli.cc reads them from the checkpoint's tensors).
TEST_F(LlamaCli, ExportAndGenerateFromALlamaRun) {
  const std::string bin = dir_ / "model.bin", tok = dir_ / "tokenizer.bin";
  write_generate_fixture(bin, tok);  // for the tokenizer (vocabulary 264)
  po::test::write_tokens(dir_ / "t264.bin", 4000, 264);
  for (const char* tie : {"false", "true"}) {
    SCOPED_TRACE(std::string("tie_embeddings = ") + tie);
    const std::string name = std::string("preset_tie_") + tie;
    po::test::write_file(dir_ / (name + ".toml"),
                         "[model]\npreset = \"llama-tiny\"\nn_layer = 1\nn_embd = 32\nn_head = 4\n"
                         "vocab_size = 264\nseq_len = 16\ntie_embeddings = " + std::string(tie) +
                         "\n[train]\nbatch_size = 2\nsteps = 1\nthreads = 1\n[data]\ntrain = \"" +
                         (dir_ / "t264.bin") + "\"\n");
    const std::string run = dir_ / name;
    const auto t = run_command(kBin + " train -c " + (dir_ / (name + ".toml")) + " --set run.dir=" + run);
    ASSERT_EQ(t.exit_code, 0) << t.output;
    fs::create_directories(run + "_hf");
    const auto ex = run_command(kBin + " export " + run + " --out " + run + "_hf/model.safetensors");
    ASSERT_EQ(ex.exit_code, 0) << ex.output;
    const Json cfg = Json::parse(po::test::read_file(run + "_hf/config.json"));
    EXPECT_EQ(cfg["tie_word_embeddings"], std::string(tie) == "true");
    EXPECT_EQ(cfg["num_key_value_heads"], 2);
    const std::string args = " --prompt hi --tokenizer " + tok + " --temperature 0 --print-ids --max-new-tokens 6";
    const auto a = run_command(kBin + " generate " + run + args);
    const auto b = run_command(kBin + " generate " + run + "_hf" + args);
    ASSERT_EQ(a.exit_code, 0) << a.output;
    ASSERT_EQ(b.exit_code, 0) << b.output;
    EXPECT_FALSE(printed_ids(a.output).empty()) << a.output;
    EXPECT_EQ(printed_ids(a.output), printed_ids(b.output)) << "the run vs its export";
  }
}

TEST_F(LlamaCli, HfDirectoryWithAMissingShard) {
  const std::string d = dir_ / "sharded";
  fs::create_directories(d);
  fs::copy_file(kDir + "hf/config.json", d + "/config.json");
  fs::copy_file(kDir + "hf/model.safetensors", d + "/model-00001-of-00002.safetensors");
  Json index;
  index["metadata"] = {{"total_size", 0}};
  const auto f32 = po::checkpoint::SafetensorsReader::open(kDir + "hf/model.safetensors");
  for (const auto& name : f32.names())
    index["weight_map"][name] = name == "model.norm.weight" ? "model-00002-of-00002.safetensors"
                                                            : "model-00001-of-00002.safetensors";
  po::test::write_file(d + "/model.safetensors.index.json", index.dump(2));
  const std::vector<std::string> needles = {"model-00002-of-00002.safetensors", "missing", "model.norm.weight"};
  expect_clean_error(train_fails(d), needles);
  expect_clean_error(run_command(kBin + " export " + d + " --out " + (dir_ / "o.safetensors")), needles);
  expect_clean_error(run_command(kBin + " generate " + d + " --prompt x"), needles);
  EXPECT_FALSE(fs::exists(dir_ / "o.safetensors"));
}

TEST_F(LlamaCli, ConfigJsonDisagreeingWithTheTensors) {
  const std::string d = dir_ / "disagree";
  fs::create_directories(d);
  fs::copy_file(kDir + "hf/model.safetensors", d + "/model.safetensors");
  Json cfg = Json::parse(po::test::read_file(kDir + "hf/config.json"));
  cfg["hidden_size"] = 32;
  po::test::write_file(d + "/config.json", cfg.dump(2));
  const std::vector<std::string> needles = {"config.json", "hidden_size = 32", "model.embed_tokens.weight"};
  expect_clean_error(train_fails(d), needles);
  expect_clean_error(train_fails(d + "/model.safetensors"), needles);  // the config.json beside it
  expect_clean_error(run_command(kBin + " export " + d + " --out " + (dir_ / "o.safetensors")), needles);
  // A model.* key disagreeing with the file names the key and what the file says.
  expect_clean_error(train_fails(kDir + "hf", "--set model.n_embd=32"), {"model.n_embd", "hidden_size = 16"});
  expect_clean_error(train_fails(kDir + "l2c_v1.bin", "--set model.n_layer=3"), {"l2c_v1.bin", "model.n_layer"});
}

TEST_F(LlamaCli, UnknownAndUnsupportedDtypes) {
  std::string bytes = po::test::read_file(kDir + "hf/model.safetensors");
  const auto at = bytes.find("\"dtype\":\"F32\"");
  ASSERT_NE(at, std::string::npos);
  std::string unknown = bytes, integer = bytes;
  unknown.replace(at, 13, "\"dtype\":\"F31\"");  // same length: the offsets stay valid
  integer.replace(at, 13, "\"dtype\":\"I32\"");  // known, 4 bytes, but not a float
  fs::create_directories(dir_ / "unknown");
  fs::create_directories(dir_ / "integer");
  po::test::write_file(dir_ / "unknown/model.safetensors", unknown);
  po::test::write_file(dir_ / "integer/model.safetensors", integer);
  for (const char* d : {"unknown", "integer"}) fs::copy_file(kDir + "hf/config.json", dir_ / (std::string(d) + "/config.json"));
  expect_clean_error(train_fails(dir_ / "unknown"), {"unknown/model.safetensors", "unknown dtype \"F31\""});
  expect_clean_error(run_command(kBin + " export " + (dir_ / "unknown/model.safetensors") + " --out " +
                                 (dir_ / "o.safetensors")),
                     {"unknown/model.safetensors", "F31"});
  expect_clean_error(train_fails(dir_ / "integer"), {"integer/model.safetensors", "dtype I32", "F32, BF16 or F16"});
}

TEST_F(LlamaCli, TruncatedAndImpossibleLlama2cFiles) {
  for (const char* file : {"l2c_legacy.bin", "l2c_v1.bin"}) {
    SCOPED_TRACE(file);
    const std::string good = po::test::read_file(kDir + file);
    const std::string trunc = dir_ / (std::string("trunc_") + file);
    po::test::write_file(trunc, good.substr(0, good.size() / 2));
    expect_clean_error(train_fails(trunc), {trunc, "truncated llama2.c checkpoint"});
    expect_clean_error(run_command(kBin + " generate " + trunc + " --prompt x"), {trunc, "truncated"});
    expect_clean_error(run_command(kBin + " export " + trunc + " --out " + (dir_ / "o.safetensors")),
                       {trunc, "truncated"});
    const size_t h = std::string(file) == "l2c_v1.bin" ? 8 : 0;  // the v1 header's fields follow magic, version
    std::string heads = good;
    put_i32(heads, h + 12, 3);  // n_heads 3 does not divide dim 16
    const std::string bad_heads = dir_ / (std::string("heads_") + file);
    po::test::write_file(bad_heads, heads);
    expect_clean_error(train_fails(bad_heads), {bad_heads, "impossible llama2.c header", "n_heads = 3"});
    expect_clean_error(run_command(kBin + " generate " + bad_heads + " --prompt x"),
                       {bad_heads, "impossible llama2.c header"});
    std::string dim = good;
    put_i32(dim, h, -16);
    const std::string bad_dim = dir_ / (std::string("dim_") + file);
    po::test::write_file(bad_dim, dim);
    expect_clean_error(train_fails(bad_dim), {bad_dim, "impossible llama2.c header", "dim = -16"});
    std::string huge = good;
    put_i32(huge, h + 8, 1 << 30);  // n_layers: the sizes overflow or exceed the file
    const std::string bad_layers = dir_ / (std::string("layers_") + file);
    po::test::write_file(bad_layers, huge);
    expect_clean_error(run_command(kBin + " export " + bad_layers + " --out " + (dir_ / "o.safetensors")),
                       {bad_layers, "n_layers"});
  }
  EXPECT_FALSE(fs::exists(dir_ / "o.safetensors"));
}

TEST_F(LlamaCli, MalformedTokenizerFiles) {
  const std::string bin = dir_ / "model.bin", tok = dir_ / "tokenizer.bin";
  write_generate_fixture(bin, tok);
  const std::string good = po::test::read_file(tok);
  std::string neg = good;
  put_i32(neg, 0, -5);
  po::test::write_file(dir_ / "neg.bin", neg);
  po::test::write_file(dir_ / "short.bin", good.substr(0, good.size() - 3));
  po::test::write_file(dir_ / "tokenizer.json", "{\"model\": {\"type\": \"BPE\", ");
  const std::string gen = kBin + " generate " + bin + " --prompt hi --tokenizer ";
  expect_clean_error(run_command(gen + (dir_ / "neg.bin")), {"neg.bin", "max_token_length -5"});
  expect_clean_error(run_command(gen + (dir_ / "short.bin")), {"short.bin", "truncated"});
  expect_clean_error(run_command(gen + (dir_ / "tokenizer.json")), {"tokenizer.json"});
  expect_clean_error(run_command(gen + (dir_ / "nope.bin")), {"nope.bin"});
}

TEST_F(LlamaCli, LayoutThatDoesNotDivide) {
  po::test::write_file(dir_ / "c.toml", "[model]\npreset = \"llama-tiny\"\nvocab_size = 32\n[train]\nsteps = 1\n"
                                        "[data]\ntrain = \"" + train_ + "\"\n");
  const std::string cmd = kBin + " train -c " + (dir_ / "c.toml") + " --set run.dir=" + (dir_ / "bad_run") +
                          " --set model.n_head=4 --set model.n_kv_head=3";
  expect_clean_error(run_command(cmd), {"model.n_kv_head", "3"});
  expect_clean_error(run_command(kBin + " plan -c " + (dir_ / "c.toml") + " --set model.n_head=4 --set model.n_kv_head=3"),
                     {"model.n_kv_head"});
  // On a Llama file the key is checked against the file first.
  expect_clean_error(train_fails(kDir + "l2c_legacy.bin", "--set model.n_kv_head=3"), {"model.n_kv_head", "l2c_legacy.bin"});
  EXPECT_FALSE(fs::exists(dir_ / "bad_run"));
}

}  // namespace
