// Pipeline schedules as data: for p ranks, m micro-batches and v model
// chunks per rank, each rank's ordered list of actions — forward, backward
// (or its input-gradient and weight-gradient halves, for the zero-bubble
// schedules), send and receive, each for one micro-batch and one stage. The
// executor runs each rank's list in order, and the planner and the trace
// read the same lists, so what is planned, run and drawn is one description.
//
// Stages are the model's chunks in order, 0 .. p·v-1; a rank holds v of them:
//   gpipe, 1f1b, zb-h1: v = 1, stage r on rank r;
//   interleaved:        stage c·p + r on rank r (chunk c), Megatron's placement;
//   zbv:                v = 2, stages r and 2p-1-r on rank r (the V: the first
//                       and the last stage share rank 0).
//
// The order of compute on each rank comes from a list-scheduling simulation
// with unit costs (forward 1, input backward 1, weight backward 1; a fused
// backward 2) or each stage's own costs: when a rank is free it runs the
// ready action its schedule ranks first, within the schedule's cap on
// micro-batches in flight. On every stage, forwards, backwards and weight
// backwards each run in micro-batch order, so every parameter's gradient
// accumulates in the order of one stage (pp = 1): a pipelined step can give
// the bits of the unpipelined one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace po::parallel::pipeline {

enum class ScheduleKind { kGPipe, k1F1B, kInterleaved, kZbH1, kZbV };

// parallel.schedule's names: "gpipe", "1f1b", "interleaved", "zb-h1", "zbv".
// Throws InvalidArgument listing them.
ScheduleKind parse_schedule(const std::string& name);
const char* schedule_name(ScheduleKind kind);

enum class Op {
  kForward,
  kBackward,        // input and weight gradients together
  kBackwardInput,   // B: the input gradient (and the norms' weights)
  kBackwardWeight,  // W: the GEMMs' weight gradients, deferred
  kSend,
  kRecv,
  // Vocabulary parallel (Schedule::vocab): the head's pieces on every rank.
  kHeadStats,  // S: this rank's pieces' logits and statistics for a micro-batch
  kHeadGrad,   // T: their logit gradients, weight gradients and input-gradient part
};
const char* op_name(Op op);

// What a send or receive carries: a stage's output activations (forward) or
// the gradient of its input (backward); with the head spread over the
// ranks, the final norm's output (to every rank), a rank's pieces'
// statistics (to every rank) and the head's input gradient as summed so far
// (to the next piece holder, the last one handing it to the last stage).
enum class Payload { kActivation, kGradient, kHeadInput, kHeadStats, kHeadGrad };

struct Action {
  Op op = Op::kForward;
  int micro = 0;  // micro-batch
  // Global stage: compute on it (S and T: the last stage); send/recv: the
  // stage that computes with it. Head messages (vocabulary parallel) name
  // virtual stages past the last, S = stages(): kHeadInput S + 1 +
  // receiver, kHeadStats S + 1 + ranks + sender, kHeadGrad S + 1 + 2·ranks +
  // the tree node's first piece, so that each (micro-batch, stage, payload)
  // is one message.
  int stage = 0;
  int peer = -1;  // send/recv: the other rank
  Payload payload = Payload::kActivation;
  bool operator==(const Action&) const = default;
};

// "F3@s1", "send act m3 s2 -> r1", ...: for traces and test messages.
std::string describe(const Action& a);

struct Schedule {
  ScheduleKind kind = ScheduleKind::k1F1B;
  int ranks = 1;          // p
  int micro_batches = 1;  // m
  int chunks = 1;         // v: stages per rank
  // Vocabulary parallel: the head's pieces spread over every rank, computed
  // in S and T actions (docs/pipeline.md). `holders`: the ranks in piece
  // order, the last stage's rank last.
  bool vocab = false;
  std::vector<int> holders;
  std::vector<std::vector<Action>> actions;  // per rank, in order

