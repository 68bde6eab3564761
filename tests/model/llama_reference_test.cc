// The Llama configuration of the decoder against PyTorch: loss, every
// parameter gradient and the weights after three AdamW steps (clipping +
// warm-up/cosine schedule) must match tests/golden/llama_ref_<case>.safetensors,
// made in float64 by tools/torch_ref/make_golden_llama.py (rerun:
// /usr/bin/python3 tools/torch_ref/make_golden_llama.py) from the Hugging Face
// Llama math in tools/torch_ref/llama.py. Cases: n_kv_head = n_head (kv4),
// n_head/2 (kv2) and 1 (kv1) with an untied head, and kv2 tied; each with and
// without activation checkpointing. Tolerances as GPT-2's: loss relative 1e-6,
// tensors norm-wise relative 1e-5.
//
// Also the model's other schedules against forward_backward, bit for bit: the
// split block backward (input half, then weight half) and a model cut into two
// pipeline stages; and the KV-cache decode path against recomputing the
// prefix (1e-5 per token: the cached attention sums in another order).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "backend/ops.h"
#include "checkpoint/safetensors.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "optim/schedule.h"

#include "../test_util.h"
#include "golden_run.h"

namespace {
using po::test::expect_close;

using po::checkpoint::SafetensorsReader;
using po::model::Transformer;
using po::model::TransformerConfig;
using po::model::UnitRange;

const char* const kCases[] = {"kv4", "kv2", "kv1", "kv2_tied"};
const char* const kUntiedCases[] = {"kv4", "kv2", "kv1"};

std::string golden_path(const std::string& name) {
  return std::string(PO_SOURCE_DIR) + "/tests/golden/llama_ref_" + name + ".safetensors";
}

// An F64 tensor of n values (the float64 losses).
std::vector<double> read_f64(const SafetensorsReader& f, const std::string& name, int64_t n) {
  const auto& t = f.require(name, po::checkpoint::StDtype::kF64, {n});
  std::vector<double> out(static_cast<size_t>(n));
  std::memcpy(out.data(), t.data, t.nbytes);
  return out;
}

double meta(const SafetensorsReader& f, const std::string& key) {
  const auto& m = f.metadata();
  auto it = m.find(key);
  if (it == m.end()) throw std::runtime_error(f.origin() + ": no metadata key '" + key + "'");
  return std::stod(it->second);
}

TransformerConfig golden_config(const SafetensorsReader& f) {
  TransformerConfig c = TransformerConfig::arch_defaults("llama");
  c.n_layer = static_cast<int64_t>(meta(f, "n_layer"));
  c.n_embd = static_cast<int64_t>(meta(f, "n_embd"));
  c.n_head = static_cast<int64_t>(meta(f, "n_head"));
  c.n_kv_head = static_cast<int64_t>(meta(f, "n_kv_head"));
  c.ffn_hidden = static_cast<int64_t>(meta(f, "ffn_hidden"));
  c.vocab_size = static_cast<int64_t>(meta(f, "vocab_size"));
  c.seq_len = static_cast<int64_t>(meta(f, "seq_len"));
  c.norm_eps = meta(f, "norm_eps");
  c.rope_theta = meta(f, "rope_theta");
  c.tie_embeddings = meta(f, "tie") != 0;
  return c;
}

// Copies every tensor of the units `model` holds from the file (HF names and
// [out, in] layout are the engine's: no transposes).
void load_golden(const SafetensorsReader& f, Transformer& model) {
  const int64_t base = model.layout().unit_offset(model.first_unit());
  for (const auto& p : model.param_infos())
    if (p.unit >= model.first_unit() && p.unit <= model.last_unit())
      f.read_f32(p.name, p.shape, model.params() + (p.offset - base));
}


struct Fixture {
  std::string name;
  SafetensorsReader file;
  TransformerConfig config;
  int64_t B, T;
  std::vector<int32_t> inputs, targets;

  explicit Fixture(const std::string& case_name)
      : name(case_name),
        file(SafetensorsReader::open(golden_path(case_name))),
        config(golden_config(file)),
        B(static_cast<int64_t>(meta(file, "batch_size"))),
        T(config.seq_len) {
    std::vector<int32_t> tokens(static_cast<size_t>(B * (T + 1)));
    const auto& t = file.require("tokens", po::checkpoint::StDtype::kI32, {B, T + 1});
    std::memcpy(tokens.data(), t.data, t.nbytes);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < T; ++i) {
        inputs.push_back(tokens[b * (T + 1) + i]);
        targets.push_back(tokens[b * (T + 1) + i + 1]);
      }
  }
  float grad_scale() const { return 1.0f / static_cast<float>(B * T); }
};

