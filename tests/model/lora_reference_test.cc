// Low-rank adapters against PyTorch: LoRA and DoRA (PEFT's math) on every
// linear layer of the golden GPT-2 and Llama, the base frozen. The loss, the
// adapters' gradients and the adapters after three AdamW steps must match
// tests/golden/lora_*.safetensors, made in float64 by
// tools/torch_ref/make_lora.py (rerun: /usr/bin/python3 tools/torch_ref/make_lora.py).
// Tolerances: loss relative 1e-6, tensors norm-wise relative 1e-5 (the
// engine computes in f32). Dropout (the _dropout cases) with the engine's
// counter-based masks, drawn again in numpy by make_lora.py. And: B = 0 gives the base's logits bit for bit;
// the merged model's logits are the adapted model's; the base is never written.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/model_io.h"
#include "checkpoint/gpt2_io.h"
#include "checkpoint/peft.h"
#include "checkpoint/safetensors.h"
#include "core/error.h"
#include "model/quant_weight.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "optim/schedule.h"
#include "train/model_setup.h"

#include <nlohmann/json.hpp>

#include "../test_util.h"
#include "golden_run.h"

namespace {
using po::checkpoint::SafetensorsReader;
using po::model::TensorSpec;
using po::model::Transformer;
using po::model::TransformerConfig;
using po::test::expect_close;

std::string golden(const std::string& file) {
  return std::string(PO_SOURCE_DIR) + "/tests/golden/" + file;
}

using po::test::base_config;
using po::test::meta;
using po::test::read_base;

struct Case {
  std::string name;
  SafetensorsReader file;
  SafetensorsReader base;
  TransformerConfig config;
  int64_t B = 0, T = 0;
  std::vector<int32_t> inputs, targets;
  uint64_t dropout_seed = 0;

  explicit Case(const std::string& case_name, bool checkpointing = false)
      : name(case_name),
        file(SafetensorsReader::open(golden("lora_" + case_name + ".safetensors"))),
        base(SafetensorsReader::open(golden(file.metadata().at("base")))) {
    const std::string arch = file.metadata().at("base").rfind("gpt2", 0) == 0 ? "gpt2" : "llama";
    config = base_config(base, arch);
    config.activation_checkpointing = checkpointing;
    config.lora.r = static_cast<int64_t>(meta(file, "r"));
    config.lora.alpha = meta(file, "alpha");
    config.lora.rslora = meta(file, "rslora") != 0;
    config.lora.dora = meta(file, "dora") != 0;
    if (file.metadata().count("dropout") != 0) {
      config.lora.dropout = meta(file, "dropout");
      dropout_seed = static_cast<uint64_t>(meta(file, "dropout_seed"));
    }
    if (file.metadata().count("quant") != 0 && file.metadata().at("quant") != "none")
      config.quant = file.metadata().at("quant") == "nf4" ? po::model::WeightQuant::kNf4
                                                          : po::model::WeightQuant::kInt8;
    std::istringstream t(file.metadata().at("targets"));
    for (std::string s; t >> s;) config.lora.targets.push_back(s);
    B = static_cast<int64_t>(meta(base, "batch_size"));
    T = config.seq_len;
    std::vector<int32_t> tokens(static_cast<size_t>(B * (T + 1)));
    const auto& tk = base.require("tokens", po::checkpoint::StDtype::kI32, {B, T + 1});
    std::memcpy(tokens.data(), tk.data, tk.nbytes);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < T; ++i) {
        inputs.push_back(tokens[b * (T + 1) + i]);
        targets.push_back(tokens[b * (T + 1) + i + 1]);
      }
  }

  // The base from the base golden (quantized: model.quant), the adapters
  // from this case's init.*.
  void load(Transformer& model) const {
    for (const TensorSpec& p : model.layout().base_tensors())
      read_base(base, p, model.base_params() + p.offset);
    if (config.quant != po::model::WeightQuant::kNone) model.quantize_base();
    for (const TensorSpec& p : model.param_infos())
      file.read_f32("init." + p.name, p.shape, model.params() + p.offset);
  }
  float grad_scale() const { return 1.0f / static_cast<float>(B * T); }
  // The training pass of `step`: with lora.dropout, its masks (the batch's
  // first sequence is 0).
  float forward_backward(Transformer& model, int64_t step) const {
    model.set_dropout(dropout_seed, step, 0);
    return model.forward_backward(inputs.data(), targets.data(), grad_scale());
  }
};

