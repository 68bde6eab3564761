// The pieces make_plan() assembles a Plan from: the items (memory by tier,
// collectives with their time on the cluster's links) and the way of
// filling them in. Internal to plan/.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "memory/paging_plan.h"
#include "model/transformer.h"
#include "plan/planner.h"

namespace po::plan::detail {

// "1.23 GiB".
std::string gib(double bytes);

// Whether a group whose members sit `stride` devices apart, `size` of them,
// spans nodes (Megatron order: tp innermost, then cp, dp, pp).
bool spans_nodes(const ClusterSpec& c, int64_t stride, int64_t size);

// A collective of `calls` operations moving `bytes` of payload in all
// (comm::Traffic's bytes) over `n` ranks, timed on the inter- or intra-node
// link; none when calls == 0.
void add_comm(Plan& p, const std::string& dim, const std::string& op, const std::string& what,
              uint64_t calls, double bytes, int n, bool inter, bool overlaps);

// The tensor group's collectives of `micro_batches` forwards and backwards
// of the model over `range` (Transformer::predicted_tp_collectives; cfg
// carries checkpointing and sequence parallel), at the layout's micro-batch
// shape.
void add_model_tp_comm(Plan& p, const model::TransformerConfig& cfg, model::UnitRange range,
                       uint64_t micro_batches, bool inter);

// The context group's buffers of one rank (ContextParallelOps: the ring's
// or the all-gather's keys and values of T / cp rows, tp's local heads); 0
// at cp = 1.
double context_buffer_bytes(const ModelSpec& m, const Layout& l);

// The context group's transfers of a step over `layers` blocks (parallel/
// context_parallel.h, per layer and micro-batch): ring: cp - 1 key/value
// blocks sent and received in the forward (again in the recompute under
// checkpointing), cp - 1 in the backward and cp gradient accumulators;
// allgather: one all-gather in the forward (and recompute), one all-gather
// and one reduce-scatter in the backward. None at cp = 1.
void add_context_comm(Plan& p, uint64_t layers);

// Paged I/O per step: every page not in the compute tier is read and
// written once. `lent_frames` (model::ActivationLender: the pages of the
// model's saved activations at their places in the 2 MiB-aligned
// allocation; PipelineExecutor::lent_frames) take that many NVMe pages'
// reads into the backward and their writes behind the next forward; the
// rest moves in the sweep. Sets Plan::lent_frames.
void add_paged_io(Plan& p, const memory::PagingPlan& plan, double lent_frames);

// A memory item; none when bytes <= 0.
void add_memory(Plan& p, const std::string& name, double bytes, Tier tier = Tier::kCompute,
                const std::string& note = "");

// The pages of a paging plan (memory/paging_plan.h, the trainer's policy)
// by tier, and the rejections of a budget it does not fit: the compute
// tier's minimum, or pages that fit in neither budget without a swap
// directory. `what` follows "N of M pages" in the compute tier's note.
void add_paged_tiers(Plan& p, const memory::PagingPlan& plan, const Layout& l, const std::string& what);

// Why the engine cannot train a layout yet (Plan::not_trainable); empty:
// it can, and the plan is engine-exact.
std::vector<std::string> not_trainable(const ModelSpec& m, const Layout& l);

// The plan (analytic.cc): the executor's own accounting of what it trains,
// the analytic model for the rest (not_trainable's reasons).
void analytic_plan(Plan& p);

}  // namespace po::plan::detail
