// The block's parts (model/parts.h): each declares its tensors in the
// layout (names, shapes, partitions, every block tensor exactly once, at the
// offsets the part keeps), and a Linear's forward and backward are the GEMM
// against a float64 reference, with a frozen (trainable = false) Linear
// leaving its gradients alone while its input gradient is unchanged.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "model/layout.h"
#include "model/parts.h"

namespace {
using po::model::Layout;
using po::model::Partition;
using po::model::TensorSpec;
using po::model::TransformerConfig;
namespace parts = po::model::parts;

// The name of the tensor starting at `offset` inside unit u, or "" if none does.
std::string name_at(const Layout& layout, int u, int64_t offset) {
  for (const TensorSpec& t : layout.tensors())
    if (t.unit == u && t.offset - layout.unit_offset(u) == offset) return t.name;
  return "";
}

// Every tensor of block unit u reached through a part, with its length: the
// parts cover the unit once, with no gaps.
void expect_parts_cover_unit(const Layout& layout, int u) {
  const parts::Block& b = layout.block();
  struct Piece {
    const char* what;
    int64_t offset, numel;  // offset -1: the architecture has none
  };
  auto linear = [](const parts::Linear& l, const char* w, const char* bias) {
    return std::vector<Piece>{{w, l.weight, l.out * l.in}, {bias, l.bias, l.out}};
  };
  std::vector<Piece> pieces = {{"norm1.weight", b.norm1.weight, b.norm1.C},
                               {"norm1.bias", b.norm1.bias, b.norm1.C},
                               {"norm2.weight", b.norm2.weight, b.norm2.C},
                               {"norm2.bias", b.norm2.bias, b.norm2.C}};
  for (const auto& more : {linear(b.attn.qkv, "qkv.weight", "qkv.bias"), linear(b.attn.out, "out.weight", "out.bias"),
                           linear(b.mlp.up, "up.weight", "up.bias"), linear(b.mlp.down, "down.weight", "down.bias")})
    pieces.insert(pieces.end(), more.begin(), more.end());
  std::map<int64_t, Piece> starts;  // by offset: the parts in the unit's order
  for (const Piece& p : pieces)
    if (p.offset >= 0) starts[p.offset] = p;
  int64_t at = 0;
  for (const auto& [off, p] : starts) {
    EXPECT_EQ(off, at) << p.what << " starts at " << off << ", the previous part ends at " << at;
    at = off + p.numel;
  }
  EXPECT_EQ(at, layout.unit_numel(u)) << "the parts cover " << at << " of the unit's "
                                      << layout.unit_numel(u) << " elements";
}

TEST(Parts, Gpt2BlockDeclaresItsTensors) {
  TransformerConfig c = TransformerConfig::preset("gpt2-tiny");
  const Layout layout(c);
  const parts::Block& b = layout.block();
  EXPECT_EQ(name_at(layout, 1, b.norm1.weight), "h.0.ln_1.weight");
  EXPECT_EQ(name_at(layout, 1, b.norm1.bias), "h.0.ln_1.bias");
  EXPECT_EQ(name_at(layout, 1, b.attn.qkv.weight), "h.0.attn.c_attn.weight");
  EXPECT_EQ(name_at(layout, 2, b.attn.out.bias), "h.1.attn.c_proj.bias");
  EXPECT_EQ(name_at(layout, 2, b.mlp.up.weight), "h.1.mlp.c_fc.weight");
  EXPECT_EQ(name_at(layout, 2, b.mlp.down.weight), "h.1.mlp.c_proj.weight");
  EXPECT_EQ(b.attn.qkv.partition, Partition::kSplitRows);
  EXPECT_EQ(b.attn.out.partition, Partition::kSplitCols);
  EXPECT_EQ(b.attn.qkv.out, 3 * c.n_embd);
  EXPECT_EQ(b.mlp.up.out, c.ffn_hidden);
  EXPECT_FALSE(b.attn.rope);
  for (int u = 1; u <= c.n_layer; ++u) expect_parts_cover_unit(layout, u);
  // The final norm is a Norm part of the head unit.
  const int hu = layout.head_unit();
  EXPECT_EQ(name_at(layout, hu, layout.final_norm().weight), "ln_f.weight");
  EXPECT_EQ(name_at(layout, hu, layout.final_norm().bias), "ln_f.bias");
}

TEST(Parts, LlamaBlockDeclaresSeparateTensorsOneLinear) {
  TransformerConfig c = TransformerConfig::preset("llama-tiny");  // 4 heads, 2 kv heads
  c.bias = true;
  const Layout layout(c);
  const parts::Block& b = layout.block();
  const int64_t hs = c.head_dim();
  EXPECT_EQ(name_at(layout, 1, b.attn.qkv.weight), "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(name_at(layout, 1, b.attn.qkv.weight + c.n_head * hs * c.n_embd),
            "model.layers.0.self_attn.k_proj.weight")
      << "q, k and v are declared back to back: one GEMM reads them";
  EXPECT_EQ(name_at(layout, 1, b.attn.qkv.bias), "model.layers.0.self_attn.q_proj.bias");
  EXPECT_EQ(name_at(layout, 1, b.mlp.up.weight), "model.layers.0.mlp.gate_proj.weight");
  EXPECT_EQ(name_at(layout, 1, b.mlp.up.weight + c.ffn_hidden * c.n_embd),
            "model.layers.0.mlp.up_proj.weight");
  EXPECT_EQ(b.attn.qkv.out, (c.n_head + 2 * c.n_kv_head) * hs);
  EXPECT_EQ(b.mlp.up.out, 2 * c.ffn_hidden);
  EXPECT_EQ(b.norm1.bias, -1) << "RMSNorm has no bias";
  EXPECT_TRUE(b.attn.rope);
  for (int u = 1; u <= c.n_layer; ++u) expect_parts_cover_unit(layout, u);
}

TEST(Parts, TensorParallelRankHoldsItsShapes) {
  TransformerConfig c = TransformerConfig::preset("llama-tiny");
  const Layout layout(c, {2, 1});
  const parts::Block& b = layout.block();
  const int64_t hs = c.head_dim();
  EXPECT_EQ(b.attn.qkv.out, (c.n_head + 2 * c.n_kv_head) / 2 * hs);
  EXPECT_EQ(b.attn.out.in, c.n_head / 2 * hs);
  EXPECT_EQ(b.attn.n_head, c.n_head / 2);
  EXPECT_EQ(b.mlp.down.in, c.ffn_hidden / 2);
  for (int u = 1; u <= c.n_layer; ++u) expect_parts_cover_unit(layout, u);
}

// y = x·Wᵀ + b, dx = dy·W, dW += dyᵀ·x, db += Σ dy in float64.
struct Reference {
  std::vector<double> y, dx, dw, db;
};
Reference reference(const std::vector<float>& x, const std::vector<float>& w,
                    const std::vector<float>& b, const std::vector<float>& dy, int64_t rows,
                    int64_t in, int64_t out) {
  Reference r{std::vector<double>(rows * out), std::vector<double>(rows * in),
              std::vector<double>(out * in), std::vector<double>(out)};
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t o = 0; o < out; ++o) {
      double s = b[o];
      for (int64_t k = 0; k < in; ++k) s += double{x[i * in + k]} * w[o * in + k];
      r.y[i * out + o] = s;
      r.db[o] += dy[i * out + o];
      for (int64_t k = 0; k < in; ++k) {
        r.dx[i * in + k] += double{dy[i * out + o]} * w[o * in + k];
        r.dw[o * in + k] += double{dy[i * out + o]} * x[i * in + k];
      }
    }
  return r;
}

