// GPT2's UnitHooks: a model whose parameters and gradients are reached
// through hooks (copies of each unit, handed out and taken back as ZeRO-3
// does) gives bit-identical losses and gradients to the model on its own
// flat buffers, and asks for units in the documented order.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "../test_util.h"
#include "backend/ops.h"
#include "core/error.h"
#include "model/transformer.h"

namespace {

using po::model::Transformer;
using po::model::TransformerConfig;
using po::model::UnitHooks;

struct Batch {
  std::vector<int32_t> in, tg;
  Batch(int64_t n, int salt) : in(n), tg(n) {
    for (int64_t i = 0; i < n; ++i) {
      in[i] = static_cast<int32_t>((i * 37 + salt) % 97);
      tg[i] = static_cast<int32_t>((i * 53 + 3 * salt + 1) % 97);
    }
  }
};

// "p3": a hook call's log entry (kind letter, unit).
std::string tag(char kind, int unit) {
  std::string s(1, kind);
  s += std::to_string(unit);
  return s;
}

// Hooks in the manner of ZeRO-3: params(u) copies the unit into a fresh
// buffer (poisoned on done), grads(u) a zeroed accumulator per micro-batch,
// added into `grads` on grads_ready. Every call is logged.
struct CopyHooks {
  const std::vector<float>& params;  // the source of truth, full model
  std::vector<float> grads;          // the sum of every micro-batch's accumulators
  const Transformer& model;
  std::vector<std::vector<float>> gathered, acc;
  std::vector<std::string> log;

  CopyHooks(const Transformer& m, const std::vector<float>& p)
      : params(p), grads(p.size(), 0.0f), model(m), gathered(m.num_units()), acc(m.num_units()) {}

  UnitHooks hooks() {
    return {[this](int u) {
              log.push_back(tag('p', u));
              EXPECT_TRUE(gathered[u].empty()) << "unit " << u << " requested twice";
              const float* src = params.data() + model.unit_offset(u);
              gathered[u].assign(src, src + model.unit_numel(u));
              return gathered[u].data();
            },
            [this](int u) {
              log.push_back(tag('d', u));
              std::fill(gathered[u].begin(), gathered[u].end(), 1e30f);  // a stale read shows
              gathered[u].clear();
            },
            [this](int u) {
              if (acc[u].empty()) {
                log.push_back(tag('g', u));
                acc[u].assign(model.unit_numel(u), 0.0f);
              }
              return acc[u].data();
            },
            [this](int u) {
              log.push_back(tag('r', u));
              float* dst = grads.data() + model.unit_offset(u);
              for (size_t i = 0; i < acc[u].size(); ++i) dst[i] += acc[u][i];
              acc[u].clear();
            },
            {},
            {},
            {},
            {},
            {}};  // no bf16 parameters, no lookup rows
  }
};

void expect_identical(const float* a, const float* b, int64_t n, const std::string& what) {
  int64_t first = -1, count = 0;
  for (int64_t i = 0; i < n; ++i)
    if (std::memcmp(a + i, b + i, sizeof(float)) != 0) {
      if (first < 0) first = i;
      ++count;
    }
  EXPECT_EQ(count, 0) << what << ": " << count << " elements differ, first at " << first << " ("
                      << a[first < 0 ? 0 : first] << " vs " << b[first < 0 ? 0 : first] << ")";
}

void check_hooks_match(bool checkpointing) {
  po::backend::cpu::set_num_threads(1);  // tiny shapes: threads only contend
  const TransformerConfig c = po::test::tiny_model(checkpointing);
  const int64_t B = 2, T = 16;
  Transformer plain(c, B, T), hooked(c, B, T);
  plain.init_random(11);
  hooked.init_random(11);
  std::vector<float> params(hooked.params(), hooked.params() + hooked.num_params());
  hooked.release_params();
  hooked.release_grads();
  CopyHooks h(hooked, params);
  hooked.set_unit_hooks(h.hooks());

  // One micro-batch: 0 + x == x, so the gradients are bit-identical.
  const Batch b1(B * T, 5);
  plain.zero_grads();
  hooked.zero_grads();  // released: nothing to do
  const float lp = plain.forward_backward(b1.in.data(), b1.tg.data(), 1.0f / (B * T));
  const float lh = hooked.forward_backward(b1.in.data(), b1.tg.data(), 1.0f / (B * T));
  EXPECT_EQ(lp, lh) << "loss with hooks";
  expect_identical(plain.grads(), h.grads.data(), plain.num_params(), "gradients with hooks");

  const int L = static_cast<int>(c.n_layer);
  std::vector<std::string> want;
  for (int u = 0; u <= L; ++u) want.insert(want.end(), {tag('p', u), tag('d', u)});
  const int f = L + 1;
  want.insert(want.end(), {"p0", tag('p', f), "g0", tag('g', f), tag('d', f), "d0", tag('r', f)});
  for (int u = L; u >= 1; --u)
    want.insert(want.end(), {tag('p', u), tag('g', u), tag('d', u), tag('r', u)});
  want.insert(want.end(), {"r0"});
  EXPECT_EQ(h.log, want) << "the order of hook calls of one forward_backward";

  // Evaluation asks for a prefix of that order and touches no gradient.
  h.log.clear();
  EXPECT_EQ(plain.evaluate(b1.in.data(), b1.tg.data()), hooked.evaluate(b1.in.data(), b1.tg.data()))
      << "evaluate with hooks";
  const std::vector<std::string> prefix(want.begin(), want.begin() + 2 * (L + 1) + 2);
  std::vector<std::string> eval_want = prefix;
  eval_want.insert(eval_want.end(), {tag('d', f), "d0"});
  EXPECT_EQ(h.log, eval_want) << "the order of hook calls of evaluate";

  std::vector<float> lp_logits(c.vocab_size), lh_logits(c.vocab_size);
  plain.next_token_logits(b1.in.data(), 9, lp_logits.data());
  hooked.next_token_logits(b1.in.data(), 9, lh_logits.data());
  expect_identical(lp_logits.data(), lh_logits.data(), c.vocab_size,
                   "next-token logits with hooks");
}

TEST(GPT2Hooks, CopyingHooksGiveBitIdenticalLossAndGradients) { check_hooks_match(false); }

TEST(GPT2Hooks, SameWithActivationCheckpointing) { check_hooks_match(true); }

// Hooks that return the model's own buffers are the model without hooks,
// over several micro-batches too.
TEST(GPT2Hooks, OwnBufferHooksAreTheModelWithoutHooks) {
  po::backend::cpu::set_num_threads(1);
  const TransformerConfig c = po::test::tiny_model(false);
  const int64_t B = 2, T = 16;
  Transformer plain(c, B, T), hooked(c, B, T);
  plain.init_random(3);
  hooked.init_random(3);
  int ready = 0;
  hooked.set_unit_hooks({[&](int u) { return hooked.params() + hooked.unit_offset(u); },
                         [](int) {}, [&](int u) { return hooked.grads() + hooked.unit_offset(u); },
                         [&](int) { ++ready; }, {}, {}, {}, {}, {}});
  plain.zero_grads();
  hooked.zero_grads();
  for (int m = 0; m < 3; ++m) {
    const Batch b(B * T, 7 * m + 1);
    EXPECT_EQ(plain.forward_backward(b.in.data(), b.tg.data(), 0.01f),
              hooked.forward_backward(b.in.data(), b.tg.data(), 0.01f))
        << "micro-batch " << m;
  }
  EXPECT_EQ(ready, 3 * hooked.num_units())
      << "grads_ready fires for every unit of every micro-batch";
  expect_identical(plain.grads(), hooked.grads(), plain.num_params(), "accumulated gradients");
}

TEST(GPT2Hooks, ReleasedBuffersAreAnErrorAndHooksComeWhole) {
  Transformer m(po::test::tiny_model(false), 1, 16);
  m.release_params();
  EXPECT_THROW(m.params(), po::core::Error);
  EXPECT_EQ(m.params_bytes(), 0u);
  m.release_grads();
  EXPECT_THROW(m.grads(), po::core::Error);
  m.zero_grads();  // nothing to zero: no error
  UnitHooks partial;
  partial.params = [](int) { return static_cast<float*>(nullptr); };
  EXPECT_THROW(m.set_unit_hooks(partial), po::core::Error);
}

}  // namespace

