// The pipeline executor (pipeline_executor.h): the chunks' buffers and
// slots, one step's actions in the rank's order, the tied pair, the update.
#include "parallel/pipeline_executor.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <set>

#include "backend/ops.h"
#include "core/error.h"
#include "model/vocab_head.h"
#include "parallel/grad_norm.h"
#include "parallel/units.h"

namespace po::parallel {
namespace ops = po::backend::cpu;
using pipeline::Action;
using pipeline::Op;
using pipeline::Payload;
using tensor::DType;

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

constexpr int kPairTag = 32700;     // the tied pair's exchange (StageLink's tags stay below 30720)
constexpr size_t kRecvWindow = 4;   // receives posted ahead of their use

tensor::Storage zeroed(int64_t elements, size_t esz = sizeof(float)) {
  tensor::Storage s(static_cast<size_t>(elements) * esz);
  std::memset(s.data(), 0, s.size());
  return s;
}

// AdamW ranges over a shard of units [first, last] (ShardLayout index i =
// u - first) of a buffer whose element 0 is unit `first`'s: each tensor
// `keep` accepts, cut to the owned part of its unit, with its state (m, v,
// the gradient shard) at the shard's local offsets. With one rank the
// state's offsets are the buffer's.
std::vector<optim::ParamRange> shard_ranges(const model::Layout& l, int first, int last,
                                            const ShardLayout& sl,
                                            const std::function<bool(const model::TensorSpec&)>& keep) {
  std::vector<optim::ParamRange> ranges;
  const int64_t base = l.unit_offset(first);
  for (const auto& t : l.tensors()) {
    if (t.unit < first || t.unit > last || !keep(t)) continue;
    const int i = t.unit - first;
    const int64_t unit_lo = l.unit_offset(t.unit);
    const int64_t lo = std::max(t.offset - unit_lo, sl.begin(i));
    const int64_t hi = std::min(t.offset + t.numel() - unit_lo, sl.end(i));
    if (lo >= hi) continue;
    ranges.push_back({unit_lo - base + lo, hi - lo, t.decay, sl.local_offset(i) + (lo - sl.begin(i))});
  }
  return ranges;
}

std::vector<int64_t> unit_sizes(const model::Layout& l, int first, int last) {
  std::vector<int64_t> n;
  for (int u = first; u <= last; ++u) n.push_back(l.unit_numel(u));
  return n;
}

bool every_tensor(const model::TensorSpec&) { return true; }

// defer_lookup's rows on `rank` (each C floats and a token): the
// embedding's rank keeps its last micro-batch's and gathers every data
// rank's; a tied head's rank elsewhere receives the gathered ones.
int64_t lookup_tail_rows(const PipelineSetup& s, const model::Layout& l, int rank, bool gathered) {
  if (!s.defer_lookup) return 0;
  const int64_t n = s.micro * s.T;
  if (rank == s.schedule.rank_of(0)) return gathered ? n * s.dp : n;
  const bool tied_head = l.tied() && rank == s.schedule.rank_of(s.schedule.stages() - 1);
  return tied_head && gathered ? n * s.dp : 0;
}

}  // namespace

bool defers_lookup(int dp, bool overlap_comm, int cp, bool bf16) {
  return dp > 1 && overlap_comm && cp == 1 && !bf16;
}

struct PipelineExecutor::Chunk {
  int stage = 0;
  int first = 0, last = 0;  // units
  int64_t base = 0, numel = 0;  // flat offset of `first`, elements held
  // Parameters and gradients as stored: fp32, or bf16 (the fp32 master then
  // exists for the ZeRO shard, `master`, unless paged).
  tensor::Storage params, grads, master;
  tensor::Storage lookup;  // the tied table's E in f32 (holds unit 0, tied)
  // The tied head without unit 0 on this rank: a replica of unit 0 (only its
  // token table is read, updated and summed).
  tensor::Storage rep_params, rep_grads, rep_master;
  void* unit0_params = nullptr;  // where this chunk's head reads unit 0 (as stored)
  void* unit0_grads = nullptr;
  // ZeRO: the units' (the replica's: unit 0's) shards over the data group
  // (one rank below ZeRO-1), AdamW over them, and with several ranks the
  // shard of the reduced gradient the update reads.
  std::unique_ptr<ShardLayout> shard, rep_shard;
  std::unique_ptr<optim::AdamW> adam, rep_adam;
  tensor::Storage grad_shard, rep_grad_shard;
  std::vector<std::unique_ptr<model::Transformer>> slots;
  std::vector<int> slot_micro;  // -1: free
  std::map<int, std::vector<model::WeightGradWork>> w_queue;
  std::vector<std::vector<model::WeightGradWork>> free_works;
  size_t work_bytes = 0;  // every WeightGradWork made (the W queue at its peak)
  bool holds(int u) const { return u >= first && u <= last; }
  bool replica() const { return rep_params.size() > 0; }
};

struct PipelineExecutor::VocabPart {
  model::vocab::Pieces pieces;
  int k0 = 0, k1 = 0;          // this rank's pieces
  int64_t row0 = 0, rows = 0;  // their rows of the head's table
  float* w = nullptr;          // those rows as read ([rows, C], row0 first)
  float* dw = nullptr;         // their gradient
  tensor::Storage w_copy, dw_own;
  float* table = nullptr;      // the owner's (the head's rank): the whole table and its gradient
  float* table_grad = nullptr;
  // One micro-batch from its S to its T: the final norm's output (a message
  // buffer, or on the head's rank the last stage's slot's), the targets,
  // and per chunk of head_chunk_rows rows the pieces' logits and statistics.
  struct Held {
    int micro = -1;
    const float* x = nullptr;
    bool x_buffer = false;
    std::vector<int32_t> targets;
    tensor::Storage logits;
    std::vector<model::vocab::Stats> stats;
  };
  std::vector<std::unique_ptr<Held>> held;
  tensor::Storage scratch;  // vocab::tree_sum's: tree_height buffers of a chunk of rows
  std::vector<float*> scratch_at(int64_t chunk, int64_t C) {
    std::vector<float*> out;
    for (int h = 0; h < model::vocab::tree_height(pieces.count()); ++h)
      out.push_back(scratch.f32() + h * chunk * C);
    return out;
  }
  Held& take(int micro, int64_t rows_, int64_t chunk, int P) {
    for (auto& h : held)
      if (h->micro < 0) {
        h->micro = micro;
        return *h;
      }
    auto h = std::make_unique<Held>();
    h->targets.resize(static_cast<size_t>(rows_));
    h->logits = tensor::Storage(static_cast<size_t>(rows_ * rows) * sizeof(float));
    for (int64_t r0 = 0; r0 < rows_; r0 += chunk) {
      h->stats.emplace_back();
      h->stats.back().resize(P, std::min(chunk, rows_ - r0));
    }
    h->micro = micro;
    held.push_back(std::move(h));
    return *held.back();
  }
  Held& find(int micro) {
    for (auto& h : held)
      if (h->micro == micro) return *h;
    PO_THROW(core::Internal, "pipeline: the head's T of micro-batch ", micro, " before its S");
  }
};

