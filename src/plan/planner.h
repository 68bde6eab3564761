// `pagedoptim plan`: memory, communication and step time of a layout,
// predicted before a job starts (DESIGN.md "Memory accounting").
//
// Two models, one report:
//   * engine-exact: what the engine trains today — GPT-2 and Llama shapes,
//     data parallel × tensor parallel × context parallel, with sequence
//     parallel and paging.
//     Sizes come from the engine's own rules — a tensor-parallel
//     rank's layout, its ZeRO shards over the data group, the all-reduce
//     buckets, the activation layout, the pools' size classes replayed along
//     the hooks' order, the pager's frames — so the predicted compute-tier
//     peak is what the engine's compute pool reaches, and the predicted
//     collectives of both groups (calls and payload bytes) are what its
//     Communicators count (tests/plan/plan_vs_engine_launch_test).
//   * analytic: everything else. Pipeline layouts the executor trains get
//     its own memory accounting (PipelineExecutor::predict, the schedule's
//     action lists replayed) and an analytic time; layouts the engine does
//     not train (attention that keeps the s×s scores, pipelines at ZeRO 2-3)
//     are planned by the ZeRO ledger, Korthikanti et al.'s activations and
//     the collectives Megatron-style layouts issue, and marked not
//     trainable with the reason (Plan::not_trainable).
// Times come from the cluster: compute = FLOPs / (peak · efficiency),
// a collective = latency + wire bytes / bus bandwidth of the link its group
// spans, with the part that can hide behind compute shown as such.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "memory/nvme_store.h"
#include "parallel/pipeline_stages.h"
#include "plan/presets.h"

namespace po::plan {

struct Layout {
  int dp = 1, tp = 1, pp = 1, cp = 1;
  bool cp_allgather = false;  // parallel.cp_mode = "allgather" (else the ring)
  // With pp > 1: parallel.schedule and parallel.virtual_stages (interleaved;
  // zbv holds 2). The plan times and sizes the schedule's own action lists
  // (parallel/pipeline_schedule.h), the same ones the engine runs.
  parallel::pipeline::ScheduleKind schedule = parallel::pipeline::ScheduleKind::k1F1B;
  int virtual_stages = 2;
  // parallel.vocab_parallel: the head's vocabulary pieces spread over the
  // pipeline ranks (fp32, tp 1); parallel.stage_layers: the split by hand.
  bool vocab_parallel = false;
  std::string stage_layers;
  int zero_stage = 0;
  bool bf16 = false;         // train.precision
  bool reduce_bf16 = false;  // parallel.reduce_dtype
  int64_t batch = 8;         // global sequences per step (train.batch_size)
  int64_t micro = 8;         // sequences per micro-batch per rank
  int64_t seq = 0;           // tokens per sequence
  bool checkpointing = false;
  bool sequence_parallel = true;  // with tp > 1 (Megatron-SP)
  bool flash_attention = true;    // analytic model: no s×s attention scores kept
  bool overlap = true;
  uint64_t bucket_bytes = 25u << 20;
  int prefetch = 1;
  // Paging (memory.*): on when a compute budget or an NVMe directory is set.
  bool paging = false;
  uint64_t compute_budget = 0, host_budget = 0;
  bool nvme = false;
  uint64_t page_bytes = 4u << 20;
  int page_prefetch = 2;
  bool lend_activations = true;  // memory.lend_activations
  int state_bits = 32;           // optim.state_bits, optim.block_size, optim.state_bits_exclude
  int64_t state_block = 256;
  std::string state_bits_exclude = "token_embedding head";
  int64_t lora_r = 0;  // lora.r: adapters on a frozen base (0: none)
  bool lora_dropout = false;  // lora.dropout > 0
  int64_t moe_experts = 0;    // model.moe_experts (the resolved model's): 0, the dense MLP
  bool sft = false;    // SFT data: a loss mask beside data.train (data/sft.h)
  bool pack = false;   // data.pack: SFT examples packed into rows

  int devices() const { return dp * tp * pp * cp; }
  // Micro-batches per step on each rank (gradient accumulation).
  int64_t accum() const { return batch / (static_cast<int64_t>(dp) * micro); }
  std::string describe() const;  // "dp 4 × tp 2 × pp 1 × cp 1, ZeRO-1, bf16, micro 2, ckpt"
};

// Throws core::InvalidArgument naming the violated constraint (tp dividing
// the heads, pp at most the layers, the batch splitting over dp × micro ...);
// `devices` > 0: dp·tp·pp·cp must equal it.
void check_layout(const ModelSpec& model, const Layout& layout, int devices = 0);

using memory::Tier;  // compute, host, NVMe (memory/nvme_store.h)

struct MemoryItem {
  std::string name;
  double bytes = 0;
  Tier tier = Tier::kCompute;
  std::string note;
};

struct CommItem {
  std::string dim;   // "dp", "tp", "pp", "cp"
  std::string op;    // comm::comm_op_name's names, "send" for pipeline p2p
  std::string what;  // "gradient buckets", "parameter gathers", ...
  uint64_t calls = 0;
  double bytes = 0;       // payload, as comm::Traffic counts it
  double wire_bytes = 0;  // what each rank sends (ring algorithms)
  double seconds = 0;
  bool overlaps = false;  // can hide behind compute
};

struct Plan {
  ModelSpec model;
  ClusterSpec cluster;
  Layout layout;
  bool engine_exact = false;
  std::vector<std::string> not_trainable;  // empty: the engine runs it today

