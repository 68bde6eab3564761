// Low-communication training inside one job (DiLoCo; docs/diloco.md): the
// outer step over parallel.replicas replicas, each a whole dp × tp × pp × cp
// mesh training on its own part of every step's batch.
//
// Every rank keeps the outer state of one slice of the model: its slice as a
// checkpoint writer (pipeline_train.cc's Writers: a cut of its stage's whole
// units over the stage's data and tensor ranks), the same slice on every
// replica. At an outer step each rank
//   1. takes Δ = θ − θ_k on its slice (θ the global copy, θ_k its replica's
//      parameters),
//   2. averages it over the replicas: a sum in a fixed order, in
//      outer.exchange_dtype (fp32 and bf16: the ring all-reduce, every rank
//      the same bits; int8: blockwise absmax codes gathered from every
//      replica and summed in replica order),
//   3. steps θ on Δ̄ (optim/outer.h) and hands θ back as the replica's new
//      parameters.
// Between outer steps the state is idle: with memory.nvme_dir (and
// outer.paged) it lives in pages of a swap file of its own, read and written
// once per outer step.
//
// outer.fragments F > 1 (Streaming DiLoCo, Douillard et al. 2025): unit u
// belongs to fragment u mod F, and fragment f's outer step comes at the
// inner steps s with (s + 1 + f·H/F) mod H = 0, so each fragment is
// synchronised every H steps and the traffic is spread over the H steps.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/outer_file.h"
#include "comm/communicator.h"
#include "core/config.h"
#include "memory/pager.h"
#include "optim/outer.h"
#include "optim/paged_state.h"

namespace po::train {

enum class ExchangeDtype : uint8_t { kF32, kBf16, kInt8 };
ExchangeDtype parse_exchange_dtype(const std::string& name);  // outer.exchange_dtype; errors name it

struct OuterOptions {
  optim::OuterConfig outer;
  int64_t local_steps = 0;  // H
  int fragments = 1;        // F
  ExchangeDtype exchange = ExchangeDtype::kF32;
  // Paged outer state: the pager's options (nvme_dir set), else in memory.
  bool paged = false;
  memory::PagerOptions pager;
};
// The keys outer.*, train.local_steps (checked; naming the key). `rank`
// names the swap file.
OuterOptions outer_options(const core::Config& cfg, int rank);

// Elements of an int8 exchange's blocks (one fp32 absmax each).
inline constexpr int64_t kExchangeBlock = 256;

class OuterSync {
 public:
  // `replicas`: the ranks holding this slice on every replica, in replica
  // order (null: one replica). `initial` (numel floats): θ at the start.
  OuterSync(const OuterOptions& o, comm::Communicator* replicas, int64_t numel, const float* initial);
  ~OuterSync();

  int64_t local_steps() const { return o_.local_steps; }
  int fragments() const { return o_.fragments; }
  // The fragment whose outer step follows inner step `step` (0-based), or
  // -1; `last`: the run's last step, after which every fragment steps.
  int due(int64_t step) const;

  struct Stats {
    double seconds = 0;
    uint64_t bytes = 0;      // payload bytes this rank exchanged with the replicas
    int64_t elements = 0;    // of this rank's slice
    double delta_sq = 0;     // Σ Δ̄² over them
  };
  // Fragment `fragment`'s outer step on `ranges` ((offset, count) pairs in
  // slice elements: the fragment's) of the slice `local`, whose elements
  // there become θ. A collective over the replicas.
  Stats step(int fragment, float* local, const std::vector<std::pair<int64_t, int64_t>>& ranges);

  int64_t outer_steps(int fragment) const { return t_[static_cast<size_t>(fragment)]; }
  // The whole state, for a checkpoint: every schema field's numel floats
  // (named by the schema) and the outer steps each fragment has taken.
  using Saved = checkpoint::OuterFile;
  Saved save();
  // Throws InvalidArgument naming `what` when `s` is not this state's shape.
  void load(const Saved& s, const std::string& what);
  bool paged() const { return pages_ != nullptr; }
  // Bytes of outer state in memory (0 when paged: a step's staging only).
  size_t resident_bytes() const;
  memory::PagerStats take_paging_stats();

 private:
  // Δ (n elements) becomes Δ̄: the replicas' mean, the same bits everywhere.
  void exchange(float* delta, int64_t n);

  OuterOptions o_;
  comm::Communicator* replicas_;
  int64_t n_;
  optim::StateSchema schema_;
  std::vector<std::vector<float>> fields_;       // in memory: one per schema field
  std::unique_ptr<optim::PagedState> pages_;     // or paged
  std::vector<int64_t> t_;                       // outer steps taken, per fragment
};

}  // namespace po::train
