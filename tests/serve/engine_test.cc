// The serving engine against `generate`'s decode (serve::sample: one
// sequence, a contiguous KV cache): greedy outputs token for token, alone
// and in a batch of 32 requests of different lengths, through chunked
// prefill, the prefix cache and preemption; seeded sampling independent of
// the batch; the KV block pool, stop sequences and UTF-8 text.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <thread>

#include "../data/llama_test_util.h"
#include "data/text_tokenizer.h"
#include "serve/detokenize.h"
#include "serve/engine.h"
#include "serve/kv_cache.h"
#include "serve/sampler.h"
#include "serve/generate.h"
#include "serve_adapters.h"

namespace po::serve {
namespace {

using test_adapters::merged_greedy;
using test_adapters::random_adapter;

using model::Transformer;
using model::TransformerConfig;

TransformerConfig tiny(const std::string& arch) {
  TransformerConfig c = TransformerConfig::arch_defaults(arch);
  c.n_layer = 2;
  c.n_embd = 32;
  c.n_head = 4;
  c.n_kv_head = arch == "llama" ? 2 : 4;  // grouped-query attention for Llama
  c.vocab_size = arch == "llama" ? 32000 : 50257;
  c.seq_len = 96;
  c.fill_derived();
  return c;
}

std::unique_ptr<data::TextTokenizer> tokenizer_for(const std::string& arch) {
  if (arch == "llama") {
    const std::string dir = data::testing::llama_fixture_dir();
    if (dir.empty()) return nullptr;
    return data::load_tokenizer(dir + "/tokenizer.json");
  }
  return data::load_tokenizer(PO_SOURCE_DIR);
}

// Everything collected from one stream.
struct Result {
  std::vector<int32_t> ids;
  std::string text, token_text;
  Finish finish = Finish::kNone;
  std::string error;
};

Result collect(Stream& s) {
  Result r;
  Update u;
  for (;;) {
    if (!s.next(u, std::chrono::milliseconds(30000))) {
      r.error = "no update within 30 s";
      return r;
    }
    for (const auto& t : u.tokens) {
      r.ids.push_back(t.id);
      r.token_text += t.text;
    }
    r.text += u.text;
    if (u.finish != Finish::kNone) {
      r.finish = u.finish;
      r.error = u.error;
      return r;
    }
  }
}

std::string ids_str(const std::vector<int32_t>& v) {
  std::string s;
  for (int32_t x : v) s += std::to_string(x) + " ";
  return s;
}

// Prompts of different lengths (ids drawn from a fixed LCG, in the vocabulary).
std::vector<std::vector<int32_t>> prompts(int count, int64_t V, uint32_t salt) {
  std::vector<std::vector<int32_t>> out;
  uint32_t x = 12345 + salt;
  for (int i = 0; i < count; ++i) {
    std::vector<int32_t> p;
    const int len = 1 + (i * 7) % 40;
    for (int j = 0; j < len; ++j) {
      x = x * 1664525u + 1013904223u;
      p.push_back(static_cast<int32_t>((x >> 8) % static_cast<uint32_t>(V)));
    }
    out.push_back(p);
  }
  return out;
}

class EngineGreedy : public ::testing::TestWithParam<std::string> {};

// Greedy: the engine's tokens are generate's, alone and among 32 requests,
// with the whole KV pool and with one so small that requests are preempted.
TEST_P(EngineGreedy, MatchesGenerateAloneInABatchAndUnderPreemption) {
  const std::string arch = GetParam();
  const TransformerConfig c = tiny(arch);
  auto tok = tokenizer_for(arch);
  ASSERT_NE(tok, nullptr) << data::testing::kLlamaSetupHint;
  Transformer ref(c, 1, c.seq_len);
  ref.init_random(7);
  const auto ps = prompts(32, c.vocab_size, arch == "llama" ? 1 : 0);
  std::vector<std::vector<int32_t>> want;
  for (size_t i = 0; i < ps.size(); ++i) {
    serve::SampleOptions o;
    o.temperature = 0;
    o.max_new_tokens = 4 + static_cast<int64_t>(i % 5) * 6;
    want.push_back(serve::sample(ref, ps[i], o));
  }
  Transformer model(c, 2, c.seq_len);  // 192 rows a step
  model.init_random(7);
  auto params = [&](size_t i) {
    SamplingParams p;
    p.max_new_tokens = static_cast<int64_t>(want[i].size());
    p.ignore_eos = true;
    return p;
  };
  // block size 8: a small pool (12 blocks: 96 positions, one request at its
  // longest) forces preemption among 32 requests; 64-row steps chunk prefills.
  // Preempted requests recomputed, or swapped to 40 host blocks and back.
  using P = EngineOptions::Preemption;
  struct Case {
    int64_t blocks, rows;
    P preemption;
  };
  for (const Case& k : {Case{0, 0, P::kRecompute}, Case{12, 64, P::kRecompute}, Case{12, 64, P::kSwap}}) {
    const int64_t blocks = k.blocks;
    EngineOptions eo;
    eo.block_size = 8;
    eo.kv_budget = static_cast<size_t>(blocks) * KvBlockPool::block_bytes(c, 8);
    eo.max_batch_total_tokens = k.rows;
    eo.preemption = k.preemption;
    if (k.preemption == P::kSwap) eo.host_kv_budget = 40 * KvBlockPool::block_bytes(c, 8);
    Engine engine(model, *tok, eo);
    const std::string where = arch + (blocks ? ", 12 KV blocks" : ", default pool") +
                              (k.preemption == P::kSwap ? ", swapping" : "");
    {  // alone
      Result r = collect(*engine.submit(ps[3], params(3)));
      EXPECT_EQ(ids_str(r.ids), ids_str(want[3])) << where << ": request 3 alone";
      EXPECT_EQ(r.finish, Finish::kLength) << r.error;
    }
    std::vector<std::shared_ptr<Stream>> streams;
    for (size_t i = 0; i < ps.size(); ++i) streams.push_back(engine.submit(ps[i], params(i)));
    for (size_t i = 0; i < ps.size(); ++i) {
      Result r = collect(*streams[i]);
      EXPECT_EQ(ids_str(r.ids), ids_str(want[i])) << where << ": request " << i << " of 32 (prompt "
                                                  << ps[i].size() << " tokens) " << r.error;
      EXPECT_EQ(r.text, r.token_text) << where << ": the update text is not the tokens' text";
    }
    const EngineStats st = engine.stats();
    EXPECT_EQ(st.finished, 33) << where;
    EXPECT_EQ(st.cancelled, 0) << where;
    EXPECT_EQ(st.kv_blocks_used, 0) << where << ": blocks still referenced after every request ended";
    if (blocks) {
      EXPECT_GT(st.preemptions, 0) << where << ": 12 blocks should not hold 32 requests";
    }
    if (k.preemption == P::kSwap) {
      EXPECT_GT(st.swapped_out, 0) << where;
      EXPECT_EQ(st.swapped_in, st.swapped_out) << where << ": every swapped request came back";
      EXPECT_EQ(st.kv_blocks_host, 0) << where;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, EngineGreedy, ::testing::Values("gpt2", "llama"));

// A shared prompt: the second request finds the first's full blocks.
// Requests of two adapters (LoRA on every linear; DoRA on the MLP's up
// and the attention's output projections) and of the bare base share the engine's steps, and each
// gives the greedy tokens `generate` gives on that adapter's merged model.
// An adapter's requests never reuse another's or the base's KV blocks; an
// unknown adapter is refused naming the loaded ones.
TEST_P(EngineGreedy, AdaptersBatchTogetherAndEachGivesItsMergedModelsTokens) {
  const std::string arch = GetParam();
  const TransformerConfig c = tiny(arch);
  auto tok = tokenizer_for(arch);
  ASSERT_NE(tok, nullptr) << data::testing::kLlamaSetupHint;
  Transformer model(c, 2, c.seq_len);
  model.init_random(7);
  const std::vector<std::string> every = arch == "gpt2" ? std::vector<std::string>{"c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"}
                                                        : std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj",
                                                                                   "gate_proj", "up_proj", "down_proj"};
  auto a = random_adapter(model, every, false, 21);
  auto b = random_adapter(model, arch == "gpt2" ? std::vector<std::string>{"c_fc", "attn.c_proj"}
                                                : std::vector<std::string>{"up_proj", "o_proj"},
                          true, 22);
  const auto ps = prompts(6, c.vocab_size, arch == "llama" ? 1 : 0);
  constexpr int64_t kNew = 10;
  const std::vector<std::string> names = {"", "a", "b", "", "a", "b"};
  std::vector<std::vector<int32_t>> want;
  for (size_t i = 0; i < ps.size(); ++i) {
    if (names[i].empty()) {
      Transformer ref(c, 1, c.seq_len);
      ref.init_random(7);
      serve::SampleOptions o;
      o.temperature = 0;
      o.max_new_tokens = kNew;
      want.push_back(serve::sample(ref, ps[i], o));
    } else {
      want.push_back(merged_greedy(names[i] == "a" ? *a : *b, ps[i], kNew));
    }
  }
  // Each adapter changes the tokens (or agreeing with the base would pass).
  EXPECT_NE(ids_str(merged_greedy(*a, ps[0], kNew)), ids_str(want[0])) << arch << ": adapter a";
  EXPECT_NE(ids_str(merged_greedy(*b, ps[0], kNew)), ids_str(want[0])) << arch << ": adapter b";
  EngineOptions eo;
  eo.block_size = 8;
  eo.adapters = {{"a", a.get()}, {"b", b.get()}};
  Engine engine(model, *tok, eo);
  std::vector<std::shared_ptr<Stream>> streams;
  for (size_t i = 0; i < ps.size(); ++i) {
    SamplingParams p;
    p.max_new_tokens = kNew;
    p.ignore_eos = true;
    p.adapter = names[i];
    streams.push_back(engine.submit(ps[i], p));
  }
  for (size_t i = 0; i < ps.size(); ++i) {
    Result r = collect(*streams[i]);
    EXPECT_EQ(ids_str(r.ids), ids_str(want[i]))
        << arch << ": request " << i << " (adapter '" << names[i] << "') " << r.error;
  }
  // One batch: the six requests took the steps of one (a prefill and kNew - 1 decodes, give or take).
  EXPECT_LE(engine.stats().steps, kNew + 2) << arch << ": the adapters' requests did not batch together";
  // The same long prompt for the base, then adapter a, then a again: a's
  // first request finds none of the base's blocks, its second finds its own.
  std::vector<int32_t> long_prompt = ps[0];
  while (long_prompt.size() < 40) long_prompt.push_back(long_prompt[long_prompt.size() % ps[0].size()]);
  SamplingParams p;
  p.max_new_tokens = 4;
  p.ignore_eos = true;
  collect(*engine.submit(long_prompt, p));
  const int64_t hits0 = engine.stats().prefix_hits;
  p.adapter = "a";
  Result first = collect(*engine.submit(long_prompt, p));
  EXPECT_EQ(engine.stats().prefix_hits, hits0) << arch << ": adapter a reused the base's KV blocks";
  EXPECT_EQ(ids_str(first.ids), ids_str(merged_greedy(*a, long_prompt, 4))) << arch;
  collect(*engine.submit(long_prompt, p));
  EXPECT_GT(engine.stats().prefix_hits, hits0) << arch << ": adapter a did not find its own blocks";
  p.adapter = "zzz";
  try {
    engine.submit(long_prompt, p);
    ADD_FAILURE() << "an unknown adapter was accepted";
  } catch (const core::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("adapter 'zzz' is not loaded (--lora NAME=DIR); loaded: a, b"),
              std::string::npos)
        << e.what();
  }
}

TEST(Engine, PrefixCacheServesASharedPrompt) {
  const TransformerConfig c = tiny("gpt2");
  auto tok = tokenizer_for("gpt2");
  Transformer model(c, 1, c.seq_len);
  model.init_random(3);
  EngineOptions eo;
  eo.block_size = 4;
  Engine engine(model, *tok, eo);
  std::vector<int32_t> p = prompts(6, c.vocab_size, 9)[5];  // 36 tokens: 8 full blocks before the last
  SamplingParams sp;
  sp.max_new_tokens = 5;
  sp.ignore_eos = true;
  const Result a = collect(*engine.submit(p, sp));
  const Result b = collect(*engine.submit(p, sp));
  EXPECT_EQ(ids_str(a.ids), ids_str(b.ids)) << "the cached prefix changed the output";
  const EngineStats st = engine.stats();
  EXPECT_EQ(st.prefix_queries, 16) << "two prompts of 36 tokens, 8 full blocks each before the last token";
  EXPECT_EQ(st.prefix_hits, 8) << "the second prompt should find all 8 blocks";
}

// Prompt log-probabilities (TGI's decoder_input_details, OpenAI's echo with
// logprobs): every prompt token after the first, scored against the logits
// of the whole sequence up to it (Transformer::next_token_logits), through a
// prefill chunked over three steps, for both forks of a shared prompt, and
// again for a prompt whose blocks are in the prefix cache (not used then).
TEST(Engine, PromptLogprobsMatchTheWholeSequenceLogits) {
  const TransformerConfig c = tiny("gpt2");
  auto tok = tokenizer_for("gpt2");
  Transformer model(c, 1, c.seq_len);
  model.init_random(5);
  const std::vector<int32_t> p = prompts(6, c.vocab_size, 4)[5];  // 36 tokens
  std::vector<float> want;  // log p(p[j+1] | p[0..j])
  std::vector<int32_t> argmax;
  {
    Transformer ref(c, 1, c.seq_len);
    ref.init_random(5);
    std::vector<float> l(static_cast<size_t>(c.vocab_size));
    for (size_t j = 0; j + 1 < p.size(); ++j) {
      ref.next_token_logits(p.data(), static_cast<int64_t>(j + 1), l.data());
      double mx = *std::max_element(l.begin(), l.end()), sum = 0;
      for (float v : l) sum += std::exp(static_cast<double>(v) - mx);
      want.push_back(static_cast<float>(l[static_cast<size_t>(p[j + 1])] - (mx + std::log(sum))));
      argmax.push_back(static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin()));
    }
  }
  EngineOptions eo;
  eo.block_size = 4;
  eo.max_batch_total_tokens = 16;  // the 36-token prompt takes three steps
  Engine engine(model, *tok, eo);
  SamplingParams sp;
  sp.max_new_tokens = 3;
  sp.ignore_eos = true;
  sp.prompt_logprobs = true;
  sp.top_logprobs = 2;
  auto scores = [&](Stream& s, const std::string& what) {
    std::vector<GeneratedToken> got;
    Update u;
    for (int i = 0; i < 100 && s.next(u, std::chrono::milliseconds(30000)); ++i) {
      if (!u.prompt.empty()) {
        EXPECT_TRUE(got.empty()) << what << ": the prompt's scores came twice";
        got = u.prompt;
      }
      if (u.finish != Finish::kNone) break;
    }
    ASSERT_EQ(got.size(), want.size()) << what << ": one score per prompt token after the first";
    for (size_t j = 0; j < got.size(); ++j) {
      EXPECT_EQ(got[j].id, p[j + 1]) << what << ": token " << j + 1;
      EXPECT_NEAR(got[j].logprob, want[j], 1e-4) << what << ": log p(token " << j + 1 << ")";
      ASSERT_EQ(got[j].top.size(), 2u) << what;
      EXPECT_EQ(got[j].top[0].first, argmax[j]) << what << ": the likeliest token after position " << j;
      EXPECT_GE(got[j].top[0].second, got[j].logprob) << what;
    }
  };
  scores(*engine.submit(p, sp), "alone, chunked");
  SamplingParams two = sp;
  two.do_sample = true;
  auto forks = engine.submit_n(p, {two, two});
  for (size_t i = 0; i < forks.size(); ++i) scores(*forks[i], "fork " + std::to_string(i));
  // The prompt's blocks are cached now (the runs above published them); a
  // plain request uses them, one that scores its prompt does not.
  SamplingParams plain = sp;
  plain.prompt_logprobs = false;
  collect(*engine.submit(p, plain));
  EXPECT_GT(engine.stats().prefix_hits, 0) << "the plain request should have hit the cache";
  const int64_t hits = engine.stats().prefix_hits;
  scores(*engine.submit(p, sp), "after the prompt was cached");
  EXPECT_EQ(engine.stats().prefix_hits, hits) << "a request that scores its prompt used cached blocks";
}

// A request that waits for blocks gives its prefix hits back at every
// attempt; the cache's counters count its lookup once, when it is admitted.
TEST(Engine, PrefixLookupsOfAWaitingRequestCountOnce) {
  const TransformerConfig c = tiny("gpt2");
  auto tok = tokenizer_for("gpt2");
  Transformer model(c, 1, c.seq_len);
  model.init_random(3);
  EngineOptions eo;
  eo.block_size = 4;
  eo.kv_budget = 12 * KvBlockPool::block_bytes(c, 4);  // 48 positions: the first request holds them all
  eo.max_total_tokens = 48;
  Engine engine(model, *tok, eo);
  const auto ps = prompts(6, c.vocab_size, 5);
  std::vector<int32_t> p = ps[5];  // 36 tokens, then 9 of the fifth prompt's
  p.insert(p.end(), ps[4].begin(), ps[4].end());
  p.resize(45);  // 11 full blocks before the last token; 12 blocks with 3 new tokens
  ASSERT_EQ(p.size(), 45u) << "the prompt helper gave fewer tokens than the test needs";
  SamplingParams sp;
  sp.max_new_tokens = 3;
  sp.ignore_eos = true;
  auto first = engine.submit(p, sp);
  auto second = engine.submit(p, sp);  // waits for the first's blocks
  const Result a = collect(*first), b = collect(*second);
  EXPECT_EQ(ids_str(a.ids), ids_str(b.ids)) << "the waiting request's output changed";
  const EngineStats st = engine.stats();
  ASSERT_EQ(st.preemptions, 0) << "the test expects the second request to wait, not to preempt";
  EXPECT_EQ(st.prefix_queries, 22) << "11 full blocks looked up per request, once each";
  EXPECT_EQ(st.prefix_hits, 11) << "the second request finds the first's 11 blocks once it is admitted";
}

// n requests of one prompt: one prefill, shared blocks, copy-on-write; each
// gives what it gives alone.
TEST(Engine, ForksShareThePromptAndCopyOnWrite) {
  const TransformerConfig c = tiny("gpt2");
  auto tok = tokenizer_for("gpt2");
  Transformer model(c, 1, c.seq_len);
  model.init_random(13);
  EngineOptions eo;
  eo.block_size = 8;
  eo.prefix_caching = false;  // the sharing below is the forks' own
  Engine engine(model, *tok, eo);
  const std::vector<int32_t> p = prompts(4, c.vocab_size, 2)[3];  // 22 tokens: the third block partly filled
  std::vector<SamplingParams> ps(4);
  for (size_t i = 0; i < ps.size(); ++i) {
    ps[i].do_sample = i > 0;  // one greedy, three sampled
    ps[i].seed = 100 + i;
    ps[i].max_new_tokens = 10;
    ps[i].ignore_eos = true;
  }
  std::vector<Result> alone;
  for (const auto& sp : ps) alone.push_back(collect(*engine.submit(p, sp)));
  const int64_t prompt_rows = engine.stats().prompt_tokens;
  auto streams = engine.submit_n(p, ps);
  ASSERT_EQ(streams.size(), 4u);
  for (size_t i = 0; i < streams.size(); ++i)
    EXPECT_EQ(ids_str(collect(*streams[i]).ids), ids_str(alone[i].ids)) << "fork " << i << " vs alone";
  const EngineStats st = engine.stats();
  // Four hold the partly filled third block; the first three to write copy
  // it, the last writes in place.
  EXPECT_EQ(st.cow_copies, 3) << "copies of the shared block";
  EXPECT_EQ(st.kv_blocks_used, 0);
  EXPECT_EQ(st.prompt_tokens - prompt_rows, 4 * 22) << "prompt tokens counted per request";
}

// Sampling: the same seed gives the same tokens alone and in a batch.
TEST(Engine, SeededSamplingDoesNotDependOnTheBatch) {
  const TransformerConfig c = tiny("gpt2");
  auto tok = tokenizer_for("gpt2");
  Transformer model(c, 2, c.seq_len);
  model.init_random(11);
  Engine engine(model, *tok, {});
  const auto ps = prompts(16, c.vocab_size, 4);
  SamplingParams sp;
  sp.do_sample = true;
  sp.temperature = 0.9;
  sp.top_k = 50;
  sp.top_p = 0.95;
  sp.max_new_tokens = 12;
  sp.ignore_eos = true;
  sp.seed = 42;
  const Result alone = collect(*engine.submit(ps[5], sp));
  std::vector<std::shared_ptr<Stream>> streams;
  for (size_t i = 0; i < ps.size(); ++i) {
    SamplingParams q = sp;
    q.seed = i == 5 ? 42 : 1000 + i;
    streams.push_back(engine.submit(ps[i], q));
  }
  std::vector<Result> rs;
  for (auto& s : streams) rs.push_back(collect(*s));
  EXPECT_EQ(ids_str(rs[5].ids), ids_str(alone.ids)) << "seed 42 alone vs in a batch of 16";
  EXPECT_NE(ids_str(rs[5].ids), ids_str(rs[6].ids)) << "different seeds and prompts gave the same tokens";
}

// `generate` chooses with serve's sampler: seeded, it gives a serve request's
// tokens for the same seed, temperature and top-k (both llama and gpt2), and
// another seed gives others.
TEST(Engine, SeededGenerateIsServesSampling) {
  for (const std::string arch : {"gpt2", "llama"}) {
    const TransformerConfig c = tiny(arch);
    auto tok = tokenizer_for(arch);
    ASSERT_NE(tok, nullptr) << data::testing::kLlamaSetupHint;
    Transformer ref(c, 1, c.seq_len), model(c, 2, c.seq_len);
    ref.init_random(11);
    model.init_random(11);
    Engine engine(model, *tok, {});
    const auto ps = prompts(4, c.vocab_size, arch == "llama" ? 1 : 0);
    for (uint64_t seed : {uint64_t{7}, uint64_t{42}}) {
      SampleOptions o;
      o.temperature = 0.8;
      o.top_k = 20;
      o.seed = seed;
      o.max_new_tokens = 16;
      const std::vector<int32_t> want = sample(ref, ps[2], o);
      SamplingParams sp;
      sp.do_sample = true;
      sp.temperature = o.temperature;
      sp.top_k = o.top_k;
      sp.seed = seed;
      sp.max_new_tokens = o.max_new_tokens;
      sp.ignore_eos = true;
      EXPECT_EQ(ids_str(collect(*engine.submit(ps[2], sp)).ids), ids_str(want))
          << arch << ", seed " << seed << ": serve vs generate";
    }
    SampleOptions a, b;
    a.temperature = b.temperature = 1.0;
    a.top_k = b.top_k = 0;
    a.max_new_tokens = b.max_new_tokens = 16;
    a.seed = 1;
    b.seed = 2;
    EXPECT_NE(ids_str(sample(ref, ps[2], a)), ids_str(sample(ref, ps[2], b))) << arch << ": seeds 1 and 2";
  }
}

// Admission: past max_concurrent_requests, submit throws at once; the
// admitted ones complete; a cancelled one ends cancelled with its blocks back.
TEST(Engine, OverloadAndCancel) {
  const TransformerConfig c = tiny("gpt2");
  auto tok = tokenizer_for("gpt2");
  Transformer model(c, 1, c.seq_len);
  model.init_random(5);
  EngineOptions eo;
  eo.max_concurrent_requests = 3;
  Engine engine(model, *tok, eo);
  SamplingParams sp;
  sp.max_new_tokens = 40;
  sp.ignore_eos = true;
  std::vector<std::shared_ptr<Stream>> s;
  for (int i = 0; i < 3; ++i) s.push_back(engine.submit({1, 2, 3, 4}, sp));
  EXPECT_THROW(engine.submit({1, 2}, sp), Overloaded);
  s[1]->cancel();
  const Result r1 = collect(*s[1]);
  EXPECT_EQ(r1.finish, Finish::kCancelled);
  EXPECT_LT(r1.ids.size(), 40u) << "a cancelled request ran to its end";
  EXPECT_EQ(collect(*s[0]).ids.size(), 40u);
  EXPECT_EQ(collect(*s[2]).ids.size(), 40u);
  const EngineStats st = engine.stats();
  EXPECT_EQ(st.rejected, 1);
  EXPECT_EQ(st.cancelled, 1);
  EXPECT_EQ(st.kv_blocks_used, 0);
  EXPECT_NO_THROW(engine.submit({5}, sp)->cancel()) << "room again once requests ended";
  // Validation: one line naming what is wrong.
  try {
    engine.submit({1, 2, 3}, [] { SamplingParams p; p.max_new_tokens = 200; return p; }());
    ADD_FAILURE() << "no error for a request past the context";
  } catch (const core::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("--max-total-tokens"), std::string::npos) << e.what();
  }
  EXPECT_THROW(engine.submit({static_cast<int32_t>(c.vocab_size)}, sp), core::InvalidArgument);
  EXPECT_THROW(engine.submit({}, sp), core::InvalidArgument);
}

