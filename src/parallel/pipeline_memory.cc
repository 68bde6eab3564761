// The memory a pipeline rank holds and pages, and what it will hold from the
// configuration and the schedule alone (pipeline_executor.h: predict, the
// planner's pipeline layouts); a unit's state read and written wherever it
// lives (in memory or pages, sharded or whole: checkpoints).
#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <tuple>

#include <cstring>
#include <vector>

#include "backend/ops.h"
#include "backend/device.h"
#include "core/error.h"
#include "optim/adamw.h"
#include "parallel/quantized_state.h"

#include "parallel/pipeline_executor.h"
#include "parallel/pipeline_executor_state.h"

namespace po::parallel {
namespace ops = po::backend::cpu;
using namespace executor_detail;  // its helpers and names (pipeline_executor_state.h)

namespace {

// One AdamW of a pipeline rank: a chunk's units [first, last], or a tied
// head's replica of the token table (`table`); its local buffers' elements
// at data rank 0 (padding included).
struct AdamUnits {
  int first = 0, last = 0;
  bool table = false;
  int64_t numel = 0;
};

std::vector<AdamUnits> adam_units(const model::Layout& layout, const PipelineSetup& setup, int rank) {
  const pipeline::Schedule& s = setup.schedule;
  const int head = layout.head_unit();
  const int zr = setup.zero_stage >= 1 ? setup.dp : 1;
  const int64_t align = setup.shard_align();
  std::vector<AdamUnits> out;
  for (int stage : s.stages_of(rank)) {
    const model::UnitRange r = setup.stage_units[static_cast<size_t>(stage)];
    const int first = r.first, last = r.last < 0 ? head : r.last;
    out.push_back({first, last, false, ShardLayout(unit_sizes(layout, first, last), zr, 0, align).local_numel()});
    if (layout.tied_trains() && last == head && first > 0 && s.rank_of(0) != rank)
      out.push_back({0, 0, true, ShardLayout(unit_sizes(layout, 0, 0), zr, 0, align).local_numel()});
  }
  return out;
}

// Adam's m and v of one AdamW at data rank 0: 8 bytes per element of the
// padded shard at 32 bits; quantized, what its stores hold (the owned part
// of each tensor, optim::moment_bytes).
size_t adam_bytes(const model::Layout& layout, const PipelineSetup& setup, int zr, const AdamUnits& a) {
  if (setup.adam.state_bits >= 32) return 2 * static_cast<size_t>(a.numel) * sizeof(float);
  const ShardLayout shard(unit_sizes(layout, a.first, a.last), zr, 0, setup.shard_align());
  const int64_t table = layout.token_embedding().offset;
  int64_t bytes = 0;
  for (const optim::ParamRange& r : unit_ranges(layout, a.first, a.last, shard, false, quantized_tensors(layout, setup.adam),
                                                [&](const model::TensorSpec& t) { return !a.table || t.offset == table; }))
    bytes += optim::moment_bytes(setup.adam, r.quantized, r.numel, r.unit_offset);
  return static_cast<size_t>(bytes);
}


// A rank's action list replayed from the schedule alone, with the
// executor's own bookkeeping: per stage the most slots (micro-batches from
// their F to their B) and deferred W works held at once; the most message
// buffers, deferred blocks' accumulators (split backwards) and, with the
// vocabulary-parallel head, micro-batches from their S to their T.
struct ScheduleReplay {
  std::map<int, int> slots, works;
  int64_t buffers = 0, accumulators = 0, vocab = 0;
};

// The blocks (units 1..L) of a stage: a split backward's accumulators and W works.
int64_t stage_blocks(const model::Layout& layout, const PipelineSetup& setup, int stage) {
  const model::UnitRange r = setup.stage_units[static_cast<size_t>(stage)];
  const int head = layout.head_unit(), first = r.first, last = r.last < 0 ? head : r.last;
  return static_cast<int64_t>(std::min(last, head - 1) - (std::max(first, 1) - 1));
}

class ActionReplay {
 public:
  ActionReplay(const model::Layout& layout, const PipelineSetup& setup, int rank)
      : layout_(layout), setup_(setup), s_(setup.schedule), rank_(rank), S_(s_.stages()),
        head_rank_(s_.rank_of(S_ - 1)), list_(s_.actions[static_cast<size_t>(rank)]) {}

