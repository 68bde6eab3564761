// The serving engine's loop (engine.h): admission, the step's schedule, the
// batched forward, sampling and the streams.
#include "serve/engine.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "core/log.h"
#include "serve/detokenize.h"
#include "serve/kv_cache.h"
#include "serve/sampler.h"

namespace po::serve {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

const char* finish_name(Finish f) {
  switch (f) {
    case Finish::kNone: return "none";
    case Finish::kLength: return "length";
    case Finish::kEos: return "eos_token";
    case Finish::kStop: return "stop_sequence";
    case Finish::kCancelled: return "cancelled";
  }
  return "?";
}

bool Stream::next(Update& out, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return has_pending_; })) return false;
  out = std::move(pending_);
  pending_ = Update{};
  has_pending_ = false;
  return true;
}

void EngineStats::Histogram::add(double s) {
  if (counts.empty()) counts.assign(std::size(kLatencyBuckets) + 1, 0);
  size_t b = 0;
  while (b < std::size(kLatencyBuckets) && s > kLatencyBuckets[b]) ++b;
  ++counts[b];
  sum += s;
  ++count;
}

// One request as the engine thread holds it.
struct Engine::Sequence {
  std::shared_ptr<Stream> stream;
  SamplingParams params;
  std::vector<int32_t> tokens;  // the prompt, then the generated tokens
  int64_t prompt = 0;           // tokens of the prompt
  std::vector<int32_t> table;   // block table (KV of positions 0 .. computed-1, and room for the step's)
  // Swapped out (preempted to the host tier): per logical block its host
  // block, or -1 where the compute-tier block stayed (shared with others).
  std::vector<int32_t> host;
  int64_t computed = 0;         // positions whose keys and values are in the cache
  const model::Transformer* adapter = nullptr;  // params.adapter's model; null: the base
  uint64_t hash0 = 0;           // the chain hash's start: 0, or the adapter name's hash
  uint64_t hash = 0;            // chain hash of the full blocks published so far
  int64_t hashed = 0;           // full blocks whose chain hash is in `hash`
  std::unique_ptr<TextStream> text;
  Clock::time_point arrived, admitted, last_token;
  // Requests of the same prompt (submit_n) that take this one's blocks and
  // its prompt's logits when its prefill ends.
  std::vector<std::unique_ptr<Sequence>> forks;
  bool scheduled = false;  // has rows in the step being built (not to be preempted)
  bool started = false;  // admitted once (queue time counted)
  // The last prefix-cache lookup (full blocks looked up, found): counted in
  // the statistics when the sequence is admitted, so a request that waits
  // for blocks, and gives its hits back, is not counted at every attempt.
  std::pair<int64_t, int64_t> prefix_lookup{0, 0};
  bool first_token = false;
  // params.prompt_logprobs: prompt token j + 1 scored given 0..j, for the j
  // computed so far (a recompute after preemption does not add them again).
  std::vector<GeneratedToken> prompt_lp;
  int64_t generated() const { return static_cast<int64_t>(tokens.size()) - prompt; }
};

struct Engine::State {
  std::unique_ptr<KvBlockPool> pool;
  std::deque<std::unique_ptr<Sequence>> waiting;  // not holding blocks, oldest first (preempted at the front)
  std::vector<std::unique_ptr<Sequence>> running;  // holding blocks, in admission order
  std::unique_ptr<KvBlockPool> host;  // the host tier's blocks (host_kv_budget)
  double row_s = 0;       // measured forward seconds per row (moving average)
  double copy_bps = 0;    // measured block copy rate, bytes per second (moving average)
  size_t block_bytes = 0;
  std::vector<float> logits;
  int64_t rows = 0;     // rows of one step
  int64_t context = 0;  // the model's positions
};