TEST(KvBlockPool, ReferencesPrefixCacheAndLeastRecentlyUsedEviction) {
  const TransformerConfig c = tiny("gpt2");
  KvBlockPool pool(c, 4, 3);
  EXPECT_EQ(pool.available(), 3);
  const int32_t a = *pool.allocate(), b = *pool.allocate(), d = *pool.allocate();
  EXPECT_FALSE(pool.allocate().has_value()) << "a fourth block out of three";
  const std::vector<int32_t> t1 = {1, 2, 3, 4}, t2 = {5, 6, 7, 8};
  const uint64_t h1 = KvBlockPool::chain_hash(0, t1), h2 = KvBlockPool::chain_hash(h1, t2);
  EXPECT_NE(h2, KvBlockPool::chain_hash(0, t2)) << "the hash must depend on the prefix";
  pool.view().k[1][a * pool.block_floats() + 3] = 42.0f;
  pool.publish(a, h1);
  pool.publish(b, h2);
  pool.ref(a);  // a second sequence shares a
  pool.unref(a);
  EXPECT_EQ(pool.refs(a), 1);
  pool.unref(a);  // a: cached (published, unreferenced)
  pool.unref(b);  // b: cached, released after a
  pool.unref(d);  // d: free (never published)
  EXPECT_EQ(pool.available(), 3);
  EXPECT_EQ(pool.cached(), 2);
  EXPECT_EQ(pool.lookup(h1), a) << "a cached block is found by its hash";
  EXPECT_EQ(pool.used(), 1);
  const int32_t e = *pool.allocate();
  EXPECT_EQ(e, d) << "free blocks go before cached ones";
  const int32_t f = *pool.allocate();
  EXPECT_EQ(f, b) << "then the least recently released cached one (a is referenced again)";
  EXPECT_FALSE(pool.lookup(h2).has_value()) << "an evicted block is no longer found";
  pool.copy(f, a);
  EXPECT_EQ(pool.view().k[1][f * pool.block_floats() + 3], 42.0f) << "copy-on-write's copy";
}