  ScheduleReplay run() {
    if (s_.ranks > 1) window();
    for (const Action& a : list_) {
      if (a.op == Op::kHeadStats) head_stats(a);
      else if (a.op == Op::kHeadGrad) head_grad(a);
      else if (a.op == Op::kForward) forward(a);
      else if (a.op == Op::kBackward || a.op == Op::kBackwardInput) backward(a);
      else if (a.op == Op::kBackwardWeight) weight(a);
      else if (a.op == Op::kSend) local_.erase({a.micro, a.stage, static_cast<int>(a.payload)});
      if (a.op != Op::kRecv && a.op != Op::kSend && s_.ranks > 1) window();
    }
    return out_;
  }

 private:
  using MsgKey = std::tuple<int, int, int>;  // (micro, stage, payload), as the executor keys messages

  void take() { out_.buffers = std::max(out_.buffers, ++live_); }  // a message buffer
  void make(const MsgKey& k) {  // a tensor made here for a send or a local consumer
    take();
    local_.insert(k);
  }
  void post_one() {  // the list's next action, posted if it is a receive
    const Action& a = list_[next_++];
    if (a.op != Op::kRecv) return;
    posted_keys_.insert({a.micro, a.stage, static_cast<int>(a.payload)});
    ++posted_;
    take();
  }
  void window() {  // receives posted ahead of their use
    while (posted_ < static_cast<int64_t>(kRecvWindow) && next_ < list_.size()) post_one();
  }
  void consume(const MsgKey& k) {  // incoming(): a local hand-off or a posted receive
    if (local_.erase(k) > 0) return;
    while (posted_keys_.count(k) == 0) post_one();
    posted_keys_.erase(k);
    --posted_;
  }
  MsgKey node_key(const Action& a, const std::pair<int, int>& node) const {
    return {a.micro, S_ + 1 + 2 * s_.ranks + node.first, static_cast<int>(Payload::kHeadGrad)};
  }
  int64_t blocks_of(int stage) const { return stage_blocks(layout_, setup_, stage); }
  void head_stats(const Action& a) {  // vocab_stats' buffers, in its order
    if (rank_ != head_rank_) consume({a.micro, S_ + 1 + rank_, static_cast<int>(Payload::kHeadInput)});
    out_.vocab = std::max(out_.vocab, ++vocab_live_);
    make({a.micro, S_ + 1 + s_.ranks + rank_, static_cast<int>(Payload::kHeadStats)});  // (one for every rank)
  }
  void head_grad(const Action& a) {  // vocab_grad's
    for (int q = 0; q < s_.ranks; ++q)
      if (q != rank_) {
        consume({a.micro, S_ + 1 + s_.ranks + q, static_cast<int>(Payload::kHeadStats)});
        --live_;
      }
    for (const auto& node : s_.grad_nodes(rank_)) make(node_key(a, node));
    if (rank_ != head_rank_) --live_;
    --vocab_live_;
  }
  void forward(const Action& a) {
    const bool first = a.stage == 0, last = a.stage == S_ - 1;
    if (!first) consume({a.micro, a.stage, static_cast<int>(Payload::kActivation)});
    out_.slots[a.stage] = std::max(out_.slots[a.stage], ++held_[a.stage]);
    if (!first) --live_;
    if (last && s_.vocab)  // vocab_forward_done
      for (int q = 0; q < s_.ranks; ++q)
        if (q != rank_) make({a.micro, S_ + 1 + q, static_cast<int>(Payload::kHeadInput)});
    if (!last) make({a.micro, a.stage + 1, static_cast<int>(Payload::kActivation)});
  }
  void backward(const Action& a) {
    const bool first = a.stage == 0, last = a.stage == S_ - 1;
    if (!last) consume({a.micro, a.stage, static_cast<int>(Payload::kGradient)});
    if (last && s_.vocab) {  // vocab_input_grad
      int parts = 0;
      for (int q = 0; q < s_.ranks; ++q)
        for (const auto& node : s_.grad_nodes(q)) {
          consume(node_key(a, node));
          ++parts;
        }
      take();
      live_ -= parts;
    }
    if (a.op == Op::kBackwardInput) {
      out_.works[a.stage] = std::max(out_.works[a.stage], ++queued_[a.stage]);
      out_.accumulators = std::max(out_.accumulators, acc_live_ += blocks_of(a.stage));
    }
    if (!last || s_.vocab) --live_;
    if (!first) make({a.micro, a.stage - 1, static_cast<int>(Payload::kGradient)});
    --held_[a.stage];
  }
  void weight(const Action& a) {
    --queued_[a.stage];
    acc_live_ -= blocks_of(a.stage);
  }