Engine::Engine(model::Transformer& model, data::TextTokenizer& tokenizer, EngineOptions options)
    : model_(model), tokenizer_(tokenizer), options_(options), state_(std::make_unique<State>()) {
  const model::TransformerConfig& c = model_.config();
  PO_CHECK(model_.whole(), "serve: the model must hold every unit");
  State& s = *state_;
  s.context = model_.seq();
  const int64_t buffer_rows = model_.batch() * model_.seq();
  if (options_.max_batch_total_tokens <= 0) options_.max_batch_total_tokens = buffer_rows;
  PO_CHECK(options_.max_batch_total_tokens <= buffer_rows, "--max-batch-total-tokens ",
           options_.max_batch_total_tokens, " exceeds the model's ", buffer_rows, " rows of buffers");
  s.rows = options_.max_batch_total_tokens;
  if (options_.max_total_tokens <= 0) options_.max_total_tokens = s.context;
  PO_CHECK(options_.max_total_tokens <= s.context, "--max-total-tokens ", options_.max_total_tokens,
           " exceeds the model's context of ", s.context, " positions");
  if (options_.max_input_tokens <= 0) options_.max_input_tokens = options_.max_total_tokens - 1;
  PO_CHECK(options_.max_input_tokens < options_.max_total_tokens, "--max-input-tokens ",
           options_.max_input_tokens, " must be below --max-total-tokens ", options_.max_total_tokens);
  PO_CHECK(options_.max_concurrent_requests >= 1, "--max-concurrent-requests must be >= 1, got ",
           options_.max_concurrent_requests);
  const int64_t bs = options_.block_size;
  PO_CHECK(bs >= 1, "--kv-block-size must be >= 1, got ", bs);
  const size_t block_bytes = KvBlockPool::block_bytes(c, bs);
  // One request at its longest must fit alone: then preemption can always
  // make room, and no request fails for lack of KV memory.
  const int64_t min_blocks = (options_.max_total_tokens + bs - 1) / bs;
  int64_t blocks = options_.kv_budget > 0 ? static_cast<int64_t>(options_.kv_budget / block_bytes)
                                          : std::max<int64_t>(4 * min_blocks, 4 * s.rows / bs);
  PO_CHECK(blocks >= min_blocks, "--kv-budget ", options_.kv_budget, " bytes holds ", blocks,
           " blocks of ", block_bytes, " bytes; one request of --max-total-tokens ",
           options_.max_total_tokens, " needs ", min_blocks, " (", min_blocks * block_bytes, " bytes)");
  s.pool = std::make_unique<KvBlockPool>(c, bs, blocks);
  s.block_bytes = block_bytes;
  const auto host_blocks = static_cast<int64_t>(options_.host_kv_budget / block_bytes);
  PO_CHECK(options_.preemption != EngineOptions::Preemption::kSwap || host_blocks >= 1,
           "preemption by swapping needs --host-kv-budget of at least one block (", block_bytes, " bytes)");
  if (host_blocks >= 1) {
    s.host = std::make_unique<KvBlockPool>(c, bs, host_blocks);
    // The copy rate to start from: a few blocks there and back.
    const auto t0 = Clock::now();
    for (int i = 0; i < 4; ++i) {
      s.host->copy_from(*s.pool, 0, 0);
      s.pool->copy_from(*s.host, 0, 0);
    }
    s.copy_bps = 8.0 * static_cast<double>(block_bytes) / std::max(1e-9, seconds(Clock::now() - t0));
  }
  s.logits.resize(static_cast<size_t>(s.rows * c.vocab_size));
  stats_.kv_blocks_total = blocks;
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::vector<int32_t> Engine::encode(const std::string& text) {
  std::lock_guard lock(tok_mu_);
  return tokenizer_.encode(text, "the prompt");
}

std::string Engine::decode(const std::vector<int32_t>& ids) {
  std::lock_guard lock(tok_mu_);
  return tokenizer_.decode(ids);
}

std::unique_ptr<Engine::Sequence> Engine::make_sequence(const std::vector<int32_t>& prompt,
                                                       const SamplingParams& p) {
  const int64_t V = model_.config().vocab_size;
  const auto n = static_cast<int64_t>(prompt.size());
  PO_CHECK(n >= 1, "the prompt is empty");
  for (int32_t t : prompt) PO_CHECK(t >= 0 && t < V, "prompt token ", t, " is outside the vocabulary (", V, ")");
  PO_CHECK(n <= options_.max_input_tokens, "the prompt has ", n, " tokens, more than --max-input-tokens ",
           options_.max_input_tokens);
  PO_CHECK(p.max_new_tokens >= 1, "max_new_tokens must be >= 1, got ", p.max_new_tokens);
  PO_CHECK(n + p.max_new_tokens <= options_.max_total_tokens, "the prompt's ", n, " tokens + max_new_tokens ",
           p.max_new_tokens, " exceed --max-total-tokens ", options_.max_total_tokens);
  PO_CHECK(!p.do_sample || p.temperature > 0, "temperature must be > 0 when sampling, got ", p.temperature);
  PO_CHECK(p.top_k >= 0, "top_k must be >= 0, got ", p.top_k);
  PO_CHECK(p.top_p > 0 && p.top_p <= 1, "top_p must be in (0, 1], got ", p.top_p);
  PO_CHECK(p.typical_p > 0 && p.typical_p <= 1, "typical_p must be in (0, 1], got ", p.typical_p);
  PO_CHECK(p.repetition_penalty > 0, "repetition_penalty must be > 0, got ", p.repetition_penalty);
  PO_CHECK(p.top_logprobs >= 0 && p.top_logprobs <= 20, "top_logprobs must be in [0, 20], got ", p.top_logprobs);
  auto seq = std::make_unique<Sequence>();
  if (!p.adapter.empty()) {
    std::string loaded;
    for (const auto& [name, m] : options_.adapters) {
      if (name == p.adapter) seq->adapter = m;
      loaded += (loaded.empty() ? "" : ", ") + name;
    }
    PO_CHECK(seq->adapter != nullptr, "adapter '", p.adapter, "' is not loaded (--lora NAME=DIR); loaded: ",
             loaded.empty() ? "none" : loaded);
    // FNV-1a of the name, never 0: its blocks are its own in the prefix cache.
    uint64_t h = 1469598103934665603ull;
    for (unsigned char c : p.adapter) h = (h ^ c) * 1099511628211ull;
    seq->hash0 = seq->hash = h | 1;
  }
  seq->stream = std::make_shared<Stream>();
  seq->params = p;
  seq->prompt = n;
  seq->tokens = prompt;
  seq->text = std::make_unique<TextStream>(tokenizer_, p.stop);
  seq->arrived = Clock::now();
  seq->stream->prompt_tokens_ = n;
  seq->stream->seed_ = p.seed;
  return seq;
}

std::shared_ptr<Stream> Engine::submit(std::vector<int32_t> prompt, const SamplingParams& p) {
  return submit_n(std::move(prompt), {p}).front();
}

std::vector<std::shared_ptr<Stream>> Engine::submit_n(std::vector<int32_t> prompt,
                                                      const std::vector<SamplingParams>& params) {
  PO_CHECK(!params.empty(), "submit_n: no request");
  for (const SamplingParams& p : params)  // the forks share the first one's KV blocks
    PO_CHECK(p.adapter == params[0].adapter, "submit_n: requests of one prompt name one adapter (",
             params[0].adapter, " and ", p.adapter, ")");
  std::unique_ptr<Sequence> first = make_sequence(prompt, params[0]);
  for (size_t i = 1; i < params.size(); ++i) first->forks.push_back(make_sequence(prompt, params[i]));
  std::vector<std::shared_ptr<Stream>> out = {first->stream};
  for (const auto& f : first->forks) out.push_back(f->stream);
  const auto count = static_cast<int64_t>(params.size());
  {
    std::lock_guard lock(mu_);
    if (draining_ || admitted_ + count > options_.max_concurrent_requests) {
      stats_.rejected += count;
      throw Overloaded(draining_ ? "the server is shutting down"
                                 : core::str_cat("Model is overloaded: ", admitted_, " requests in, ", count,
                                                 " more asked, --max-concurrent-requests ",
                                                 options_.max_concurrent_requests));
    }
    admitted_ += count;
    stats_.requests += count;
    for (auto& s : out) s->id_ = next_id_++;
    incoming_.push_back(std::move(first));
  }
  wake_.notify_all();
  return out;
}

void Engine::drain(std::chrono::milliseconds grace) {
  const auto until = Clock::now() + grace;
  {
    std::lock_guard lock(mu_);
    draining_ = true;
  }
  bool cancelled = false;
  for (;;) {
    {
      std::lock_guard lock(mu_);
      if (admitted_ == 0) return;
      if (!cancelled && Clock::now() >= until) {
        cancel_all_ = true;
        cancelled = true;
      }
    }
    wake_.notify_all();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

bool Engine::has_adapter(const std::string& name) const {
  for (const auto& a : options_.adapters)
    if (a.first == name) return true;
  return false;
}

EngineStats Engine::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

void Engine::loop() {
  for (;;) {
    {
      std::unique_lock lock(mu_);
      wake_.wait(lock, [&] {
        return stop_ || !incoming_.empty() || !state_->waiting.empty() || !state_->running.empty();
      });
      if (stop_) break;
    }
    try {
      step();
    } catch (const std::exception& e) {
      // A failed step ends every request it held with the error (HTTP 424);
      // the engine keeps serving.
      PO_LOG_WARN("serve: a step failed: ", e.what());
      State& s = *state_;
      for (auto& q : s.running) finish(*q, Finish::kCancelled, e.what());
      s.running.clear();
    }
  }
  // Stopping: whatever is left ends cancelled.
  State& s = *state_;
  {
    std::lock_guard lock(mu_);
    for (auto& q : incoming_) s.waiting.push_back(std::move(q));
    incoming_.clear();
  }
  for (auto& q : s.running) finish(*q, Finish::kCancelled, "");
  for (auto& q : s.waiting) finish(*q, Finish::kCancelled, "");
  s.running.clear();
  s.waiting.clear();
}

void Engine::release_blocks(Sequence& q) {
  for (size_t i = 0; i < q.table.size(); ++i) {
    if (!q.host.empty() && q.host[i] >= 0)
      state_->host->unref(q.host[i]);
    else
      state_->pool->unref(q.table[i]);
  }
  q.table.clear();
  q.host.clear();
  q.computed = 0;
  q.hash = q.hash0;
  q.hashed = 0;
}

// Ends a request: its stream gets the last update, its blocks go back.
void Engine::finish(Sequence& q, Finish why, const std::string& error) {
  for (auto& f : q.forks) finish(*f, why, error);  // not forked yet: they end with it
  q.forks.clear();
  release_blocks(q);
  const auto now = Clock::now();
  {
    std::lock_guard lock(mu_);
    stats_.kv_blocks_used = state_->pool->used();  // before the stream hears of its end
    stats_.kv_blocks_cached = state_->pool->cached();
    --admitted_;
    if (why == Finish::kCancelled)
      ++stats_.cancelled;
    else
      ++stats_.finished;
    stats_.request_duration.add(seconds(now - q.arrived));
  }
  Stream& st = *q.stream;
  std::lock_guard lock(st.mu_);
  st.pending_.finish = why;
  st.pending_.error = error;
  st.has_pending_ = true;
  st.done_ = true;
  st.cv_.notify_all();
}

// Blocks for positions [q.computed, q.computed + n) (copy-on-write for a
// shared last block). False, with nothing taken, when the pool cannot.
bool Engine::reserve(Sequence& q, int64_t n) {
  KvBlockPool& pool = *state_->pool;
  const int64_t bs = pool.block_size();
  const int64_t have = static_cast<int64_t>(q.table.size());
  const int64_t need = (q.computed + n + bs - 1) / bs;
  // A shared block about to be written: positions computed.. fall in block
  // computed / bs, if that block is partly filled and held by others.
  const bool cow = q.computed % bs != 0 && q.computed / bs < have &&
                   pool.refs(q.table[static_cast<size_t>(q.computed / bs)]) > 1;
  if (pool.available() < std::max<int64_t>(0, need - have) + (cow ? 1 : 0)) return false;
  if (cow) {
    const int32_t old = q.table[static_cast<size_t>(q.computed / bs)];
    const int32_t fresh = *pool.allocate();
    pool.copy(fresh, old);
    pool.unref(old);
    q.table[static_cast<size_t>(q.computed / bs)] = fresh;
    std::lock_guard lock(mu_);
    ++stats_.cow_copies;
  }
  while (static_cast<int64_t>(q.table.size()) < need) q.table.push_back(*pool.allocate());
  return true;
}

// The newest running sequence other than `keep` gives its blocks back and
// waits again (at the front: it is recomputed first). False when there is
// none to preempt.
bool Engine::preempt_newest(const Sequence* keep) {
  State& s = *state_;
  for (auto it = s.running.rbegin(); it != s.running.rend(); ++it)
    if (it->get() != keep && !(*it)->scheduled) return preempt(**it), true;
  return false;
}

// q (running, not in the step) waits again, at the front of the queue, its
// blocks swapped out to the host tier or freed.
void Engine::preempt(Sequence& victim) {
  State& s = *state_;
  const auto it = std::find_if(s.running.begin(), s.running.end(),
                               [&](const std::unique_ptr<Sequence>& q) { return q.get() == &victim; });
  PO_ASSERT(it != s.running.end() && !victim.scheduled, "serve: preempting a sequence not running or in the step");
  std::unique_ptr<Sequence> q = std::move(*it);
  s.running.erase(it);
  const bool swapped = swap_out(*q);
  if (!swapped) release_blocks(*q);
  s.waiting.push_front(std::move(q));
  std::lock_guard lock(mu_);
  ++stats_.preemptions;
  stats_.swapped_out += swapped ? 1 : 0;
  stats_.kv_blocks_host = s.host ? s.host->used() : 0;
}

// Preemption to the host tier, when chosen and there is room: the blocks
// only q holds are copied there and freed here (shared ones stay, with q's
// reference). False: q is to be recomputed instead.
bool Engine::swap_out(Sequence& q) {
  State& s = *state_;
  using P = EngineOptions::Preemption;
  if (!s.host || options_.preemption == P::kRecompute || q.table.empty()) return false;
  int64_t own = 0;
  for (int32_t b : q.table) own += s.pool->refs(b) == 1 ? 1 : 0;
  if (own > s.host->available()) return false;
  if (options_.preemption == P::kAuto) {
    const double copy_s = 2.0 * static_cast<double>(own) * static_cast<double>(s.block_bytes) / s.copy_bps;
    const double recompute_s = static_cast<double>(q.computed) * s.row_s;
    if (s.row_s <= 0 || copy_s >= recompute_s) return false;
  }
  const auto t0 = Clock::now();
  q.host.assign(q.table.size(), -1);
  for (size_t i = 0; i < q.table.size(); ++i) {
    if (s.pool->refs(q.table[i]) != 1) continue;
    const int32_t h = *s.host->allocate();
    s.host->copy_from(*s.pool, q.table[i], h);
    s.pool->unref(q.table[i]);
    q.host[i] = h;
  }
  if (own > 0)
    s.copy_bps = 0.5 * s.copy_bps + 0.5 * static_cast<double>(own) * static_cast<double>(s.block_bytes) /
                                        std::max(1e-9, seconds(Clock::now() - t0));
  return true;
}

// A swapped-out sequence's blocks back into the compute tier; false (nothing
// moved) when it has no room yet.
bool Engine::swap_in(Sequence& q) {
  State& s = *state_;
  int64_t need = 0;
  for (int32_t h : q.host) need += h >= 0 ? 1 : 0;
  if (need + 1 > s.pool->available()) return false;  // and room for its next position
  for (size_t i = 0; i < q.host.size(); ++i) {
    if (q.host[i] < 0) continue;
    const int32_t b = *s.pool->allocate();
    s.pool->copy_from(*s.host, q.host[i], b);
    s.host->unref(q.host[i]);
    q.table[i] = b;
  }
  q.host.clear();
  std::lock_guard lock(mu_);
  ++stats_.swapped_in;
  stats_.kv_blocks_host = s.host->used();
  return true;
}

// A waiting sequence's full prompt blocks already in the prefix cache (at
// most up to its last token, which must be computed for its logits).
void Engine::match_prefix(Sequence& q) {
  KvBlockPool& pool = *state_->pool;
  const int64_t bs = pool.block_size();
  const int64_t full = (static_cast<int64_t>(q.tokens.size()) - 1) / bs;
  int64_t hits = 0;
  for (int64_t b = 0; b < full; ++b) {
    const uint64_t h = KvBlockPool::chain_hash(
        q.hash, std::span<const int32_t>(q.tokens.data() + b * bs, static_cast<size_t>(bs)));
    const auto found = pool.lookup(h);
    if (!found) break;
    q.table.push_back(*found);
    q.hash = h;
    q.hashed = b + 1;
    q.computed = (b + 1) * bs;
    ++hits;
  }
  q.prefix_lookup = {full, hits};
}

// After a forward: the sequence's newly full blocks go into the prefix cache.
void Engine::publish_full(Sequence& q) {
  if (!options_.prefix_caching) return;
  KvBlockPool& pool = *state_->pool;
  const int64_t bs = pool.block_size();
  for (; (q.hashed + 1) * bs <= q.computed; ++q.hashed) {
    q.hash = KvBlockPool::chain_hash(
        q.hash, std::span<const int32_t>(q.tokens.data() + q.hashed * bs, static_cast<size_t>(bs)));
    pool.publish(q.table[static_cast<size_t>(q.hashed)], q.hash);
  }
}

// The rows of one step: which sequences run, and how many rows each.
struct Engine::Batch {
  struct Work {
    Sequence* q;
    int64_t n;
  };
  std::vector<Work> work;
  int64_t rows = 0;
  void add(Sequence& q, int64_t n) {
    q.scheduled = true;
    work.push_back({&q, n});
    rows += n;
  }
};

// One step: cancelled requests leave, decodes are scheduled first (one row
// each), then prefills, in admission order; one forward for every row; then
// each sequence whose logits came out samples, streams and maybe finishes.
bool Engine::step() {
  State& s = *state_;
  drop_cancelled();
  Batch b;
  for (auto& q : s.running) q->scheduled = false;
  schedule_decodes(b);
  schedule_prefills(b);
  if (b.work.empty()) {
    publish_stats();
    // Nothing could run (every request waits for blocks held by none: not
    // possible) or nothing to do: sleep until something arrives.
    if (!s.waiting.empty() && s.running.empty()) {  // not expected: fail it rather than spin
      finish(*s.waiting.front(), Finish::kCancelled,
             core::str_cat("the KV cache (", s.pool->blocks(), " blocks) cannot hold this request now"));
      s.waiting.pop_front();
    }
    return false;
  }
  const std::vector<model::PagedSeq> seqs = forward(b);
  const int64_t sampled = sample(b, seqs);
  {
    std::lock_guard lock(mu_);
    ++stats_.steps;
    stats_.batch_size = sampled;
  }
  publish_stats();
  return true;
}

// New requests join the queue; cancelled ones (or all, at a cancel-all) leave.
void Engine::drop_cancelled() {
  State& s = *state_;
  bool cancel_all = false;
  {
    std::lock_guard lock(mu_);
    for (auto& q : incoming_) s.waiting.push_back(std::move(q));
    incoming_.clear();
    cancel_all = cancel_all_;
  }
  std::vector<std::unique_ptr<Sequence>> orphans;  // forks of a cancelled request, alone now
  auto gone = [&](std::unique_ptr<Sequence>& q) {
    std::erase_if(q->forks, [&](const std::unique_ptr<Sequence>& f) {
      if (!cancel_all && !f->stream->cancelled()) return false;
      finish(*f, Finish::kCancelled, "");
      return true;
    });
    if (!cancel_all && !q->stream->cancelled()) return false;
    for (auto& f : q->forks) orphans.push_back(std::move(f));
    q->forks.clear();
    finish(*q, Finish::kCancelled, "");
    return true;
  };
  std::erase_if(s.running, gone);
  std::erase_if(s.waiting, gone);
  for (auto it = orphans.rbegin(); it != orphans.rend(); ++it) s.waiting.push_front(std::move(*it));
}

// Decodes, one row each; a sequence without room for its next position
// preempts the newest others, or itself waits. Only sequences not yet in the
// step are preempted, so the oldest always progresses (one request alone
// always fits).
void Engine::schedule_decodes(Batch& b) {
  State& s = *state_;
  for (size_t i = 0; i < s.running.size() && b.rows < s.rows;) {
    Sequence& q = *s.running[i];
    const int64_t left = static_cast<int64_t>(q.tokens.size()) - q.computed;
    if (left != 1) {  // still prefilling: schedule_prefills
      ++i;
      continue;
    }
    bool ok = reserve(q, 1);
    while (!ok && preempt_newest(&q)) ok = reserve(q, 1);
    if (!ok) {  // every other is in the step: q waits (the next one moves to index i)
      preempt(q);
      continue;
    }
    b.add(q, 1);
    ++i;
  }
}

// Prefills in admission order: the running ones' next chunks, then waiting
// requests while the step has rows and the cache blocks.
void Engine::schedule_prefills(Batch& b) {
  State& s = *state_;
  for (size_t i = 0; i < s.running.size() && b.rows < s.rows; ++i) {
    Sequence& q = *s.running[i];
    const int64_t left = static_cast<int64_t>(q.tokens.size()) - q.computed;
    if (left <= 1 || q.scheduled) continue;
    const int64_t n = std::min(left, s.rows - b.rows);
    bool ok = reserve(q, n);
    while (!ok && preempt_newest(&q)) ok = reserve(q, n);
    if (!ok) break;  // it keeps its blocks and waits for the older ones
    b.add(q, n);
  }
  while (!s.waiting.empty() && b.rows < s.rows) {
    Sequence& q = *s.waiting.front();
    if (!q.host.empty() && !swap_in(q)) break;  // swapped out: it resumes where it was
    // Prompt log-probabilities need every prompt position's logits: no hits.
    if (options_.prefix_caching && q.table.empty() && !q.params.prompt_logprobs) match_prefix(q);
    const int64_t left = static_cast<int64_t>(q.tokens.size()) - q.computed;
    int64_t n = std::min(left, s.rows - b.rows);
    // As much of the chunk as the free blocks hold (at least one position).
    const int64_t bs = s.pool->block_size();
    while (n > 0 && !reserve(q, n)) n = std::min(n - 1, (q.computed / bs + s.pool->available()) * bs - q.computed);
    if (n <= 0) {
      release_blocks(q);  // the prefix hits go back too; it waits for room
      break;
    }
    admitted(q);
    s.running.push_back(std::move(s.waiting.front()));
    s.waiting.pop_front();
    b.add(*s.running.back(), n);
  }
}

// A waiting request enters the batch: its prefix lookups and (the first
// time) its time in the queue are counted.
void Engine::admitted(Sequence& q) {
  std::lock_guard lock(mu_);
  stats_.prefix_queries += q.prefix_lookup.first;
  stats_.prefix_hits += q.prefix_lookup.second;
  q.prefix_lookup = {0, 0};
  if (q.started) return;
  q.started = true;
  q.admitted = Clock::now();
  stats_.queue_duration.add(seconds(q.admitted - q.arrived));
  q.stream->queue_s_ = seconds(q.admitted - q.arrived);
  for (auto& f : q.forks) f->stream->queue_s_ = seconds(q.admitted - f->arrived);
}

// One forward for every row of the batch; prompt log-probabilities are
// scored as their rows' logits come out.
std::vector<model::PagedSeq> Engine::forward(const Batch& b) {
  State& s = *state_;
  std::vector<model::PagedSeq> seqs;
  const int64_t V = model_.config().vocab_size;
  for (const Batch::Work& w : b.work) {
    Sequence& q = *w.q;
    const bool last = q.computed + w.n == static_cast<int64_t>(q.tokens.size());
    // Prompt log-probabilities: the rows whose next token is a prompt token.
    const int64_t scored = q.params.prompt_logprobs ? std::clamp<int64_t>(q.prompt - 1 - q.computed, 0, w.n) : 0;
    seqs.push_back({q.tokens.data() + q.computed, w.n, q.computed, q.table.data(), last, scored, q.adapter});
  }
  const auto f0 = Clock::now();
  model_.forward_paged(seqs, s.pool->view(), s.logits.data(),
                       [&](size_t i, int64_t first, int64_t n, const float* l) {
                         Sequence& q = *b.work[i].q;
                         for (int64_t r = 0; r < n; ++r) {
                           const int64_t pos = q.computed + first + r;  // predicts token pos + 1
                           if (pos != static_cast<int64_t>(q.prompt_lp.size())) continue;  // recomputed
                           q.prompt_lp.push_back(score_token(l + r * V, V, q.tokens[static_cast<size_t>(pos + 1)],
                                                             q.params.top_logprobs));
                         }
                       });
  const double per_row = seconds(Clock::now() - f0) / static_cast<double>(b.rows);
  s.row_s = s.row_s > 0 ? 0.8 * s.row_s + 0.2 * per_row : per_row;
  return seqs;
}

// Sample, stream, finish: returns the sequences sampled. A request whose
// prompt was just prefilled hands its blocks and its logits to its forks,
// which join the batch.
int64_t Engine::sample(const Batch& b, const std::vector<model::PagedSeq>& seqs) {
  State& s = *state_;
  const int64_t V = model_.config().vocab_size;
  int64_t out = 0, sampled = 0;
  std::vector<Sequence*> done;
  std::vector<Finish> why;
  const auto now = Clock::now();
  std::vector<float> row;
  auto take = [&](Sequence& r, float* logits) {
    ++sampled;
    if (const Finish f = emit(r, logits, now); f != Finish::kNone) {
      done.push_back(&r);
      why.push_back(f);
    }
  };
  for (size_t i = 0; i < b.work.size(); ++i) {
    Sequence& q = *b.work[i].q;
    q.computed += b.work[i].n;
    publish_full(q);
    if (!seqs[i].logits) continue;
    float* l = s.logits.data() + (out++) * V;
    std::vector<std::unique_ptr<Sequence>> forks = std::move(q.forks);
    q.forks.clear();
    if (!forks.empty()) row.assign(l, l + V);
    take(q, l);
    for (auto& f : forks) {
      f->table = q.table;
      for (int32_t blk : f->table) s.pool->ref(blk);
      f->computed = f->prompt;
      f->hash = q.hash;
      f->hashed = q.hashed;
      f->started = true;
      f->admitted = q.admitted;
      f->prompt_lp = q.prompt_lp;
      std::vector<float> mine = row;
      Sequence& r = *f;
      s.running.push_back(std::move(f));
      take(r, mine.data());
    }
  }
  for (size_t i = 0; i < done.size(); ++i) {
    finish(*done[i], why[i], "");
    std::erase_if(s.running, [&](const std::unique_ptr<Sequence>& q) { return q.get() == done[i]; });
  }
  return sampled;
}

// Samples q's next token from its logits row and streams it; the reason it
// ends, if it does.
Finish Engine::emit(Sequence& q, float* l, Clock::time_point now) {
  const int64_t V = model_.config().vocab_size;
  const int32_t eos = tokenizer_.eos_id();
  const Choice c = sample_token(l, V, q.params, q.tokens, q.generated(), static_cast<uint64_t>(q.generated()));
  q.tokens.push_back(c.id);
  GeneratedToken t;
  t.id = c.id;
  t.logprob = c.logprob;
  t.top = c.top;
  t.special = c.id == eos;
  Finish f = Finish::kNone;
  if (c.id == eos && !q.params.ignore_eos) {
    f = Finish::kEos;
  } else {
    std::lock_guard lock(tok_mu_);
    t.text = q.text->push(c.id);
    if (q.text->stopped()) f = Finish::kStop;
  }
  if (f == Finish::kNone && (q.generated() >= q.params.max_new_tokens ||
                             static_cast<int64_t>(q.tokens.size()) >= options_.max_total_tokens))
    f = Finish::kLength;
  if (f == Finish::kLength || f == Finish::kEos) {
    std::lock_guard lock(tok_mu_);
    t.text += q.text->flush();
  }
  {
    std::lock_guard lock(mu_);
    ++stats_.generated_tokens;
    if (!q.first_token) {
      stats_.time_to_first_token.add(seconds(now - q.arrived));
      stats_.prompt_tokens += q.prompt;
    } else {
      stats_.inter_token_latency.add(seconds(now - q.last_token));
    }
  }
  Stream& st = *q.stream;
  std::lock_guard lock(st.mu_);
  if (!q.first_token && q.params.prompt_logprobs) st.pending_.prompt = q.prompt_lp;
  q.first_token = true;
  q.last_token = now;
  st.pending_.text += t.text;
  st.pending_.tokens.push_back(std::move(t));
  st.has_pending_ = true;
  st.cv_.notify_all();
  return f;
}

void Engine::publish_stats() {
  State& s = *state_;
  int64_t held = 0;
  for (const auto& q : s.running) held += q->computed;
  std::lock_guard lock(mu_);
  stats_.running = static_cast<int64_t>(s.running.size());
  stats_.waiting = static_cast<int64_t>(s.waiting.size() + incoming_.size());
  stats_.kv_blocks_used = s.pool->used();
  stats_.kv_blocks_cached = s.pool->cached();
  stats_.kv_tokens_held = held;
  stats_.kv_blocks_host = s.host ? s.host->used() : 0;
}

}  // namespace po::serve