PipelineExecutor::PipelineExecutor(const model::TransformerConfig& config,
                                   const optim::AdamWConfig& adam, PipelineSetup setup)
    : config_(config.resolved()), layout_(config_, setup.split), setup_(std::move(setup)) {
  const pipeline::Schedule& s = setup_.schedule;
  PO_CHECK(static_cast<int>(setup_.stage_units.size()) == s.stages(), "pipeline: ",
           setup_.stage_units.size(), " unit ranges for ", s.stages(), " stages");
  rank_ = setup_.pipe ? setup_.pipe->rank() : 0;
  PO_CHECK((setup_.pipe ? setup_.pipe->size() : 1) == s.ranks, "pipeline: the group has ",
           setup_.pipe ? setup_.pipe->size() : 1, " ranks, the schedule ", s.ranks);
  PO_CHECK(setup_.zero_stage == 0 || setup_.zero_stage == 1, "pipeline: ZeRO stage ",
           setup_.zero_stage, " (stages 0 and 1 compose with pipeline parallel)");
  if (setup_.data != nullptr) setup_.dp = setup_.data->size();
  bf16_ = setup_.bf16;
  const size_t esz = stored_esz();
  const bool sharded = setup_.zero_stage == 1 && setup_.dp > 1;
  const int zr = sharded ? setup_.dp : 1, zk = sharded ? setup_.data->rank() : 0;
  if (setup_.pipe) link_ = std::make_unique<StageLink>(*setup_.pipe);
  const int head = layout_.head_unit();
  const int64_t sp = config_.sequence_parallel && setup_.split.size > 1 ? setup_.split.size : 1;
  rows_ = setup_.micro * setup_.T / sp;
  for (int stage : s.stages_of(rank_)) {
    auto c = std::make_unique<Chunk>();
    const model::UnitRange r = setup_.stage_units[static_cast<size_t>(stage)];
    c->stage = stage;
    c->first = r.first;
    c->last = r.last < 0 ? head : r.last;
    c->base = layout_.unit_offset(c->first);
    c->numel = layout_.unit_offset(c->last + 1) - c->base;
    c->params = zeroed(c->numel, esz);
    c->grads = zeroed(c->numel, esz);
    c->shard = std::make_unique<ShardLayout>(unit_sizes(layout_, c->first, c->last), zr, zk);
    if (bf16_) c->master = zeroed(c->shard->local_numel());
    c->adam = std::make_unique<optim::AdamW>(
        adam, shard_ranges(layout_, c->first, c->last, *c->shard, every_tensor),
        c->shard->local_numel());
    if (sharded && !bf16_) c->grad_shard = zeroed(c->shard->local_numel());
    if (layout_.tied() && c->holds(0)) c->lookup = zeroed(layout_.token_embedding().numel());
    chunks_.push_back(std::move(c));
  }
  emb_rank_ = s.rank_of(0);
  head_rank_ = s.rank_of(s.stages() - 1);
  for (auto& c : chunks_) {
    if (!layout_.tied() || !c->holds(head) || c->holds(0)) continue;
    if (emb_rank_ == rank_) {  // zbv: the embedding's chunk is here
      Chunk& e = chunk_of_stage(0);
      c->unit0_params = e.params.data();
      c->unit0_grads = e.grads.data();
      continue;
    }
    const int64_t n0 = layout_.unit_numel(0);
    c->rep_params = zeroed(n0, esz);
    c->rep_grads = zeroed(n0, esz);
    c->unit0_params = c->rep_params.data();
    c->unit0_grads = c->rep_grads.data();
    // The embedding's shard layout of unit 0, so that both copies of the
    // table update the same elements on the same data rank.
    const int64_t wte = layout_.token_embedding().offset;
    c->rep_shard = std::make_unique<ShardLayout>(unit_sizes(layout_, 0, 0), zr, zk);
    c->rep_adam = std::make_unique<optim::AdamW>(
        adam,
        shard_ranges(layout_, 0, 0, *c->rep_shard,
                     [wte](const model::TensorSpec& t) { return t.offset == wte; }),
        c->rep_shard->local_numel());
    if (sharded && !bf16_) c->rep_grad_shard = zeroed(c->rep_shard->local_numel());
    if (bf16_) c->rep_master = zeroed(c->rep_shard->local_numel());
  }
  // The largest unit held (a replica's included): ZeRO-1's gathers take a
  // send block and ranks receive blocks of its stride; bf16 stages its f32
  // sum over the data group (parallel.reduce_dtype fp32).
  int64_t largest = 0;
  for (const auto& c : chunks_) {
    for (int u = c->first; u <= c->last; ++u) largest = std::max(largest, layout_.unit_numel(u));
    if (c->replica()) largest = std::max(largest, layout_.unit_numel(0));
  }
  if (sharded) gather_ = zeroed((largest + zr - 1) / zr * (1 + zr));
  PO_CHECK(!setup_.defer_lookup || (!bf16_ && setup_.data != nullptr),
           "pipeline: deferred lookup rows need fp32 and a data group");
  const int64_t C = config_.n_embd;
  for (const bool all : {false, true}) {
    const int64_t n = lookup_tail_rows(setup_, layout_, rank_, all);
    if (n == 0) continue;
    (all ? rows_all_ : tail_rows_) = zeroed(n * C);
    (all ? tokens_all_ : tail_tokens_) = tensor::Storage(static_cast<size_t>(n) * sizeof(int32_t));
  }
  if (bf16_) {  // the widened parameters and the f32 gradient accumulators: unit 0's, the others'
    int64_t n0 = 0, other = 0;
    for (const auto& c : chunks_) {
      for (int u = c->first; u <= c->last; ++u)
        (u == 0 ? n0 : other) = std::max(u == 0 ? n0 : other, layout_.unit_numel(u));
      if (c->unit0_params != nullptr) n0 = layout_.unit_numel(0);
    }
    for (int k = 0; k < 2; ++k) {
      widen_[k] = zeroed(k == 0 ? n0 : other);
      acc_[k] = zeroed(k == 0 ? n0 : other);
    }
    if (setup_.dp > 1 && !setup_.reduce_bf16) staging_ = zeroed(largest);
  }
  // A fault test's knob: this rank's messages declare the transposed shape
  // (the same size: what matching by order alone would swap in silently).
  if (const char* r = std::getenv("PAGEDOPTIM_TEST_PP_SKEW_RANK"))
    skew_ = std::atoi(r) == rank_ && setup_.pipe != nullptr;
  inputs_.resize(static_cast<size_t>(setup_.micro * setup_.T));
  targets_.resize(inputs_.size());
  vocab_setup();
}

// A step that ended in an error (a timeout, a shape mismatch, a failing
// batch) leaves receives posted into message buffers and sends in flight
// from them, and comm::Work leaks such operations while unwinding rather
// than wait. Their memory is leaked with them: the buffers, the receives'
// headers (moved with their map's nodes, which do not move) and the link
// with its sends' headers; a message that arrives later then lands in
// memory nobody else owns, never in a freed and reused block.
PipelineExecutor::~PipelineExecutor() {
  if (posted_.empty() && sending_.empty()) return;
  std::set<const float*> busy(sending_.begin(), sending_.end());
  for (const auto& [key, p] : posted_) busy.insert(p.buffer);
  for (auto& b : buffers_)
    if (busy.count(b.get()) > 0) (void)b.release();
  (void)new std::map<Key, Posted>(std::move(posted_));
  (void)link_.release();
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
  for (const auto& c : chunks_)
    if (c->replica())
      return static_cast<const char*>(c->rep_params.data()) +
             static_cast<size_t>(layout_.token_embedding().offset) * stored_esz();
  return nullptr;
}

void* PipelineExecutor::stored_unit(int u) {
  for (auto& c : chunks_)
    if (c->holds(u))
      return static_cast<char*>(c->params.data()) +
             static_cast<size_t>(layout_.unit_offset(u) - c->base) * stored_esz();
  PO_THROW(core::Internal, "pipeline: unit ", u, " is not on rank ", rank_);
}

float* PipelineExecutor::unit_params(int u) {
  PO_ASSERT(!bf16_, "pipeline: unit_params of bf16 stages (use read_unit)");
  return static_cast<float*>(stored_unit(u));
}

// Every data rank's shard of one unit (`mine`: this rank's owned(i)
// elements) into dst, the whole unit: a collective over the data group.
void PipelineExecutor::gather_unit(const ShardLayout& sl, int i, const void* mine, void* dst,
                                   DType dtype) {
  const size_t esz = dtype == DType::kBF16 ? sizeof(uint16_t) : sizeof(float);
  const int64_t stride = sl.stride(i), owned = sl.owned(i);
  char* send = static_cast<char*>(gather_.data());
  char* recv = send + static_cast<size_t>(stride) * esz;
  std::memcpy(send, mine, static_cast<size_t>(owned) * esz);
  std::memset(send + static_cast<size_t>(owned) * esz, 0, static_cast<size_t>(stride - owned) * esz);
  setup_.data->all_gather(send, recv, static_cast<size_t>(stride), dtype);
  std::memcpy(dst, recv, static_cast<size_t>(sl.unit_numel(i)) * esz);
}

// Elements [offset, offset + n) of Adam m, v or (bf16 parameters) the fp32
// master, in state coordinates, out of and into memory or the pages.
void PipelineExecutor::read_field(Chunk& c, bool replica, State kind, int64_t offset, int64_t n,
                                  float* dst) {
  optim::AdamW& a = replica ? *c.rep_adam : *c.adam;
  if (a.paged()) return a.paged_state()->copy_out(paged_field(kind), offset, n, dst);
  std::memcpy(dst, field_in_memory(c, replica, kind) + offset, static_cast<size_t>(n) * sizeof(float));
}

void PipelineExecutor::write_field(Chunk& c, bool replica, State kind, int64_t offset, int64_t n,
                                   const float* src) {
  optim::AdamW& a = replica ? *c.rep_adam : *c.adam;
  if (a.paged()) return a.paged_state()->copy_in(paged_field(kind), offset, n, src);
  std::memcpy(field_in_memory(c, replica, kind) + offset, src, static_cast<size_t>(n) * sizeof(float));
}

optim::PagedAdamState::Field PipelineExecutor::paged_field(State kind) {
  using F = optim::PagedAdamState::Field;
  return kind == State::kAdamM ? F::kM : kind == State::kAdamV ? F::kV : F::kMaster;
}

float* PipelineExecutor::field_in_memory(Chunk& c, bool replica, State kind) {
  optim::AdamW& a = replica ? *c.rep_adam : *c.adam;
  if (kind == State::kAdamM) return a.m();
  if (kind == State::kAdamV) return a.v();
  return (replica ? c.rep_master : c.master).f32();
}

void PipelineExecutor::read_unit(State kind, int u, float* dst) {
  const auto n = static_cast<size_t>(layout_.unit_numel(u));
  if (kind == State::kParams && !bf16_) {
    std::memcpy(dst, unit_params(u), n * sizeof(float));
    return;
  }
  for (auto& c : chunks_) {
    if (!c->holds(u)) continue;
    const ShardLayout& sl = *c->shard;
    const int i = u - c->first;
    if (sl.ranks() == 1) {
      read_field(*c, false, kind, sl.local_offset(i), sl.unit_numel(i), dst);
      return;
    }
    std::vector<float> mine(static_cast<size_t>(sl.owned(i)));
    read_field(*c, false, kind, sl.local_offset(i), sl.owned(i), mine.data());
    gather_unit(sl, i, mine.data(), dst, DType::kF32);
    return;
  }
  PO_THROW(core::Internal, "pipeline: unit ", u, " is not on rank ", rank_);
}

