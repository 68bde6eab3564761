// The mixture-of-experts MLP (model/moe.h) against PyTorch: the golden files
// of tools/torch_ref/make_moe.py (HF Mixtral's and Qwen2-MoE's math in
// float64; rerun: /usr/bin/python3 tools/torch_ref/make_moe.py). Per case:
// the experts each row chose (in order), the output, the balance and z
// losses, the input gradient and every weight's gradient (the router's
// included) within 1e-5 relative. Cases: Mixtral (top 2 of 4,
// renormalised), Qwen2-MoE's raw top-k weights (top 2 of 6), and a skewed
// router whose 3 of 4 experts get no row (their gradients stay 0). And the
// layer's exactness: the same rows in another batch give the same bits, and
// the balance loss of a step does not change with how its sequences are
// split into micro-batches.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../test_util.h"
#include "checkpoint/safetensors.h"
#include "model/moe.h"

namespace {

namespace moe = po::model::moe;
using po::checkpoint::SafetensorsReader;
using po::test::expect_close;

double meta(const SafetensorsReader& f, const std::string& key) { return std::stod(f.metadata().at(key)); }

struct Golden {
  SafetensorsReader file;
  moe::Shape shape;
  int64_t B = 0, T = 0, R = 0;
  moe::Losses losses;
  std::vector<float> x, dout, weights;  // weights: the router, then each expert's gate | up, down