// Parameter: (case, activation checkpointing).
class LlamaReference : public ::testing::TestWithParam<std::tuple<const char*, bool>> {
 protected:
  std::string label() const {
    return std::string(std::get<0>(GetParam())) + (std::get<1>(GetParam()) ? " (ckpt)" : "");
  }
};

using Param = std::tuple<const char*, bool>;
std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return std::string(std::get<0>(info.param)) + (std::get<1>(info.param) ? "_checkpointing" : "");
}

TEST_P(LlamaReference, LossAndEveryGradientMatchPyTorch) {
  Fixture fx(std::get<0>(GetParam()));
  fx.config.activation_checkpointing = std::get<1>(GetParam());
  Transformer model(fx.config, fx.B, fx.T);
  load_golden(fx.file, model);
  model.zero_grads();
  const float loss = model.forward_backward(fx.inputs.data(), fx.targets.data(), fx.grad_scale());
  const double want = read_f64(fx.file, "loss0_f64", 1)[0];
  const double loss_rel = std::fabs(loss - want) / want;
  EXPECT_LE(loss_rel, 1e-6) << "loss: engine " << loss << " vs PyTorch " << want;
  double worst = 0;
  std::string worst_name;
  for (const auto& p : model.param_infos()) {
    const double rel = expect_close(model.grads() + p.offset,
                                    fx.file.read_f32("grad." + p.name, p.shape),
                                    fx.name + ": gradient of " + p.name, 1e-5);
    if (rel > worst) worst = rel, worst_name = p.name;
  }
  std::printf("[%s] loss rel %.2e; max gradient rel %.2e (%s)\n", label().c_str(), loss_rel,
              worst, worst_name.c_str());
}

TEST_P(LlamaReference, ThreeAdamWStepsMatchPyTorch) {
  Fixture fx(std::get<0>(GetParam()));
  fx.config.activation_checkpointing = std::get<1>(GetParam());
  Transformer model(fx.config, fx.B, fx.T);
  load_golden(fx.file, model);
  const auto& f = fx.file;
  const po::test::GoldenRun run(f);
  const po::optim::LrSchedule& sched = run.schedule;
  const po::optim::AdamWConfig& oc = run.adam;
  po::optim::AdamW opt = run.optimizer(model);

  const auto losses = read_f64(f, "losses_f64", sched.total_steps);
  const auto norms = f.read_f32("grad_norms", {sched.total_steps});
  const auto lrs = f.read_f32("lrs", {sched.total_steps});
  bool clipped = false;
  double worst_loss = 0, worst_norm = 0;
  for (int64_t s = 0; s < sched.total_steps; ++s) {
    model.zero_grads();
    const float loss =
        model.forward_backward(fx.inputs.data(), fx.targets.data(), fx.grad_scale());
    const double loss_rel = std::fabs(loss - losses[s]) / losses[s];
    EXPECT_LE(loss_rel, 1e-6) << fx.name << ": loss before step " << s << ": engine " << loss
                              << " vs PyTorch " << losses[s];
    const double lr = sched.at(s);
    EXPECT_NEAR(lr, lrs[s], 1e-7 * lrs[s]) << "learning rate at step " << s;
    const double norm = opt.step(model.params(), model.grads(), lr);
    const double norm_rel = std::fabs(norm - norms[s]) / norms[s];
    EXPECT_LE(norm_rel, 1e-5) << fx.name << ": grad norm at step " << s << ": engine " << norm
                              << " vs PyTorch " << norms[s];
    clipped |= norm > oc.grad_clip;
    worst_loss = std::max(worst_loss, loss_rel);
    worst_norm = std::max(worst_norm, norm_rel);
  }
  EXPECT_TRUE(clipped) << "the golden run must exercise gradient clipping";
  double worst = 0;
  std::string worst_name;
  for (const auto& p : model.param_infos()) {
    const double rel = expect_close(model.params() + p.offset,
                                    f.read_f32("after3." + p.name, p.shape),
                                    fx.name + ": weights after 3 steps: " + p.name, 1e-5);
    if (rel > worst) worst = rel, worst_name = p.name;
  }
  std::printf("[%s] 3 steps: max loss rel %.2e, max grad-norm rel %.2e; max weight rel %.2e (%s)\n",
              label().c_str(), worst_loss, worst_norm, worst, worst_name.c_str());
}