TEST(TextStream, StopSequencesAcrossTokensAndWholeCharacters) {
  auto tok = tokenizer_for("gpt2");
  // "Hello world, this is it": stop on "s is" which spans tokens.
  const std::string text = "Hello world, this is it";
  const std::vector<int32_t> ids = tok->encode(text);
  TextStream s(*tok, {"s is"});
  std::string out;
  for (int32_t id : ids) {
    out += s.push(id);
    EXPECT_EQ(out.find("s i"), std::string::npos) << "a prefix of the stop leaked: '" << out << "'";
    if (s.stopped()) break;
  }
  EXPECT_TRUE(s.stopped());
  EXPECT_EQ(out, "Hello world, thi");
  // A held-back prefix that does not become the stop is released later.
  TextStream t(*tok, {"world peace"});
  out.clear();
  for (int32_t id : ids) out += t.push(id);
  out += t.flush();
  EXPECT_EQ(out, text);
  // A character split over byte tokens arrives whole: "é" is 0xC3 0xA9,
  // GPT-2's byte tokens Ã (195 -> id 127) and © (169 -> id 102)?  Use the
  // tokenizer's own ids for the two bytes.
  std::vector<int32_t> bytes;
  for (int32_t id = 0; id < tok->vocab_size() && bytes.size() < 2; ++id) {
    const std::string p = tok->piece_bytes(id);
    if (bytes.empty() && p == "\xC3") bytes.push_back(id);
  }
  for (int32_t id = 0; id < tok->vocab_size() && bytes.size() < 2; ++id)
    if (tok->piece_bytes(id) == "\xA9") bytes.push_back(id);
  ASSERT_EQ(bytes.size(), 2u);
  TextStream u(*tok, {});
  EXPECT_EQ(u.push(bytes[0]), "") << "half a character was released";
  EXPECT_EQ(u.push(bytes[1]), "\xC3\xA9");
  EXPECT_EQ(complete_utf8_prefix("ab\xE2\x82"), 2u);
  EXPECT_EQ(complete_utf8_prefix("ab\xE2\x82\xAC"), 5u);
}

