// A pipeline's stages: the model's units (embedding, the L blocks, the head)
// cut into contiguous ranges, one per stage (parallel/pipeline_schedule.h
// numbers them), balanced by forward FLOPs per token or set by hand.
//
// How the units are weighed (forward FLOPs per token; backward is 2× each,
// so the ratios hold): a block 2·(its parameters) + 2·T·C for causal
// attention (QKᵀ and AV over half the sequence on average); the head
// 2·V·C, which at GPT-2's vocabulary is about five 124M blocks; the
// embedding lookup 0. Every stage holds at least one block; the embedding
// goes with the first, the head with the last.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/transformer.h"
#include "parallel/pipeline_schedule.h"

namespace po::parallel::pipeline {

// Forward FLOPs per token of unit u (0: embedding, 1..L: blocks, L+1: head) at sequence T.
double unit_cost(const model::TransformerConfig& config, int64_t T, int u);

// `stages` contiguous unit ranges covering every unit. stage_layers empty:
// the split whose costliest stage is cheapest (ties: earlier stages
// lighter); else parallel.stage_layers, blocks per stage as "4,4,3,1",
// which must have `stages` positive entries summing to model.n_layer
// (errors name both keys).
// head_on_last = false: the head is spread over the ranks (vocabulary
// parallel) and weighs on no stage.
std::vector<model::UnitRange> partition_stages(const model::TransformerConfig& config, int64_t T,
                                               int stages, const std::string& stage_layers = "",
                                               bool head_on_last = true);

// The same for `schedule`'s stages (the default split): where a rank holds
// several stages (interleaved, zbv), blocks then move across stage
// boundaries while that lowers the busiest rank's total compute (forward and
// both backward halves, stage_costs), so that a rank holding the head's
// stage takes fewer blocks in its other ones.
std::vector<model::UnitRange> partition_stages(const model::TransformerConfig& config, int64_t T,
                                               const Schedule& schedule,
                                               const std::string& stage_layers = "");

// Each stage's compute as the executor runs it, in forward-FLOPs-of-a-block
// units: a block's forward 2·P + 2·T·C, its input backward 2·P + 4·T·C
// (the GEMMs' input gradients, attention's backward), its weight backward
// 2·P; the last stage's forward also runs the head and its fused loss
// backward (logits, input and weight gradients: 3 × 2·V·C). For
// simulate(): a bubble that sees the stages' imbalance. vocab_ranks > 0:
// the head is spread over that many ranks (vocabulary parallel): the last
// stage's forward is its blocks', and its Costs carry one rank's S (the
// logits, 2·V·C / ranks) and T (the input and weight gradients, twice that).
std::vector<Costs> stage_costs(const model::TransformerConfig& config, int64_t T,
                               const std::vector<model::UnitRange>& stages, int vocab_ranks = 0);

// A pipeline as the engine runs it: the schedule's stages (partition_stages)
// and the schedule ordered at their FLOP costs (make_schedule with
// stage_costs). The trainer, the planner and `plan --trace` all build it so.
struct Pipeline {
  Schedule schedule;
  std::vector<model::UnitRange> stages;
};
Pipeline make_pipeline(const model::TransformerConfig& config, int64_t T, ScheduleKind kind,
                       int ranks, int micro_batches, int virtual_stages, bool vocab = false,
                       const std::string& stage_layers = "");

}  // namespace po::parallel::pipeline