  const model::Layout& layout_;
  const PipelineSetup& setup_;
  const pipeline::Schedule& s_;
  const int rank_, S_, head_rank_;
  const std::vector<Action>& list_;
  size_t next_ = 0;
  int64_t live_ = 0, posted_ = 0, acc_live_ = 0, vocab_live_ = 0;
  std::set<MsgKey> posted_keys_, local_;
  std::map<int, int> held_, queued_;
  ScheduleReplay out_;
};

// The sizes the working buffers follow: the largest unit 0 a rank uses (its
// own, or a tied head's replica), the largest other unit, the largest of
// all (a replica's included).
struct HeldUnits {
  int64_t n0_used = 0, other = 0, largest = 0;
};

// Each stage's parameters, gradients, frozen base, activations (its slots)
// and deferred W works on `rank`, and the tied table's lookup rows.
HeldUnits add_stages(PipelineExecutor::Memory& m, const model::TransformerConfig& c, const model::Layout& layout,
                     const PipelineSetup& setup, int rank, const ScheduleReplay& replay) {
  const pipeline::Schedule& s = setup.schedule;
  const int head = layout.head_unit();
  const int64_t tp = setup.split.size;
  const bool z2 = setup.zero_stage >= 2;
  const int zr = setup.zero_stage >= 1 ? setup.dp : 1;
  const bool z3 = stores_shards(setup);
  const size_t esz = setup.bf16 ? 2 : 4;
  const size_t shards = z3 && setup.paged ? 0 : esz;  // ZeRO-3 paged: the shards are in the pages
  const size_t work = model::Transformer::predicted_weight_grad_work_bytes(c, setup.micro, setup.T, tp);
  auto shard_numel = [&](int first, int last) {
    return static_cast<size_t>(ShardLayout(unit_sizes(layout, first, last), zr, 0, setup.shard_align()).local_numel());
  };
  HeldUnits h;
  for (int stage : s.stages_of(rank)) {
    const model::UnitRange r = setup.stage_units[static_cast<size_t>(stage)];
    const int first = r.first, last = r.last < 0 ? head : r.last;
    const auto n = static_cast<size_t>(layout.unit_offset(last + 1) - layout.unit_offset(first));
    for (int u = first; u <= last; ++u) {
      (u == 0 ? h.n0_used : h.other) = std::max(u == 0 ? h.n0_used : h.other, layout.unit_numel(u));
      h.largest = std::max(h.largest, layout.unit_numel(u));
    }
    if (layout.tied_trains() && last == head && first > 0) h.n0_used = layout.unit_numel(0);
    m.params += z3 ? shard_numel(first, last) * shards : n * esz;
    m.grads += z3 ? shard_numel(first, last) * shards : (z2 ? shard_numel(first, last) : n) * esz;
    m.frozen += model::Transformer::predicted_frozen_bytes(c, {first, last}, setup.split);
    if (layout.adapters()) {  // the frozen model's own buffers (one row: it never runs)
      model::TransformerConfig fc = c.weights_only();
      fc.inference = true;
      m.frozen += model::Transformer::predicted_stage_activation_bytes(fc, 1, 1, setup.split.size, {first, last});
    }
    if (layout.adapters() && layout.tied() && last == head && first > 0)  // the base token table's copy
      m.frozen += static_cast<size_t>(layout.base_unit_numel(0)) * sizeof(float);
    if (layout.tied_trains() && first == 0)  // the step's lookup rows (tied_pair.h)
      m.buffers += LookupRows::predicted_bytes(s.micro_batches * setup.micro * setup.T, c.n_embd, setup.dp);
    if (layout.tied_trains() && last == head && first > 0 && s.rank_of(0) != rank) {  // the replica
      const auto n0 = static_cast<size_t>(layout.unit_numel(0));
      m.params += z3 ? shard_numel(0, 0) * shards : n0 * esz;
      m.grads += z3 ? shard_numel(0, 0) * shards : (z2 ? shard_numel(0, 0) : n0) * esz;
      h.largest = std::max(h.largest, layout.unit_numel(0));
    }
    // (vocabulary parallel: the last stage's first slot alone has logits)
    const bool spread = s.vocab && last == head;
    const size_t with_logits =
        model::Transformer::predicted_stage_activation_bytes(c, setup.micro, setup.T, tp, {first, last});
    const size_t without = spread ? model::Transformer::predicted_stage_activation_bytes(
                                        c, setup.micro, setup.T, tp, {first, last}, false)
                                  : with_logits;
    const int slots = replay.slots.count(stage) > 0 ? replay.slots.at(stage) : 0;
    if (slots > 0) m.activations += with_logits + static_cast<size_t>(slots - 1) * without;
    const int works = replay.works.count(stage) > 0 ? replay.works.at(stage) : 0;
    m.w_queue += static_cast<size_t>(works * stage_blocks(layout, setup, stage)) * work;
  }
  return h;
}

// Adam's moments (bf16: and the fp32 master) over each AdamW's ZeRO 1-2
// shard, padded, unless paged; fp32 ZeRO-1 also copies out the reduced
// gradient's shard.
void add_optimizer(PipelineExecutor::Memory& m, const model::Layout& layout, const PipelineSetup& setup, int rank) {
  const int zr = setup.zero_stage >= 1 ? setup.dp : 1;
  for (const AdamUnits& a : adam_units(layout, setup, rank)) {
    if (!setup.paged) m.adam += adam_bytes(layout, setup, zr, a);
    if (setup.bf16 && !setup.paged) m.master += static_cast<size_t>(a.numel) * sizeof(float);
    if (zr > 1 && !setup.bf16 && setup.zero_stage < 2) m.grads += static_cast<size_t>(a.numel) * sizeof(float);
  }
}

// The working buffers (pipeline_chunks.cc's setup_buffers): the message
// buffers at the replay's peak; ZeRO 1-2's gathers through a send block +
// ranks receive blocks of the largest unit's stride; bf16's widened units
// (unit 0's and the largest other's) and its staged f32 sum; the f32
// accumulators of bf16 and ZeRO 2-3, as many of each kind as its ring holds
// (acc_ring; ZeRO 2-3 at dp > 1: padded to ranks × stride, with the
// reduce-scatter's receive block and bf16 send block, acc_layout), and the
// split backward's in a pool (counted with the W queue); ZeRO-3's gathered
// units, ranks × stride as stored (the others' kind 1 + parallel.prefetch
// of them; paged: each with a send block of one stride); the deferred
// lookup's rows and tokens; sequence parallel's norm sums (f32).
void add_buffers(PipelineExecutor::Memory& m, const model::TransformerConfig& c, const model::Layout& layout,
                 const PipelineSetup& setup, int rank, const ScheduleReplay& replay, const HeldUnits& h) {
  const auto f = sizeof(float);
  const int64_t tp = setup.split.size;
  const int64_t sp = c.sequence_parallel && tp > 1 ? tp : 1;
  m.buffers += static_cast<size_t>(replay.buffers * setup.micro * setup.T / sp * c.n_embd) * f;
  const bool z2 = setup.zero_stage >= 2;
  const int zr = setup.zero_stage >= 1 ? setup.dp : 1;
  const size_t esz = setup.bf16 ? 2 : 4;
  const int64_t align = setup.shard_align();
  if (zr > 1 && !stores_shards(setup))  // (ZeRO-3: a checkpoint's gather takes its buffer for the time it runs)
    m.buffers += static_cast<size_t>(ShardLayout::stride_of(h.largest, zr, align) * (1 + zr)) * f;
  if (setup.bf16) {
    m.buffers += static_cast<size_t>(h.n0_used + h.other) * f;
    if (!z2 && setup.dp > 1 && !setup.reduce_bf16) m.buffers += static_cast<size_t>(h.largest) * f;
  }
  if (setup.bf16 || z2) {
    m.buffers += static_cast<size_t>(acc_ring(setup, 0)) * acc_layout(h.n0_used, setup).bytes +
                 static_cast<size_t>(acc_ring(setup, 1)) * acc_layout(h.other, setup).bytes;
    if (stores_shards(setup))
      m.buffers += static_cast<size_t>(use_buffer_numel(h.n0_used, setup) +
                                       (1 + setup.prefetch) * use_buffer_numel(h.other, setup)) * esz;
    m.w_queue += static_cast<size_t>(replay.accumulators) * acc_layout(layout.unit_numel(1), setup).bytes;
  }
  for (const bool all : {false, true})  // defer_lookup's rows and tokens
    m.buffers += static_cast<size_t>(lookup_tail_rows(setup, rank, all) * (c.n_embd + 1)) * f;
  m.buffers += static_cast<size_t>(norm_sum_numel(c, layout, setup, rank)) * f;  // sequence parallel's norm sums
}

}  // namespace

PipelineExecutor::Memory PipelineExecutor::predict(const model::TransformerConfig& config,
                                                   const PipelineSetup& setup, int rank) {
  const model::TransformerConfig c = config.resolved();
  const model::Layout layout(c, setup.split);
  const ScheduleReplay replay = ActionReplay(layout, setup, rank).run();
  Memory m;
  const HeldUnits held = add_stages(m, c, layout, setup, rank, replay);
  add_optimizer(m, layout, setup, rank);
  add_buffers(m, c, layout, setup, rank, replay, held);
  const pipeline::Schedule& s = setup.schedule;
  if (s.vocab) {  // the head's pieces: their rows' copy and gradient, the tree's sums, the held micro-batches
    const auto f = sizeof(float);
    const model::vocab::Pieces pieces = model::vocab::pieces_of(c.vocab_size);
    const auto [k0, k1] = s.pieces_of(rank, pieces.count());
    const auto rows = static_cast<size_t>((pieces.begin(k1) - pieces.begin(k0)) * c.n_embd) * f;
    const auto [copy, own] = vocab_copies(layout, setup, rank);
    if (copy) m.params += rows;
    if (own) m.grads += rows;
    m.buffers += static_cast<size_t>(model::vocab::tree_height(pieces.count()) *
                                     model::Transformer::head_chunk_rows(setup.micro, setup.T) *
                                     c.n_embd) * f;
    m.activations += static_cast<size_t>(replay.vocab) * vocab_held_bytes(config, setup, rank);
  }
  return m;
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

std::pair<size_t, size_t> PipelineExecutor::paging_pages(const model::TransformerConfig& config,
                                                         const PipelineSetup& setup, int rank,
                                                         size_t page_bytes, int prefetch) {
  // Each AdamW as the executor builds it at data rank 0, paged as it pages
  // (quantized moments: their blocks and side pages, optim/adamw.h).
  const model::Layout layout(config.resolved(), setup.split);
  const std::vector<bool> quantized = quantized_tensors(layout, setup.adam);
  const int zr = setup.zero_stage >= 1 ? setup.dp : 1;
  const bool sharded_params = stores_shards(setup);
  const int64_t table = layout.token_embedding().offset;
  const optim::PagedState::Layout base = paged_fields(setup);
  size_t pages = 0, least = 0;
  for (const AdamUnits& a : adam_units(layout, setup, rank)) {
    const ShardLayout shard(unit_sizes(layout, a.first, a.last), zr, 0, setup.shard_align());
    const optim::AdamW adam(setup.adam,
                            unit_ranges(layout, a.first, a.last, shard, sharded_params, quantized,
                                         [&](const model::TensorSpec& t) { return !a.table || t.offset == table; }),
                            a.numel);
    const auto g = optim::PagedState::geometry(adam.paged_numel(base), page_bytes, adam.paged_layout(base));
    pages += g.pages();
    least += optim::PagedState::min_compute_frames(g, prefetch);
  }
  return {pages, least};
}

std::pair<size_t, size_t> PipelineExecutor::paging_pages(size_t page_bytes, int prefetch) const {
  return paging_pages(config_, setup_, rank_, page_bytes, prefetch);
}

void PipelineExecutor::enable_paging(const memory::PagerOptions& options) {
  PO_CHECK(setup_.paged, "pipeline: enable_paging on a setup that is not paged (PipelineSetup::paged)");
  // (Sequence parallel: a block's gradient is final only once the step has
  // summed its norms over the tensor group, so every page waits for the step.)
  early_ = setup_.update_in_backward && setup_.adam.grad_clip <= 0 && setup_.overlap_comm && norm_sums_.size() == 0;
  const auto list = adams();
  std::vector<size_t> pages, least;  // (each keeps its fields' minimum: PagedState::min_compute_frames)
  const optim::PagedState::Layout base = paged_fields(setup_);
  for (const auto& [a, name] : list) {
    const auto g = optim::PagedState::geometry(a->paged_numel(base), options.page_bytes, a->paged_layout(base));
    pages.push_back(g.pages());
    least.push_back(optim::PagedState::min_compute_frames(g, options.prefetch));
  }
  const size_t all = std::accumulate(pages.begin(), pages.end(), size_t{0});
  const std::vector<size_t> compute =
      memory::split_frames(options.compute_frames == 0 ? all : options.compute_frames, pages, least);
  const std::vector<size_t> host = memory::split_frames(options.host_frames, pages, 0);
  for (size_t k = 0; k < list.size(); ++k) {
    memory::PagerOptions o = options;
    o.compute_frames = compute[k];
    o.host_frames = host[k];
    const std::string& name = list[k].second;
    const auto dot = o.file_name.rfind('.');
    o.file_name = dot == std::string::npos ? o.file_name + name
                                           : o.file_name.substr(0, dot) + name + o.file_name.substr(dot);
    list[k].first->enable_paging(o, base);
  }
  paged_shards_ = shard_params_;  // (ZeRO-3: the stored shards too; their values come after)
  if (paged_shards_) paged_sq_.assign(static_cast<size_t>(layout_.num_units()), 0.0);
  for (auto& c : chunks_) {  // bf16: the master is in the pages now
    c->master = tensor::Storage();
    c->rep_master = tensor::Storage();
    if (!paged_shards_) continue;
    for (tensor::Storage* s : {&c->params, &c->grads, &c->rep_params, &c->rep_grads}) *s = tensor::Storage();
  }
  Chunk& c = *chunks_.front();
  if (setup_.lend_activations && chunks_.size() == 1 && c.first == 0 && c.last == layout_.head_unit()) {
    memory::Pager& pager = c.adam->paged_state()->pager();
    const int last = setup_.schedule.micro_batches - 1;
    const bool read_ahead = !early_;  // (early updates visit pages in their own order, which reads ahead by itself)
    lender_ = {[this, &pager, last, read_ahead](int r, char* base, size_t bytes) {
                 if (cur_micro_ != last) return false;  // (the step's last micro-batch's)
                 pager.lend(r, base, bytes, read_ahead);
                 return true;
               },
               [&pager](int r) { pager.claim(r); }};
    for (auto& m : c.slots) m->set_activation_lender(lender_);
  }
  setup_early();
}

std::vector<const optim::PagedState*> PipelineExecutor::paged_states() const {
  std::vector<const optim::PagedState*> out;
  for (const auto& [a, name] : adams())
    if (a->paged()) out.push_back(a->paged_state());
  return out;
}

size_t PipelineExecutor::lent_frames(const model::TransformerConfig& config, const PipelineSetup& setup,
                                     size_t page_bytes) {
  size_t n = 0;
  for (const auto& [offset, bytes] :
       model::Transformer::predicted_activation_regions(config, setup.micro, setup.T, setup.split.size))
    n += memory::Pager::frames_in(offset, bytes, page_bytes);
  return n;
}

size_t PipelineExecutor::lent_frames() const {
  if (!lender_.lend) return 0;
  return lent_frames(config_, setup_, chunks_.front()->adam->paged_state()->page_bytes());
}

memory::PagerStats PipelineExecutor::take_paging_stats() {
  memory::PagerStats sum;
  for (const auto& [a, name] : adams()) {
    if (a->paged()) sum.add(a->paged_state()->take_stats());
  }
  return sum;
}

// Elements [offset, offset + n) of Adam m, v or (bf16 parameters) the fp32
// master, in state coordinates, out of and into memory or the pages
// (quantized moments: decoded, and recovered or quantized on the way in).
void PipelineExecutor::read_field(Chunk& c, bool replica, State kind, int64_t offset, int64_t n,
                                  float* dst) {
  optim::AdamW& a = replica ? *c.rep_adam : *c.adam;
  if (a.quantized() && kind != State::kParams) return a.read_moment(kind, offset, n, dst);  // decoded
  if (a.paged()) return a.copy_out_paged(optim::AdamW::paged_field(kind), offset, n, dst);
  backend::to_host(dst, field_in_memory(c, replica, kind) + offset, static_cast<size_t>(n) * sizeof(float));
}

void PipelineExecutor::write_field(Chunk& c, bool replica, State kind, int64_t offset, int64_t n,
                                   const float* src) {
  optim::AdamW& a = replica ? *c.rep_adam : *c.adam;
  if (a.quantized() && kind != State::kParams) {  // the codes recovered, or quantized
    quantized_on_load_ += a.write_moment(kind, offset, n, src);
    return;
  }
  if (a.paged()) return a.copy_in_paged(optim::AdamW::paged_field(kind), offset, n, src);
  backend::from_host(field_in_memory(c, replica, kind) + offset, src, static_cast<size_t>(n) * sizeof(float));
}

float* PipelineExecutor::field_in_memory(Chunk& c, bool replica, State kind) {
  optim::AdamW& a = replica ? *c.rep_adam : *c.adam;
  if (kind == State::kAdamM) return a.m();
  if (kind == State::kAdamV) return a.v();
  return (replica ? c.rep_master : c.master).f32();
}

void PipelineExecutor::read_unit(State kind, int u, float* dst) {
  const auto n = static_cast<size_t>(layout_.unit_numel(u));
  if (kind == State::kParams && !bf16_ && !shard_params_) {
    backend::to_host(dst, unit_params(u), n * sizeof(float));
    return;
  }
  for (auto& c : chunks_) {
    if (!c->holds(u)) continue;
    const ShardLayout& sl = *c->shard;
    const int i = u - c->first;
    if (kind == State::kParams && !bf16_) {  // ZeRO-3: the stored shards
      std::vector<float> mine(static_cast<size_t>(sl.owned(i)));
      shard_out(shard_of(*c, u, true), 0, sl.owned(i), mine.data(), Direction::kDeviceToHost);
      return gather_unit(sl, i, mine.data(), dst, DType::kF32);
    }
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

bool PipelineExecutor::local_parts() const {
  return setup_.zero_stage == 0 || setup_.dp == 1 || setup_.shard_align() == 1;
}

void PipelineExecutor::read_unit_part(State kind, int u, int64_t lo, int64_t hi, float* dst) {
  const auto n = static_cast<size_t>(hi - lo);
  if (kind == State::kParams && !bf16_ && !shard_params_) {  // fp32 parameters, whole
    backend::to_host(dst, unit_params(u) + lo, n * sizeof(float));
    return;
  }
  for (auto& c : chunks_) {
    if (!c->holds(u)) continue;
    const ShardLayout& sl = *c->shard;
    const int i = u - c->first;
    const int64_t mine = sl.ranks() == 1 ? 0 : sl.begin(i);  // this rank's first element of the unit
    PO_ASSERT(lo >= mine && hi <= mine + (sl.ranks() == 1 ? sl.unit_numel(i) : sl.owned(i)), "pipeline: elements [",
              lo, ", ", hi, ") of unit ", u, " are not in rank ", rank_, "'s cut");
    if (kind == State::kParams && !bf16_)  // ZeRO-3: the stored fp32 shard
      return shard_out(shard_of(*c, u, true), lo - mine, hi - lo, dst, Direction::kDeviceToHost);
    read_field(*c, false, kind, sl.local_offset(i) + (lo - mine), hi - lo, dst);
    return;
  }
  PO_THROW(core::Internal, "pipeline: unit ", u, " is not on rank ", rank_);
}

void PipelineExecutor::write_unit(State kind, int u, const float* src) {
  for (auto& c : chunks_) {
    if (!c->holds(u)) continue;
    if (kind == State::kParams) return store_unit(*c, false, u, src);
    const ShardLayout& sl = *c->shard;
    const int i = u - c->first;
    write_field(*c, false, kind, sl.local_offset(i), sl.owned(i), src + sl.begin(i));
    return;
  }
  PO_THROW(core::Internal, "pipeline: unit ", u, " is not on rank ", rank_);
}

void PipelineExecutor::set_base(model::Transformer& whole) {
  PO_CHECK(layout_.adapters() && whole.layout().adapters() && whole.whole(),
           "pipeline: set_base takes a whole model with adapters, for a pipeline with adapters");
  const model::Layout& wl = whole.layout();
  const float* src = whole.base_params();
  for (auto& c : chunks_) {
    model::Transformer& f = *c->frozen;
    float* dst = f.base_params();
    const int64_t lo = wl.base_unit_offset(c->first);
    for (const model::TensorSpec& t : wl.base_tensors()) {
      if (!c->holds(t.unit)) continue;
      if (const model::QuantTensor* q = whole.quantized(t)) {
        f.set_quantized(t, *q);
        continue;
      }
      std::copy_n(src + t.offset, t.numel(), dst + (t.offset - lo));
    }
    if (whole.base_quantized()) f.quantize_base();  // (every quantized tensor is given: nothing is quantized again)
    if (c->frozen_unit0.size() > 0) std::copy_n(src, wl.base_unit_numel(0), c->frozen_unit0.f32());
  }
}

// The working buffers, by what they hold: messages between stages; gathered
// parameters (ZeRO gathers, ZeRO-3's units in use, bf16's widened units);
// gradient sums (accumulator rings, reduction staging, the tied table's
// lookup rows and their gathers, the vocabulary pieces' scratch, sequence
// parallel's norm sums); the deferred blocks' accumulators.
PipelineExecutor::Buffers PipelineExecutor::buffer_bytes() const {
  Buffers b;
  b.messages = messages_->bytes();
  b.gathered = gather_.size() + widen_[0].size() + widen_[1].size();
  if (gathers_) b.gathered += gathers_->bytes();
  b.sums = (sums_ ? sums_->bytes() : 0) + tail_rows_.size() + tail_tokens_.size() + rows_all_.size() +
           tokens_all_.size() + norm_sums_.size();
  for (const auto& c : chunks_)
    if (c->rows) b.sums += c->rows->bytes();
  if (accs_) b.sums += accs_->ring_bytes();
  if (vocab_) b.sums += vocab_->scratch.size();
  if (accs_) b.deferred += accs_->pool_bytes();
  return b;
}

PipelineExecutor::Memory PipelineExecutor::memory() const {
  Memory m;
  for (const auto& c : chunks_) {
    m.params += c->params.size() + c->rep_params.size();
    m.grads += c->grads.size() + c->rep_grads.size() + c->grad_shard.size() +
               c->rep_grad_shard.size();
    m.master += c->master.size() + c->rep_master.size();
    for (const auto& s : c->slots) m.activations += s->activation_bytes();
    m.w_queue += c->work_bytes;
    if (c->frozen) m.frozen += c->frozen->frozen_bytes() + c->frozen->activation_bytes() + c->frozen_unit0.size();
  }
  for (const auto& [a, name] : adams()) {
    m.adam += a->state_bytes();
    if (a->paged()) m.pages += a->paged_state()->compute_frames() * a->paged_state()->page_bytes();
  }
  const Buffers b = buffer_bytes();
  m.buffers = b.messages + b.gathered + b.sums;
  m.w_queue += b.deferred;
  if (vocab_) {
    m.params += vocab_->w_copy.size();
    m.grads += vocab_->dw_own.size();
    m.activations += vocab_->held.size() * vocab_held_bytes(config_, setup_, rank_);
  }
  return m;
}

MemoryReport PipelineExecutor::memory_report() const {
  const Memory m = memory();
  const Buffers b = buffer_bytes();
  MemoryReport r;
  r.params = m.params + m.frozen;  // (a frozen base: with the parameters)
  r.grads = m.grads;
  r.master = m.master;
  r.adam = m.adam;
  r.gathered = b.gathered;
  r.buckets = b.sums + b.deferred;
  r.activations = m.activations + (m.w_queue - b.deferred) + b.messages;
  r.pages = m.pages;
  for (const auto& [a, name] : adams())
    if (a->paged()) r.host += a->paged_state()->host_frames() * a->paged_state()->page_bytes();
  return r;
}

PagingReport PipelineExecutor::paging_report() const {
  PagingReport r;
  for (const auto& [a, name] : adams())
    if (a->paged()) r.add(*a->paged_state());
  r.pages_updated_in_backward = static_cast<uint64_t>(early_last_);
  return r;
}

}  // namespace po::parallel