// The _dropout cases: lora.dropout = 0.25, the masks drawn by make_lora.py's
// numpy port of the engine's counter-based rule (parts.h AdapterDropout).
// The _nf4 and _int8 cases (QLoRA, model.quant): the base's block linear
// weights quantized at load, against PyTorch on make_lora.py's reference-
// dequantized base (numpy ports of bitsandbytes' NF4 and LLM.int8() formats).
const char* const kCases[] = {"gpt2",          "gpt2_dora",  "llama",     "llama_dora",
                              "gpt2_dropout",  "llama_dropout", "gpt2_nf4", "llama_nf4",
                              "llama_nf4_dora", "llama_int8"};

class LoraReference : public ::testing::TestWithParam<const char*> {};

TEST_P(LoraReference, LossAndAdapterGradientsMatchPyTorch) {
  for (bool checkpointing : {false, true}) {
    const Case c(GetParam(), checkpointing);
    Transformer model(c.config, c.B, c.T);
    c.load(model);
    ASSERT_GT(model.num_params(), 0);
    model.zero_grads();
    const float loss = c.forward_backward(model, 0);
    const double want = c.file.read_f32("loss0", {1})[0];
    const std::string label = c.name + (checkpointing ? " (checkpointing)" : "");
    EXPECT_LE(std::fabs(loss - want) / want, 1e-6) << label << ": loss " << loss << " vs PyTorch " << want;
    for (const TensorSpec& p : model.param_infos())
      expect_close(model.grads() + p.offset, c.file.read_f32("grad." + p.name, p.shape),
                   label + ": gradient of " + p.name, 1e-5);
  }
}

TEST_P(LoraReference, ThreeAdamWStepsMatchPyTorchAndLeaveTheBaseAlone) {
  const Case c(GetParam());
  Transformer model(c.config, c.B, c.T);
  c.load(model);
  const int64_t base_n = model.layout().base_num_params();
  std::vector<float> base_before(static_cast<size_t>(base_n)), base_after(base_before.size());
  model.base_values(base_before.data());  // (a quantized base: its decoded values)
  const SafetensorsReader& f = c.file;
  const po::test::GoldenRun run(f);
  const po::optim::LrSchedule& sched = run.schedule;
  po::optim::AdamW opt = run.optimizer(model);
  const auto losses = f.read_f32("losses", {sched.total_steps});
  const auto norms = f.read_f32("grad_norms", {sched.total_steps});
  for (int64_t s = 0; s < sched.total_steps; ++s) {
    model.zero_grads();
    const float loss = c.forward_backward(model, s);
    EXPECT_LE(std::fabs(loss - losses[s]) / losses[s], 1e-6)
        << c.name << ": loss before step " << s << ": " << loss << " vs PyTorch " << losses[s];
    const double norm = opt.step(model.params(), model.grads(), sched.at(s));
    EXPECT_LE(std::fabs(norm - norms[s]) / norms[s], 1e-5)
        << c.name << ": grad norm at step " << s << ": " << norm << " vs PyTorch " << norms[s];
  }
  for (const TensorSpec& p : model.param_infos())
    expect_close(model.params() + p.offset, f.read_f32("after3." + p.name, p.shape),
                 c.name + ": " + p.name + " after 3 steps", 1e-5);
  model.base_values(base_after.data());
  EXPECT_EQ(std::memcmp(base_before.data(), base_after.data(), base_before.size() * sizeof(float)), 0)
      << c.name << ": the frozen base was written";
}

// Logits at every prefix length of the first sequence's last position.
std::vector<float> logits(Transformer& m, const Case& c) {
  std::vector<float> out(static_cast<size_t>(c.config.vocab_size));
  m.next_token_logits(c.inputs.data(), c.T, out.data());
  return out;
}

