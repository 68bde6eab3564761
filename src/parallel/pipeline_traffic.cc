// The collectives a pipeline rank's step issues on its data and tensor
// groups, from the configuration and the schedule alone
// (PipelineExecutor::predict_collectives): the executor's calls, counted as
// comm::Traffic counts them (allreduce: the buffer; reduce_scatter: the
// whole input; all_gather: the whole output).
#include "parallel/pipeline_executor.h"
#include "parallel/pipeline_executor_state.h"

#include <algorithm>

#include "comm/mpi/ring_sizes.h"

namespace po::parallel {
using namespace executor_detail;  // its helpers and names (pipeline_executor_state.h)

namespace {

void add(comm::Traffic& t, comm::CommOp op, uint64_t calls, double bytes) {
  t.calls[static_cast<int>(op)] += calls;
  t.bytes[static_cast<int>(op)] += static_cast<uint64_t>(bytes);
}

comm::CommOp op_of(model::Transformer::Collective c) {
  using C = model::Transformer::Collective;
  return c == C::kAllReduce ? comm::CommOp::kAllReduce
         : c == C::kReduceScatter ? comm::CommOp::kReduceScatter
                                  : comm::CommOp::kAllGather;
}

}  // namespace

PipelineExecutor::Collectives PipelineExecutor::predict_collectives(const model::TransformerConfig& config,
                                                                    const PipelineSetup& setup, int rank) {
  using comm::CommOp;
  const model::TransformerConfig c = config.resolved();
  const model::Layout layout(c, setup.split);
  const pipeline::Schedule& s = setup.schedule;
  const int head = layout.head_unit(), dp = setup.dp;
  const int64_t tp = setup.split.size;
  const auto m = static_cast<uint64_t>(s.micro_batches);
  const int z = setup.zero_stage;
  const bool sharded = z >= 1 && dp > 1;
  const double stored = setup.bf16 ? 2 : 4, wire = setup.reduce_bf16 ? 2 : 4;
  auto stride = [&](int u) {
    return static_cast<double>(ShardLayout::stride_of(layout.unit_numel(u), dp, setup.shard_align()));
  };
  Collectives out;
  for (int stage : s.stages_of(rank)) {
    const model::UnitRange r = setup.stage_units[static_cast<size_t>(stage)];
    const int first = r.first, last = r.last < 0 ? head : r.last;
    // The model's own, per micro-batch.
    for (const auto& item : model::Transformer::predicted_tp_collectives(c, setup.micro, setup.T, tp, {first, last}))
      add(out.tensor, op_of(item.op), item.calls * m, item.bytes * static_cast<double>(m));
    if (dp == 1) continue;
    // Unit 0 on the tied head's chunk: its replica, or (zbv) the embedding chunk's.
    const bool with_unit0 = layout.tied_trains() && last == head && first > 0;
    const bool replica = with_unit0 && s.rank_of(0) != rank;
    std::vector<int> units;
    for (int u = first; u <= last; ++u) units.push_back(u);
    if (with_unit0) units.push_back(0);
    if (z >= 2) {  // every micro-batch's accumulator of every unit, reduce-scattered as it completes
      for (int u : units) add(out.data, CommOp::kReduceScatter, m, static_cast<double>(m) * dp * stride(u) * wire);
    } else {  // the step's sums: the chunk's buckets (bf16 summed in f32: units in f32), the replica's
      const double esz = setup.bf16 && setup.reduce_bf16 ? 2 : 4;
      auto sums = [&](int u0, int u1) {
        const double n = static_cast<double>(layout.unit_offset(u1 + 1) - layout.unit_offset(u0));
        add(out.data, CommOp::kAllReduce, 1, n * esz);
      };
      for (const auto& [lo, hi] : grad_buckets(layout, first, last, setup)) sums(lo, hi);
      if (replica) sums(0, 0);
    }
    if (z == 3) {  // a gather per use: the units each step of the one-stage schedule on this chunk reads
      for (const model::Step& st : layout.training_steps()) {
        const bool block = st.kind == model::Step::kBlockForward || st.kind == model::Step::kBlockBackward;
        const bool here = block ? st.layer + 1 >= first && st.layer + 1 <= last
                                : st.kind == model::Step::kHead ? last == head : first == 0;
        if (!here) continue;
        for (int u : layout.step_units(st))
          add(out.data, CommOp::kAllGather, m, static_cast<double>(m) * dp * stride(u) * stored);
      }
    } else if (sharded) {  // ZeRO 1-2: the updated shards, unit by unit (a replica's unit 0 too)
      for (int u = first; u <= last; ++u) add(out.data, CommOp::kAllGather, 1, dp * stride(u) * stored);
      if (replica) add(out.data, CommOp::kAllGather, 1, dp * stride(0) * stored);
    }
  }
  const int64_t rows = setup.micro * setup.T, C = c.n_embd;
  if (dp > 1 && s.rank_of(0) == rank) {
    if (layout.tied_trains()) {  // the step's lookup rows and tokens (tied_pair.h)
      const double n = static_cast<double>(m) * static_cast<double>(rows) * dp;
      add(out.data, CommOp::kAllGather, 2, n * 4.0 * static_cast<double>(C + 1));
    }
    if (setup.defer_lookup)  // the last micro-batch's rows and tokens
      add(out.data, CommOp::kAllGather, 2, static_cast<double>(rows) * dp * 4.0 * static_cast<double>(C + 1));
  }
  // Sequence parallel: the norms' gradients over the tensor group, once a step (sum_norm_rows).
  if (const int64_t n = norm_sum_numel(c, layout, setup, rank); n > 0)
    add(out.tensor, CommOp::kAllReduce, 1, 4.0 * static_cast<double>(n));
  // The gradient norm: ZeRO 2-3 a double per rank over the data group, then
  // the tensor group; ZeRO 0-1 a double per unit over the tensor group.
  if (z >= 2) {
    if (dp > 1) add(out.data, CommOp::kAllGather, 1, 8.0 * dp);
    if (tp > 1) add(out.tensor, CommOp::kAllGather, 1, 8.0 * static_cast<double>(tp));
  } else if (tp > 1) {
    add(out.tensor, CommOp::kAllGather, 1, 8.0 * static_cast<double>(layout.num_units() * tp));
  }
  return out;
}

size_t PipelineExecutor::predict_ring_scratch(const model::TransformerConfig& config, const PipelineSetup& setup,
                                              int rank) {
  namespace ring = comm::mpi::ring;
  const model::TransformerConfig c = config.resolved();
  const model::Layout layout(c, setup.split);
  const int head = layout.head_unit(), dp = setup.dp, tp = setup.split.size;
  double out = 0;
  if (dp > 1) {  // at most: every eligible sum in flight at once, each the largest one's
    const double wire = setup.reduce_bf16 ? 2 : 4;
    double largest = 0;
    int eligible = 0;
    auto consider = [&](bool rs, double payload) {
      const double r = ring::scratch_bytes(rs, payload, dp);
      eligible += r > 0 ? 1 : 0;
      largest = std::max(largest, r);
    };
    for (int stage : setup.schedule.stages_of(rank)) {
      const model::UnitRange r = setup.stage_units[static_cast<size_t>(stage)];
      const int first = r.first, last = r.last < 0 ? head : r.last;
      if (setup.zero_stage >= 2) {
        for (int u = first; u <= last; ++u)
          consider(true, static_cast<double>(ShardLayout::stride_of(layout.unit_numel(u), dp, setup.shard_align()) *
                                             dp) * wire);
      } else {
        const double esz = setup.bf16 && setup.reduce_bf16 ? 2 : 4;
        for (const auto& [lo, hi] : grad_buckets(layout, first, last, setup))
          consider(false, static_cast<double>(layout.unit_offset(hi + 1) - layout.unit_offset(lo)) * esz);
      }
    }
    // ZeRO 2-3: the accumulators' ring bounds the reduce-scatters in flight.
    if (setup.zero_stage >= 2) eligible = std::min(eligible, acc_ring(setup, 1));
    out += eligible * largest;
  }
  // The tensor group's ring is a channel of its own. Its collectives block,
  // one at a time, and the largest is a [B·T, C] f32 activation (a
  // reduce-scatter's under sequence parallel, an all-reduce's otherwise).
  out += ring::scratch_bytes(c.sequence_parallel && tp > 1,
                             4.0 * static_cast<double>(setup.micro * setup.T * c.n_embd), tp);
  return static_cast<size_t>(out);
}

}  // namespace po::parallel
