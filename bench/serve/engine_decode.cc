// The serving engine without HTTP: gpt2-124M-shaped random weights, one
// request alone and then S at once (prompt P, N new tokens each, greedy),
// timing decode steps from the streams' token arrivals. For profiling the
// engine's step (perf record build/bench/engine_decode); bench/serve_load.sh
// is the benchmark of record.
//   engine_decode [S=32] [P=128] [N=64] [THREADS=2] [PRESET=gpt2-124M]
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "data/text_tokenizer.h"
#include "serve/engine.h"

using namespace po;
using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  const int S = argc > 1 ? std::atoi(argv[1]) : 32;
  const int P = argc > 2 ? std::atoi(argv[2]) : 128;
  const int N = argc > 3 ? std::atoi(argv[3]) : 64;
  omp_set_num_threads(argc > 4 ? std::atoi(argv[4]) : 2);
  const std::string preset = argc > 5 ? argv[5] : "gpt2-124M";
  model::TransformerConfig c = model::TransformerConfig::preset(preset);
  c.fill_derived();
  model::Transformer m(c, 1, c.seq_len);
  m.init_random(1);
  auto tok = data::load_tokenizer("");
  serve::EngineOptions eo;
  eo.kv_budget = size_t{2} << 30;  // as bench/serve_load.sh: every request's KV fits
  serve::Engine engine(m, *tok, eo);
  serve::SamplingParams sp;
  sp.max_new_tokens = N;
  sp.ignore_eos = true;
  auto run = [&](int streams) {
    std::vector<std::shared_ptr<serve::Stream>> ss;
    const auto t0 = Clock::now();
    for (int i = 0; i < streams; ++i) {
      std::vector<int32_t> p;
      for (int j = 0; j < P; ++j) p.push_back((i * 7919 + j * 104729) % 50000);
      ss.push_back(engine.submit(p, sp));
    }
    double first = 0, last = 0;  // the last stream's first token, the last token
    int64_t tokens = 0;
    std::vector<bool> started(ss.size(), false), done(ss.size(), false);
    for (size_t left = ss.size(); left > 0;) {
      // Block on one open stream at a time (a polling loop would take a core from the engine's threads).
      size_t first_open = 0;
      while (done[first_open]) ++first_open;
      for (size_t i = 0; i < ss.size(); ++i) {
        serve::Update u;
        if (done[i] || !ss[i]->next(u, std::chrono::milliseconds(i == first_open ? 20 : 0))) continue;
        const double t = std::chrono::duration<double>(Clock::now() - t0).count();
        if (!started[i] && !u.tokens.empty()) {
          started[i] = true;
          first = std::max(first, t);
        }
        tokens += static_cast<int64_t>(u.tokens.size());
        last = std::max(last, t);
        if (u.finish != serve::Finish::kNone) {
          done[i] = true;
          --left;
        }
      }
    }
    std::printf("{\"bench\":\"engine_decode\",\"preset\":\"%s\",\"streams\":%d,\"prompt\":%d,\"new\":%d,"
                "\"last_first_token_s\":%.3f,\"total_s\":%.3f,\"tokens_per_s\":%.1f,\"steps\":%lld}\n",
                preset.c_str(), streams, P, N, first, last, static_cast<double>(tokens) / last,
                static_cast<long long>(engine.stats().steps));
  };
  run(1);
  run(S);
  return 0;
}
