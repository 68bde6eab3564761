// Tensor parallel inside the model, against the unsplit computation: tp
// ranks run as threads of one process, their collectives through an
// in-process ParallelOps (sums in rank order, the same bits on every rank).
// Each piece is checked on its own (column- and row-parallel linear layers
// in a block, the vocabulary-parallel embedding and loss, padding) by
// running whole models whose only difference is the split:
//   - a shard's initial values are the unsplit tensor's, bit for bit;
//   - loss and every gradient, mapped back into the whole tensors through
//     Layout::global_runs, agree with tp = 1 (the sums run in another order:
//     relative 1e-5);
//   - replicated tensors get the same bits on every rank;
//   - padded vocabulary rows get no gradient and never win the softmax.
#include <gtest/gtest.h>

#include <barrier>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "backend/ops.h"
#include "core/error.h"
#include "model/transformer.h"
#include "plan/planner.h"

namespace {

using po::model::Layout;
using po::model::Partition;
using po::model::TensorSpec;
using po::model::TensorSplit;
using po::model::Transformer;
using po::model::TransformerConfig;

// The tensor group of `n` threads: every reduction publishes each rank's
// buffer, every rank adds them in rank order into its own result, and all
// wait until everyone has read before writing back.
class ThreadGroup {
 public:
  explicit ThreadGroup(int n) : n_(n), sync_(n), ptrs_(static_cast<size_t>(n)) {}
  int size() const { return n_; }

  template <typename T, typename Op>
  void all_reduce(int rank, T* x, int64_t count, Op op) {
    ptrs_[static_cast<size_t>(rank)] = x;
    sync_.arrive_and_wait();
    std::vector<T> out(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) {
      T acc = static_cast<T*>(ptrs_[0])[i];
      for (int r = 1; r < n_; ++r) acc = op(acc, static_cast<T*>(ptrs_[static_cast<size_t>(r)])[i]);
      out[static_cast<size_t>(i)] = acc;
    }
    sync_.arrive_and_wait();
    std::copy(out.begin(), out.end(), x);
  }
  // out[n·size] = every rank's x[n] in rank order.
  void all_gather(int rank, const float* x, float* out, int64_t n) {
    ptrs_[static_cast<size_t>(rank)] = const_cast<float*>(x);
    sync_.arrive_and_wait();
    for (int r = 0; r < n_; ++r)
      std::copy_n(static_cast<const float*>(ptrs_[static_cast<size_t>(r)]), n, out + r * n);
    sync_.arrive_and_wait();
  }
  // out[n] = block `rank` of the sum over ranks of x[n·size], in rank order.
  void reduce_scatter(int rank, const float* x, float* out, int64_t n) {
    ptrs_[static_cast<size_t>(rank)] = const_cast<float*>(x);
    sync_.arrive_and_wait();
    for (int64_t i = 0; i < n; ++i) {
      float acc = 0;
      for (int r = 0; r < n_; ++r) acc += static_cast<const float*>(ptrs_[static_cast<size_t>(r)])[rank * n + i];
      out[i] = acc;
    }
    sync_.arrive_and_wait();
  }

 private:
  int n_;
  std::barrier<> sync_;
  std::vector<void*> ptrs_;
};

class ThreadOps final : public po::model::ParallelOps {
 public:
  ThreadOps(ThreadGroup& g, int rank) : g_(g), rank_(rank) {}
  int tp_size() const override { return g_.size(); }
  int tp_rank() const override { return rank_; }
  void tp_all_reduce(float* x, int64_t n) override {
    ++calls;
    g_.all_reduce(rank_, x, n, [](float a, float b) { return a + b; });
  }
  void tp_all_reduce(double* x, int64_t n) override {
    ++calls;
    g_.all_reduce(rank_, x, n, [](double a, double b) { return a + b; });
  }
  void tp_all_reduce_max(float* x, int64_t n) override {
    ++calls;
    g_.all_reduce(rank_, x, n, [](float a, float b) { return a > b ? a : b; });
  }
  void tp_all_gather(const float* x, float* out, int64_t n) override {
    ++calls;
    ++gathers;
    g_.all_gather(rank_, x, out, n);
  }
  void tp_reduce_scatter(const float* x, float* out, int64_t n) override {
    ++calls;
    ++scatters;
    g_.reduce_scatter(rank_, x, out, n);
  }
  int calls = 0, gathers = 0, scatters = 0;