TEST_P(LoraReference, TheMergedModelGivesTheAdaptedLogits) {
  const Case c(GetParam());
  Transformer adapted(c.config, 1, c.T);
  c.load(adapted);
  const TransformerConfig plain_config = c.config.base_model();
  Transformer merged(plain_config, 1, c.T);
  ASSERT_EQ(merged.num_params(), adapted.layout().base_num_params());
  adapted.merged_params(merged.params());
  const std::vector<float> want = logits(adapted, c);
  expect_close(logits(merged, c).data(), want, c.name + ": the merged model's logits", 1e-5);
  // And the adapters change the logits: the merge is not the base.
  Transformer base(plain_config, 1, c.T);
  adapted.base_values(base.params());
  const std::vector<float> b = logits(base, c);
  double diff = 0;
  for (size_t i = 0; i < b.size(); ++i) diff = std::max(diff, std::fabs(static_cast<double>(b[i]) - want[i]));
  EXPECT_GT(diff, 1e-4) << c.name << ": the adapters leave the logits as the base's";
}

// QLoRA's base holds its codes, not its f32 values: NF4's bytes are
// bitsandbytes' (4 bits a weight, a code per block of 64, a float per 256
// blocks, the offset), and the quantized tensors' f32 pages are given back,
// so that a stray read of them faults rather than reading zeros.
TEST(QloraBase, HoldsItsCodesAndGivesItsF32PagesBack) {
  const Case c("llama_nf4");
  Transformer model(c.config, 1, c.T);
  c.load(model);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  size_t want_bytes = 0, f32_bytes = 0, tensors = 0;
  const TensorSpec* largest = nullptr;
  for (const TensorSpec& p : model.layout().base_tensors()) {
    if (model.quantized(p) == nullptr) continue;
    const size_t n = static_cast<size_t>(p.numel()), blocks = (n + 63) / 64;
    want_bytes += (n + 1) / 2 + blocks + 4 * ((blocks + 255) / 256) + 4;
    f32_bytes += 4 * n;
    ++tensors;
    if (largest == nullptr || p.numel() > largest->numel()) largest = &p;
  }
  ASSERT_EQ(tensors, 2u * 7u) << "every block linear of the 2-layer Llama (q k v o gate up down)";
  EXPECT_EQ(model.quantized_bytes(), want_bytes);
  EXPECT_GE(model.released_base_bytes() + 2 * page * tensors, f32_bytes)
      << "the quantized tensors' f32 pages were not given back";
  const float* w = model.base_params() + largest->offset;
  const uintptr_t inside = (reinterpret_cast<uintptr_t>(w) + page - 1) / page * page;
  ASSERT_LE(inside + page, reinterpret_cast<uintptr_t>(w + largest->numel())) << largest->name;
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH({ std::printf("%f\n", static_cast<double>(*reinterpret_cast<const volatile float*>(inside))); }, "")
      << largest->name << "'s f32 values are still readable";
}

// A weight that is not finite cannot be quantized: a one-line error naming
// the tensor, the element, its row and column, in either format.
TEST(QloraBase, ANonFiniteWeightIsNamed) {
  for (const auto format : {po::model::WeightQuant::kNf4, po::model::WeightQuant::kInt8}) {
    std::vector<float> w(8 * 64, 0.5f);
    w[1 * 64 + 2] = std::nanf("");
    w[5 * 64] = INFINITY;
    try {
      (void)po::model::quantize_weight(format, w.data(), 8, 64, "h.0.mlp.up");
      ADD_FAILURE() << po::model::weight_quant_name(format) << ": a NaN weight was quantized";
    } catch (const po::core::Error& e) {
      EXPECT_NE(std::string(e.what()).find("h.0.mlp.up: element 66 (row 1, column 2) is nan"), std::string::npos)
          << po::model::weight_quant_name(format) << ": " << e.what();
    }
  }
}