TEST(Sampler, GreedyPenaltiesAndFilters) {
  std::vector<float> l = {1, 3, 2, 3};
  SamplingParams p;
  EXPECT_EQ(sample_token(l.data(), 4, p, {}, 0, 0).id, 1) << "greedy takes the first maximum";
  p.repetition_penalty = 2;
  l = {1, 3, 2, 2.9f};
  EXPECT_EQ(sample_token(l.data(), 4, p, {1}, 0, 0).id, 3) << "token 1 seen: 3 / 2 = 1.5";
  p = {};
  p.presence_penalty = 1;
  l = {1, 3, 2.5f, 0};
  EXPECT_EQ(sample_token(l.data(), 4, p, {1}, 1, 0).id, 2) << "token 1 in the output: 3 - 1";
  p = {};
  p.do_sample = true;
  p.top_k = 1;
  l = {1, 3, 2, 0};
  for (uint64_t i = 0; i < 20; ++i) EXPECT_EQ(sample_token(l.data(), 4, p, {}, 0, i).id, 1) << "top_k 1";
  p.top_k = 0;
  p.top_p = 0.5;
  l = {0, 5, 0, 0};
  for (uint64_t i = 0; i < 20; ++i) EXPECT_EQ(sample_token(l.data(), 4, p, {}, 0, i).id, 1) << "top_p 0.5";
  // logprob of the chosen token under the raw logits
  l = {0, 0, 0, 0};
  const Choice ch = sample_token(l.data(), 4, SamplingParams{}, {}, 0, 0);
  EXPECT_NEAR(ch.logprob, std::log(0.25), 1e-6);
  // The most likely tokens, best first, of the raw logits (penalties aside).
  p = {};
  p.top_logprobs = 2;
  p.repetition_penalty = 5;
  l = {0, 2, 1, 0};
  const Choice t = sample_token(l.data(), 4, p, {1}, 0, 0);
  ASSERT_EQ(t.top.size(), 2u);
  EXPECT_EQ(t.top[0].first, 1);
  EXPECT_EQ(t.top[1].first, 2);
  EXPECT_NEAR(t.top[0].second, 2 - std::log(1 + std::exp(2.0) + std::exp(1.0) + 1), 1e-6);
  EXPECT_EQ(t.id, 2) << "token 1 penalised: 2 / 5 < 1";
}

}  // namespace
}  // namespace po::serve
