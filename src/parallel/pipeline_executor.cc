// The pipeline executor (pipeline_executor.h): the chunks' slots, one
// step's actions in the rank's order. The chunks' state is made in
// pipeline_chunks.cc, the data group's gradient sums (ZeRO 0-1's buckets,
// ZeRO 2-3's reduce-scatters) are in pipeline_grad_sync.cc, its parameter
// gathers (ZeRO 1's updated shards, ZeRO-3's uses) in pipeline_gathers.cc, the step's end (the tied pair, ZeRO-2's
// shards, the norm, the update) in pipeline_finalize.cc, the
// vocabulary-parallel head in pipeline_vocab.cc, the memory the executor
// holds and predicts in pipeline_memory.cc.
#include "parallel/pipeline_executor.h"
#include "backend/device.h"
#include "parallel/pipeline_executor_state.h"
#include "parallel/quantized_state.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <set>
#include <utility>

#include "backend/ops.h"
#include "core/error.h"
#include "model/vocab_head.h"
#include "parallel/unit_blocks.h"

namespace po::parallel {
namespace ops = po::backend::cpu;
using namespace executor_detail;  // its helpers and names (pipeline_executor_state.h)

PipelineExecutor::PipelineExecutor(const model::TransformerConfig& config,
                                   const optim::AdamWConfig& adam, PipelineSetup setup)
    : config_(config.resolved()), layout_(config_, setup.split), setup_(std::move(setup)) {
  setup_.adam = adam;
  const pipeline::Schedule& s = setup_.schedule;
  PO_CHECK(static_cast<int>(setup_.stage_units.size()) == s.stages(), "pipeline: ",
           setup_.stage_units.size(), " unit ranges for ", s.stages(), " stages");
  rank_ = setup_.pipe ? setup_.pipe->rank() : 0;
  PO_CHECK((setup_.pipe ? setup_.pipe->size() : 1) == s.ranks, "pipeline: the group has ",
           setup_.pipe ? setup_.pipe->size() : 1, " ranks, the schedule ", s.ranks);
  PO_CHECK(setup_.zero_stage >= 0 && setup_.zero_stage <= 3, "pipeline: ZeRO stage ",
           setup_.zero_stage, " (stages 0-3)");
  PO_CHECK(setup_.zero_stage < 2 || !s.vocab, "pipeline: ZeRO-", setup_.zero_stage,
           " with the vocabulary-parallel head");
  PO_CHECK(setup_.prefetch >= 0, "parallel.prefetch = ", setup_.prefetch, " must be >= 0");
  PO_CHECK(!setup_.defer_lookup || setup_.data != nullptr, "pipeline: deferred lookup rows need a data group");
  if (setup_.data != nullptr) setup_.dp = setup_.data->size();
  bf16_ = setup_.bf16;
  shard_grads_ = setup_.zero_stage >= 2;
  accumulate_ = bf16_ || shard_grads_;
  // ZeRO-3 stores the parameters' shards over dp > 1, and with paged state
  // on one data rank too: its one "shard" (the whole unit) lives in the
  // pages and is copied out for each use.
  shard_params_ = setup_.zero_stage == 3 && (sharded() || setup_.paged);
  if (setup_.tensor != nullptr && setup_.tensor->rank() > 0) {  // what tp ranks > 0 do not count in the norm
    uncounted_ = layout_.replicated_ranges();
    std::sort(uncounted_.begin(), uncounted_.end());
  }
  const std::vector<bool> quantized = quantized_tensors(layout_, adam);
  const int64_t sp = config_.sequence_parallel && setup_.split.size > 1 ? setup_.split.size : 1;
  rows_ = setup_.micro * setup_.T / sp;
  for (int stage : s.stages_of(rank_)) chunks_.push_back(make_chunk(stage, quantized));
  emb_rank_ = s.rank_of(0);
  head_rank_ = s.rank_of(s.stages() - 1);
  for (auto& c : chunks_) setup_unit0(*c, quantized);
  setup_buffers();
  keep_unit0_ = head_meets_embedding();
  // A fault test's knob: this rank's messages declare the transposed shape
  // (the same size: what matching by order alone would swap in silently).
  bool skew = false;
  if (const char* r = std::getenv("PAGEDOPTIM_TEST_PP_SKEW_RANK")) skew = std::atoi(r) == rank_ && setup_.pipe != nullptr;
  messages_ = std::make_unique<StageMessages>(
      rank_, setup_.pipe != nullptr ? std::make_unique<StageLink>(*setup_.pipe) : nullptr,
      s.actions[static_cast<size_t>(rank_)], message_shape(),
      skew ? tensor::Shape{config_.n_embd, rows_} : message_shape());
  inputs_.resize(static_cast<size_t>(setup_.micro * setup_.T));
  targets_.resize(inputs_.size());
  vocab_setup();
  setup_buckets();
}

// A step that ended in an error (a timeout, a shape mismatch, a failing
// batch) leaves operations in flight, and comm::Work leaks such operations
// while unwinding rather than wait. What they write is leaked with them by
// its owner, so that a message that arrives later lands in memory nobody
// else owns, never in a freed and reused block: the messages' buffers and
// the link (StageMessages), the accumulators of ZeRO 2-3's reduce-scatters
// (UnitAccumulators), ZeRO-3's prefetched gathers' buffers (ParamGathers).
PipelineExecutor::~PipelineExecutor() {
  if (lender_.lend)  // (lent frames back to their models before the pager goes)
    for (auto& c : chunks_)
      for (auto& m : c->slots) m->set_activation_lender({});
}

PipelineExecutor::Chunk& PipelineExecutor::chunk_of_stage(int stage) {
  for (auto& c : chunks_)
    if (c->stage == stage) return *c;
  PO_THROW(core::Internal, "pipeline: stage ", stage, " is not on rank ", rank_);
}

bool PipelineExecutor::holds(int u) const {
  for (const auto& c : chunks_)
    if (c->holds(u)) return true;
  return false;
}

bool PipelineExecutor::has_loss() const { return head_rank_ == rank_; }

const void* PipelineExecutor::tied_replica() const {
  PO_ASSERT(!shard_params_, "pipeline: tied_replica under ZeRO-3 (its shard only is held)");
  for (const auto& c : chunks_)
    if (c->replica())
      return static_cast<const char*>(c->rep_params.data()) +
             static_cast<size_t>(layout_.token_embedding().offset) * stored_esz();
  return nullptr;
}

void* PipelineExecutor::stored_unit(int u) {
  for (auto& c : chunks_)
    if (c->holds(u)) return stored_at(*c, false, u);
  PO_THROW(core::Internal, "pipeline: unit ", u, " is not on rank ", rank_);
}

// Where chunk c (its replica) stores unit u's parameters: the whole unit,
// or under ZeRO-3 this rank's shard of it.
void* PipelineExecutor::stored_at(Chunk& c, bool replica, int u) {
  PO_ASSERT(!paged_shards_, "pipeline: unit ", u, "'s stored parameters are in pages (shard_out)");
  if (shard_params_) return shard_of(c, u, true).at(stored_esz());
  const int64_t at = replica ? 0 : layout_.unit_offset(u) - c.base;
  return static_cast<char*>((replica ? c.rep_params : c.params).data()) + static_cast<size_t>(at) * stored_esz();
}

// Unit u's values (the whole unit's floats at src) into chunk c's (its
// replica's) stored parameters, whole or its shard, and a bf16 stage's
// master shard.
void PipelineExecutor::store_unit(Chunk& c, bool replica, int u, const float* src) {
  const ShardLayout& sl = replica ? *c.rep_shard : *c.shard;
  const int i = replica ? 0 : u - c.first;
  if (bf16_) write_field(c, replica, State::kParams, sl.local_offset(i), sl.owned(i), src + sl.begin(i));
  if (shard_params_) {  // this rank's shard, wherever it lives (the padding stays 0)
    std::vector<uint16_t> narrowed(bf16_ ? static_cast<size_t>(sl.owned(i)) : 0);
    if (bf16_) ops::f32_to_bf16(narrowed.data(), src + sl.begin(i), sl.owned(i));
    const void* stored = bf16_ ? static_cast<const void*>(narrowed.data()) : src + sl.begin(i);
    return shard_in(shard_of(c, u, true), 0, sl.owned(i), stored, Direction::kHostToDevice);  // (c's replica: unit 0's)
  }
  void* dst = stored_at(c, replica, u);
  if (!bf16_) return backend::from_host(dst, src, static_cast<size_t>(sl.unit_numel(i)) * sizeof(float));
  ops::f32_to_bf16(static_cast<uint16_t*>(dst), src, sl.unit_numel(i));
}

float* PipelineExecutor::unit_params(int u) {
  PO_ASSERT(!bf16_ && !shard_params_, "pipeline: unit_params of bf16 or ZeRO-3 stages (use read_unit)");
  return static_cast<float*>(stored_unit(u));
}

int64_t PipelineExecutor::adam_steps() const { return chunks_.front()->adam->steps_taken(); }

void PipelineExecutor::set_adam_steps(int64_t t) {
  for (auto& c : chunks_) {
    c->adam->set_steps_taken(t);
    if (c->rep_adam) c->rep_adam->set_steps_taken(t);
  }
}

void PipelineExecutor::init_random(uint64_t seed) {
  // The initialiser of a one-block model of the same shapes gives each
  // unit's values (they depend on (seed, tensor, index) only).
  model::Transformer init(config_.weights_only(), 1, 1, model::UnitRange{0, 0}, setup_.split);
  std::vector<float> unit;
  for (auto& c : chunks_) {
    for (int u = c->first; u <= c->last; ++u) {
      unit.resize(static_cast<size_t>(layout_.unit_numel(u)));
      init.init_random_unit(seed, u, unit.data());
      write_unit(State::kParams, u, unit.data());
    }
    if (!c->replica()) continue;
    unit.resize(static_cast<size_t>(layout_.unit_numel(0)));
    init.init_random_unit(seed, 0, unit.data());
    store_unit(*c, true, 0, unit.data());
  }
  vocab_init(seed);
}

void PipelineExecutor::sync_replica() {
  if (!layout_.tied_trains() || emb_rank_ == head_rank_) return vocab_refresh();
  // (ZeRO-3: this data rank's shard of it, the same cut on both copies)
  const int64_t n = layout_.unit_numel(0);
  const auto n0 = static_cast<size_t>(shard_params_ ? ShardLayout::stride_of(n, setup_.dp, setup_.shard_align()) : n);
  const DType stored = bf16_ ? DType::kBF16 : DType::kF32;
  // The stored unit 0, then Adam m, v (and bf16: the master) of this data
  // rank's shard of it: the same elements in both copies (the same shard layout).
  const State kinds[3] = {State::kAdamM, State::kAdamV, State::kParams};
  const int fields = bf16_ ? 3 : 2;
  if (rank_ == emb_rank_) {
    Chunk& e = chunk_of_stage(0);
    const auto own = static_cast<size_t>(e.shard->owned(0));
    std::vector<float> state(own);
    std::vector<char> shard(shard_params_ ? n0 * stored_esz() : 0);  // (ZeRO-3: out of its pages, if paged)
    if (shard_params_) shard_out(shard_of(e, 0, true), 0, static_cast<int64_t>(n0), shard.data());
    setup_.pipe->send(shard_params_ ? shard.data() : stored_unit(0), n0, stored, head_rank_, kPairTag);
    for (int k = 0; k < fields; ++k) {
      read_field(e, false, kinds[k], e.shard->local_offset(0), e.shard->owned(0), state.data());
      setup_.pipe->send(state.data(), own, DType::kF32, head_rank_, kPairTag + 3 + k);
    }
  }
  if (rank_ == head_rank_)
    for (auto& c : chunks_)
      if (c->replica()) {
        const auto own = static_cast<size_t>(c->rep_shard->owned(0));
        std::vector<float> state(own);
        std::vector<char> shard(shard_params_ ? n0 * stored_esz() : 0);
        setup_.pipe->recv(shard_params_ ? shard.data() : stored_at(*c, true, 0), n0, stored, emb_rank_, kPairTag);
        if (shard_params_) shard_in(shard_of(*c, 0, true), 0, static_cast<int64_t>(n0), shard.data());
        for (int k = 0; k < fields; ++k) {
          setup_.pipe->recv(state.data(), own, DType::kF32, emb_rank_, kPairTag + 3 + k);
          write_field(*c, true, kinds[k], c->rep_shard->local_offset(0), c->rep_shard->owned(0),
                      state.data());
        }
      }
  vocab_refresh();
}

model::Transformer& PipelineExecutor::acquire_slot(Chunk& c, int micro) {
  size_t i = 0;
  while (i < c.slots.size() && c.slot_micro[i] != -1) ++i;
  if (i == c.slots.size()) {
    // Vocabulary parallel: the last stage's slots run only the final norm;
    // the first one keeps the logits for evaluate(), which computes the
    // whole head there (every slot is free then, so it takes the first).
    const bool logits = !(setup_.schedule.vocab && c.holds(layout_.head_unit())) || c.slots.empty();
    auto m = std::make_unique<model::Transformer>(config_, setup_.micro, setup_.T,
                                                  model::UnitRange{c.first, c.last}, setup_.split,
                                                  logits);
    if (setup_.tp_ops) m->set_parallel_ops(*setup_.tp_ops);
    m->set_tp_overlap(setup_.tp_overlap);
    Chunk* cp = &c;
    const model::Layout* l = &layout_;
    auto at = [cp, l](float* base, float* unit0, int u) {
      if (cp->holds(u)) return base + (l->unit_offset(u) - cp->base);
      PO_ASSERT(u == 0 && unit0 != nullptr, "pipeline chunk ", cp->stage, ": unit ", u, " not held");
      return unit0;
    };
    model::UnitHooks h;
    if (bf16_) {  // widened parameters (widen; ZeRO-3: of the gathered unit)
      h.params = [this, cp](int u) { return widen(*cp, u); };
      h.done = [this](int u) {
        widen_busy_[u == 0 ? 0 : 1] = false;
        if (shard_params_) release_use(u);
      };
      h.params_bf16 = [this, cp](int u) { return stored_bf16(*cp, u); };
      h.params_lean = [this, cp](int u) { return widen(*cp, u, true); };
    } else if (shard_params_) {  // ZeRO-3: gathered for each use
      h.params = [this, cp](int u) { return static_cast<float*>(const_cast<void*>(gather_use(*cp, u))); };
      h.done = [this](int u) { release_use(u); };
    } else {
      h.params = [cp, at](int u) { return at(cp->params.f32(), static_cast<float*>(cp->unit0_params), u); };
      h.done = [](int) {};
    }
    if (!accumulate_) {
      h.grads = [cp, at](int u) { return at(cp->grads.f32(), static_cast<float*>(cp->unit0_grads), u); };
      h.grads_ready = [this, cp](int u) {
        if (cur_fused_) unit_finished(*cp, u);
      };
    } else {  // f32 accumulators per micro-batch (see accumulator)
      h.grads = [this, cp](int u) { return accumulator(*cp, u); };
      h.grads_ready = [this, cp](int u) {
        progress();
        if (accs_->find({cur_micro_, cp->stage, u}) != nullptr) flush({cur_micro_, cp->stage, u});
        if (cur_fused_) unit_finished(*cp, u);
      };
    }
    if (c.frozen) {  // a tied head's unit 0 holds no adapters: its table is the frozen base's
      m->share_base(*c.frozen, c.frozen_unit0.size() > 0 ? c.frozen_unit0.f32() : nullptr);
      const auto frozen_table = [cp](auto hook) {
        return [cp, hook](int u) { return cp->holds(u) ? hook(u) : nullptr; };
      };
      h.params = frozen_table(h.params);
      if (h.params_lean) h.params_lean = frozen_table(h.params_lean);
      if (h.params_bf16) h.params_bf16 = frozen_table(h.params_bf16);
      h.done = [cp, done = h.done](int u) {
        if (cp->holds(u)) done(u);
      };
    }
    if (LookupRows* rows = c.rows.get())  // the tied table's E, added once at the step (tied_pair.h)
      h.lookup_rows = [rows](const float* r, const int32_t* t, int64_t n) { rows->append(r, t, n); };
    if (setup_.defer_lookup && c.holds(0)) {  // the last micro-batch's lookup rows wait for the step's sums
      h.defers_lookup = [this] { return cur_micro_ == setup_.schedule.micro_batches - 1; };
      h.deferred_lookup = [this](const float* r, const int32_t* t, int64_t n) { keep_lookup_tail(r, t, n); };
    }
    m->set_unit_hooks(std::move(h));
    if (lender_.lend) m->set_activation_lender(lender_);
    c.slots.push_back(std::move(m));
    c.slot_micro.push_back(-1);
  }
  c.slot_micro[i] = micro;
  stats_->peak_in_flight = std::max(stats_->peak_in_flight, ++in_flight_);
  return *c.slots[i];
}

// bf16: unit u's stored parameters widened to f32, one buffer for unit 0
// and one for the others (a block, or the head with the tied table beside
// it); the model returns each before it asks for the next of its kind.
float* PipelineExecutor::widen(Chunk& c, int u, bool lean) {
  const int k = u == 0 ? 0 : 1;
  PO_ASSERT(!widen_busy_[k], "pipeline: unit ", u, "'s parameters asked for while unit ",
            k == 0 ? "0's" : "another's", " are in use");
  widen_busy_[k] = true;
  const auto* src = shard_params_ ? static_cast<const uint16_t*>(gather_use(c, u)) : stored_bf16(c, u);
  widen_unit(layout_, u, src, widen_[k].f32(), lean);
  return widen_[k].f32();
}

// bf16: unit u's stored parameters (the model's bf16 GEMMs read their
// weights here); ZeRO-3: as gathered for the use in hand.
const uint16_t* PipelineExecutor::stored_bf16(const Chunk& c, int u) const {
  if (shard_params_) return static_cast<const uint16_t*>(gathers_->in_use(u));
  const auto* src = c.holds(u) ? static_cast<const uint16_t*>(c.params.data()) + (layout_.unit_offset(u) - c.base)
                               : static_cast<const uint16_t*>(c.unit0_params);
  PO_ASSERT(src != nullptr, "pipeline chunk ", c.stage, ": unit ", u, " not held");
  return src;
}

// bf16 and ZeRO 2-3: the f32 gradient accumulator of unit u for the
// micro-batch in hand, zeroed at its first use; once the micro-batch's part
// is complete (flush) its sum is rounded into the stored bf16 gradient, or
// (ZeRO 2-3) reduce-scattered into the shard: as pp = 1 does per micro-batch
// and unit. A block whose weight half is deferred keeps its own until the W
// (a pool of block-sized buffers, counted with the W queue); the others
// take their kind's ring in turn (acc_ring), a slot whose reduction is
// still in flight once that reduction has completed.
float* PipelineExecutor::accumulator(Chunk& c, int u) {
  const UnitAccumulators::Key key{cur_micro_, c.stage, u};
  if (float* buf = accs_->find(key)) return buf;
  const bool pooled = cur_deferred_ && u >= 1 && u <= static_cast<int>(config_.n_layer);
  return accs_->take(key, pooled, acc_layout(layout_.unit_numel(u), setup_).bytes,
                     static_cast<size_t>(acc_numel(u)) * sizeof(float),
                     [this](int64_t seq) { reductions_->complete_through(seq); });
}

void PipelineExecutor::flush(const UnitAccumulators::Key& key) {
  const auto [micro, stage, u] = key;
  const bool last_micro = micro == setup_.schedule.micro_batches - 1;
  Chunk& c = chunk_of_stage(stage);
  const UnitAccumulators::Acc a = accs_->remove(key);
  if (shard_grads_)  // (it gives the buffer back)
    return reduce_into_shard(c, u, a, last_micro);
  auto* dst = c.holds(u) ? static_cast<uint16_t*>(c.grads.data()) + (layout_.unit_offset(u) - c.base)
                         : static_cast<uint16_t*>(c.unit0_grads);
  ops::bf16_add_f32(dst, a.buf, layout_.unit_numel(u));  // (bf16 below ZeRO-2)
  accs_->release(a);
}

// Whether the one chunk that holds the embedding and the head (one stage)
// runs each micro-batch's backward before the next forward: the tied
// table's accumulator then waits from the head's forward to the embedding's
// backward (its kind's ring has one buffer), so unit 0 is summed once a
// micro-batch, as at pp = 1, not once for the head's part and once for the
// rest.
bool PipelineExecutor::head_meets_embedding() const {
  if (setup_.schedule.stages() != 1) return false;
  int open = -1;  // the micro-batch forwarded and not yet backwarded
  for (const Action& a : setup_.schedule.actions[static_cast<size_t>(rank_)]) {
    if (a.op == Op::kForward) {
      if (open >= 0) return false;
      open = a.micro;
    } else if (a.op == Op::kBackward || a.op == Op::kBackwardInput) {
      if (a.micro != open) return false;
      open = -1;
    }
  }
  return true;
}

// Every accumulator of (micro, the chunk's stage) into the stored gradient,
// but, with `keep_deferred`, those of blocks whose weight half is to come,
// and with `keep_unit0` unit 0's.
void PipelineExecutor::flush_micro(Chunk& c, int micro, bool keep_deferred, bool keep_unit0) {
  for (const UnitAccumulators::Key& key : accs_->taken()) {
    const auto [k, stage, u] = key;
    if (k == micro && stage == c.stage && !(keep_deferred && accs_->pooled(key)) && !(keep_unit0 && u == 0))
      flush(key);
  }
}

void PipelineExecutor::release_slot(Chunk& c, int micro) {
  for (size_t i = 0; i < c.slots.size(); ++i)
    if (c.slot_micro[i] == micro) {
      c.slot_micro[i] = -1;
      --in_flight_;
      return;
    }
  PO_THROW(core::Internal, "pipeline: no slot holds micro-batch ", micro, " of stage ", c.stage);
}

tensor::Shape PipelineExecutor::message_shape() const { return {rows_, config_.n_embd}; }

// The tensor the compute `consumer` reads: made on this rank (a local
// hand-off) or received (posted ahead; waited here).
const float* PipelineExecutor::incoming(const Action& consumer, Payload payload) {
  return incoming_key(consumer, {consumer.micro, consumer.stage, static_cast<int>(payload)});
}

// The same for the message `key` (the head's, vocabulary parallel); a
// receive's wait is a span of the step.
float* PipelineExecutor::incoming_key(const Action& consumer, const Key& key) {
  StageMessages::Wait w;
  float* b = messages_->get(consumer, key, &w);
  if (w.peer < 0) return b;
  Action r = consumer;
  r.op = Op::kRecv;
  r.payload = static_cast<Payload>(std::get<2>(key));
  r.peer = w.peer;
  spans_.push_back({r, true, w.start_ns - step_start_ns_, w.end_ns - step_start_ns_});
  stats_->wait_s += static_cast<double>(w.end_ns - w.start_ns) / 1e9;
  return b;
}

void PipelineExecutor::run_compute(const Action& a, const BatchFn& batch, float grad_scale,
                                   const MicroFn& before_forward, PipelineStepStats& stats) {
  if (a.op == Op::kHeadStats) return vocab_stats(a, batch);
  if (a.op == Op::kHeadGrad) return vocab_grad(a, grad_scale, stats);
  Chunk& c = chunk_of_stage(a.stage);
  const int S = setup_.schedule.stages();
  const bool first = a.stage == 0, last = a.stage == S - 1;
  const size_t msg = static_cast<size_t>(rows_ * config_.n_embd) * sizeof(float);
  cur_micro_ = a.micro;  // (bf16: whose accumulators the hooks hand out)
  cur_deferred_ = a.op == Op::kBackwardInput || a.op == Op::kBackwardWeight;
  // Vocabulary parallel: the last stage runs its head's final norm, every
  // rank its pieces (pipeline_vocab.cc); an evaluation runs the whole head.
  using HeadPart = model::Transformer::HeadPart;
  const HeadPart head = vocab_ && last ? HeadPart::kNormOnly : HeadPart::kWhole;
  switch (a.op) {
    case Op::kForward: {
      if (first || last) batch(a.micro, inputs_.data(), targets_.data());
      const float* x = first ? nullptr : incoming(a, Payload::kActivation);
      const int64_t t0 = now_ns();
      model::Transformer& m = acquire_slot(c, a.micro);
      if (before_forward) before_forward(a.micro, m);
      const double sum = m.stage_forward(first ? inputs_.data() : nullptr, x,
                                         last ? targets_.data() : nullptr, grad_scale, head);
      if (x != nullptr) messages_->give(const_cast<float*>(x));
      // The head's gradients are complete (the tied table's may wait for the
      // embedding's backward: keep_unit0_).
      if (accumulate_ && last) flush_micro(c, a.micro, false, first && keep_unit0_);
      if (last && vocab_) vocab_forward_done(m, a.micro);
      if (last) {
        stats.loss_sum += static_cast<float>(sum / static_cast<double>(setup_.micro * setup_.T));
      } else {
        float* out = messages_->take();
        backend::device_copy(out, m.stage_output(), msg);
        messages_->made({a.micro, a.stage + 1, static_cast<int>(Payload::kActivation)}, out);
      }
      spans_.push_back({a, false, t0 - step_start_ns_, now_ns() - step_start_ns_});
      break;
    }
    case Op::kBackward:
    case Op::kBackwardInput: {
      const float* d = !last ? incoming(a, Payload::kGradient) : vocab_ ? vocab_input_grad(a) : nullptr;
      if (first) batch(a.micro, inputs_.data(), targets_.data());
      const int64_t t0 = now_ns();
      model::Transformer* m = nullptr;
      for (size_t i = 0; i < c.slots.size(); ++i)
        if (c.slot_micro[i] == a.micro) m = c.slots[i].get();
      PO_ASSERT(m != nullptr, "pipeline: ", pipeline::describe(a), " before its forward");
      const float* dres = nullptr;
      if (a.op == Op::kBackwardInput) {
        std::vector<model::WeightGradWork> works;
        if (!c.free_works.empty()) {
          works = std::move(c.free_works.back());
          c.free_works.pop_back();
        } else {
          const int blocks = std::min(c.last, static_cast<int>(config_.n_layer)) -
                             (std::max(c.first, 1) - 1);
          for (int i = 0; i < blocks; ++i) {
            works.push_back(m->make_weight_grad_work());
            c.work_bytes += works.back().storage.size();
          }
        }
        dres = m->stage_backward(first ? inputs_.data() : nullptr, d, {}, &works, head);
        c.w_queue[a.micro] = std::move(works);
        stats.peak_w_queue = std::max(stats.peak_w_queue, ++w_queue_);
      } else {  // (the hooks' grads_ready finishes each unit: unit_finished)
        cur_fused_ = true;
        dres = m->stage_backward(first ? inputs_.data() : nullptr, d, {}, nullptr, head);
        cur_fused_ = false;
      }
      if (accumulate_) flush_micro(c, a.micro, a.op == Op::kBackwardInput);
      if (d != nullptr) messages_->give(const_cast<float*>(d));
      if (!first) {
        float* out = messages_->take();
        backend::device_copy(out, dres, msg);
        messages_->made({a.micro, a.stage - 1, static_cast<int>(Payload::kGradient)}, out);
      }
      release_slot(c, a.micro);
      spans_.push_back({a, false, t0 - step_start_ns_, now_ns() - step_start_ns_});
      break;
    }
    case Op::kBackwardWeight: {
      const int64_t t0 = now_ns();
      auto it = c.w_queue.find(a.micro);
      PO_ASSERT(it != c.w_queue.end(), "pipeline: ", pipeline::describe(a), " before its B");
      c.slots.front()->stage_backward_weight(it->second);
      if (accumulate_) flush_micro(c, a.micro, false);
      chunk_finished(c);
      c.free_works.push_back(std::move(it->second));
      c.w_queue.erase(it);
      --w_queue_;
      spans_.push_back({a, false, t0 - step_start_ns_, now_ns() - step_start_ns_});
      break;
    }
    default:
      PO_THROW(core::Internal, "pipeline: ", pipeline::describe(a), " is not a compute");
  }
}

PipelineStepStats PipelineExecutor::forward_backward(const BatchFn& batch, float grad_scale,
                                                     const MicroFn& before_forward) {
  PipelineStepStats stats;
  stats_ = &stats;
  spans_.clear();
  step_start_ns_ = now_ns();
  const auto& list = setup_.schedule.actions[static_cast<size_t>(rank_)];
  if (gathers_) gathers_->begin_step();  // (ZeRO-3: the first step's requests are the order)
  messages_->begin_step();
  for (size_t i = 0; i < list.size(); ++i) {
    const Action& a = list[i];
    if (a.op == Op::kRecv) continue;  // posted ahead, waited by its compute
    if (a.op == Op::kSend) {
      const int64_t t0 = now_ns();
      messages_->send(a);
      stats.sent_bytes += rows_ * config_.n_embd * static_cast<int64_t>(sizeof(float));
      ++stats.sends;
      spans_.push_back({a, false, t0 - step_start_ns_, now_ns() - step_start_ns_});
      continue;
    }
    const int64_t t0 = now_ns();
    run_compute(a, batch, grad_scale, before_forward, stats);
    stats.busy_s += static_cast<double>(now_ns() - t0) / 1e9;
    messages_->post_ahead();
  }
  messages_->end_step();
  if (gathers_) {
    gathers_->end_step();
    stats.param_gathers = gathers_->uses();
    stats.prefetched = gathers_->prefetched();
  }
  PO_ASSERT(messages_->idle() && in_flight_ == 0 && w_queue_ == 0,
            "pipeline rank ", rank_, ": the step left tensors behind");
  backward_end_ns_ = now_ns();
  stats.seconds = static_cast<double>(backward_end_ns_ - step_start_ns_) / 1e9;
  stats.busy_s -= stats.wait_s;  // a compute's time includes its receive's wait
  stats_ = nullptr;
  return stats;
}

double PipelineExecutor::evaluate(const int32_t* inputs, const int32_t* targets, const int32_t* positions) {
  const pipeline::Schedule& s = setup_.schedule;
  const int S = s.stages();
  const size_t msg = static_cast<size_t>(rows_ * config_.n_embd);
  std::vector<float> x(msg);
  bool have = false;  // x holds the previous stage's output
  double loss = 0;
  PipelineStepStats scratch;
  stats_ = &scratch;
  for (int st = 0; st < S; ++st) {
    if (s.rank_of(st) != rank_) {
      have = false;
      continue;
    }
    Chunk& c = chunk_of_stage(st);
    if (st > 0 && !have) {
      Action r{Op::kRecv, 0, st, s.rank_of(st - 1), Payload::kActivation};
      messages_->link()->recv(x.data(), message_shape(), r.peer, pipeline::message_tag(r));
    }
    model::Transformer& m = acquire_slot(c, -2);
    m.set_positions(positions);  // (null: clears what a training micro-batch left)
    const double sum = m.stage_forward(st == 0 ? inputs : nullptr, st == 0 ? nullptr : x.data(),
                                       st == S - 1 ? targets : nullptr, 0.0f);
    if (st == S - 1) loss = static_cast<float>(sum / static_cast<double>(setup_.micro * setup_.T));
    else backend::device_copy(x.data(), m.stage_output(), msg * sizeof(float));
    release_slot(c, -2);
    have = true;
    if (gathers_) gathers_->drain();  // (what the training order prefetched past the evaluation's requests)
    if (st + 1 < S && s.rank_of(st + 1) != rank_) {
      Action snd{Op::kSend, 0, st + 1, s.rank_of(st + 1), Payload::kActivation};
      messages_->link()->send(x.data(), message_shape(), snd.peer, pipeline::message_tag(snd));
      messages_->link()->wait_sends();
    }
  }
  stats_ = nullptr;
  if (setup_.pipe != nullptr) {
    std::vector<double> all(static_cast<size_t>(s.ranks));
    setup_.pipe->all_gather(&loss, all.data(), 2, DType::kI32);  // doubles, bit-exact
    loss = all[static_cast<size_t>(head_rank_)];
  }
  return loss;
}

std::string PipelineExecutor::gather_trace() {
  const pipeline::Schedule& s = setup_.schedule;
  // Per span: op, micro, stage, peer, payload, wait, start, end (as doubles), from the step's start
  // on the shared steady clock.
  std::vector<double> mine;
  mine.push_back(static_cast<double>(step_start_ns_));
  for (const PipelineSpan& sp : spans_) {
    const Action& a = sp.action;
    mine.insert(mine.end(), {static_cast<double>(a.op), static_cast<double>(a.micro),
                             static_cast<double>(a.stage), static_cast<double>(a.peer),
                             static_cast<double>(a.payload), sp.wait ? 1.0 : 0.0,
                             static_cast<double>(sp.start_ns), static_cast<double>(sp.end_ns)});
  }
  std::vector<std::vector<double>> all{mine};
  if (setup_.pipe != nullptr) {
    const int n = s.ranks;
    int64_t len = static_cast<int64_t>(mine.size());
    std::vector<int64_t> lens(static_cast<size_t>(n));
    setup_.pipe->all_gather(&len, lens.data(), 2, DType::kI32);
    const int64_t most = *std::max_element(lens.begin(), lens.end());
    mine.resize(static_cast<size_t>(most), 0.0);
    std::vector<double> flat(static_cast<size_t>(most * n));
    setup_.pipe->all_gather(mine.data(), flat.data(), static_cast<size_t>(2 * most), DType::kI32);
    all.assign(static_cast<size_t>(n), {});
    for (int r = 0; r < n; ++r)
      all[static_cast<size_t>(r)].assign(flat.begin() + r * most,
                                         flat.begin() + r * most + lens[static_cast<size_t>(r)]);
  }
  if (rank_ != 0) return "";
  double t0 = all[0][0];
  for (const auto& v : all) t0 = std::min(t0, v[0]);
  pipeline::Timing t;
  t.spans.resize(all.size());
  t.busy.assign(all.size(), 0.0);
  for (size_t r = 0; r < all.size(); ++r) {
    const std::vector<double>& v = all[r];
    const double shift = (v[0] - t0) / 1e3;  // µs
    for (size_t i = 1; i + 8 <= v.size(); i += 8) {
      Action a{static_cast<Op>(static_cast<int>(v[i])), static_cast<int>(v[i + 1]),
               static_cast<int>(v[i + 2]), static_cast<int>(v[i + 3]),
               static_cast<Payload>(static_cast<int>(v[i + 4]))};
      const double start = shift + v[i + 6] / 1e3, end = shift + v[i + 7] / 1e3;
      t.spans[r].push_back({a, start, end});
      t.step = std::max(t.step, end);
      if (a.op != Op::kSend && a.op != Op::kRecv) t.busy[r] += end - start;
    }
  }
  return pipeline::chrome_trace(s, t, 1.0);
}

}  // namespace po::parallel