  std::vector<MemoryItem> memory;  // per rank (the busiest: rank 0 / first stage)
  double compute_peak = 0;   // Σ compute-tier items: the engine's compute-pool peak
  double device_peak = 0;    // + the framework's overhead
  double host_bytes = 0, nvme_bytes = 0;
  double activations_no_ckpt = 0, activations_ckpt = 0;  // per rank, for comparison
  // Korthikanti et al.'s 16-bit count for the same layers and micro-batch
  // (flash-style attention), next to the engine's own layout.
  double activations_formula = 0;
  double min_compute_budget = 0;  // paging: the smallest memory.compute_budget the engine accepts

  std::vector<CommItem> comm;  // per rank per step
  double model_flops = 0;      // per step, all devices
  double compute_s = 0, bubble_s = 0, comm_s = 0, exposed_comm_s = 0, io_s = 0, step_s = 0;
  // Paging I/O per step at the disk's (and host copies') rates: all of it,
  // the part lent frames move under the backward (reads) and the forward
  // (writes), and the frames lent (memory.lend_activations). io_s is what
  // the step waits for: the sweep's share, and whatever of the lent share
  // the forward and backward cannot hide. io_limit_s = max(the step without
  // paging, io_total_s): the step when everything overlaps.
  double io_total_s = 0, io_under_backward_s = 0, io_under_forward_s = 0, io_limit_s = 0;
  double lent_frames = 0;
  double bubble = 0;  // pipeline bubble, share of the step (the schedule's, simulated at unit costs)
  // The same with each stage's FLOP costs (pipeline_stages.h's stage_costs:
  // the head's stage is heavier); the step time uses it.
  double bubble_stages = 0;
  double tokens_per_s = 0, mfu = 0;

  bool fits = true;
  std::vector<std::string> rejections;  // why it does not fit
};

Plan make_plan(const ModelSpec& model, const ClusterSpec& cluster, const Layout& layout);
// A pipelined layout's schedule as the engine builds it (ordered at its
// stages' FLOP costs, parallel/pipeline_stages.h's make_pipeline) with those
// stages; where the partition refuses the layout, the unit-cost orders and
// no stages.
parallel::pipeline::Pipeline pipeline_schedule(const ModelSpec& model, const Layout& layout);

// Every layout of `devices` devices (dp × tp × pp × cp, ZeRO stage, paging,
// micro-batch, checkpointing) for the base's batch, precision and sequence;
// fitting plans ranked by tokens/s, then the rejected ones.
struct SearchResult {
  std::vector<Plan> fitting, rejected;
  size_t invalid = 0;  // combinations that break a constraint (not planned)
};
// `trainable_only`: only layouts the engine trains today.
SearchResult search(const ModelSpec& model, const ClusterSpec& cluster, const Layout& base,
                    int devices, bool trainable_only = false);

std::string format_plan(const Plan& plan);
std::string format_search(const SearchResult& result, size_t top = 10);
nlohmann::json plan_json(const Plan& plan);

// Formulas the plans use, exposed for tests against the literature.
// Korthikanti et al. 2022, 16-bit activations of one transformer layer, bytes:
// s·b·h·(34 + 5as/h) alone, s·b·h·(10 + 24/t + 5as/(ht)) with tp t,
// s·b·h/t·(34 + 5as/h) with tp + sequence parallel, 2·s·b·h with full
// recompute; `flash` drops the 5as/h terms (no s×s scores kept).
double korthikanti_layer_bytes(double s, double b, double h, double a, int t, bool sp,
                               bool recompute, bool flash = false);
// The same count for an engine without dropout (no masks: 2 of the 34 bytes)
// and with flash attention, in elements: 16·s·b·h alone, s·b·h·(4 + 12/t)
// with tp t, 16·s·b·h/t with sequence parallel. (GPT's shapes: q|k|v of 3h,
// an MLP of 4h.)
double korthikanti_layer_elements(double s, double b, double h, int t, bool sp);
// ZeRO (Rajbhandari et al. 2020) mixed-precision Adam model states per rank:
// 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N.
double zero_model_state_bytes(double psi, int ranks, int stage);

}  // namespace po::plan
