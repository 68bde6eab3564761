// SFT batches against PyTorch: the loss over the counted targets only
// (cross-entropy with ignore_index) and packed rows (positions reset per
// example, block-diagonal causal attention), on the golden GPT-2 and Llama
// with every parameter training. The loss and every gradient must match
// tests/golden/sft_*.safetensors, made in float64 by tools/torch_ref/make_sft.py
// (rerun: /usr/bin/python3 tools/torch_ref/make_sft.py), for both layouts of
// the same eight examples of different lengths: one per row, padded, and
// packed three rows. Tolerances: loss relative 1e-6, tensors norm-wise
// relative 1e-5 (the engine computes in f32). And, engine against engine:
// packed and one-per-row give the same loss and gradients (1e-6); a batch of
// 8 rows gives the gradients of 8 batches of 1 accumulated (1e-6).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "model/transformer.h"

#include "../test_util.h"
#include "golden_run.h"

namespace {
using po::checkpoint::SafetensorsReader;
using po::checkpoint::StDtype;
using po::model::TensorSpec;
using po::model::Transformer;
using po::model::TransformerConfig;
using po::test::expect_close;

std::string golden(const std::string& file) { return std::string(PO_SOURCE_DIR) + "/tests/golden/" + file; }

std::vector<int32_t> ints(const SafetensorsReader& f, const std::string& name, int64_t rows, int64_t T) {
  std::vector<int32_t> out(static_cast<size_t>(rows * T));
  const auto& t = f.require(name, StDtype::kI32, {rows, T});
  std::memcpy(out.data(), t.data, t.nbytes);
  return out;
}

struct Case {
  SafetensorsReader file, base;
  std::string arch;
  TransformerConfig config;
  int64_t T = 0, rows = 0, packed_rows = 0;
  double counted = 0;

  explicit Case(const std::string& family)
      : file(SafetensorsReader::open(golden("sft_" + family + ".safetensors"))),
        base(SafetensorsReader::open(golden(file.metadata().at("base")))),
        arch(family),
        config(po::test::base_config(base, family)) {
    T = config.seq_len;
    rows = file.find("rows.inputs")->shape[0];
    packed_rows = file.find("packed.inputs")->shape[0];
    counted = po::test::meta(file, "counted");
  }

  void load(Transformer& model) const {
    for (const TensorSpec& p : model.param_infos()) po::test::read_base(base, p, model.params() + p.offset);
  }

  // One forward and backward over the rows of `layout` ("rows" or
  // "packed"), in micro-batches of `micro` rows accumulated, each scaled by
  // 1/counted; returns the loss over the counted targets.
  double run(Transformer& model, const std::string& layout, int64_t micro) const {
    const int64_t R = layout == "rows" ? rows : packed_rows;
    const auto in = ints(file, layout + ".inputs", R, T), tg = ints(file, layout + ".targets", R, T);
    const auto pos = layout == "packed" ? ints(file, "packed.positions", R, T) : std::vector<int32_t>{};
    model.zero_grads();
    double sum = 0;
    for (int64_t r = 0; r < R; r += micro) {
      if (!pos.empty()) model.set_positions(pos.data() + r * T);
      const float mean = model.forward_backward(in.data() + r * T, tg.data() + r * T,
                                                static_cast<float>(1.0 / counted));
      sum += static_cast<double>(mean) * static_cast<double>(micro * T);
    }
    return sum / counted;
  }

  void expect_golden(Transformer& model, double loss, const std::string& what) const {
    const double want = file.read_f32("loss", {1})[0];
    EXPECT_LE(std::fabs(loss - want) / want, 1e-6) << what << ": loss " << loss << " vs PyTorch " << want;
    for (const TensorSpec& p : model.param_infos()) {
      TensorSpec g = p;
      g.name = "grad." + p.name;
      std::vector<float> ref(static_cast<size_t>(p.numel()));
      po::test::read_base(file, g, ref.data());
      expect_close(model.grads() + p.offset, ref, what + ": gradient of " + p.name, 1e-5);
    }
  }
};

class SftReference : public ::testing::TestWithParam<std::string> {};

TEST_P(SftReference, MaskedLossAndGradientsMatchPyTorchOnePerRow) {
  const Case c(GetParam());
  Transformer model(c.config, c.rows, c.T);
  c.load(model);
  c.expect_golden(model, c.run(model, "rows", c.rows), GetParam() + " one example per row");
}

TEST_P(SftReference, PackedRowsMatchPyTorchsBlockDiagonalAttention) {
  for (bool checkpointing : {false, true}) {
    Case c(GetParam());
    c.config.activation_checkpointing = checkpointing;
    Transformer model(c.config, c.packed_rows, c.T);
    c.load(model);
    c.expect_golden(model, c.run(model, "packed", c.packed_rows),
                    GetParam() + " packed" + (checkpointing ? ", activation checkpointing" : ""));
  }
}

TEST_P(SftReference, PackedAndOnePerRowGiveTheSameLossAndGradients) {
  const Case c(GetParam());
  Transformer rows(c.config, c.rows, c.T), packed(c.config, c.packed_rows, c.T);
  c.load(rows);
  c.load(packed);
  const double lr = c.run(rows, "rows", c.rows), lp = c.run(packed, "packed", c.packed_rows);
  EXPECT_LE(std::fabs(lr - lp) / lr, 1e-6) << "loss: one per row " << lr << ", packed " << lp;
  for (const TensorSpec& p : rows.param_infos()) {
    const std::vector<float> want(rows.grads() + p.offset, rows.grads() + p.offset + p.numel());
    expect_close(packed.grads() + p.offset, want, "packed vs one per row: gradient of " + p.name, 1e-6);
  }
}

// The loss is normalised by the batch's counted targets, not per micro-batch:
// 8 rows at once and 8 micro-batches of one row (each of its own length, 2
// to 19 counted targets) accumulate the same gradients.
TEST_P(SftReference, BatchOf8IsBatchOf1Accumulated8Times) {
  const Case c(GetParam());
  Transformer whole(c.config, c.rows, c.T), one(c.config, 1, c.T);
  c.load(whole);
  c.load(one);
  const double l8 = c.run(whole, "rows", c.rows), l1 = c.run(one, "rows", 1);
  EXPECT_LE(std::fabs(l8 - l1) / l8, 1e-6) << "loss: batch 8 " << l8 << ", 8 × batch 1 " << l1;
  for (const TensorSpec& p : whole.param_infos()) {
    const std::vector<float> want(whole.grads() + p.offset, whole.grads() + p.offset + p.numel());
    expect_close(one.grads() + p.offset, want, "8 accumulated micro-batches of 1 vs one of 8: gradient of " + p.name,
                 1e-6);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, SftReference, ::testing::Values("gpt2", "llama"),
                         [](const auto& info) { return info.param; });

// A bad position list is refused with the row and column named.
TEST(SftPositions, PositionsThatDoNotCountUpAreRefused) {
  const Case c("gpt2");
  Transformer model(c.config, 1, c.T);
  std::vector<int32_t> pos(static_cast<size_t>(c.T));
  for (int64_t t = 0; t < c.T; ++t) pos[t] = static_cast<int32_t>(t);
  pos[5] = 7;
  EXPECT_NE(po::test::error_of([&] { model.set_positions(pos.data()); })
                .find("packed positions: row 0 column 5 holds position 7 after 4"),
            std::string::npos);
  pos[0] = 3;
  EXPECT_NE(po::test::error_of([&] { model.set_positions(pos.data()); })
                .find("packed positions: row 0 starts at position 3, not 0"),
            std::string::npos);
}

}  // namespace