void PipelineExecutor::write_unit(State kind, int u, const float* src) {
  const auto n = layout_.unit_numel(u);
  if (kind == State::kParams && !bf16_) {
    std::memcpy(unit_params(u), src, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  for (auto& c : chunks_) {
    if (!c->holds(u)) continue;
    const ShardLayout& sl = *c->shard;
    const int i = u - c->first;
    write_field(*c, false, kind, sl.local_offset(i), sl.owned(i), src + sl.begin(i));
    // bf16: the stored parameters are the master's rounding (the whole unit).
    if (kind == State::kParams) ops::f32_to_bf16(static_cast<uint16_t*>(stored_unit(u)), src, n);
    return;
  }
  PO_THROW(core::Internal, "pipeline: unit ", u, " is not on rank ", rank_);
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
    if (!bf16_) {
      std::memcpy(c->rep_params.data(), unit.data(), unit.size() * sizeof(float));
      continue;
    }
    ops::f32_to_bf16(static_cast<uint16_t*>(c->rep_params.data()), unit.data(), layout_.unit_numel(0));
    write_field(*c, true, State::kParams, c->rep_shard->local_offset(0), c->rep_shard->owned(0),
                unit.data() + c->rep_shard->begin(0));
  }
  vocab_init(seed);
}

void PipelineExecutor::sync_replica() {
  if (!layout_.tied() || emb_rank_ == head_rank_) return vocab_refresh();
  const auto n0 = static_cast<size_t>(layout_.unit_numel(0));
  const DType stored = bf16_ ? DType::kBF16 : DType::kF32;
  // The stored unit 0, then Adam m, v (and bf16: the master) of this data
  // rank's shard of it: the same elements in both copies (the same shard layout).
  const State kinds[3] = {State::kAdamM, State::kAdamV, State::kParams};
  const int fields = bf16_ ? 3 : 2;
  if (rank_ == emb_rank_) {
    Chunk& e = chunk_of_stage(0);
    const auto own = static_cast<size_t>(e.shard->owned(0));
    std::vector<float> state(own);
    setup_.pipe->send(stored_unit(0), n0, stored, head_rank_, kPairTag);
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
        setup_.pipe->recv(c->rep_params.data(), n0, stored, emb_rank_, kPairTag);
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
    if (!bf16_) {
      h.params = [cp, at](int u) {
        return at(cp->params.f32(), static_cast<float*>(cp->unit0_params), u);
      };
      h.grads = [cp, at](int u) { return at(cp->grads.f32(), static_cast<float*>(cp->unit0_grads), u); };
      h.done = [](int) {};
      h.grads_ready = [](int) {};
    } else {  // bf16: widened parameters, f32 accumulators per micro-batch (see widen, accumulator)
      h.params = [this, cp](int u) { return widen(*cp, u); };
      h.done = [this](int u) { widen_busy_[u == 0 ? 0 : 1] = false; };
      h.params_bf16 = [this, cp](int u) { return stored_bf16(*cp, u); };
      h.params_lean = [this, cp](int u) { return widen(*cp, u, true); };
      h.grads = [this, cp](int u) { return accumulator(*cp, u); };
      h.grads_ready = [this, cp](int u) {
        const auto it = accs_.find({cur_micro_, cp->stage, u});
        if (it != accs_.end()) flush(it);
      };
    }
    m->set_unit_hooks(std::move(h));
    m->set_accumulating(true);
    if (setup_.schedule.vocab && c.holds(layout_.head_unit())) m->set_external_head(true);
    if (c.lookup.size() > 0) m->set_tied_lookup_grads(c.lookup.f32());
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
  widen_unit(layout_, u, stored_bf16(c, u), widen_[k].f32(), lean);
  return widen_[k].f32();
}

// bf16: unit u's stored parameters (the model's bf16 GEMMs read their weights here).
const uint16_t* PipelineExecutor::stored_bf16(const Chunk& c, int u) const {
  const auto* src = c.holds(u) ? static_cast<const uint16_t*>(c.params.data()) + (layout_.unit_offset(u) - c.base)
                               : static_cast<const uint16_t*>(c.unit0_params);
  PO_ASSERT(src != nullptr, "pipeline chunk ", c.stage, ": unit ", u, " not held");
  return src;
}

// bf16: the f32 gradient accumulator of unit u for the micro-batch in hand,
// zeroed at its first use; its sum is rounded into the stored bf16 gradient
// once the micro-batch's part is complete (flush): as pp = 1 does per
// micro-batch and unit. A block whose weight half is deferred keeps its own
// until the W (a pool of block-sized buffers, counted with the W queue);
// the others take the one buffer of their kind.
float* PipelineExecutor::accumulator(Chunk& c, int u) {
  const std::tuple<int, int, int> key{cur_micro_, c.stage, u};
  if (const auto it = accs_.find(key); it != accs_.end()) return it->second.buf;
  const int64_t n = layout_.unit_numel(u);
  Acc a;
  if (cur_deferred_ && u >= 1 && u <= static_cast<int>(config_.n_layer)) {
    if (acc_free_.empty()) {
      acc_pool_.push_back(zeroed(n));
      acc_free_.push_back(acc_pool_.back().f32());
    }
    a.buf = acc_free_.back();
    acc_free_.pop_back();
  } else {
    a.fixed = u == 0 ? 0 : 1;
    PO_ASSERT(!acc_busy_[a.fixed], "pipeline: a second accumulator of unit ", u, "'s kind");
    acc_busy_[a.fixed] = true;
    a.buf = acc_[a.fixed].f32();
  }
  std::memset(a.buf, 0, static_cast<size_t>(n) * sizeof(float));
  a.chunk = &c;
  return accs_.emplace(key, a).first->second.buf;
}

void PipelineExecutor::flush(std::map<AccKey, Acc>::iterator it) {
  const int u = std::get<2>(it->first);
  const Acc& a = it->second;
  Chunk& c = *a.chunk;
  auto* dst = c.holds(u) ? static_cast<uint16_t*>(c.grads.data()) + (layout_.unit_offset(u) - c.base)
                         : static_cast<uint16_t*>(c.unit0_grads);
  ops::bf16_add_f32(dst, a.buf, layout_.unit_numel(u));
  if (a.fixed >= 0)
    acc_busy_[a.fixed] = false;
  else
    acc_free_.push_back(a.buf);
  accs_.erase(it);
}

// Every accumulator of (micro, the chunk's stage) into the stored gradient,
// but, with `keep_deferred`, those of blocks whose weight half is to come.
void PipelineExecutor::flush_micro(Chunk& c, int micro, bool keep_deferred) {
  for (auto it = accs_.begin(); it != accs_.end();) {
    const auto next = std::next(it);
    const auto [k, stage, u] = it->first;
    if (k == micro && stage == c.stage && !(keep_deferred && it->second.fixed < 0)) flush(it);
    it = next;
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

float* PipelineExecutor::take_buffer() {
  if (free_buffers_.empty()) {
    buffers_.push_back(std::make_unique<float[]>(static_cast<size_t>(rows_ * config_.n_embd)));
    free_buffers_.push_back(buffers_.back().get());
  }
  float* b = free_buffers_.back();
  free_buffers_.pop_back();
  return b;
}

void PipelineExecutor::give_buffer(float* b) { free_buffers_.push_back(b); }

tensor::Shape PipelineExecutor::message_shape() const { return {rows_, config_.n_embd}; }

// The list's next action, posted if it is a receive.
void PipelineExecutor::post_next() {
  const Action& a = setup_.schedule.actions[static_cast<size_t>(rank_)][next_recv_++];
  if (a.op != Op::kRecv) return;
  Posted& p = posted_[{a.micro, a.stage, static_cast<int>(a.payload)}];
  p.buffer = take_buffer();
  link_->post_recv(p.in, p.buffer, message_shape(), a.peer, pipeline::message_tag(a));
}

void PipelineExecutor::post_receives() {
  const size_t n = setup_.schedule.actions[static_cast<size_t>(rank_)].size();
  while (posted_.size() < kRecvWindow && next_recv_ < n) post_next();
}

// The tensor the compute `consumer` reads: made on this rank (a local
// hand-off) or received (posted ahead; waited here).
const float* PipelineExecutor::incoming(const Action& consumer, Payload payload) {
  return incoming_key(consumer, {consumer.micro, consumer.stage, static_cast<int>(payload)});
}

// The same for the message `key` (the head's, vocabulary parallel).
float* PipelineExecutor::incoming_key(const Action& consumer, const Key& key) {
  const auto payload = static_cast<Payload>(std::get<2>(key));
  if (auto it = ready_.find(key); it != ready_.end()) {
    float* b = it->second;
    ready_.erase(it);
    return b;
  }
  const auto& list = setup_.schedule.actions[static_cast<size_t>(rank_)];
  while (posted_.find(key) == posted_.end()) {
    PO_ASSERT(next_recv_ < list.size(), "pipeline rank ", rank_, ": no receive for ",
              pipeline::describe(consumer));
    post_next();
  }
  auto it = posted_.find(key);
  const int64_t t0 = now_ns();
  link_->finish_recv(it->second.in);
  const int64_t t1 = now_ns();
  Action r = consumer;
  r.op = Op::kRecv;
  r.payload = payload;
  r.peer = it->second.in.peer;
  spans_.push_back({r, true, t0 - step_start_ns_, t1 - step_start_ns_});
  stats_->wait_s += static_cast<double>(t1 - t0) / 1e9;
  float* b = it->second.buffer;
  posted_.erase(it);
  return b;
}

void PipelineExecutor::run_compute(const Action& a, const BatchFn& batch, float grad_scale,
                                   PipelineStepStats& stats) {
  if (a.op == Op::kHeadStats) return vocab_stats(a, batch);
  if (a.op == Op::kHeadGrad) return vocab_grad(a, grad_scale, stats);
  Chunk& c = chunk_of_stage(a.stage);
  const int S = setup_.schedule.stages();
  const bool first = a.stage == 0, last = a.stage == S - 1;
  const size_t msg = static_cast<size_t>(rows_ * config_.n_embd) * sizeof(float);
  cur_micro_ = a.micro;  // (bf16: whose accumulators the hooks hand out)
  cur_deferred_ = a.op == Op::kBackwardInput || a.op == Op::kBackwardWeight;
  switch (a.op) {
    case Op::kForward: {
      if (first || last) batch(a.micro, inputs_.data(), targets_.data());
      const float* x = first ? nullptr : incoming(a, Payload::kActivation);
      const int64_t t0 = now_ns();
      model::Transformer& m = acquire_slot(c, a.micro);
      const double sum = m.stage_forward(first ? inputs_.data() : nullptr, x,
                                         last ? targets_.data() : nullptr, grad_scale);
      if (x != nullptr) give_buffer(const_cast<float*>(x));
      if (bf16_ && last) flush_micro(c, a.micro, false);  // the head's gradients are complete
      if (last && vocab_) vocab_forward_done(m, a.micro);
      if (last) {
        stats.loss_sum += static_cast<float>(sum / static_cast<double>(setup_.micro * setup_.T));
      } else {
        float* out = take_buffer();
        std::memcpy(out, m.stage_output(), msg);
        ready_[{a.micro, a.stage + 1, static_cast<int>(Payload::kActivation)}] = out;
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
      // (as the one-stage model's last micro-batch with DataParallel's deferred embedding)
      const bool keep = first && setup_.defer_lookup && a.micro == setup_.schedule.micro_batches - 1;
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
        dres = m->stage_backward(first ? inputs_.data() : nullptr, d, {}, &works, keep);
        c.w_queue[a.micro] = std::move(works);
        stats.peak_w_queue = std::max(stats.peak_w_queue, ++w_queue_);
      } else {
        dres = m->stage_backward(first ? inputs_.data() : nullptr, d, {}, nullptr, keep);
      }
      if (keep) keep_lookup_tail(*m);
      if (bf16_) flush_micro(c, a.micro, a.op == Op::kBackwardInput);
      if (d != nullptr) give_buffer(const_cast<float*>(d));
      if (!first) {
        float* out = take_buffer();
        std::memcpy(out, dres, msg);
        ready_[{a.micro, a.stage - 1, static_cast<int>(Payload::kGradient)}] = out;
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
      if (bf16_) flush_micro(c, a.micro, false);
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

PipelineStepStats PipelineExecutor::forward_backward(const BatchFn& batch, float grad_scale) {
  PipelineStepStats stats;
  stats_ = &stats;
  spans_.clear();
  step_start_ns_ = now_ns();
  const auto& list = setup_.schedule.actions[static_cast<size_t>(rank_)];
  next_recv_ = 0;
  if (link_) post_receives();
  for (size_t i = 0; i < list.size(); ++i) {
    const Action& a = list[i];
    if (a.op == Op::kRecv) continue;  // posted ahead, waited by its compute
    if (a.op == Op::kSend) {
      const auto it = ready_.find({a.micro, a.stage, static_cast<int>(a.payload)});
      PO_ASSERT(it != ready_.end(), "pipeline: ", pipeline::describe(a), " before its tensor");
      const int64_t t0 = now_ns();
      link_->send(it->second, skew_ ? tensor::Shape{config_.n_embd, rows_} : message_shape(),
                  a.peer, pipeline::message_tag(a));
      stats.sent_bytes += rows_ * config_.n_embd * static_cast<int64_t>(sizeof(float));
      ++stats.sends;
      // A tensor for several ranks (the head's statistics) leaves with its last send.
      const auto f = fanout_.find(it->first);
      if (f == fanout_.end() || --f->second == 0) {
        if (f != fanout_.end()) fanout_.erase(f);
        sending_.push_back(it->second);
        ready_.erase(it);
      }
      spans_.push_back({a, false, t0 - step_start_ns_, now_ns() - step_start_ns_});
      continue;
    }
    const int64_t t0 = now_ns();
    run_compute(a, batch, grad_scale, stats);
    stats.busy_s += static_cast<double>(now_ns() - t0) / 1e9;
    if (link_) post_receives();
  }
  if (link_) link_->wait_sends();
  for (float* b : sending_) give_buffer(b);
  sending_.clear();
  PO_ASSERT(ready_.empty() && posted_.empty() && in_flight_ == 0 && w_queue_ == 0,
            "pipeline rank ", rank_, ": the step left tensors behind");
  stats.seconds = static_cast<double>(now_ns() - step_start_ns_) / 1e9;
  stats.busy_s -= stats.wait_s;  // a compute's time includes its receive's wait
  stats_ = nullptr;
  return stats;
}

// The tied table: H (the head's, in the replica or the embedding chunk's
// own gradient) plus E (the lookups', f32), the same sum on both copies;
// bf16: wte = bf16(H + E), H as the micro-batches rounded it in
// (DataParallel::fold_tied_lookup's sum at pp = 1). The embedding's rank
// and the head's exchange H (as stored) and E.
void PipelineExecutor::sum_tied_pair() {
  if (!layout_.tied()) return;
  const model::TensorSpec& wte = layout_.token_embedding();
  const int64_t n = wte.numel();
  const DType stored = bf16_ ? DType::kBF16 : DType::kF32;
  auto table = [&](tensor::Storage& g) {
    return static_cast<char*>(g.data()) + static_cast<size_t>(wte.offset) * stored_esz();
  };
  auto add = [&](void* h, const float* e) {  // h = h + e, as stored
    if (bf16_) return ops::bf16_add_f32(static_cast<uint16_t*>(h), e, n);
    float* f = static_cast<float*>(h);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) f[i] = f[i] + e[i];
  };
  if (emb_rank_ == head_rank_) {
    if (rank_ != emb_rank_) return;
    Chunk& e = chunk_of_stage(0);
    add(table(e.grads), e.lookup.f32());
    std::memset(e.lookup.data(), 0, e.lookup.size());
    return;
  }
  if (rank_ == emb_rank_) {
    Chunk& e = chunk_of_stage(0);
    comm::Work s = setup_.pipe->isend(e.lookup.f32(), static_cast<size_t>(n), DType::kF32,
                                      head_rank_, kPairTag + 1);
    void* g = table(e.grads);  // 0 here (the head is elsewhere): it takes H
    setup_.pipe->recv(g, static_cast<size_t>(n), stored, head_rank_, kPairTag + 2);
    s.wait();
    add(g, e.lookup.f32());
    std::memset(e.lookup.data(), 0, e.lookup.size());
  }
  if (rank_ == head_rank_) {
    std::vector<float> other(static_cast<size_t>(n));
    for (auto& c : chunks_) {
      if (!c->replica()) continue;
      void* h = table(c->rep_grads);
      comm::Work s = setup_.pipe->isend(h, static_cast<size_t>(n), stored, emb_rank_, kPairTag + 2);
      setup_.pipe->recv(other.data(), static_cast<size_t>(n), DType::kF32, emb_rank_, kPairTag + 1);
      s.wait();
      add(h, other.data());
    }
  }
}

// The data group's sum of stored gradients: fp32 in place; bf16 over the
// wire in bf16, or (parallel.reduce_dtype fp32) widened unit by unit into
// an f32 staging buffer, summed, and rounded back, as DataParallel does.
void PipelineExecutor::allreduce_grads(void* grads, int first, int last) {
  const int64_t n = layout_.unit_offset(last + 1) - layout_.unit_offset(first);
  if (!bf16_) {
    setup_.data->allreduce(grads, static_cast<size_t>(n), DType::kF32, comm::ReduceOp::kSum);
    return;
  }
  if (setup_.reduce_bf16) {
    setup_.data->allreduce(grads, static_cast<size_t>(n), DType::kBF16, comm::ReduceOp::kSum);
    return;
  }
  auto* g = static_cast<uint16_t*>(grads);
  for (int u = first; u <= last; ++u) {
    const int64_t k = layout_.unit_numel(u);
    ops::bf16_to_f32(staging_.f32(), g, k);
    setup_.data->allreduce(staging_.f32(), static_cast<size_t>(k), DType::kF32, comm::ReduceOp::kSum);
    ops::f32_to_bf16(g, staging_.f32(), k);
    g += k;
  }
}

// defer_lookup: the embedding's last micro-batch's lookup rows and tokens,
// kept until the step.
void PipelineExecutor::keep_lookup_tail(const model::Transformer& m) {
  std::memcpy(tail_rows_.data(), m.embedding_output_grad(), tail_rows_.size());
  std::memcpy(tail_tokens_.data(), inputs_.data(), tail_tokens_.size());
}

// defer_lookup: every data rank's last lookup rows, added into the reduced
// token (and position) table in rank order, as DataParallel adds them at
// pp = 1; a tied head elsewhere gets the gathered rows and adds them the
// same way into its copy.
void PipelineExecutor::add_lookup_tail() {
  if (!setup_.defer_lookup || rows_all_.size() == 0) return;
  const int64_t C = config_.n_embd, T = setup_.T, B = setup_.micro * setup_.dp;
  const auto count = static_cast<size_t>(B * T);
  const model::TensorSpec* pos = layout_.position_embedding();
  float* wpe = nullptr;
  float* wte = nullptr;
  if (rank_ == emb_rank_) {
    float* g = chunk_of_stage(0).grads.f32();
    wte = g + layout_.token_embedding().offset;
    wpe = pos != nullptr ? g + pos->offset : nullptr;
    setup_.data->all_gather(tail_tokens_.data(), tokens_all_.data(), count / static_cast<size_t>(setup_.dp),
                            DType::kI32);
    setup_.data->all_gather(tail_rows_.data(), rows_all_.data(), tail_rows_.size() / sizeof(float),
                            DType::kF32);
    if (emb_rank_ != head_rank_ && layout_.tied()) {
      setup_.pipe->send(tokens_all_.data(), count, DType::kI32, head_rank_, kPairTag + 6);
      setup_.pipe->send(rows_all_.data(), count * static_cast<size_t>(C), DType::kF32, head_rank_,
                        kPairTag + 7);
    }
  } else {  // the tied head's replica of the table
    for (auto& c : chunks_)
      if (c->replica()) wte = c->rep_grads.f32() + layout_.token_embedding().offset;
    setup_.pipe->recv(tokens_all_.data(), count, DType::kI32, emb_rank_, kPairTag + 6);
    setup_.pipe->recv(rows_all_.data(), count * static_cast<size_t>(C), DType::kF32, emb_rank_,
                      kPairTag + 7);
  }
  PO_ASSERT(wte != nullptr, "pipeline rank ", rank_, ": deferred lookup rows without a table");
  ops::embedding_backward_slice(wte, wpe, rows_all_.f32(), static_cast<const int32_t*>(tokens_all_.data()), B,
                                T, C, layout_.vocab_begin(), layout_.vocab_real());
}

double PipelineExecutor::step(double lr) {
  // Vocabulary parallel: the pieces' rows of the head's gradient to its owner.
  vocab_gather_grads();
  // The tied table's two parts: fp32 adds them on each data rank before the
  // data group's sum, as the one-stage model adds E before its reduction;
  // bf16 sums each part over the replicas first, then the pair (so both
  // copies add the same reduced H and E).
  if (!bf16_) sum_tied_pair();
  if (setup_.data != nullptr) {
    for (auto& c : chunks_) {
      allreduce_grads(c->grads.data(), c->first, c->last);
      if (bf16_ && c->lookup.size() > 0)
        setup_.data->allreduce(c->lookup.data(), c->lookup.size() / sizeof(float), DType::kF32,
                               comm::ReduceOp::kSum);
      if (c->replica()) allreduce_grads(c->rep_grads.data(), 0, 0);
    }
  }
  if (bf16_) sum_tied_pair();
  add_lookup_tail();
  // The norm: per unit, over the tensor group, then over the stages.
  std::vector<std::pair<int64_t, int64_t>> uncounted;
  if (setup_.tensor != nullptr && setup_.tensor->rank() > 0) {
    uncounted = layout_.replicated_ranges();
    std::sort(uncounted.begin(), uncounted.end());
  }
  std::vector<double> sq(static_cast<size_t>(layout_.num_units()), 0.0);
  for (auto& c : chunks_)
    for (int u = c->first; u <= c->last; ++u) {
      SumOfSquares acc;
      const int64_t at = layout_.unit_offset(u) - c->base;
      if (bf16_)
        add_counted_flat(acc, layout_.unit_offset(u), static_cast<const uint16_t*>(c->grads.data()) + at,
                         layout_.unit_numel(u), uncounted);
      else
        add_counted_flat(acc, layout_.unit_offset(u), c->grads.f32() + at, layout_.unit_numel(u),
                         uncounted);
      sq[static_cast<size_t>(u)] = acc.total();
    }
  sum_units_over(sq, setup_.tensor);
  sum_units_over(sq, setup_.pipe);  // each unit's owner's value, the others' 0
  const double norm = std::sqrt(sum_in_unit_order(sq));
  const double clip = chunks_.front()->adam->clip_scale(norm);
  for (auto& c : chunks_) {
    update(*c, false, lr, clip);
    if (c->replica()) update(*c, true, lr, clip);
  }
  vocab_refresh();
  return norm;
}

// One AdamW step of a chunk's units (or of its replica of unit 0) from the
// full reduced gradient, which starts the next step at zero. ZeRO-1: this
// rank's shard of it is copied out, the shard of the parameters updated, and
// the updated shards all-gathered unit by unit.
void PipelineExecutor::update(Chunk& c, bool replica, double lr, double clip) {
  const ShardLayout& sl = replica ? *c.rep_shard : *c.shard;
  optim::AdamW& adam = replica ? *c.rep_adam : *c.adam;
  tensor::Storage& params = replica ? c.rep_params : c.params;
  tensor::Storage& grads = replica ? c.rep_grads : c.grads;
  if (bf16_) {
    // The fp32 master (this rank's shard) takes the update from the bf16
    // gradient, rounded into the stored parameters; ZeRO-1 gathers those.
    auto* p16 = static_cast<uint16_t*>(params.data());
    adam.apply_mixed((replica ? c.rep_master : c.master).f32(), static_cast<const uint16_t*>(grads.data()),
                     false, p16, lr, clip);
    int64_t at = 0;
    for (int i = 0; sl.ranks() > 1 && i < sl.num_units(); at += sl.unit_numel(i), ++i)
      gather_unit(sl, i, p16 + at + sl.begin(i), p16 + at, DType::kBF16);
  } else if (sl.ranks() == 1) {
    adam.apply(params.f32(), grads.f32(), lr, clip);
  } else {
    float* shard = replica ? c.rep_grad_shard.f32() : c.grad_shard.f32();
    int64_t at = 0;  // unit i's first element in the buffers
    for (int i = 0; i < sl.num_units(); at += sl.unit_numel(i), ++i)
      std::memcpy(shard + sl.local_offset(i), grads.f32() + at + sl.begin(i),
                  static_cast<size_t>(sl.owned(i)) * sizeof(float));
    adam.apply(params.f32(), shard, lr, clip);
    at = 0;
    for (int i = 0; i < sl.num_units(); at += sl.unit_numel(i), ++i)
      gather_unit(sl, i, params.f32() + at + sl.begin(i), params.f32() + at, DType::kF32);
  }
  std::memset(grads.data(), 0, grads.size());
}

double PipelineExecutor::evaluate(const int32_t* inputs, const int32_t* targets) {
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
      link_->recv(x.data(), message_shape(), r.peer, pipeline::message_tag(r));
    }
    model::Transformer& m = acquire_slot(c, -2);
    if (vocab_ && st == S - 1) m.set_external_head(false);  // the owner has the whole table
    const double sum = m.stage_forward(st == 0 ? inputs : nullptr, st == 0 ? nullptr : x.data(),
                                       st == S - 1 ? targets : nullptr, 0.0f);
    if (vocab_ && st == S - 1) m.set_external_head(true);
    if (st == S - 1) loss = static_cast<float>(sum / static_cast<double>(setup_.micro * setup_.T));
    else std::memcpy(x.data(), m.stage_output(), msg * sizeof(float));
    release_slot(c, -2);
    have = true;
    if (st + 1 < S && s.rank_of(st + 1) != rank_) {
      Action snd{Op::kSend, 0, st + 1, s.rank_of(st + 1), Payload::kActivation};
      link_->send(x.data(), message_shape(), snd.peer, pipeline::message_tag(snd));
      link_->wait_sends();
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

std::vector<size_t> PipelineExecutor::slot_bytes() const {
  std::vector<size_t> out;
  for (const auto& c : chunks_)
    out.push_back(c->slots.empty() ? 0 : c->slots.front()->activation_bytes());
  return out;
}

// Every AdamW of this rank (the chunks' and the tied replicas'), with the
// name of its swap file's suffix.
std::vector<std::pair<optim::AdamW*, std::string>> PipelineExecutor::adams() const {
  std::vector<std::pair<optim::AdamW*, std::string>> out;
  for (const auto& c : chunks_) {
    out.emplace_back(c->adam.get(), core::str_cat("-stage", c->stage));
    if (c->rep_adam) out.emplace_back(c->rep_adam.get(), core::str_cat("-stage", c->stage, "-replica"));
  }
  return out;
}

std::vector<int64_t> PipelineExecutor::adam_numels(const model::TransformerConfig& config,
                                                   const PipelineSetup& setup, int rank) {
  const model::Layout layout(config.resolved(), setup.split);
  const pipeline::Schedule& s = setup.schedule;
  const int head = layout.head_unit();
  const int zr = setup.zero_stage == 1 ? setup.dp : 1;
  std::vector<int64_t> out;
  for (int stage : s.stages_of(rank)) {
    const model::UnitRange r = setup.stage_units[static_cast<size_t>(stage)];
    const int first = r.first, last = r.last < 0 ? head : r.last;
    out.push_back(ShardLayout(unit_sizes(layout, first, last), zr, 0).local_numel());
    if (layout.tied() && last == head && first > 0 && s.rank_of(0) != rank)
      out.push_back(ShardLayout(unit_sizes(layout, 0, 0), zr, 0).local_numel());
  }
  return out;
}

std::pair<size_t, size_t> PipelineExecutor::paging_pages(const model::TransformerConfig& config,
                                                         const PipelineSetup& setup, int rank,
                                                         size_t page_bytes, int prefetch) {
  size_t pages = 0, least = 0;
  for (int64_t n : adam_numels(config, setup, rank)) {
    const auto g = optim::PagedAdamState::geometry(n, page_bytes, {.master = setup.bf16});
    pages += g.pages();
    least += optim::PagedAdamState::min_compute_frames(g, prefetch);
  }
  return {pages, least};
}

std::pair<size_t, size_t> PipelineExecutor::paging_pages(size_t page_bytes, int prefetch) const {
  return paging_pages(config_, setup_, rank_, page_bytes, prefetch);
}

void PipelineExecutor::enable_paging(const memory::PagerOptions& options) {
  const auto list = adams();
  std::vector<size_t> pages;
  for (const auto& [a, name] : list)
    pages.push_back(optim::PagedAdamState::geometry(a->num_params(), options.page_bytes, {.master = bf16_}).pages());
  const size_t all = std::accumulate(pages.begin(), pages.end(), size_t{0});
  const std::vector<size_t> compute = memory::split_frames(
      options.compute_frames == 0 ? all : options.compute_frames, pages,
      memory::Pager::min_compute_frames(options.prefetch));
  const std::vector<size_t> host = memory::split_frames(options.host_frames, pages, 0);
  for (size_t k = 0; k < list.size(); ++k) {
    memory::PagerOptions o = options;
    o.compute_frames = compute[k];
    o.host_frames = host[k];
    const std::string& name = list[k].second;
    const auto dot = o.file_name.rfind('.');
    o.file_name = dot == std::string::npos ? o.file_name + name
                                           : o.file_name.substr(0, dot) + name + o.file_name.substr(dot);
    list[k].first->enable_paging(o, {.master = bf16_});
  }
  for (auto& c : chunks_) {  // bf16: the master is in the pages now
    c->master = tensor::Storage();
    c->rep_master = tensor::Storage();
  }
}

memory::PagerStats PipelineExecutor::take_paging_stats() {
  memory::PagerStats sum;
  for (const auto& [a, name] : adams()) {
    if (a->paged()) sum.add(a->paged_state()->take_stats());
  }
  return sum;
}

PipelineExecutor::Memory PipelineExecutor::memory() const {
  Memory m;
  for (const auto& c : chunks_) {
    m.params += c->params.size() + c->rep_params.size();
    m.grads += c->grads.size() + c->rep_grads.size() + c->lookup.size() + c->grad_shard.size() +
               c->rep_grad_shard.size();
    m.master += c->master.size() + c->rep_master.size();
    for (const auto& s : c->slots) m.activations += s->activation_bytes();
    m.w_queue += c->work_bytes;
  }
  for (const auto& [a, name] : adams()) {
    m.adam += a->state_bytes();
    if (a->paged()) m.pages += a->paged_state()->compute_frames() * a->paged_state()->page_bytes();
  }
  m.buffers = buffers_.size() * static_cast<size_t>(rows_ * config_.n_embd) * sizeof(float) +
              gather_.size() + widen_[0].size() + widen_[1].size() + acc_[0].size() + acc_[1].size() +
              staging_.size() + tail_rows_.size() + tail_tokens_.size() + rows_all_.size() +
              tokens_all_.size();
  for (const auto& b : acc_pool_) m.w_queue += b.size();
  if (vocab_) {
    m.buffers += vocab_->scratch.size();
    m.params += vocab_->w_copy.size();
    m.grads += vocab_->dw_own.size();
    m.activations += vocab_->held.size() * vocab_held_bytes(config_, setup_, rank_);
  }
  return m;
}

PipelineExecutor::Memory PipelineExecutor::predict(const model::TransformerConfig& config,
                                                   const PipelineSetup& setup, int rank) {
  const model::TransformerConfig c = config.resolved();
  const model::Layout layout(c, setup.split);
  const pipeline::Schedule& s = setup.schedule;
  const int S = s.stages(), head = layout.head_unit();
  const int64_t tp = setup.split.size;
  const int64_t sp = c.sequence_parallel && tp > 1 ? tp : 1;
  const auto f = sizeof(float);
  Memory m;
  const std::vector<int> stages = s.stages_of(rank);
  const bool emb_here = s.rank_of(0) == rank;
  // Per chunk: the most slots and deferred works held at once, replayed.
  std::map<int, int> held, slots, queued, works;
  int64_t live = 0, peak = 0, posted = 0;
  int64_t acc_live = 0, acc_peak = 0;  // bf16: deferred blocks' accumulators
  int64_t vocab_live = 0, vocab_peak = 0;  // vocabulary parallel: micro-batches from S to T
  const int head_rank = s.rank_of(S - 1);
  auto blocks_of = [&](int stage) {
    const model::UnitRange r = setup.stage_units[static_cast<size_t>(stage)];
    const int first = r.first, last = r.last < 0 ? head : r.last;
    return static_cast<int64_t>(std::min(last, head - 1) - (std::max(first, 1) - 1));
  };
  size_t next = 0;
  std::set<Key> posted_keys, local;
  const auto& list = s.actions[static_cast<size_t>(rank)];
  auto post_one = [&] {
    const Action& a = list[next++];
    if (a.op != Op::kRecv) return;
    posted_keys.insert({a.micro, a.stage, static_cast<int>(a.payload)});
    ++posted;
    peak = std::max(peak, ++live);
  };
  auto window = [&] {
    while (posted < static_cast<int64_t>(kRecvWindow) && next < list.size()) post_one();
  };
  auto consume = [&](const Key& k) {  // incoming(): a local hand-off or a posted receive
    if (local.erase(k) > 0) return;
    while (posted_keys.count(k) == 0) post_one();
    posted_keys.erase(k);
    --posted;
  };
  if (s.ranks > 1) window();
  for (const Action& a : list) {
    if (a.op == Op::kRecv) continue;
    if (a.op == Op::kSend) {
      local.erase({a.micro, a.stage, static_cast<int>(a.payload)});
      continue;
    }
    const bool first = a.stage == 0, last = a.stage == S - 1;
    const int p = s.ranks;
    auto node_key = [&](const std::pair<int, int>& node) {
      return Key{a.micro, S + 1 + 2 * p + node.first, static_cast<int>(Payload::kHeadGrad)};
    };
    if (a.op == Op::kHeadStats) {  // vocab_stats' buffers, in its order
      if (rank != head_rank) consume({a.micro, S + 1 + rank, static_cast<int>(Payload::kHeadInput)});
      vocab_peak = std::max(vocab_peak, ++vocab_live);
      peak = std::max(peak, ++live);  // one buffer for every rank
      local.insert({a.micro, S + 1 + p + rank, static_cast<int>(Payload::kHeadStats)});
    } else if (a.op == Op::kHeadGrad) {  // vocab_grad's
      for (int q = 0; q < p; ++q)
        if (q != rank) {
          consume({a.micro, S + 1 + p + q, static_cast<int>(Payload::kHeadStats)});
          --live;
        }
      for (const auto& node : s.grad_nodes(rank)) {
        peak = std::max(peak, ++live);
        local.insert(node_key(node));
      }
      if (rank != head_rank) --live;
      --vocab_live;
    } else if (a.op == Op::kForward) {
      if (!first) consume({a.micro, a.stage, static_cast<int>(Payload::kActivation)});
      slots[a.stage] = std::max(slots[a.stage], ++held[a.stage]);
      if (!first) --live;
      if (last && s.vocab)  // vocab_forward_done
        for (int q = 0; q < p; ++q)
          if (q != rank) {
            peak = std::max(peak, ++live);
            local.insert({a.micro, S + 1 + q, static_cast<int>(Payload::kHeadInput)});
          }
      if (!last) {
        peak = std::max(peak, ++live);
        local.insert({a.micro, a.stage + 1, static_cast<int>(Payload::kActivation)});
      }
    } else if (a.op == Op::kBackward || a.op == Op::kBackwardInput) {
      if (!last) consume({a.micro, a.stage, static_cast<int>(Payload::kGradient)});
      if (last && s.vocab) {  // vocab_input_grad
        int parts = 0;
        for (int q = 0; q < p; ++q)
          for (const auto& node : s.grad_nodes(q)) {
            consume(node_key(node));
            ++parts;
          }
        peak = std::max(peak, ++live);
        live -= parts;
      }
      if (a.op == Op::kBackwardInput) {
        works[a.stage] = std::max(works[a.stage], ++queued[a.stage]);
        acc_peak = std::max(acc_peak, acc_live += blocks_of(a.stage));
      }
      if (!last || s.vocab) --live;
      if (!first) {
        peak = std::max(peak, ++live);
        local.insert({a.micro, a.stage - 1, static_cast<int>(Payload::kGradient)});
      }
      --held[a.stage];
    } else if (a.op == Op::kBackwardWeight) {
      --queued[a.stage];
      acc_live -= blocks_of(a.stage);
    }
    if (s.ranks > 1) window();
  }
  m.buffers = static_cast<size_t>(peak * setup.micro * setup.T / sp * c.n_embd) * f;
  const size_t work = model::Transformer::predicted_weight_grad_work_bytes(c, setup.micro, setup.T, tp);
  // Adam (bf16: and the master) over the ZeRO-1 shard, padded; fp32 ZeRO-1
  // also copies out the reduced gradient's shard, and gathers through a send
  // block + ranks receive blocks of the largest unit's stride. bf16 stores
  // parameters and gradients in 2 bytes, widens and accumulates in buffers
  // of unit 0 and of the largest other unit, and stages a unit's f32 sum.
  const int zr = setup.zero_stage == 1 ? setup.dp : 1;
  const size_t esz = setup.bf16 ? 2 : 4;
  int64_t n0_used = 0, other = 0, largest = 0;  // largest: of the units held, a replica's included
  for (int stage : stages) {
    const model::UnitRange r = setup.stage_units[static_cast<size_t>(stage)];
    const int first = r.first, last = r.last < 0 ? head : r.last;
    const auto n = static_cast<size_t>(layout.unit_offset(last + 1) - layout.unit_offset(first));
    for (int u = first; u <= last; ++u) {
      (u == 0 ? n0_used : other) = std::max(u == 0 ? n0_used : other, layout.unit_numel(u));
      largest = std::max(largest, layout.unit_numel(u));
    }
    if (layout.tied() && last == head && first > 0) n0_used = layout.unit_numel(0);
    m.params += n * esz;
    m.grads += n * esz;
    if (layout.tied() && first == 0) m.grads += static_cast<size_t>(layout.token_embedding().numel()) * f;
    if (layout.tied() && last == head && first > 0 && !emb_here) {
      const auto n0 = static_cast<size_t>(layout.unit_numel(0));
      m.params += n0 * esz;
      m.grads += n0 * esz;
      largest = std::max(largest, layout.unit_numel(0));
    }
    // (vocabulary parallel: the last stage's first slot alone has logits)
    const bool spread = s.vocab && last == head;
    const size_t with_logits =
        model::Transformer::predicted_stage_activation_bytes(c, setup.micro, setup.T, tp, {first, last});
    const size_t without = spread ? model::Transformer::predicted_stage_activation_bytes(
                                        c, setup.micro, setup.T, tp, {first, last}, false)
                                  : with_logits;
    if (slots[stage] > 0)
      m.activations += with_logits + static_cast<size_t>(slots[stage] - 1) * without;
    m.w_queue += static_cast<size_t>(works[stage] * blocks_of(stage)) * work;
  }
  for (int64_t n : adam_numels(config, setup, rank)) {
    m.adam += 2 * static_cast<size_t>(n) * f;
    if (setup.bf16) m.master += static_cast<size_t>(n) * f;
    if (zr > 1 && !setup.bf16) m.grads += static_cast<size_t>(n) * f;
  }
  if (zr > 1) m.buffers += static_cast<size_t>((largest + zr - 1) / zr * (1 + zr)) * f;
  if (setup.bf16) {
    m.buffers += static_cast<size_t>(2 * (n0_used + other)) * f;
    if (setup.dp > 1 && !setup.reduce_bf16) m.buffers += static_cast<size_t>(largest) * f;
    m.w_queue += static_cast<size_t>(acc_peak * layout.unit_numel(1)) * f;
  }
  for (const bool all : {false, true})  // defer_lookup's rows and tokens
    m.buffers += static_cast<size_t>(lookup_tail_rows(setup, layout, rank, all) * (c.n_embd + 1)) * f;
  if (s.vocab) {
    const model::vocab::Pieces pieces = model::vocab::pieces_of(c.vocab_size);
    const auto [k0, k1] = s.pieces_of(rank, pieces.count());
    const auto rows = static_cast<size_t>((pieces.begin(k1) - pieces.begin(k0)) * c.n_embd) * f;
    const auto [copy, own] = vocab_copies(layout, setup, rank);
    if (copy) m.params += rows;
    if (own) m.grads += rows;
    m.buffers += static_cast<size_t>(model::vocab::tree_height(pieces.count()) *
                                     model::Transformer::head_chunk_rows(setup.micro, setup.T) *
                                     c.n_embd) * f;
    m.activations += static_cast<size_t>(vocab_peak) * vocab_held_bytes(config, setup, rank);
  }
  return m;
}

}  // namespace po::parallel

// ---- Vocabulary parallel: the head's pieces on every rank (pipeline_executor.h) ----

namespace po::parallel {

namespace {
constexpr int kVocabGradTag = 32710, kVocabRowsTag = 32711;
}

// Whether pipeline rank `rank` keeps a copy of its pieces' rows (neither
// the owner nor, tied, the embedding's rank, which reads its own table),
// and whether it keeps its own rows' gradient (every rank but the owner).
std::pair<bool, bool> PipelineExecutor::vocab_copies(const model::Layout& layout,
                                                     const PipelineSetup& setup, int rank) {
  const pipeline::Schedule& s = setup.schedule;
  if (!s.vocab) return {false, false};
  const int head = s.rank_of(s.stages() - 1);
  if (rank == head) return {false, false};
  return {!(layout.tied() && rank == s.rank_of(0)), true};
}

size_t PipelineExecutor::vocab_held_bytes(const model::TransformerConfig& config,
                                          const PipelineSetup& setup, int rank) {
  const pipeline::Schedule& s = setup.schedule;
  const model::vocab::Pieces p = model::vocab::pieces_of(config.resolved().vocab_size);
  const auto [k0, k1] = s.pieces_of(rank, p.count());
  const int64_t rows = setup.micro * setup.T, vr = p.begin(k1) - p.begin(k0);
  // logits, targets, and per row and piece mx, sum, scale (4 + 8 + 4) and zt
  return static_cast<size_t>(rows * vr) * sizeof(float) + static_cast<size_t>(rows) * sizeof(int32_t) +
         static_cast<size_t>(rows * (16 * p.count() + 4));
}

void PipelineExecutor::vocab_setup() {
  const pipeline::Schedule& s = setup_.schedule;
  if (!s.vocab) return;
  PO_CHECK(!bf16_ && setup_.split.size == 1, "pipeline: the head spread over the ranks ",
           "(parallel.vocab_parallel) needs train.precision = \"fp32\" and parallel.tp = 1");
  auto v = std::make_unique<VocabPart>();
  const int64_t C = config_.n_embd;
  v->pieces = model::vocab::pieces_of(config_.vocab_size);
  std::tie(v->k0, v->k1) = s.pieces_of(rank_, v->pieces.count());
  v->row0 = v->pieces.begin(v->k0);
  v->rows = v->pieces.begin(v->k1) - v->row0;
  PO_CHECK(v->pieces.count() == model::vocab::kPieces, "pipeline: parallel.vocab_parallel needs ",
           "a vocabulary of at least ", model::vocab::kPieces, " tokens (model.vocab_size = ",
           config_.vocab_size, ")");
  const int64_t chunk = model::Transformer::head_chunk_rows(setup_.micro, setup_.T);
  v->scratch = zeroed(model::vocab::tree_height(v->pieces.count()) * chunk * C);
  PO_CHECK(3 * (v->k1 - v->k0) + 1 <= C, "pipeline: parallel.vocab_parallel sends ",
           3 * (v->k1 - v->k0) + 1, " statistics per row in a message of model.n_embd = ", C,
           " floats; use fewer pipeline ranks or a wider model");
  const int64_t head_off = layout_.head().offset;
  if (rank_ == head_rank_) {
    Chunk& c = chunk_of_stage(s.stages() - 1);
    v->table = layout_.tied() ? static_cast<float*>(c.unit0_params) + head_off
                              : c.params.f32() + (head_off - c.base);
    v->table_grad = layout_.tied() ? static_cast<float*>(c.unit0_grads) + head_off
                                   : c.grads.f32() + (head_off - c.base);
    v->w = v->table + v->row0 * C;
    v->dw = v->table_grad + v->row0 * C;
  } else {
    const auto [copy, own] = vocab_copies(layout_, setup_, rank_);
    if (copy) {
      v->w_copy = zeroed(v->rows * C);
      v->w = v->w_copy.f32();
    } else {  // the embedding's table, updated as the owner's is
      v->w = static_cast<float*>(stored_unit(0)) + head_off + v->row0 * C;
    }
    if (own) {
      v->dw_own = zeroed(v->rows * C);
      v->dw = v->dw_own.f32();
    }
  }
  vocab_ = std::move(v);
}

// A copy's rows from the initialiser: the head weight's values (tied: the
// token table's, unit 0).
void PipelineExecutor::vocab_init(uint64_t seed) {
  if (!vocab_ || vocab_->w_copy.size() == 0) return;
  model::Transformer init(config_.weights_only(), 1, 1, model::UnitRange{0, 0}, setup_.split);
  const int u = layout_.tied() ? 0 : layout_.head_unit();
  std::vector<float> unit(static_cast<size_t>(layout_.unit_numel(u)));
  init.init_random_unit(seed, u, unit.data());
  const int64_t C = config_.n_embd;
  std::memcpy(vocab_->w_copy.data(),
              unit.data() + (layout_.head().offset - layout_.unit_offset(u)) + vocab_->row0 * C,
              vocab_->w_copy.size());
}

// The last stage's forward is done: its final norm's output to every other rank.
void PipelineExecutor::vocab_forward_done(model::Transformer& m, int micro) {
  const pipeline::Schedule& s = setup_.schedule;
  const size_t msg = static_cast<size_t>(rows_ * config_.n_embd) * sizeof(float);
  for (int q = 0; q < s.ranks; ++q) {
    if (q == rank_) continue;
    float* out = take_buffer();
    std::memcpy(out, m.stage_output(), msg);
    ready_[{micro, s.stages() + 1 + q, static_cast<int>(Payload::kHeadInput)}] = out;
  }
}

// S: this rank's pieces' logits and statistics for one micro-batch, chunk by
// chunk of rows as one stage runs them; the statistics to every other rank.
void PipelineExecutor::vocab_stats(const Action& a, const BatchFn& batch) {
  const pipeline::Schedule& s = setup_.schedule;
  VocabPart& v = *vocab_;
  const int S = s.stages(), P = v.pieces.count();
  const int64_t C = config_.n_embd, chunk = model::Transformer::head_chunk_rows(setup_.micro, setup_.T);
  const float* x = nullptr;
  bool from_buffer = false;
  if (rank_ == head_rank_) {
    Chunk& c = chunk_of_stage(S - 1);
    for (size_t i = 0; i < c.slots.size(); ++i)
      if (c.slot_micro[i] == a.micro) x = c.slots[i]->stage_output();
    PO_ASSERT(x != nullptr, "pipeline: ", pipeline::describe(a), " before the last stage's forward");
  } else {
    x = incoming_key(a, {a.micro, S + 1 + rank_, static_cast<int>(Payload::kHeadInput)});
    from_buffer = true;
  }
  const int64_t t0 = now_ns();
  VocabPart::Held& h = v.take(a.micro, rows_, chunk, P);
  h.x = x;
  h.x_buffer = from_buffer;
  batch(a.micro, inputs_.data(), h.targets.data());
  float* logits = h.logits.f32();
  for (int64_t r0 = 0, ci = 0; r0 < rows_; r0 += chunk, ++ci) {
    const int64_t n = std::min(chunk, rows_ - r0);
    for (int k = v.k0; k < v.k1; ++k)
      model::vocab::piece_forward(v.pieces, k, ops::Operand(x + r0 * C), ops::Operand(v.w),
                                  h.targets.data() + r0, n, C,
                                  logits + r0 * v.rows + n * (v.pieces.begin(k) - v.row0),
                                  h.stats[static_cast<size_t>(ci)], true, v.row0);
  }
  // Packed per chunk: the pieces' maxima, sums (doubles) and the targets'
  // logits; one buffer sent to every other rank.
  {
    float* out = take_buffer();
    float* at = out;
    for (int64_t r0 = 0, ci = 0; r0 < rows_; r0 += chunk, ++ci) {
      const int64_t n = std::min(chunk, rows_ - r0);
      const model::vocab::Stats& st = h.stats[static_cast<size_t>(ci)];
      const auto mine = static_cast<size_t>((v.k1 - v.k0) * n);
      std::memcpy(at, st.mx.data() + v.k0 * n, mine * sizeof(float));
      at += mine;
      std::memcpy(at, st.sum.data() + v.k0 * n, mine * sizeof(double));
      at += 2 * mine;
      std::memcpy(at, st.zt.data(), static_cast<size_t>(n) * sizeof(float));
      at += n;
    }
    const Key key{a.micro, S + 1 + s.ranks + rank_, static_cast<int>(Payload::kHeadStats)};
    ready_[key] = out;
    fanout_[key] = s.ranks - 1;
  }
  spans_.push_back({a, false, t0 - step_start_ns_, now_ns() - step_start_ns_});
}

// T: every rank's statistics, the rows' losses, this rank's pieces' logit
// and weight gradients, and the head's input gradient continued from the
// previous holder (to the next one, or on the last stage's rank to its backward).
void PipelineExecutor::vocab_grad(const Action& a, float grad_scale, PipelineStepStats& stats) {
  const pipeline::Schedule& s = setup_.schedule;
  VocabPart& v = *vocab_;
  const int S = s.stages(), P = v.pieces.count();
  const int64_t C = config_.n_embd, chunk = model::Transformer::head_chunk_rows(setup_.micro, setup_.T);
  VocabPart::Held& h = v.find(a.micro);
  for (int q = 0; q < s.ranks; ++q) {
    if (q == rank_) continue;
    float* in = incoming_key(a, {a.micro, S + 1 + s.ranks + q, static_cast<int>(Payload::kHeadStats)});
    const auto [q0, q1] = s.pieces_of(q, P);
    const float* at = in;
    for (int64_t r0 = 0, ci = 0; r0 < rows_; r0 += chunk, ++ci) {
      const int64_t n = std::min(chunk, rows_ - r0);
      model::vocab::Stats& st = h.stats[static_cast<size_t>(ci)];
      const auto theirs = static_cast<size_t>((q1 - q0) * n);
      std::memcpy(st.mx.data() + q0 * n, at, theirs * sizeof(float));
      at += theirs;
      std::memcpy(st.sum.data() + q0 * n, at, theirs * sizeof(double));
      at += 2 * theirs;
      const int64_t lo = v.pieces.begin(q0), hi = v.pieces.begin(q1);
      for (int64_t r = 0; r < n; ++r) {
        const int64_t t = h.targets[static_cast<size_t>(r0 + r)];
        if (t >= lo && t < hi) st.zt[static_cast<size_t>(r)] = at[r];
      }
      at += n;
    }
    give_buffer(in);
  }
  const int64_t t0 = now_ns();
  std::vector<float> losses(static_cast<size_t>(chunk));
  double loss_sum = 0;
  float* logits = h.logits.f32();
  for (int64_t r0 = 0, ci = 0; r0 < rows_; r0 += chunk, ++ci) {
    const int64_t n = std::min(chunk, rows_ - r0);
    model::vocab::combine(P, n, losses.data(), h.stats[static_cast<size_t>(ci)], grad_scale);
    for (int64_t r = 0; r < n; ++r) loss_sum += losses[static_cast<size_t>(r)];
  }
  if (rank_ == head_rank_)
    stats.loss_sum += static_cast<float>(loss_sum / static_cast<double>(setup_.micro * setup_.T));
  // The input gradient's tree nodes of this rank's pieces (their leaves
  // also add the pieces' weight gradients), for the last stage's backward.
  const std::vector<float*> scratch = v.scratch_at(chunk, C);
  for (const auto& [lo, hi] : s.grad_nodes(rank_)) {
    float* node = take_buffer();
    for (int64_t r0 = 0, ci = 0; r0 < rows_; r0 += chunk, ++ci) {
      const int64_t n = std::min(chunk, rows_ - r0);
      const model::vocab::Stats& st = h.stats[static_cast<size_t>(ci)];
      model::vocab::tree_sum(
          lo, hi, node + r0 * C, n, C,
          [&](int k, float* dst) {
            model::vocab::piece_backward(v.pieces, k, logits + r0 * v.rows + n * (v.pieces.begin(k) - v.row0),
                                         nullptr, st, h.targets.data() + r0,
                                         ops::Operand(h.x + r0 * C), ops::Operand(v.w), v.dw, dst,
                                         false, n, C, grad_scale, v.row0);
          },
          {}, scratch.data());
    }
    ready_[{a.micro, S + 1 + 2 * s.ranks + lo, static_cast<int>(Payload::kHeadGrad)}] = node;
  }
  if (h.x_buffer) give_buffer(const_cast<float*>(h.x));
  h.micro = -1;
  spans_.push_back({a, false, t0 - step_start_ns_, now_ns() - step_start_ns_});
}

// The last stage's backward of a micro-batch: the head's input gradient,
// every rank's tree nodes (received, or this rank's own) added up in the
// tree as one stage adds its pieces' parts.
float* PipelineExecutor::vocab_input_grad(const Action& a) {
  const pipeline::Schedule& s = setup_.schedule;
  VocabPart& v = *vocab_;
  const int S = s.stages(), P = v.pieces.count();
  const int64_t C = config_.n_embd, chunk = model::Transformer::head_chunk_rows(setup_.micro, setup_.T);
  std::map<std::pair<int, int>, float*> parts;
  for (int q = 0; q < s.ranks; ++q)
    for (const auto& node : s.grad_nodes(q))
      parts[node] = incoming_key(a, {a.micro, S + 1 + 2 * s.ranks + node.first,
                                     static_cast<int>(Payload::kHeadGrad)});
  float* d = take_buffer();
  const std::vector<float*> scratch = v.scratch_at(chunk, C);
  for (int64_t r0 = 0; r0 < rows_; r0 += chunk) {
    const int64_t n = std::min(chunk, rows_ - r0);
    model::vocab::tree_sum(
        0, P, d + r0 * C, n, C,
        [&](int k, float*) { PO_THROW(core::Internal, "pipeline: no rank sent piece ", k, "'s part"); },
        [&](int lo, int hi) -> const float* {
          const auto it = parts.find({lo, hi});
          return it == parts.end() ? nullptr : it->second + r0 * C;
        },
        scratch.data());
  }
  for (const auto& [node, buffer] : parts) give_buffer(buffer);
  return d;
}

// Before the update: every other rank's rows of the head weight's gradient
// into the owner's (the head's rank), in place of the zeros there.
void PipelineExecutor::vocab_gather_grads() {
  if (!vocab_) return;
  const pipeline::Schedule& s = setup_.schedule;
  VocabPart& v = *vocab_;
  const int64_t C = config_.n_embd;
  if (rank_ != head_rank_) {
    setup_.pipe->send(v.dw, static_cast<size_t>(v.rows * C), DType::kF32, head_rank_, kVocabGradTag);
    std::memset(v.dw, 0, static_cast<size_t>(v.rows * C) * sizeof(float));
    return;
  }
  for (int q : s.holders) {
    if (q == rank_) continue;
    const auto [q0, q1] = s.pieces_of(q, v.pieces.count());
    const int64_t r0 = v.pieces.begin(q0), n = v.pieces.begin(q1) - r0;
    setup_.pipe->recv(v.table_grad + r0 * C, static_cast<size_t>(n * C), DType::kF32, q, kVocabGradTag);
  }
}

// After the update (or a load): the owner's rows to the ranks that copy theirs.
void PipelineExecutor::vocab_refresh() {
  if (!vocab_) return;
  const pipeline::Schedule& s = setup_.schedule;
  VocabPart& v = *vocab_;
  const int64_t C = config_.n_embd;
  if (rank_ == head_rank_) {
    for (int q : s.holders) {
      if (q == rank_ || !vocab_copies(layout_, setup_, q).first) continue;
      const auto [q0, q1] = s.pieces_of(q, v.pieces.count());
      const int64_t r0 = v.pieces.begin(q0), n = v.pieces.begin(q1) - r0;
      setup_.pipe->send(v.table + r0 * C, static_cast<size_t>(n * C), DType::kF32, q, kVocabRowsTag);
    }
  } else if (v.w_copy.size() > 0) {
    setup_.pipe->recv(v.w_copy.data(), static_cast<size_t>(v.rows * C), DType::kF32, head_rank_,
                      kVocabRowsTag);
  }
}

}  // namespace po::parallel
