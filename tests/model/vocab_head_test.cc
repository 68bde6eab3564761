// The head over vocabulary pieces (model/vocab_head.h): the pieces' bounds,
// and the guarantee pipeline ranks rely on: pieces computed by different
// holders, each from its own copy of its rows of the table, with the
// statistics exchanged and the input gradient's sum handed from one holder
// to the next, give the bits of one holder computing every piece in turn.
#include <gtest/gtest.h>

#include <cstring>
#include <map>

#include "backend/ops.h"
#include "model/vocab_head.h"
#include "../backend/test_util.h"

namespace ops = po::backend::cpu;
namespace vocab = po::model::vocab;
using po::test::random_vec;

namespace {

struct HeadResult {
  std::vector<float> losses, dx, dw;
};

// n rows of x [n, C] through the head W [V, C] with the pieces split over
// holders at `cuts` (holder h computes pieces [cuts[h], cuts[h+1])), each from
// a copy of its rows; bf16: the GEMMs at kBF16 with the dlogits in bf16.
HeadResult run_head(const std::vector<float>& x, const std::vector<float>& w,
                    const std::vector<int32_t>& targets, int64_t n, int64_t C, int64_t V,
                    const std::vector<int>& cuts, float gs, bool bf16) {
  const vocab::Pieces p = vocab::pieces_of(V);
  const int P = p.count(), H = static_cast<int>(cuts.size()) - 1;
  ops::set_gemm_precision(bf16 ? ops::GemmPrecision::kBF16 : ops::GemmPrecision::kF32);
  std::vector<uint16_t> x16(x.size()), w16(w.size());
  ops::f32_to_bf16(x16.data(), x.data(), static_cast<int64_t>(x.size()));
  ops::f32_to_bf16(w16.data(), w.data(), static_cast<int64_t>(w.size()));
  const ops::Operand xin(x.data(), bf16 ? x16.data() : nullptr);
  struct Holder {
    std::vector<float> w, dw, logits;
    std::vector<uint16_t> w16, g16;
    vocab::Stats st;
    int64_t row0 = 0;
  };
  std::vector<Holder> hs(static_cast<size_t>(H));
  HeadResult out;
  out.losses.assign(static_cast<size_t>(n), 0.0f);
  // Forward: each holder its pieces' logits and statistics.
  for (int h = 0; h < H; ++h) {
    Holder& hd = hs[static_cast<size_t>(h)];
    hd.row0 = p.begin(cuts[h]);
    const int64_t rows = p.begin(cuts[h + 1]) - hd.row0;
    hd.w.assign(w.begin() + hd.row0 * C, w.begin() + (hd.row0 + rows) * C);
    hd.w16.assign(w16.begin() + hd.row0 * C, w16.begin() + (hd.row0 + rows) * C);
    hd.dw.assign(static_cast<size_t>(rows * C), 0.0f);
    hd.logits.assign(static_cast<size_t>(n * rows), 0.0f);
    hd.g16.assign(hd.logits.size(), 0);
    hd.st.resize(P, n);
    for (int k = cuts[h]; k < cuts[h + 1]; ++k)
      vocab::piece_forward(p, k, xin, ops::Operand(hd.w.data(), bf16 ? hd.w16.data() : nullptr),
                           targets.data(), n, C, hd.logits.data() + n * (p.begin(k) - hd.row0),
                           hd.st, gs != 0.0f, hd.row0);
  }
  // The exchange: every holder gets every piece's statistics (a copy).
  for (int h = 0; h < H; ++h)
    for (int g = 0; g < H; ++g) {
      if (g == h) continue;
      auto& to = hs[static_cast<size_t>(h)].st;
      const auto& from = hs[static_cast<size_t>(g)].st;
      for (int k = cuts[g]; k < cuts[g + 1]; ++k)
        for (int64_t r = 0; r < n; ++r) {
          to.mx[k * n + r] = from.mx[k * n + r];
          to.sum[k * n + r] = from.sum[k * n + r];
          const int64_t t = targets[r];
          if (t >= p.begin(k) && t < p.end(k)) to.zt[r] = from.zt[r];
        }
    }
  // Each holder sums the tree's nodes its pieces fill; the last adds them up
  // in the same tree (given: the holders' node sums, as messages are copies).
  std::map<std::pair<int, int>, std::vector<float>> nodes;
  std::vector<std::vector<float>> scratch(3, std::vector<float>(static_cast<size_t>(n * C)));
  std::vector<float*> sp{scratch[0].data(), scratch[1].data(), scratch[2].data()};
  for (int h = 0; h < H; ++h) {
    Holder& hd = hs[static_cast<size_t>(h)];
    std::vector<float> losses(static_cast<size_t>(n));
    vocab::combine(P, n, losses.data(), hd.st, targets.data(), gs);
    if (h == 0) out.losses = losses;
    for (int64_t r = 0; r < n; ++r)
      EXPECT_EQ(losses[r], out.losses[r]) << "holder " << h << " combines another loss at row " << r;
    if (gs == 0.0f) continue;
    for (const auto& [lo, hi] : vocab::tree_nodes(P, cuts[h], cuts[h + 1])) {
      std::vector<float>& node = nodes[{lo, hi}];
      node.assign(static_cast<size_t>(n * C), 0.0f);
      vocab::tree_sum(
          lo, hi, node.data(), n, C,
          [&](int k, float* dst) {
            const int64_t off = n * (p.begin(k) - hd.row0);
            vocab::piece_backward(p, k, hd.logits.data() + off, bf16 ? hd.g16.data() + off : nullptr,
                                  hd.st, targets.data(), xin,
                                  ops::Operand(hd.w.data(), bf16 ? hd.w16.data() : nullptr),
                                  hd.dw.data(), dst, false, n, C, gs, hd.row0);
          },
          {}, sp.data());
    }
    out.dw.insert(out.dw.end(), hd.dw.begin(), hd.dw.end());
  }
  std::vector<float> dx(static_cast<size_t>(n * C), 0.0f);
  if (gs != 0.0f)
    vocab::tree_sum(
        0, P, dx.data(), n, C, [](int k, float*) { FAIL() << "piece " << k << " is no holder's"; },
        [&](int lo, int hi) -> const float* {
          const auto it = nodes.find({lo, hi});
          return it == nodes.end() ? nullptr : it->second.data();
        },
        sp.data());
  out.dx = dx;
  ops::set_gemm_precision(ops::GemmPrecision::kF32);
  return out;
}

void expect_same_bits(const char* what, const std::vector<float>& a, const std::vector<float>& b,
                      const std::string& tag) {
  ASSERT_EQ(a.size(), b.size()) << what << tag;
  for (size_t i = 0; i < a.size(); ++i)
    ASSERT_EQ(std::memcmp(&a[i], &b[i], sizeof(float)), 0)
        << what << tag << " differs at " << i << ": " << a[i] << " vs " << b[i];
}

}  // namespace