  int stages() const { return ranks * chunks; }
  int rank_of(int stage) const;
  // The stages rank r holds, in model order.
  std::vector<int> stages_of(int rank) const;
  bool split_backward() const { return kind == ScheduleKind::kZbH1 || kind == ScheduleKind::kZbV; }
  // Micro-batches (stage activations) a rank may hold at once, from a
  // forward until its input backward: the schedule's memory bound. (A
  // deferred weight backward keeps only its GEMMs' inputs and output
  // gradients: the W queue, counted apart.) Vocabulary parallel: one
  // micro-batch more for 1f1b, zb-h1 and zbv (p + 1 on the first stage, as
  // Yeung et al.'s one-barrier schedules hold): the last stage's input
  // backward waits for every rank's head pieces, and the extra micro-batch
  // keeps the ranks computing meanwhile.
  int in_flight_cap(int rank) const;
  // Weight backwards a rank may defer (zero-bubble schedules; 0 otherwise).
  int w_queue_cap(int rank) const;
  // Vocabulary parallel: the head pieces [first, second) rank r computes
  // (model/vocab_head.h's `pieces` of them, cut evenly in holder order), and
  // the nodes of the input gradient's tree (vocab::tree_nodes) those fill:
  // what its T sends to the last stage's rank.
  std::pair<int, int> pieces_of(int rank, int pieces) const;
  int holder_index(int rank) const;
  std::vector<std::pair<int, int>> grad_nodes(int rank) const;
};

// Stages per rank: 2 for zbv, virtual_stages for interleaved, else 1.
int chunks_per_rank(ScheduleKind kind, int virtual_stages);

// Throws InvalidArgument naming parallel.pp, parallel.micro_batches or
// parallel.virtual_stages when they do not fit the schedule (without
// building it: the planner checks every layout it searches).
void check_schedule(ScheduleKind kind, int ranks, int micro_batches, int virtual_stages);

// Costs of one stage's compute, in any unit (the simulation's defaults are
// the unit costs the orders are built with).
// head_stats and head_grad: one rank's S and T (vocabulary parallel; read
// from the last stage's Costs).
struct Costs {
  double forward = 1, backward_input = 1, backward_weight = 1;
  double head_stats = 0.5, head_grad = 1;
  double backward() const { return backward_input + backward_weight; }
};

// check_schedule, then the schedule; `vocab`: the head spread over the ranks
// (at most 8, and stages() + 2·ranks + 1 <= 64 for the head messages' tags).
// `costs` (each stage's, e.g. pipeline_stages.h's stage_costs): the list
// scheduler also orders at these costs, and the schedule keeps whichever
// orders, these or the unit costs', simulate the shorter step at them.
Schedule make_schedule(ScheduleKind kind, int ranks, int micro_batches, int chunks = 1,
                       bool vocab = false, const std::vector<Costs>& costs = {});

// The p2p tag of a send/recv, unique per (micro-batch, stage, payload), the
// same on both ends.
int message_tag(const Action& a);


// One compute action as simulated (or, from the executor, as run).
struct Span {
  Action action;
  double start = 0, end = 0;
};

struct Timing {
  double step = 0;              // the last action's end
  std::vector<std::vector<Span>> spans;  // per rank, in order
  std::vector<double> busy;     // per rank: compute time
  std::vector<int> peak_in_flight;  // per rank: the most micro-batches held at once (forward to B)
  std::vector<int> peak_w_queue;    // per rank: the most weight backwards waiting (B to W)
  // Idle share of the step, averaged over ranks: 1 - mean(busy) / step.
  double bubble() const;
};

// Times the schedule's lists as they are (each rank in its order; a compute
// waits for its inputs, communication takes no time).
Timing simulate(const Schedule& s, const Costs& costs = {});
// The same with each stage's own costs (stage_costs[stage], e.g. from
// pipeline_stages.h's stage_costs: the head's stage is heavier).
Timing simulate(const Schedule& s, const std::vector<Costs>& stage_costs);

// Chrome trace-event JSON (opens in Perfetto or chrome://tracing) of the
// spans: one track per rank (pid 0, tid = rank), a complete event ("ph":
// "X") per action named as describe() names it, `us_per_unit`
// microseconds per unit of time; the bubble of each rank in the args.
std::string chrome_trace(const Schedule& s, const Timing& t, double us_per_unit = 1000);

// The published bubble (share of the step) of a schedule at (p, m, v):
// (p-1)/(m+p-1) for gpipe and 1f1b, (p-1)/(v·m+p-1) interleaved, (p-1)/(3m+p-1)
// zb-h1, 0 for zbv (REFERENCE.md, "Pipeline schedules").
double formula_bubble(ScheduleKind kind, int ranks, int micro_batches, int chunks = 1);

}  // namespace po::parallel::pipeline