  explicit Golden(const std::string& name)
      : file(SafetensorsReader::open(std::string(PO_SOURCE_DIR) + "/tests/golden/moe_" + name + ".safetensors")) {
    shape.C = static_cast<int64_t>(meta(file, "C"));
    shape.F = static_cast<int64_t>(meta(file, "F"));
    shape.E = static_cast<int64_t>(meta(file, "E"));
    shape.k = static_cast<int64_t>(meta(file, "k"));
    shape.router = file.metadata().at("router") == "softmax_topk" ? moe::Router::kSoftmaxTopK
                                                                  : moe::Router::kSoftmaxTopKRaw;
    B = static_cast<int64_t>(meta(file, "B"));
    T = static_cast<int64_t>(meta(file, "T"));
    R = B * T;
    losses = {meta(file, "aux"), meta(file, "z_coef"), 1.0 / static_cast<double>(B), 1.0 / static_cast<double>(R), T};
    const int64_t C = shape.C, F = shape.F;
    x = file.read_f32("x", {R, C});
    dout = file.read_f32("dout", {R, C});
    weights.resize(static_cast<size_t>(shape.numel()));
    file.read_f32("router", {shape.E, C}, weights.data());
    for (int64_t e = 0; e < shape.E; ++e) {
      float* at = expert(weights.data(), e);
      file.read_f32("experts." + std::to_string(e) + ".w1", {F, C}, at);
      file.read_f32("experts." + std::to_string(e) + ".w3", {F, C}, at + F * C);
      file.read_f32("experts." + std::to_string(e) + ".w2", {C, F}, at + 2 * F * C);
    }
    std::printf("moe_%s: seed %s (%s seeds skipped: a top-k margin under 1e-4)\n", name.c_str(),
                file.metadata().at("seed").c_str(), file.metadata().at("skipped_seeds").c_str());
  }
  float* expert(float* w, int64_t e) const { return w + shape.E * shape.C + e * shape.expert_numel(); }
  std::vector<float> ref(const std::string& name, const po::tensor::Shape& s) const { return file.read_f32(name, s); }
};

// The layer's saved activations and scratch, owned.
struct Held {
  std::vector<float> f, w;
  std::vector<int32_t> i;
  moe::Saved saved;
  moe::Work work;
  Held(const moe::Shape& s, int64_t R)
      : f(static_cast<size_t>(moe::Saved::floats(s, R))), w(static_cast<size_t>(moe::Work::floats(s, R))),
        i(static_cast<size_t>(moe::Saved::ints(s, R))), saved(moe::Saved::carve(s, R, f.data(), i.data())),
        work(moe::Work::carve(s, R, w.data())) {}
};

void check_case(const std::string& name) {
  SCOPED_TRACE(name);
  const Golden g(name);
  const moe::Shape& s = g.shape;
  const int64_t C = s.C, F = s.F, R = g.R;
  Held held(s, R);
  const moe::Weights w{g.weights.data(), g.weights.data() + s.E * C};
  std::vector<float> out(static_cast<size_t>(R * C));
  moe::Stats stats;
  moe::forward(s, out.data(), g.x.data(), w, R, held.saved, held.work, g.losses, &stats);

  const auto& chosen = g.file.require("chosen", po::checkpoint::StDtype::kI32, {R, s.k});
  std::vector<int32_t> want(static_cast<size_t>(R * s.k));
  std::memcpy(want.data(), chosen.data, chosen.nbytes);
  for (int64_t i = 0; i < R * s.k; ++i)
    ASSERT_EQ(held.saved.chosen[i], want[static_cast<size_t>(i)])
        << "row " << i / s.k << " slot " << i % s.k << ": expert " << held.saved.chosen[i] << ", PyTorch's "
        << want[static_cast<size_t>(i)];
  expect_close(out.data(), g.ref("out", {R, C}), "out", 1e-5);
  const float balance = g.ref("balance", {1})[0], z = g.ref("z", {1})[0];
  EXPECT_NEAR(stats.aux, balance, 1e-5 * std::fabs(balance) + 1e-12) << "balance loss";
  EXPECT_NEAR(stats.z, z, 1e-5 * std::fabs(z) + 1e-12) << "z-loss";

  std::vector<float> dx(static_cast<size_t>(R * C)), grads(g.weights.size(), 0.0f);
  moe::backward(s, dx.data(), {grads.data(), grads.data() + s.E * C}, g.dout.data(), g.x.data(), w, R, held.saved,
                held.work, g.losses);
  expect_close(dx.data(), g.ref("dx", {R, C}), "dx", 1e-5);
  expect_close(grads.data(), g.ref("grad.router", {s.E, C}), "router gradient", 1e-5);
  for (int64_t e = 0; e < s.E; ++e) {
    const std::string n = "experts." + std::to_string(e);
    const float* at = g.expert(grads.data(), e);
    if (stats.tokens[static_cast<size_t>(e)] == 0) {  // no row: no gradient, and PyTorch's is 0 too
      for (int64_t i = 0; i < s.expert_numel(); ++i) ASSERT_EQ(at[i], 0.0f) << n << " got no row";
      continue;
    }
    expect_close(at, g.ref("grad." + n + ".w1", {F, C}), n + ".w1 gradient", 1e-5);
    expect_close(at + F * C, g.ref("grad." + n + ".w3", {F, C}), n + ".w3 gradient", 1e-5);
    expect_close(at + 2 * F * C, g.ref("grad." + n + ".w2", {C, F}), n + ".w2 gradient", 1e-5);
  }
}

TEST(MoeReference, MixtralRouterMatchesPyTorch) { check_case("mixtral"); }
TEST(MoeReference, QwenRawTopKWeightsMatchPyTorch) { check_case("qwen_raw"); }
TEST(MoeReference, ExpertsWithoutRowsTakeNoGradient) { check_case("skewed"); }

// The balance loss of a step does not change with how its sequences are
// split into micro-batches (a sequence's f and P are its own): micro-batches
// of one sequence each sum to the whole batch's value (to 1e-6, below). A sequence alone gets
// the outputs it gets in the batch (up to the GEMMs' rounding: oneDNN's
// blocking depends on the rows an expert gets; exact shapes per source chunk
// come with expert parallel), and the same batch twice the same bits.
TEST(MoeReference, TheBalanceLossDoesNotDependOnTheMicroBatches) {
  const Golden g("mixtral");
  const moe::Shape& s = g.shape;
  const int64_t C = s.C, T = g.T, R = g.R;
  const moe::Weights w{g.weights.data(), g.weights.data() + s.E * C};
  Held whole(s, R);
  std::vector<float> out(static_cast<size_t>(R * C)), again(out.size());
  moe::Stats all;
  moe::forward(s, out.data(), g.x.data(), w, R, whole.saved, whole.work, g.losses, &all);
  moe::forward(s, again.data(), g.x.data(), w, R, whole.saved, whole.work, g.losses);
  EXPECT_EQ(std::memcmp(out.data(), again.data(), out.size() * sizeof(float)), 0) << "the same batch twice";
  double parts = 0;
  for (int64_t q = 0; q < g.B; ++q) {
    Held one(s, T);
    std::vector<float> o(static_cast<size_t>(T * C));
    moe::Stats st;
    moe::forward(s, o.data(), g.x.data() + q * T * C, w, T, one.saved, one.work, g.losses, &st);  // (the step's scales)
    parts += st.aux;
    const std::vector<float> in_batch(out.begin() + q * T * C, out.begin() + (q + 1) * T * C);
    expect_close(o.data(), in_batch, "sequence " + std::to_string(q) + " alone vs in the batch", 1e-6);
  }
  // (The probabilities carry the router GEMM's rounding, as the outputs do.)
  EXPECT_NEAR(parts, all.aux, 1e-6 * std::fabs(all.aux))
      << "the balance loss over micro-batches of one sequence vs over the whole batch";
}

}  // namespace