INSTANTIATE_TEST_SUITE_P(Cases, LlamaReference,
                         ::testing::Combine(::testing::ValuesIn(kCases), ::testing::Bool()),
                         param_name);

// The first index where a and b differ bitwise, or -1.
int64_t first_difference(const float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::memcmp(a + i, b + i, sizeof(float)) != 0) return i;
  return -1;
}

void expect_bits(const float* got, const float* want, const po::model::TensorSpec& p,
                 const std::string& what) {
  const int64_t i = first_difference(got, want, p.numel());
  EXPECT_EQ(i, -1) << what << ": gradient of " << p.name << " differs first at element " << i
                   << ": " << (i >= 0 ? got[i] : 0.0f) << " vs forward_backward's "
                   << (i >= 0 ? want[i] : 0.0f);
}

// Parameter: (case, activation checkpointing).
class LlamaSchedules : public LlamaReference {};

// The split backward, driven as a zero-bubble pipeline drives one stage:
// every block's input half (and the embedding's lookup), then the weight
// halves (stage_backward with deferred works, stage_backward_weight).
TEST_P(LlamaSchedules, SplitBackwardIsBitIdenticalToForwardBackward) {
  Fixture fx(std::get<0>(GetParam()));
  fx.config.activation_checkpointing = std::get<1>(GetParam());
  Transformer whole(fx.config, fx.B, fx.T), split(fx.config, fx.B, fx.T);
  load_golden(fx.file, whole);
  load_golden(fx.file, split);
  whole.zero_grads();
  split.zero_grads();
  const float loss = whole.forward_backward(fx.inputs.data(), fx.targets.data(), fx.grad_scale());
  const double sum =
      split.stage_forward(fx.inputs.data(), nullptr, fx.targets.data(), fx.grad_scale());
  EXPECT_EQ(static_cast<float>(sum / static_cast<double>(fx.B * fx.T)), loss);
  std::vector<po::model::WeightGradWork> works;
  for (int64_t l = 0; l < fx.config.n_layer; ++l) works.push_back(split.make_weight_grad_work());
  split.stage_backward(fx.inputs.data(), nullptr, {}, &works);
  split.stage_backward_weight(works);
  for (const auto& p : whole.param_infos())
    expect_bits(split.grads() + p.offset, whole.grads() + p.offset, p, fx.name + " split");
}

// Two pipeline stages, units [0, k] and [k+1, head], for every cut k of an
// untied model: the same loss and gradients as the whole model, bit for bit.
class LlamaStages : public LlamaReference {};

TEST_P(LlamaStages, TwoStagesAreBitIdenticalToTheWholeModel) {
  Fixture fx(std::get<0>(GetParam()));
  ASSERT_FALSE(fx.config.tie_embeddings) << "a tied head needs the embedding on its stage";
  fx.config.activation_checkpointing = std::get<1>(GetParam());
  Transformer whole(fx.config, fx.B, fx.T);
  load_golden(fx.file, whole);
  whole.zero_grads();
  const float loss = whole.forward_backward(fx.inputs.data(), fx.targets.data(), fx.grad_scale());
  const int head = whole.layout().head_unit();
  for (int k = 0; k < head; ++k) {
    SCOPED_TRACE("stages [0, " + std::to_string(k) + "] and [" + std::to_string(k + 1) + ", " +
                 std::to_string(head) + "]");
    Transformer first(fx.config, fx.B, fx.T, UnitRange{0, k});
    Transformer second(fx.config, fx.B, fx.T, UnitRange{k + 1, -1});
    ASSERT_EQ(first.num_params() + second.num_params(), whole.num_params());
    load_golden(fx.file, first);
    load_golden(fx.file, second);
    first.zero_grads();
    second.zero_grads();
    EXPECT_EQ(first.stage_forward(fx.inputs.data(), nullptr, nullptr, fx.grad_scale()), 0.0);
    const double sum =
        second.stage_forward(nullptr, first.stage_output(), fx.targets.data(), fx.grad_scale());
    EXPECT_EQ(static_cast<float>(sum / static_cast<double>(fx.B * fx.T)), loss)
        << "loss of the two stages";
    const float* d_mid = second.stage_backward(nullptr, nullptr);
    EXPECT_EQ(d_mid, second.backward_buffer());
    first.stage_backward(fx.inputs.data(), d_mid);
    const int64_t split_at = whole.layout().unit_offset(k + 1);
    for (const auto& p : whole.param_infos()) {
      const bool in_first = p.unit <= k;
      const float* got =
          in_first ? first.grads() + p.offset : second.grads() + (p.offset - split_at);
      expect_bits(got, whole.grads() + p.offset, p, fx.name + (in_first ? " stage 0" : " stage 1"));
    }
  }
}