 private:
  ThreadGroup& g_;
  int rank_;
};

struct Result {
  float loss = 0, eval_loss = 0;
  std::vector<float> params, grads;  // held layout
  int gathers = 0, scatters = 0;     // sequence-parallel collectives of the two micro-batches
};

constexpr int64_t kB = 2, kT = 16;
constexpr uint64_t kSeed = 7;

void batch(const TransformerConfig& c, std::vector<int32_t>& in, std::vector<int32_t>& tg) {
  in.resize(kB * kT);
  tg.resize(kB * kT);
  for (int64_t i = 0; i < kB * kT; ++i) {
    in[i] = static_cast<int32_t>((i * 37 + 5) % c.vocab_size);
    tg[i] = static_cast<int32_t>((i * 53 + 11) % c.vocab_size);
  }
  tg[3] = static_cast<int32_t>(c.vocab_size - 1);  // the last real row, beside the padding
  in[4] = static_cast<int32_t>(c.vocab_size - 1);
}

// Two micro-batches (gradients accumulate) and an evaluation, at tp ranks.
std::vector<Result> run(const TransformerConfig& c, int tp, bool tp_overlap = false) {
  std::vector<int32_t> in, tg;
  batch(c, in, tg);
  std::vector<Result> out(static_cast<size_t>(tp));
  ThreadGroup group(tp);
  auto rank_main = [&](int r) {
    Transformer m(c, kB, kT, {}, TensorSplit{tp, r});
    ThreadOps ops(group, r);
    m.set_parallel_ops(ops);
    m.set_tp_overlap(tp_overlap);
    m.init_random(kSeed);
    Result& res = out[static_cast<size_t>(r)];
    res.params.assign(m.params(), m.params() + m.num_params());
    m.zero_grads();
    res.loss = m.forward_backward(in.data(), tg.data(), 0.5f / (kB * kT));
    (void)m.forward_backward(tg.data(), in.data(), 0.5f / (kB * kT));
    res.grads.assign(m.grads(), m.grads() + m.num_params());
    // Sequence parallel: each rank's norm gradients are its rows' part; the
    // step sums them over the group (the executor's sum_norm_rows).
    if (m.sequence_shards() > 1)
      for (const auto& [at, n] : m.layout().norm_ranges()) ops.tp_all_reduce(res.grads.data() + at, n);
    res.gathers = ops.gathers;
    res.scatters = ops.scatters;
    res.eval_loss = m.evaluate(in.data(), tg.data());
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r) threads.emplace_back(rank_main, r);
  for (auto& t : threads) t.join();
  return out;
}

// Every held element of every rank against the whole tensor at tp = 1.
void expect_matches_whole(const TransformerConfig& c, int tp, const std::vector<Result>& whole,
                          const std::vector<Result>& split, double tol = 1e-5) {
  const Layout full(c);
  const float loss = whole[0].loss;
  for (int r = 0; r < tp; ++r) {
    const Result& s = split[static_cast<size_t>(r)];
    EXPECT_NEAR(s.loss, loss, tol * std::fabs(loss)) << "tp " << tp << " rank " << r << ": loss";
    EXPECT_NEAR(s.eval_loss, whole[0].eval_loss, tol * std::fabs(loss))
        << "tp " << tp << " rank " << r << ": evaluate()";
    const Layout held(c, TensorSplit{tp, r});
    for (size_t k = 0; k < held.tensors().size(); ++k) {
      const TensorSpec& t = held.tensors()[k];
      const TensorSpec& g = full.tensors()[k];
      ASSERT_EQ(t.name, g.name);
      ASSERT_EQ(t.global_shape, g.shape) << t.name;
      // ||held - whole|| / ||whole|| over the held elements (as the PyTorch
      // comparisons measure), and the worst element for the message.
      int64_t bad = 0, padding = 0;
      double diff2 = 0, ref2 = 0, worst = 0;
      std::string first;
      held.global_runs(t, [&](int64_t local, int64_t global, int64_t n) {
        for (int64_t i = 0; i < n; ++i) {
          const float p = s.params[static_cast<size_t>(t.offset + local + i)];
          const float dg = s.grads[static_cast<size_t>(t.offset + local + i)];
          if (global < 0) {  // padding: zero, and nothing flows into it
            padding += (p != 0.0f || dg != 0.0f);
            continue;
          }
          const size_t gi = static_cast<size_t>(g.offset + global + i);
          if (p != whole[0].params[gi]) ++bad;  // initialisation: bit for bit
          const double want = whole[0].grads[gi], d = std::fabs(dg - want);
          diff2 += d * d;
          ref2 += want * want;
          if (d > worst) {
            worst = d;
            first = std::to_string(local + i) + " (whole " + std::to_string(global + i) +
                    "): " + std::to_string(dg) + " vs " + std::to_string(want);
          }
        }
      });
      const double rel = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
      EXPECT_EQ(bad, 0) << "tp " << tp << " rank " << r << ": " << t.name << ": " << bad
                        << " initial values differ from the unsplit tensor's";
      EXPECT_EQ(padding, 0) << "tp " << tp << " rank " << r << ": " << t.name
                            << ": padding rows not zero";
      EXPECT_LE(rel, tol) << "tp " << tp << " rank " << r << ": " << t.name
                           << ": gradient differs by " << rel << " (relative norm), worst at held element "
                           << first;
      if (t.partition == Partition::kReplicated && r > 0) {  // the same bits on every rank
        for (int64_t i = 0; i < t.numel(); ++i) {
          ASSERT_EQ(s.grads[static_cast<size_t>(t.offset + i)],
                    split[0].grads[static_cast<size_t>(t.offset + i)])
              << "tp " << tp << ": replicated " << t.name << " element " << i
              << " differs between rank 0 and rank " << r;
        }
      }
    }
  }
}

TransformerConfig gpt2_config() {
  TransformerConfig c = TransformerConfig::arch_defaults("gpt2");
  c.n_layer = 2;
  c.n_embd = 64;
  c.n_head = 4;
  c.vocab_size = 101;  // pads to 102 at tp 2, 104 at tp 4
  c.seq_len = kT;
  return c;
}

TransformerConfig llama_config(int64_t n_kv_head, bool tied) {
  TransformerConfig c = TransformerConfig::arch_defaults("llama");
  c.n_layer = 2;
  c.n_embd = 64;
  c.n_head = 4;
  c.n_kv_head = n_kv_head;
  c.ffn_hidden = 96;
  c.vocab_size = 103;
  c.seq_len = kT;
  c.tie_embeddings = tied;
  return c;
}

class TensorParallel : public ::testing::Test {
 protected:
  void SetUp() override { po::backend::cpu::set_num_threads(1); }
};

TEST_F(TensorParallel, Gpt2AtTp2AndTp4MatchesTheWholeModel) {
  const TransformerConfig c = gpt2_config();
  const auto whole = run(c, 1);
  for (int tp : {2, 4}) expect_matches_whole(c, tp, whole, run(c, tp));
}

TEST_F(TensorParallel, Gpt2UntiedWithoutBiasMatches) {
  TransformerConfig c = gpt2_config();
  c.bias = false;
  c.tie_embeddings = false;
  expect_matches_whole(c, 2, run(c, 1), run(c, 2));
}

TEST_F(TensorParallel, LlamaGroupedQueryMatches) {
  for (bool tied : {false, true}) {
    const TransformerConfig c = llama_config(2, tied);
    expect_matches_whole(c, 2, run(c, 1), run(c, 2));
  }
  const TransformerConfig mha = llama_config(4, false);
  expect_matches_whole(mha, 4, run(mha, 1), run(mha, 4));
}

// Activation checkpointing recomputes the same split forward: 1e-5. bf16
// activations round what they save, and a last-bit difference of the f32
// value moves a rounding: bf16's tolerance, 1e-3.
TEST_F(TensorParallel, CheckpointedAndBf16ActivationsMatch) {
  TransformerConfig c = llama_config(2, false);
  c.activation_checkpointing = true;
  expect_matches_whole(c, 2, run(c, 1), run(c, 2));
  c = gpt2_config();
  c.bf16_activations = true;
  expect_matches_whole(c, 2, run(c, 1), run(c, 2), 1e-3);
}

// Sequence parallel: each rank holds B·T/tp rows of the norm and residual
// regions; the model's result is tp's without it (relative 1e-5), and every
// norm weight's gradient, its rows' parts summed over the ranks (as the
// executor's step does), is replicated bit for bit. A block makes 2 all-gathers and 2 reduce-scatters forward, 4 and 2
// backward (the norm outputs are gathered again for the weight gradients);
// the embedding 1 reduce-scatter and 1 gather, the head 1 and 1.
TEST_F(TensorParallel, SequenceParallelMatchesTheWholeModel) {
  TransformerConfig c = gpt2_config();
  const auto whole = run(c, 1);
  c.sequence_parallel = true;
  for (int tp : {2, 4}) {
    const auto split = run(c, tp);
    expect_matches_whole(c, tp, whole, split);
    const int per_micro_gathers = 6 * static_cast<int>(c.n_layer) + 2;
    const int per_micro_scatters = 4 * static_cast<int>(c.n_layer) + 2;
    EXPECT_EQ(split[0].gathers, 2 * per_micro_gathers) << "tp " << tp << ": all-gathers";
    EXPECT_EQ(split[0].scatters, 2 * per_micro_scatters) << "tp " << tp << ": reduce-scatters";
  }
  for (bool tied : {false, true}) {
    TransformerConfig l = llama_config(2, tied);
    const auto lw = run(l, 1);
    l.sequence_parallel = true;
    expect_matches_whole(l, 2, lw, run(l, 2));
  }
}

TEST_F(TensorParallel, SequenceParallelCheckpointedAndBf16Match) {
  TransformerConfig c = llama_config(2, false);
  c.activation_checkpointing = true;
  const auto ckpt = run(c, 1);
  c.sequence_parallel = true;
  expect_matches_whole(c, 2, ckpt, run(c, 2));
  c = gpt2_config();
  c.bf16_activations = true;
  const auto bf16 = run(c, 1);
  c.sequence_parallel = true;
  expect_matches_whole(c, 2, bf16, run(c, 2), 1e-3);
}

// parallel.tp_overlap splits each column-parallel GEMM's backward around its
// reduction: the bits of the fused backward, with and without sequence
// parallel (here the collectives block; the launch test overlaps them).
TEST_F(TensorParallel, OverlappedBackwardGivesTheSameBits) {
  for (bool sp : {false, true}) {
    TransformerConfig c = llama_config(2, false);
    c.sequence_parallel = sp;
    const auto plain = run(c, 2), overlapped = run(c, 2, true);
    for (int r = 0; r < 2; ++r) {
      const auto& a = plain[static_cast<size_t>(r)].grads;
      const auto& b = overlapped[static_cast<size_t>(r)].grads;
      ASSERT_EQ(a.size(), b.size());
      size_t bad = 0;
      for (size_t i = 0; i < a.size(); ++i) bad += a[i] != b[i];
      EXPECT_EQ(bad, 0u) << (sp ? "sequence parallel" : "tp") << " rank " << r << ": " << bad
                         << " gradient elements differ with tp_overlap";
    }
  }
}

TEST_F(TensorParallel, SequenceParallelNeedsTheTokensToSplit) {
  TransformerConfig c = gpt2_config();
  c.sequence_parallel = true;
  try {
    Transformer m(c, 1, 6, {}, TensorSplit{4, 0});
    FAIL() << "6 tokens over 4 sequence-parallel ranks were accepted";
  } catch (const po::core::InvalidArgument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("parallel.sequence_parallel"), std::string::npos) << msg;
    EXPECT_NE(msg.find("train.micro_batch_size × model.seq_len = 1 × 6"), std::string::npos) << msg;
  }
}

