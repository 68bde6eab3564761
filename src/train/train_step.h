// What every step shares, whichever layout: the loss's denominator (every
// token of the global batch, or with SFT data its counted targets), the
// context group's cut of a batch, MFU, and the step's record in
// metrics.jsonl. Batches are a pure function of (seed, step, rank's slice),
// so a resumed run takes the same steps as an uninterrupted one.
#pragma once

#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "data/loader.h"
#include "data/token_file.h"
#include "memory/pager.h"
#include "model/transformer.h"
#include "parallel/context_parallel.h"
#include "train/launch.h"
#include "train/rank_records.h"
#include "train/run_state.h"

namespace po::train {

// Context parallel: this rank's chunks (model/parallel_ops.h) of `micro`
// whole sequences of T tokens, seq[micro × T] → local[micro × T / cp].
void cut_context_rows(const model::ContextSplit& cp, int64_t micro, int64_t T,
                      const int32_t* seq, int32_t* local);

// Tokens in one step's global batch, all ranks (of every replica).
inline double tokens_per_step(const Plan& p) { return static_cast<double>(p.replicas * p.batch * p.T); }

// MFU's denominator, GFLOP/s per rank: train.peak_gflops, or the GEMM peak
// of the precision the steps run in (the bf16 GEMM's on bf16 operands in a
// bf16 run), measured here on this rank's threads. Every rank measures at
// once, so each reads the peak of its own share of the cores.
double gemm_peak_gflops(const core::Config& cfg);
// The log's words for it: "sgemm peak N GFLOP/s[, as configured]: mfu's denominator".
std::string gemm_peak_note(const core::Config& cfg, double peak_gflops);

// Model FLOPs utilisation of a step: its tokens per second × the model's
// FLOPs per token, over every rank's peak.
inline double model_flops_utilisation(const Plan& p, const model::TransformerConfig& m,
                                      double tokens_per_s, double peak_gflops) {
  return tokens_per_s * m.flops_per_token(p.T) / (peak_gflops * 1e9 * static_cast<double>(p.world()));
}

// What one step did, on this rank.
struct StepStats {
  double loss = 0;  // mean over the global batch (every rank's)
  double lr = 0, grad_norm = 0;
  double seconds = 0;      // the step's wall time, the loss's reduction included
  double comm_wait_s = 0;  // waiting on the gradients' collectives
  comm::Traffic traffic;   // what the step's training moved over dp (not the reporting)
  comm::Traffic tp_traffic;  // what it moved over the tensor group
  double tp_seconds = 0;     // in the tensor group's collectives (on the critical path)
  double cp_attention_s = 0, cp_wait_s = 0;  // context parallel's blocks, and its exposed waits
  comm::Traffic cp_traffic;  // what it moved over the context group
  memory::PagerStats paging;
};

// The targets step `step`'s loss is the mean over: every token of the
// global batch, or with SFT data the batch's counted targets (each rank
// counts them from the sampler, a pure function of the step; none is an
// error naming the step), so a batch of 8 is the batch of 1 accumulated 8
// times however long the examples are. `first`: the batch's first
// sequence in the step's (replica ρ's batch starts at ρ · batch).
double step_targets(const data::BatchSampler& sampler, const Plan& p, int64_t step, int64_t first = 0);

// Validation over SFT data: sum (Σ of a batch's mean × its rows) over the
// counted targets of those batches, both summed over the context group
// (null at cp = 1) first; none counted is an error.
double counted_mean(double sum, double counted, comm::Communicator* context, int64_t batches);

// Exposed communication: how long it ran on after the LAST rank finished its
// backward; imbalance: how far apart the ranks' backwards ended.
// `wait_end_ns`: when this rank's wait for the sums ended (the engine's);
// one rank (no world): neither.
struct CommSplit {
  double exposed_ms = 0, imbalance_ms = 0;
};
CommSplit comm_split(const comm::Communicator* world, int64_t wait_end_ns, const std::vector<RankRecord>& records,
                     double comm_wait_s);

// The step's record in metrics.jsonl. `state` is after the step; `predicted`:
// the memory ledger's prediction for this rank (bytes).
// Either engine's: `peak_gflops` is mfu's denominator (gemm_peak_gflops).
nlohmann::json step_metrics(const Plan& p, const model::TransformerConfig& mcfg, double peak_gflops,
                            const StepStats& s, const TrainState& state, const CommSplit& split, size_t predicted,
                            const std::vector<RankRecord>& records);


}  // namespace po::train