// A Hugging Face "-bnb-4bit" checkpoint (tests/golden/bnb4bit_llama, written
// by tools/torch_ref/make_bnb4bit.py in bitsandbytes' Linear4bit layout) as
// model.init of a QLoRA run: its NF4 tensors are taken as stored, the same
// codes the engine's own quantizer gives the f32 golden, so the loss and the
// adapters' gradients are the llama_nf4 case's against PyTorch; read as a
// plain model, its tensors decode to the same values. Bad files are one-line
// errors naming the tensor.
TEST(QloraBase, ABnb4bitCheckpointLoadsItsCodesAsStored) {
  const Case c("llama_nf4");
  Transformer own(c.config, c.B, c.T), bnb(c.config, c.B, c.T);
  c.load(own);
  const std::string dir = golden("bnb4bit_llama");
  po::checkpoint::load_model_weights(dir, bnb);
  bnb.quantize_base();
  for (const TensorSpec& p : bnb.param_infos()) c.file.read_f32("init." + p.name, p.shape, bnb.params() + p.offset);
  int compared = 0;
  for (const TensorSpec& p : own.layout().base_tensors()) {
    const po::model::QuantTensor* a = own.quantized(p);
    const po::model::QuantTensor* b = bnb.quantized(p);
    ASSERT_EQ(a == nullptr, b == nullptr) << p.name;
    if (a == nullptr) continue;
    EXPECT_EQ(a->nf4.codes, b->nf4.codes) << p.name << ": codes";
    EXPECT_EQ(a->nf4.absmax_codes, b->nf4.absmax_codes) << p.name << ": absmax codes";
    EXPECT_EQ(a->nf4.nested_absmax, b->nf4.nested_absmax) << p.name << ": nested absmax";
    EXPECT_EQ(a->nf4.offset, b->nf4.offset) << p.name << ": offset";
    ++compared;
  }
  EXPECT_EQ(compared, 14);
  bnb.zero_grads();
  const float loss = c.forward_backward(bnb, 0);
  const double want = c.file.read_f32("loss0", {1})[0];
  EXPECT_LE(std::fabs(loss - want) / want, 1e-6) << "loss " << loss << " vs PyTorch " << want;
  for (const TensorSpec& p : bnb.param_infos())
    expect_close(bnb.grads() + p.offset, c.file.read_f32("grad." + p.name, p.shape), "gradient of " + p.name, 1e-5);
  // As a plain model: every tensor decoded, the values the QLoRA model computes with.
  Transformer plain(c.config.base_model(), 1, c.T);
  po::checkpoint::load_model_weights(dir, plain);
  std::vector<float> decoded(static_cast<size_t>(plain.num_params()));
  own.base_values(decoded.data());
  EXPECT_EQ(std::memcmp(decoded.data(), plain.params(), decoded.size() * sizeof(float)), 0)
      << "the bnb-4bit file read as f32 differs from the decoded NF4 base";
  // An f32 Hugging Face directory (the golden exported) quantized tensor by
  // tensor while it loads: the codes of quantizing the whole base at once.
  const std::filesystem::path hf = std::filesystem::temp_directory_path() / ("po_hf_" + std::to_string(getpid()));
  std::filesystem::create_directories(hf);
  // config.json and model.safetensors (decoded values: any f32 model will do)
  po::checkpoint::export_model_weights((hf / "model.safetensors").string(), plain);
  Transformer whole(c.config, 1, c.T), streamed(c.config, 1, c.T);
  po::checkpoint::load_model_weights(hf.string(), streamed);
  streamed.quantize_base();
  {
    Transformer f32(c.config.base_model(), 1, c.T);
    po::checkpoint::load_model_weights(hf.string(), f32);
    std::memcpy(whole.base_params(), f32.params(), static_cast<size_t>(f32.num_params()) * sizeof(float));
    whole.quantize_base();
  }
  for (const TensorSpec& p : whole.layout().base_tensors()) {
    const po::model::QuantTensor* a = whole.quantized(p);
    const po::model::QuantTensor* b = streamed.quantized(p);
    ASSERT_EQ(a == nullptr, b == nullptr) << p.name;
    if (a != nullptr) {
      EXPECT_EQ(a->nf4.codes, b->nf4.codes) << p.name << ": quantized while loading";
    }
  }
  std::filesystem::remove_all(hf);
  // Bad files: another quant_type, a missing companion tensor.
  const std::filesystem::path tmp = std::filesystem::temp_directory_path() / ("po_bnb_" + std::to_string(getpid()));
  struct Bad {
    std::string from, to, want;
  } bad[] = {
      {R"("quant_type": "nf4")", R"("quant_type": "xx4")",
       R"(model.layers.0.mlp.down_proj.weight.quant_state.bitsandbytes__nf4': quant_type "xx4", expected "nf4")"},
      {R"(model.layers.0.mlp.down_proj.weight.absmax")", R"(model.layers.0.mlp.down_proj.weight.absmaz")",
       "NF4 tensor 'model.layers.0.mlp.down_proj.weight' has no 'model.layers.0.mlp.down_proj.weight.absmax'"},
  };
  for (const Bad& b : bad) {
    std::filesystem::remove_all(tmp);
    std::filesystem::create_directories(tmp);
    std::filesystem::copy_file(dir + "/config.json", tmp / "config.json");
    std::ifstream in(dir + "/model.safetensors", std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t at = bytes.find(b.from);
    ASSERT_NE(at, std::string::npos) << b.from;
    bytes.replace(at, b.from.size(), b.to);
    std::ofstream(tmp / "model.safetensors", std::ios::binary) << bytes;
    Transformer m(c.config, 1, c.T);
    try {
      po::checkpoint::load_model_weights(tmp.string(), m);
      ADD_FAILURE() << b.to << " was accepted";
    } catch (const po::core::Error& e) {
      EXPECT_NE(std::string(e.what()).find(b.want), std::string::npos) << e.what();
    }
  }
  std::filesystem::remove_all(tmp);
}

// (LoRA only: DoRA's scale m / ‖W0‖ is 1 only in exact arithmetic.)
TEST(LoraBZero, GivesTheBaseLossAndLogitsBitForBit) {
  for (const char* name : {"gpt2", "llama"}) {
    const Case c(name);
    Transformer adapted(c.config, c.B, c.T);
    c.load(adapted);
    for (const TensorSpec& p : adapted.param_infos())
      if (p.name.find("lora_B") != std::string::npos)
        std::fill_n(adapted.params() + p.offset, p.numel(), 0.0f);
    const TransformerConfig plain_config = c.config.base_model();
    Transformer base(plain_config, c.B, c.T);
    std::memcpy(base.params(), adapted.base_params(), static_cast<size_t>(base.num_params()) * sizeof(float));
    const float la = adapted.evaluate(c.inputs.data(), c.targets.data());
    const float lb = base.evaluate(c.inputs.data(), c.targets.data());
    EXPECT_EQ(std::memcmp(&la, &lb, sizeof la), 0) << c.name << ": loss " << la << " vs the base's " << lb;
    const std::vector<float> a = logits(adapted, c), b = logits(base, c);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
        << c.name << ": B = 0 changed the logits";
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, LoraReference, ::testing::ValuesIn(kCases));

// tests/golden/peft_<case>/: the same adapters as PEFT saves them, written by
// numpy and the stdlib (make_lora.py). Through read_peft_config and
// read_peft_adapter (what lora.init does) they give the reference's loss.
class PeftFixture : public ::testing::TestWithParam<const char*> {};

TEST_P(PeftFixture, LoadsThroughLoraInitAndGivesTheReferenceLoss) {
  Case c(GetParam());
  const std::string dir = golden(std::string("peft_") + GetParam());
  const po::model::LoraConfig from = po::checkpoint::read_peft_config(dir);
  EXPECT_EQ(from.r, c.config.lora.r);
  EXPECT_EQ(from.alpha, c.config.lora.alpha);
  EXPECT_EQ(from.rslora, c.config.lora.rslora);
  EXPECT_EQ(from.targets, c.config.lora.targets);
  c.config.lora = from;
  Transformer model(c.config, c.B, c.T);
  c.load(model);
  const std::vector<float> want(model.params(), model.params() + model.num_params());
  std::fill_n(model.params(), model.num_params(), 0.0f);
  po::checkpoint::read_peft_adapter(dir, model);
  EXPECT_EQ(std::memcmp(want.data(), model.params(), want.size() * sizeof(float)), 0)
      << c.name << ": the PEFT file's adapters are not the reference's";
  const float loss = model.evaluate(c.inputs.data(), c.targets.data());
  const double ref = c.file.read_f32("loss0", {1})[0];
  EXPECT_LE(std::fabs(loss - ref) / ref, 1e-6) << c.name << ": loss " << loss << " vs PyTorch " << ref;
}

// (GPT-2: a Llama weights file needs its config.json beside it, which the
// golden file has not.)
TEST(PeftMerge, PagedoptimMergeGivesTheAdaptedLogits) {
  const Case c("gpt2");
  const std::string dir = golden("peft_gpt2");
  po::test::TempDir tmp;
  const std::string out = tmp / (c.config.arch == "gpt2" ? "merged.safetensors" : "merged");
  const std::string base_file = golden(c.file.metadata().at("base"));
  const auto r = po::test::run_command(std::string(PO_BINARY) + " merge " + base_file + " " + dir +
                                       " --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  Transformer adapted(c.config, 1, c.T);
  c.load(adapted);
  const TransformerConfig plain_config = c.config.base_model();
  Transformer merged(plain_config, 1, c.T);
  po::checkpoint::load_model_weights(out, merged);  // (Llama: a Hugging Face model directory)
  expect_close(logits(merged, c).data(), logits(adapted, c), c.name + ": merge's logits", 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Cases, PeftFixture, ::testing::Values("gpt2", "llama"));

// A copy of the GPT-2 fixture with its config or tensors changed.
struct BadAdapter {
  po::test::TempDir dir;
  explicit BadAdapter(const std::function<void(nlohmann::json&)>& config,
                      const std::function<bool(const std::string&)>& keep = {}) {
    const std::string src = golden("peft_gpt2");
    std::ifstream in(src + "/adapter_config.json");
    nlohmann::json c = nlohmann::json::parse(in);
    config(c);
    std::ofstream(dir / "adapter_config.json") << c.dump(2);
    const SafetensorsReader f = SafetensorsReader::open(src + "/adapter_model.safetensors");
    std::vector<po::checkpoint::StTensorRef> refs;
    for (const std::string& n : f.names())
      if (!keep || keep(n)) refs.push_back({n, f.get(n).dtype, f.get(n).shape, f.get(n).data});
    po::checkpoint::write_safetensors(dir / "adapter_model.safetensors", refs, {{"format", "pt"}});
  }
  // What lora.init of this directory on the golden GPT-2 says, or "" if it loads.
  std::string error() const {
    return po::test::error_of([&] {
      const Case c("gpt2");
      TransformerConfig config = c.config;
      config.lora = po::checkpoint::read_peft_config(dir.path().string());
      Transformer model(config, 1, 8);
      po::checkpoint::read_peft_adapter(dir.path().string(), model);
    });
  }
};

TEST(PeftBadInput, OneLineErrorsNameTheFileAndTensor) {
  const std::string b0 = "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight";
  struct Want {
    std::string what, error;
    std::vector<std::string> has;
  };
  const BadAdapter r8([](nlohmann::json& c) { c["r"] = 8; });
  const BadAdapter no_b([](nlohmann::json&) {}, [&](const std::string& n) { return n != b0; });
  const BadAdapter regex([](nlohmann::json& c) { c["target_modules"] = ".*c_attn"; });
  const BadAdapter fewer([](nlohmann::json& c) { c["target_modules"] = {"c_attn"}; });
  const Want wants[] = {
      {"r disagrees with the tensors", r8.error(),
       {"adapter_model.safetensors", "transformer.h.0.attn.c_attn.lora_A.weight", "[4, 64]", "[8, 64]"}},
      {"a missing lora_B", no_b.error(), {"adapter_model.safetensors", b0}},
      {"a regular expression", regex.error(), {"adapter_config.json", "target_modules"}},
      {"tensors of modules the config does not name", fewer.error(),
       {"adapter_model.safetensors", "attn.c_proj.lora_A.weight", "adapts no module"}},
  };
  for (const Want& w : wants) {
    ASSERT_FALSE(w.error.empty()) << w.what << " was accepted";
    EXPECT_EQ(w.error.find('\n'), std::string::npos) << w.what << ": not one line: " << w.error;
    for (const std::string& h : w.has) EXPECT_NE(w.error.find(h), std::string::npos) << w.what << ": " << w.error;
  }
  // An adapter made for another architecture: the Llama fixture on GPT-2.
  const std::string other = po::test::error_of([&] {
    const Case c("gpt2");
    TransformerConfig config = c.config;
    config.lora = po::checkpoint::read_peft_config(golden("peft_llama"));
    Transformer model(config, 1, 8);
  });
  EXPECT_NE(other.find("'q_proj' is not a linear layer of this gpt2 model"), std::string::npos) << other;
}

TEST(LoraLayout, OnlyTheAdaptersTrainAndTheBaseKeepsItsLayout) {
  TransformerConfig c = TransformerConfig::preset("gpt2-tiny");
  TransformerConfig plain = c;
  c.lora.r = 8;
  c.lora.targets = {"c_attn", "mlp.c_proj"};
  const po::model::Layout lora(c), base(plain);
  ASSERT_TRUE(lora.adapters());
  EXPECT_EQ(lora.base_num_params(), base.num_params());
  ASSERT_EQ(lora.base_tensors().size(), base.tensors().size());
  for (size_t i = 0; i < base.tensors().size(); ++i) {
    EXPECT_EQ(lora.base_tensors()[i].name, base.tensors()[i].name);
    EXPECT_EQ(lora.base_tensors()[i].offset, base.tensors()[i].offset) << base.tensors()[i].name;
  }
  EXPECT_EQ(lora.unit_numel(0), 0) << "the embedding trains nothing";
  EXPECT_EQ(lora.unit_numel(lora.head_unit()), 0) << "the head trains nothing";
  const int64_t C = c.n_embd, r = 8;
  // c_attn: A [r, C], B [3C, r]; mlp.c_proj: A [r, 4C], B [C, r].
  EXPECT_EQ(lora.unit_numel(1), r * C + 3 * C * r + r * 4 * C + C * r);
  EXPECT_EQ(lora.num_params(), c.n_layer * lora.unit_numel(1));
  EXPECT_EQ(lora.tensors()[0].name, "h.0.attn.c_attn.lora_A.weight");
  EXPECT_EQ(lora.tensors()[1].name, "h.0.attn.c_attn.lora_B.weight");
  EXPECT_EQ(lora.tensors()[2].name, "h.0.mlp.c_proj.lora_A.weight");
}

TEST(LoraLayout, ATargetNotInTheModelIsAnErrorNamingIt) {
  TransformerConfig c = TransformerConfig::preset("gpt2-tiny");
  c.lora.r = 4;
  c.lora.targets = {"c_attn", "q_proj"};
  try {
    const po::model::Layout l(c);
    FAIL() << "q_proj on GPT-2 was accepted";
  } catch (const po::core::InvalidArgument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("'q_proj'"), std::string::npos) << m;
    EXPECT_NE(m.find("attn.c_attn attn.c_proj mlp.c_fc mlp.c_proj"), std::string::npos) << m;
  }
}

TEST(LoraLayout, FreshAdaptersAreKaimingAAndZeroB) {
  TransformerConfig c = TransformerConfig::preset("gpt2-tiny");
  c.lora.r = 4;
  c.lora.dora = true;
  c.lora.targets = {"c_fc"};
  Transformer m(c, 1, 8);
  m.init_random(7);
  for (const TensorSpec& p : m.param_infos()) {
    const float* v = m.params() + p.offset;
    if (p.name.find("lora_A") != std::string::npos) {
      const float bound = 1.0f / std::sqrt(static_cast<float>(c.n_embd));
      float lo = 1, hi = -1;
      for (int64_t i = 0; i < p.numel(); ++i) lo = std::min(lo, v[i]), hi = std::max(hi, v[i]);
      EXPECT_GE(lo, -bound) << p.name;
      EXPECT_LE(hi, bound) << p.name;
      EXPECT_LT(lo, -0.8f * bound) << p.name << " does not spread over U(-1/sqrt(in), 1/sqrt(in))";
      EXPECT_GT(hi, 0.8f * bound) << p.name;
    } else if (p.name.find("lora_B") != std::string::npos) {
      for (int64_t i = 0; i < p.numel(); ++i) ASSERT_EQ(v[i], 0.0f) << p.name << "[" << i << "]";
    } else {  // the magnitude: the base weight's row norms
      const TensorSpec& w = m.adapted_weight(p);
      const float* rows = m.base_params() + w.offset;
      for (int64_t j = 0; j < p.numel(); ++j) {
        double s = 0;
        for (int64_t i = 0; i < w.shape[1]; ++i) s += static_cast<double>(rows[j * w.shape[1] + i]) * rows[j * w.shape[1] + i];
        ASSERT_NEAR(v[j], std::sqrt(s), 1e-6 * std::sqrt(s)) << p.name << "[" << j << "]";
      }
    }
  }
}

}  // namespace
