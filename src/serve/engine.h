// The serving engine: requests in, tokens out, many requests sharing each
// step. One engine thread runs the loop; HTTP handler threads submit requests
// and read their streams.
//
// Each step (continuous batching):
//   1. cancelled requests (a client gone, a drain past its grace) leave and
//      their KV blocks are freed;
//   2. the running sequences that decode take one token each, first;
//   3. waiting requests' prompts fill the rest of the step's token budget
//      (max_batch_total_tokens), in arrival order, a long prompt in chunks
//      over several steps (chunked prefill); a prompt's full blocks already
//      in the prefix cache are not computed again;
//   4. one batched forward runs every row (the weights read once for all of
//      them), through the paged KV cache (kv_cache.h);
//   5. each sequence that finished its prompt or decoded samples its next
//      token with its own parameters and its own seed, and its stream gets
//      the new token and the text it releases (detokenize.h: whole UTF-8
//      characters only, text that could still become a stop sequence held
//      back).
// When the KV cache cannot hold the step, the newest running sequences are
// preempted and wait again, at the front. Their blocks either go to the host
// tier (host_kv_budget) and come back when they resume, or are freed and
// recomputed from the prompt and the tokens made so far (the same tokens:
// sampling is keyed on the request's seed and the token's index, not on the
// batch; full blocks still in the prefix cache are found again instead).
// `preemption` chooses; kAuto compares the measured cost of the copies both
// ways (bytes over the copy rate measured at start and on each swap) with
// the measured forward time of the positions to recompute.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "data/text_tokenizer.h"
#include "model/transformer.h"
#include "serve/types.h"

namespace po::serve {

// A request the engine cannot take now (HTTP 429): --max-concurrent-requests
// requests are already in.
class Overloaded : public core::Error {
  using Error::Error;
};

// One request's output, read by the HTTP handler that submitted it.
class Stream {
 public:
  // Waits up to `timeout` for new output; false when nothing came. After the
  // update with finish != kNone, returns false at once.
  bool next(Update& out, std::chrono::milliseconds timeout);
  // Asks the engine to drop this request at its next step (its blocks freed).
  void cancel() { cancelled_ = true; }
  bool cancelled() const { return cancelled_; }

  int64_t id() const { return id_; }
  int64_t prompt_tokens() const { return prompt_tokens_; }
  // Seconds from arrival to admission (its first step); < 0 until admitted.
  double queue_seconds() const { return queue_s_; }
  uint64_t seed() const { return seed_; }

 private:
  friend class Engine;
  std::mutex mu_;
  std::condition_variable cv_;
  Update pending_;
  bool has_pending_ = false, done_ = false;
  std::atomic<bool> cancelled_{false};
  std::atomic<double> queue_s_{-1};
  int64_t id_ = 0, prompt_tokens_ = 0;
  uint64_t seed_ = 0;
};

struct EngineOptions {
  int64_t block_size = 16;              // tokens per KV block (--kv-block-size)
  size_t kv_budget = 0;                 // bytes of KV blocks in the compute tier (0: enough for max_batch_total_tokens × 4)
  size_t host_kv_budget = 0;            // bytes of KV blocks preempted sequences may keep in host RAM
  int64_t max_batch_total_tokens = 0;   // rows of one step's forward (0: the model's buffer)
  int64_t max_concurrent_requests = 128;
  int64_t max_input_tokens = 0;         // 0: the context - 1
  int64_t max_total_tokens = 0;         // prompt + new tokens; 0: the context
  bool prefix_caching = true;
  enum class Preemption { kAuto, kSwap, kRecompute };
  Preemption preemption = Preemption::kAuto;  // kSwap and kAuto need host_kv_budget
  // LoRA adapters requests may name (SamplingParams::adapter): each a model
  // with adapters on the served model's shapes (its params() the adapters'
  // tensors). Requests of different adapters share a step: the base GEMMs
  // run once for every row, each adapter's product over its own rows. An
  // adapter's sequences never share KV blocks with another's or the base's
  // (the prefix cache's chain hash starts from the adapter's name).
  std::vector<std::pair<std::string, const model::Transformer*>> adapters;
};

// Counters and gauges for /metrics (TGI's names where TGI has one).
struct EngineStats {
  int64_t requests = 0, finished = 0, cancelled = 0, rejected = 0;
  int64_t running = 0, waiting = 0, batch_size = 0;
  int64_t kv_blocks_total = 0, kv_blocks_used = 0, kv_blocks_cached = 0, kv_blocks_host = 0;
  int64_t kv_tokens_held = 0;  // tokens whose keys and values the used blocks hold
  int64_t prefix_hits = 0, prefix_queries = 0;  // full prompt blocks found / looked up
  int64_t preemptions = 0, swapped_out = 0, swapped_in = 0;  // preemptions; of them to host, back from host
  int64_t cow_copies = 0;  // shared blocks copied before a write
  int64_t prompt_tokens = 0, generated_tokens = 0, steps = 0;
  // Sums and counts of durations in seconds, and their histograms (buckets
  // of kLatencyBuckets).
  struct Histogram {
    std::vector<int64_t> counts;  // per bucket (cumulative is computed when printed)
    double sum = 0;
    int64_t count = 0;
    void add(double seconds);
  };
  Histogram request_duration, queue_duration, time_to_first_token, inter_token_latency;
};
inline constexpr double kLatencyBuckets[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                             0.5,   1,    2.5,   5,    10,  30};

class Engine {
 public:
  // `model` must be a whole model (every unit) with B·T rows of buffers;
  // the engine owns neither argument and uses them from its own thread.
  Engine(model::Transformer& model, data::TextTokenizer& tokenizer, EngineOptions options);
  ~Engine();  // stops the loop; unfinished streams end cancelled
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // A request of `prompt` (ids, BOS included where the family has one).
  // Throws Overloaded past max_concurrent_requests or while draining, and
  // InvalidArgument (one line) for a prompt or parameters out of range.
  std::shared_ptr<Stream> submit(std::vector<int32_t> prompt, const SamplingParams& params);
  // Several requests of one prompt (OpenAI's n, TGI's best_of), one stream
  // each: the prompt is prefilled once and its blocks shared, each request
  // then copying a shared block before it writes into it (copy-on-write).
  // Admitted all or none.
  std::vector<std::shared_ptr<Stream>> submit_n(std::vector<int32_t> prompt,
                                                const std::vector<SamplingParams>& params);