// The model reaches split layers' collectives only through ParallelOps: a
// recording implementation at tp = 1 (sums over one rank: identity) sees the
// Megatron points (2 per block forward, 2 per block backward, the head's
// input gradient) and leaves the bits of the null one.
TEST(ParallelOpsSeam, CalledAtMegatronPointsAndIdentityAtOneRank) {
  struct Recording final : po::model::ParallelOps {
    int calls = 0;
    int tp_size() const override { return 1; }
    int tp_rank() const override { return 0; }
    void tp_all_reduce(float*, int64_t) override { ++calls; }
    void tp_all_reduce(double*, int64_t) override { ADD_FAILURE() << "loss sums at tp = 1"; }
    void tp_all_reduce_max(float*, int64_t) override { ADD_FAILURE() << "loss max at tp = 1"; }
    void tp_all_gather(const float*, float*, int64_t) override {
      ADD_FAILURE() << "a sequence-parallel gather at tp = 1";
    }
    void tp_reduce_scatter(const float*, float*, int64_t) override {
      ADD_FAILURE() << "a sequence-parallel reduce-scatter at tp = 1";
    }
  };
  const auto c = po::test::tiny_model(false);
  const int64_t B = 2, T = 8;
  Transformer plain(c, B, T), seamed(c, B, T);
  plain.init_random(3);
  seamed.init_random(3);
  Recording rec;
  seamed.set_parallel_ops(rec);
  std::vector<int32_t> in(B * T), tg(B * T);
  for (int64_t i = 0; i < B * T; ++i) {
    in[i] = static_cast<int32_t>((i * 7) % c.vocab_size);
    tg[i] = static_cast<int32_t>((i * 5 + 1) % c.vocab_size);
  }
  plain.zero_grads();
  seamed.zero_grads();
  const float a = plain.forward_backward(in.data(), tg.data(), 1.0f / (B * T));
  const float b = seamed.forward_backward(in.data(), tg.data(), 1.0f / (B * T));
  EXPECT_EQ(a, b) << "loss with a one-rank ParallelOps differs from the null one";
  EXPECT_EQ(0, std::memcmp(plain.grads(), seamed.grads(),
                           static_cast<size_t>(plain.num_params()) * sizeof(float)))
      << "gradients with a one-rank ParallelOps differ from the null one";
  EXPECT_EQ(rec.calls, static_cast<int>(4 * c.n_layer + 1))
      << "expected 2 all-reduces per block forward, 2 per block backward and 1 in the head";
}