// The bytes a block saves for its backward, from the engine's own activation
// layout, against Korthikanti et al.'s count (flash form, no dropout masks):
// within 2% (the norm statistics and attention's log-sum-exp rows are
// extra), and sequence parallel saves the formula's share within 10%.
TEST_F(TensorParallel, SavedActivationsPerLayerFollowKorthikanti) {
  TransformerConfig c = TransformerConfig::preset("bench-small");
  const int64_t B = 4, T = c.seq_len, t = 2;
  const double s = static_cast<double>(T), b = B, h = static_cast<double>(c.n_embd);
  const double tp_only = static_cast<double>(Transformer::predicted_layer_bytes(c, B, T, t));
  c.sequence_parallel = true;
  const double with_sp = static_cast<double>(Transformer::predicted_layer_bytes(c, B, T, t));
  const double f_tp = 4 * po::plan::korthikanti_layer_elements(s, b, h, t, false);
  const double f_sp = 4 * po::plan::korthikanti_layer_elements(s, b, h, t, true);
  EXPECT_NEAR(tp_only / f_tp, 1.0, 0.02) << "tp 2: engine " << tp_only << " B vs formula " << f_tp;
  EXPECT_NEAR(with_sp / f_sp, 1.0, 0.02) << "tp 2 + SP: engine " << with_sp << " B vs formula "
                                         << f_sp;
  const double saved = 1 - with_sp / tp_only, formula = 1 - f_sp / f_tp;
  EXPECT_NEAR(saved / formula, 1.0, 0.10)
      << "sequence parallel saves " << saved << " of a layer's activations, the formula " << formula;
  // bf16 activations halve the saved tensors (the statistics stay f32).
  c.bf16_activations = true;
  const double bf16_sp = static_cast<double>(Transformer::predicted_layer_bytes(c, B, T, t));
  EXPECT_NEAR(bf16_sp / (f_sp / 2), 1.0, 0.03) << "bf16 tp 2 + SP: " << bf16_sp << " B";
}

