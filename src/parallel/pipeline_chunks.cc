// The pipeline executor's chunks (pipeline_executor.h): what a chunk of
// units holds per rank (stored parameters and gradients, the fp32 master
// and AdamW over its ZeRO shard, a frozen base, the tied table's lookup rows
// or replica) and the executor's working buffers, sized by the largest
// unit held.
#include "parallel/pipeline_executor.h"
#include "parallel/pipeline_executor_state.h"

#include <algorithm>

#include "parallel/quantized_state.h"

namespace po::parallel {
using namespace executor_detail;  // its helpers and names (pipeline_executor_state.h)

// ZeRO 1-3 over dp > 1: the state is cut over the data group.
bool PipelineExecutor::sharded() const { return setup_.zero_stage >= 1 && setup_.dp > 1; }

// A chunk of `stage`'s units: its stored parameters and gradients (ZeRO-3,
// ZeRO 2-3: their shards), the fp32 master and AdamW over its ZeRO shard,
// with adapters its frozen base, and on the tied embedding the step's
// lookup rows.
std::unique_ptr<PipelineExecutor::Chunk> PipelineExecutor::make_chunk(int stage, const std::vector<bool>& quantized) {
  const size_t esz = stored_esz();
  const int zr = sharded() ? setup_.dp : 1, zk = sharded() ? setup_.data->rank() : 0;
  const int head = layout_.head_unit();
  auto c = std::make_unique<Chunk>();
  const model::UnitRange r = setup_.stage_units[static_cast<size_t>(stage)];
  c->stage = stage;
  c->first = r.first;
  c->last = r.last < 0 ? head : r.last;
  c->base = layout_.unit_offset(c->first);
  c->numel = layout_.unit_offset(c->last + 1) - c->base;
  c->shard = std::make_unique<ShardLayout>(unit_sizes(layout_, c->first, c->last), zr, zk, setup_.shard_align());
  c->params = zeroed(shard_params_ ? c->shard->local_numel() : c->numel, esz);  // ZeRO-3: the shard
  c->grads = zeroed(shard_grads_ ? c->shard->local_numel() : c->numel, esz);    // ZeRO 2-3: the shard
  if (bf16_) c->master = zeroed(c->shard->local_numel());
  c->adam = std::make_unique<optim::AdamW>(
      setup_.adam, unit_ranges(layout_, c->first, c->last, *c->shard, shard_params_, quantized),
      c->shard->local_numel());
  if (sharded() && !bf16_ && !shard_grads_) c->grad_shard = zeroed(c->shard->local_numel());
  if (layout_.adapters()) {  // the frozen base (its values come with set_base)
    model::TransformerConfig fc = config_.weights_only();
    fc.inference = true;  // no training buffers: it never runs
    c->frozen = std::make_unique<model::Transformer>(fc, 1, 1, model::UnitRange{c->first, c->last}, setup_.split);
    if (layout_.tied() && c->holds(head) && !c->holds(0))
      c->frozen_unit0 = zeroed(layout_.base_unit_offset(1) - layout_.base_unit_offset(0));
  }
  if (layout_.tied_trains() && c->holds(0)) {  // the step's lookup rows (tied_pair.h)
    c->rows = std::make_unique<LookupRows>(config_.n_embd, layout_.vocab_begin(), layout_.vocab_real());
    c->rows->reserve(static_cast<int64_t>(setup_.schedule.micro_batches) * setup_.micro * setup_.T);
  }
  return c;
}

// Where the tied head's chunk without unit 0 reads and writes the token
// table: under zbv the embedding chunk's own buffers on this rank, else a
// replica of unit 0 cut as the embedding's, with its own AdamW over the
// table only.
void PipelineExecutor::setup_unit0(Chunk& c, const std::vector<bool>& quantized) {
  if (!layout_.tied_trains() || !c.holds(layout_.head_unit()) || c.holds(0)) return;
  if (emb_rank_ == rank_) {  // zbv: the embedding's chunk is here
    Chunk& e = chunk_of_stage(0);
    c.unit0_params = e.params.data();
    c.unit0_grads = e.grads.data();
    return;
  }
  const size_t esz = stored_esz();
  const int zr = sharded() ? setup_.dp : 1, zk = sharded() ? setup_.data->rank() : 0;
  const int64_t n0 = layout_.unit_numel(0);
  // The embedding's shard layout of unit 0, so that both copies of the
  // table update the same elements on the same data rank.
  const int64_t wte = layout_.token_embedding().offset;
  c.rep_shard = std::make_unique<ShardLayout>(unit_sizes(layout_, 0, 0), zr, zk, setup_.shard_align());
  c.rep_params = zeroed(shard_params_ ? c.rep_shard->local_numel() : n0, esz);
  c.rep_grads = zeroed(shard_grads_ ? c.rep_shard->local_numel() : n0, esz);
  c.unit0_params = c.rep_params.data();
  c.unit0_grads = c.rep_grads.data();
  c.rep_adam = std::make_unique<optim::AdamW>(
      setup_.adam,
      unit_ranges(layout_, 0, 0, *c.rep_shard, shard_params_, quantized,
                   [wte](const model::TensorSpec& t) { return t.offset == wte; }),
      c.rep_shard->local_numel());
  if (sharded() && !bf16_ && !shard_grads_) c.rep_grad_shard = zeroed(c.rep_shard->local_numel());
  if (bf16_) c.rep_master = zeroed(c.rep_shard->local_numel());
}

// The largest unit held, a replica's included.
int64_t PipelineExecutor::largest_unit() const {
  int64_t largest = 0;
  for (const auto& c : chunks_) {
    for (int u = c->first; u <= c->last; ++u) largest = std::max(largest, layout_.unit_numel(u));
    if (c->replica()) largest = std::max(largest, layout_.unit_numel(0));
  }
  return largest;
}

// The working buffers, sized by the largest unit held (a replica's
// included): ZeRO-1's gathers take a send block and ranks receive blocks of
// its stride; the deferred lookup's rows; bf16's widened
// parameters and the f32 accumulators (unit 0's ring and the others',
// acc_ring; ZeRO 2-3's reduce-scatter blocks in them), ZeRO-3's gathered
// units.
void PipelineExecutor::setup_buffers() {
  const int zr = sharded() ? setup_.dp : 1;
  const int64_t align = setup_.shard_align();
  const int64_t largest = largest_unit();
  // (ZeRO-3 gathers a whole unit only for a checkpoint: a buffer then, not held.)
  if (sharded() && !shard_params_) gather_ = zeroed(ShardLayout::stride_of(largest, zr, align) * (1 + zr));
  const int64_t C = config_.n_embd;
  for (const bool all : {false, true}) {
    const int64_t n = lookup_tail_rows(setup_, rank_, all);
    if (n == 0) continue;
    (all ? rows_all_ : tail_rows_) = zeroed(n * C);
    (all ? tokens_all_ : tail_tokens_) = tensor::Storage(static_cast<size_t>(n) * sizeof(int32_t));
  }
  if (const int64_t k = norm_sum_numel(config_, layout_, setup_, rank_); k > 0) {
    norms_ = layout_.norm_ranges();
    norm_sums_ = zeroed(k);
  }
  if (!accumulate_) return;
  int64_t n[2] = {0, 0};
  size_t acc[2] = {0, 0};  // an accumulator's bytes, its blocks included
  auto take = [&](int u) {
    const int k = u == 0 ? 0 : 1;
    n[k] = std::max(n[k], layout_.unit_numel(u));
    acc[k] = std::max(acc[k], acc_layout(layout_.unit_numel(u), setup_).bytes);
  };
  for (const auto& c : chunks_) {
    for (int u = c->first; u <= c->last; ++u) take(u);
    if (c->unit0_params != nullptr) take(0);
  }
  for (int k = 0; k < 2 && bf16_; ++k) widen_[k] = zeroed(n[k]);
  accs_ = std::make_unique<UnitAccumulators>(std::array<size_t, 2>{acc[0], acc[1]},
                                             std::array<int, 2>{acc_ring(setup_, 0), acc_ring(setup_, 1)});
  if (shard_grads_) reductions_ = std::make_unique<ShardReductions>();
  if (shard_params_) {
    const auto bytes = [&](int k) { return static_cast<size_t>(use_buffer_numel(n[k], setup_)) * stored_esz(); };
    gathers_ = std::make_unique<ParamGathers>(
        std::array<size_t, 2>{bytes(0), bytes(1)}, setup_.prefetch,
        [this](int stage, int u, void* buf) { return start_param_gather(stage, u, buf); },
        [this](int stage, int u) {  // paged shards: the pages of the gather after those issued start coming in
          if (!paged_shards_) return;
          const UnitShard s = shard_of(chunk_of_stage(stage), u, true);
          s.adam->paged_state()->prefetch(optim::PagedState::kParam, s.layout->local_offset(s.index),
                                          s.layout->stride(s.index));
        });
  }
}

}  // namespace po::parallel