void expect_near_all(const std::vector<float>& got, const std::vector<double>& want,
                     const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], 1e-4 * (1 + std::fabs(want[i]))) << what << " element " << i;
}

TEST(Parts, LinearIsTheGemmAndAFrozenOneKeepsItsGradients) {
  const int64_t rows = 5, in = 24, out = 40;
  parts::Linear lin;
  lin.in = in;
  lin.out = out;
  lin.weight = 3;  // inside a "unit": 3 floats of something else first
  lin.bias = 3 + out * in;
  std::vector<float> unit(3 + out * in + out), x(rows * in), dy(rows * out);
  uint32_t h = 12345;
  auto next = [&] {
    h = h * 1664525u + 1013904223u;
    return static_cast<float>(h >> 8) / 16777216.0f - 0.5f;
  };
  for (float& v : unit) v = next();
  for (float& v : x) v = next();
  for (float& v : dy) v = next();
  const std::vector<float> w(unit.begin() + 3, unit.begin() + 3 + out * in);
  const std::vector<float> b(unit.begin() + 3 + out * in, unit.end());
  const Reference ref = reference(x, w, b, dy, rows, in, out);

  const parts::Linear::Weights p = lin.weights(unit.data(), nullptr, false);
  std::vector<float> y(rows * out), dx(rows * in), grads(unit.size(), 0.0f);
  lin.forward(y.data(), x.data(), p, rows);
  expect_near_all(y, ref.y, "y");
  lin.backward(dx.data(), lin.grads(grads.data()), dy.data(), x.data(), p, rows);
  expect_near_all(dx, ref.dx, "dx");
  expect_near_all(std::vector<float>(grads.begin() + 3, grads.begin() + 3 + out * in), ref.dw, "dW");
  expect_near_all(std::vector<float>(grads.begin() + 3 + out * in, grads.end()), ref.db, "db");

  // Frozen: the same input gradient, bit for bit; the gradients untouched.
  parts::Linear frozen = lin;
  frozen.trainable = false;
  std::vector<float> dx2(rows * in), grads2(unit.size(), 7.0f);
  frozen.backward(dx2.data(), frozen.grads(grads2.data()), dy.data(), x.data(), p, rows);
  EXPECT_EQ(dx2, dx) << "a frozen Linear's input gradient differs from a trainable one's";
  for (float g : grads2) ASSERT_EQ(g, 7.0f) << "a frozen Linear wrote a gradient";
}

}  // namespace