TEST_F(TensorParallel, HeldShapesAndPadding) {
  const TransformerConfig c = gpt2_config();
  const Layout held(c, TensorSplit{4, 3});
  EXPECT_EQ(held.vocab_rows(), 26);  // 104 / 4
  EXPECT_EQ(held.vocab_begin(), 78);
  EXPECT_EQ(held.vocab_real(), 23);  // 101 - 78: three padding rows
  const TensorSpec& qkv = held.tensor("h.0.attn.c_attn.weight");
  EXPECT_EQ(qkv.shape, (po::tensor::Shape{48, 64}));  // [q_r; k_r; v_r], 16 rows each
  EXPECT_EQ(qkv.global_shape, (po::tensor::Shape{192, 64}));
  // Row 16 of the held c_attn is k's first held row: whole row 64 + 3·16.
  int64_t seen = 0;
  held.global_runs(qkv, [&](int64_t local, int64_t global, int64_t n) {
    if (local == 16 * 64) {
      EXPECT_EQ(global, (64 + 48) * 64);
    }
    seen += n;
  });
  EXPECT_EQ(seen, qkv.numel());
  const TensorSpec& proj = held.tensor("h.1.mlp.c_proj.weight");
  EXPECT_EQ(proj.shape, (po::tensor::Shape{64, 64}));  // [C, F/4]
  EXPECT_EQ(proj.global_shape, (po::tensor::Shape{64, 256}));
  // Every tp rank's units have the same sizes (dp shards cut them alike).
  const Layout other(c, TensorSplit{4, 0});
  for (int u = 0; u < held.num_units(); ++u) EXPECT_EQ(held.unit_numel(u), other.unit_numel(u));
}