TEST(VocabPieces, CoverTheVocabularyEvenly) {
  for (int64_t V : {1, 5, 8, 37, 1000, 50257, 32000}) {
    const vocab::Pieces p = vocab::pieces_of(V);
    ASSERT_EQ(p.count(), std::min<int64_t>(8, V)) << "V = " << V;
    EXPECT_EQ(p.begin(0), 0);
    EXPECT_EQ(p.end(p.count() - 1), V) << "V = " << V;
    for (int k = 0; k < p.count(); ++k) {
      EXPECT_GE(p.size(k), V / p.count()) << "piece " << k << " of V = " << V;
      EXPECT_LE(p.size(k), V / p.count() + 1) << "piece " << k << " of V = " << V;
    }
  }
}

// Pieces spread over 2, 3 or 8 holders give one holder's losses, input
// gradient and table gradient to the bit, in f32 and bf16, with and without
// a gradient.
TEST(VocabPieces, SpreadOverHoldersIsTheBitsOfOne) {
  const int64_t n = 37, C = 48, V = 1003;
  const auto x = random_vec(n * C, 1, -1.0f, 1.0f);
  const auto w = random_vec(V * C, 2, -0.5f, 0.5f);
  std::vector<int32_t> targets(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) targets[r] = static_cast<int32_t>((r * 7919 + 11) % V);
  for (bool bf16 : {false, true})
    for (float gs : {0.0f, 1.0f / 37}) {
      const HeadResult one = run_head(x, w, targets, n, C, V, {0, 8}, gs, bf16);
      for (const std::vector<int>& cuts : std::vector<std::vector<int>>{{0, 4, 8}, {0, 3, 6, 8},
                                                                      {0, 1, 2, 3, 4, 5, 6, 7, 8}}) {
        const std::string tag = std::string(bf16 ? " (bf16" : " (f32") + ", grad_scale " +
                                std::to_string(gs) + ", " + std::to_string(cuts.size() - 1) +
                                " holders)";
        const HeadResult spread = run_head(x, w, targets, n, C, V, cuts, gs, bf16);
        expect_same_bits("losses", spread.losses, one.losses, tag);
        expect_same_bits("input gradient", spread.dx, one.dx, tag);
        expect_same_bits("table gradient", spread.dw, one.dw, tag);
      }
    }
}

// The pieces' head follows the fused one-piece head within the loss's
// rounding (the combination adds one exp and a product per piece in double).
TEST(VocabPieces, EightPiecesFollowOne) {
  const int64_t n = 16, C = 32, V = 4099;
  const auto x = random_vec(n * C, 3, -1.0f, 1.0f);
  const auto w = random_vec(V * C, 4, -2.0f, 2.0f);
  std::vector<int32_t> targets(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) targets[r] = static_cast<int32_t>((r * 131 + 5) % V);
  const HeadResult eight = run_head(x, w, targets, n, C, V, {0, 8}, 0.0f, false);
  std::vector<float> logits(static_cast<size_t>(n * V)), losses(static_cast<size_t>(n));
  ops::matmul_forward(logits.data(), x.data(), w.data(), nullptr, n, C, V);
  ops::crossentropy_forward(losses.data(), logits.data(), targets.data(), n, V, 0.0f);
  EXPECT_TRUE(po::test::all_close("losses, 8 pieces vs fused", eight.losses.data(), losses.data(),
                                  n, 1e-6, 1e-7));
}