// Layout::norm_ranges: exactly the elements of the norms' weights and biases
// (what sequence parallel leaves as each rank's rows' part), in order and
// merged; none when adapters train (the norms are the frozen base's).
TEST(Parts, NormRangesHoldTheNormsAndNothingElse) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    TransformerConfig c = TransformerConfig::preset(preset);
    const Layout layout(c);
    std::vector<char> want(static_cast<size_t>(layout.num_params()), 0), got(want.size(), 0);
    for (const TensorSpec& t : layout.tensors()) {
      const bool norm = t.name.find("ln_") != std::string::npos || t.name.find("norm") != std::string::npos;
      if (norm) std::fill_n(want.begin() + t.offset, t.numel(), 1);
    }
    int64_t last_end = -1;
    for (const auto& [at, n] : layout.norm_ranges()) {
      EXPECT_GT(at, last_end) << preset << ": ranges out of order or not merged at " << at;
      last_end = at + n;
      std::fill_n(got.begin() + at, n, 1);
    }
    for (size_t i = 0; i < want.size(); ++i)
      ASSERT_EQ(got[i], want[i]) << preset << ": element " << i << (want[i] ? " of a norm is missing"
                                                                             : " is not a norm's");
    c.lora.r = 4;
    c.lora.targets = {c.arch == "gpt2" ? "c_attn" : "q_proj"};
    EXPECT_TRUE(Layout(c).norm_ranges().empty()) << preset << " with adapters";
  }
}