// Generation: the KV-cache path gives, token by token, the logits of
// recomputing the whole prefix (norm-wise relative 1e-5 per position), fed
// one token at a time and after a prefill of several.
TEST_P(LlamaSchedules, CachedDecodeMatchesRecomputedLogits) {
  Fixture fx(std::get<0>(GetParam()));
  fx.config.activation_checkpointing = std::get<1>(GetParam());
  Transformer model(fx.config, fx.B, fx.T);
  load_golden(fx.file, model);
  const int64_t V = fx.config.vocab_size, T = fx.T;
  const int32_t* seq = fx.inputs.data() + T;  // the batch's second row
  std::vector<float> cached(static_cast<size_t>(V)), full(static_cast<size_t>(V));
  double worst = 0;
  for (const int64_t prefill : {int64_t{1}, int64_t{7}}) {
    po::model::KvCache cache = model.make_kv_cache(T);
    for (int64_t t = prefill - 1; t < T; ++t) {
      const int64_t start = t == prefill - 1 ? 0 : t;
      model.forward_cached(seq + start, t + 1 - start, cache, cached.data());
      ASSERT_EQ(cache.length, t + 1);
      model.next_token_logits(seq, t + 1, full.data());
      double diff2 = 0, ref2 = 0;
      for (int64_t v = 0; v < V; ++v) {
        const double d = static_cast<double>(cached[v]) - full[v];
        diff2 += d * d;
        ref2 += static_cast<double>(full[v]) * full[v];
      }
      const double rel = std::sqrt(diff2 / std::max(ref2, 1e-60));
      EXPECT_LE(rel, 1e-5) << fx.name << ": logits at position " << t << " (prefill " << prefill
                           << "): cached vs recomputed relative error " << rel;
      worst = std::max(worst, rel);
    }
  }
  std::printf("[%s] cached decode: max logits rel %.2e\n", label().c_str(), worst);
}

// A model built for inference (TransformerConfig::inference: one block's
// tensors, no saved activations or backward buffers) decodes bit-identically
// to the training layout, in a fraction of its activation memory, and
// refuses a training forward with a message.
TEST_P(LlamaSchedules, InferenceLayoutDecodesBitIdenticallyInLessMemory) {
  Fixture fx(std::get<0>(GetParam()));
  fx.config.activation_checkpointing = std::get<1>(GetParam());
  Transformer trained(fx.config, fx.B, fx.T);
  load_golden(fx.file, trained);
  po::model::TransformerConfig ic = fx.config;
  ic.activation_checkpointing = false;
  ic.inference = true;
  Transformer inferring(ic, fx.B, fx.T);
  load_golden(fx.file, inferring);
  const int64_t V = fx.config.vocab_size, T = fx.T;
  const int32_t* seq = fx.inputs.data() + T;
  std::vector<float> a(static_cast<size_t>(V)), b(static_cast<size_t>(V));
  po::model::KvCache ca = trained.make_kv_cache(T), cb = inferring.make_kv_cache(T);
  for (int64_t t = 6; t < T; ++t) {
    const int64_t start = t == 6 ? 0 : t;
    trained.forward_cached(seq + start, t + 1 - start, ca, a.data());
    inferring.forward_cached(seq + start, t + 1 - start, cb, b.data());
    ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
        << fx.name << ": logits at position " << t << " differ between the training and inference layouts";
  }
  // A third of the layout that saves every block; below even the checkpointing one.
  EXPECT_LT(inferring.activation_bytes() * (fx.config.activation_checkpointing ? 1 : 3), trained.activation_bytes())
      << fx.name << ": inference " << inferring.activation_bytes() << " bytes of activations, training "
      << trained.activation_bytes();
  try {
    inferring.next_token_logits(seq, 4, b.data());
    ADD_FAILURE() << "a training forward on an inference model should be refused";
  } catch (const po::core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("built for inference"), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, LlamaSchedules,
                         ::testing::Combine(::testing::ValuesIn(kCases), ::testing::Bool()),
                         param_name);

INSTANTIATE_TEST_SUITE_P(Cases, LlamaStages,
                         ::testing::Combine(::testing::ValuesIn(kUntiedCases), ::testing::Bool()),
                         param_name);

}  // namespace