  // The tokenizer, serialised (it is not thread-safe).
  std::vector<int32_t> encode(const std::string& text);
  std::string decode(const std::vector<int32_t>& ids);
  const data::TextTokenizer& tokenizer() const { return tokenizer_; }
  const model::TransformerConfig& config() const { return model_.config(); }
  bool has_adapter(const std::string& name) const;
  const EngineOptions& options() const { return options_; }
  int64_t vocab_size() const { return model_.config().vocab_size; }  // the ids a prompt may hold

  // Stop admitting (submit throws Overloaded); wait up to `grace` for the
  // running requests, then cancel the rest. Returns when none is left.
  void drain(std::chrono::milliseconds grace);
  EngineStats stats() const;
  // Prometheus text exposition of stats().
  std::string metrics_text() const;

 private:
  struct Sequence;
  void loop();
  bool step();  // one step; false when there was nothing to do
  struct Batch;
  void drop_cancelled();
  void schedule_decodes(Batch& b);
  void schedule_prefills(Batch& b);
  void admitted(Sequence& q);
  std::vector<model::PagedSeq> forward(const Batch& b);
  int64_t sample(const Batch& b, const std::vector<model::PagedSeq>& seqs);
  void finish(Sequence& q, Finish why, const std::string& error);
  void release_blocks(Sequence& q);
  bool reserve(Sequence& q, int64_t n);
  bool preempt_newest(const Sequence* keep);
  void preempt(Sequence& victim);
  bool swap_out(Sequence& q);
  bool swap_in(Sequence& q);
  void match_prefix(Sequence& q);
  void publish_full(Sequence& q);
  void publish_stats();
  std::unique_ptr<Sequence> make_sequence(const std::vector<int32_t>& prompt, const SamplingParams& p);
  Finish emit(Sequence& q, float* logits, std::chrono::steady_clock::time_point now);

  model::Transformer& model_;
  data::TextTokenizer& tokenizer_;
  EngineOptions options_;
  std::mutex tok_mu_;
  mutable std::mutex mu_;  // guards incoming_, stats_, draining_
  std::condition_variable wake_;
  std::deque<std::unique_ptr<Sequence>> incoming_;
  bool stop_ = false, draining_ = false, cancel_all_ = false;
  int64_t admitted_ = 0;  // requests in (incoming, waiting or running)
  int64_t next_id_ = 1;
  EngineStats stats_;
  struct State;
  std::unique_ptr<State> state_;  // the engine thread's (KV cache, queues)
  std::thread thread_;
};

}  // namespace po::serve