TEST_F(TensorParallel, LayoutsThatDoNotDivideAreOneLineErrors) {
  try {
    Layout l(llama_config(2, false), TensorSplit{4, 0});
    FAIL() << "tp 4 over 2 kv heads was accepted";
  } catch (const po::core::InvalidArgument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("parallel.tp = 4"), std::string::npos) << msg;
    EXPECT_NE(msg.find("model.n_kv_head = 2"), std::string::npos) << msg;
  }
  TransformerConfig c = llama_config(4, false);
  c.ffn_hidden = 90;
  try {
    Layout l(c, TensorSplit{4, 1});
    FAIL() << "tp 4 over ffn_hidden 90 was accepted";
  } catch (const po::core::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("model.ffn_hidden = 90"), std::string::npos) << e.what();
  }
}

// The vocabulary-parallel loss kernels, run as one rank holding every
// column, against the fused cross-entropy.
TEST_F(TensorParallel, VocabLossKernelsAtOneRankMatchFusedCrossEntropy) {
  namespace ops = po::backend::cpu;
  const int64_t n = 5, V = 37;
  std::vector<float> a(n * V), b;
  for (int64_t i = 0; i < n * V; ++i) a[i] = std::sin(0.7f * static_cast<float>(i)) * 3.0f;
  b = a;
  std::vector<int32_t> tg = {0, 36, 5, 17, 2};
  std::vector<float> la(n), lb(n), mx(n);
  std::vector<double> sums(2 * n);
  ops::crossentropy_forward(la.data(), a.data(), tg.data(), n, V, 0.25f);
  ops::vocab_ce_max(mx.data(), b.data(), n, V, V);
  ops::vocab_ce_sums(sums.data(), b.data(), tg.data(), mx.data(), n, V, V, 0, true);
  ops::vocab_ce_finish(lb.data(), b.data(), tg.data(), mx.data(), sums.data(), n, V, V, 0, 0.25f);
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(la[i], lb[i], 1e-6) << "loss of row " << i;
  for (int64_t i = 0; i < n * V; ++i) EXPECT_NEAR(a[i], b[i], 1e-7) << "gradient element " << i;
}

}  // namespace
