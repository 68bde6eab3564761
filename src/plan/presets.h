// What the planner plans for: model shapes and clusters, by preset name or
// from a file. Layouts the engine cannot train yet (tensor, pipeline,
// grouped-query attention, untied head; GPT-3 175B's size is fine, its shape
// is GPT-2's) are modelled all the same and marked "not yet trainable".
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace po::plan {

inline constexpr double kGiB = 1024.0 * 1024 * 1024;

enum class Arch { kGPT2, kLlama };

struct ModelSpec {
  std::string name;
  Arch arch = Arch::kGPT2;
  int64_t n_layer = 0, n_embd = 0, n_head = 0;
  int64_t n_kv_head = 0;  // grouped-query attention (Llama); = n_head otherwise
  int64_t ffn = 0;        // MLP hidden width: 4C for GPT-2, SwiGLU's for Llama
  int64_t vocab = 0;
  int64_t seq_len = 0;    // the sequence length trained at
  bool tied_head = true;  // GPT-2 ties the LM head to wte; Llama does not

  // Parameters: each unit's (embeddings [+ untied head], blocks, final norm).
  std::vector<int64_t> unit_numels() const;
  int64_t num_params() const;
  // Training FLOPs per token at sequence T: 6Ψ + 12·L·C·T (REFERENCE.md).
  double flops_per_token(int64_t T) const;
  // The engine's own config of this shape: its declared layout
  // (model/layout.h) gives the unit sizes above.
  model::TransformerConfig engine;
};

// The planner's view of an engine config (name: the preset, for reports).
ModelSpec model_spec(const model::TransformerConfig& config, const std::string& name);
// A preset by name: the engine's (model/config.cc: GPT-2, Llama, TinyStories,
// gpt3-175b). Throws naming the known ones.
ModelSpec model_preset(const std::string& name);
std::vector<std::string> model_preset_names();

// Per device ("device": a GPU, or one rank of a CPU build) and per link.
struct ClusterSpec {
  std::string name;
  std::string source;       // where the numbers come from (datasheet, measured ...)
  int nodes = 1;
  int devices_per_node = 1;
  double device_memory = 0;      // bytes of compute-tier memory per device
  double host_memory = 0;        // bytes of host RAM per node
  double peak_flops_bf16 = 0;    // dense, per device
  double peak_flops_fp32 = 0;
  double efficiency = 0.5;       // fraction of peak the kernels reach in a step
  double intra_bw = 0;           // bytes/s bus bandwidth per device inside a node
  double inter_bw = 0;           // bytes/s bus bandwidth per device between nodes
  double latency = 0;            // seconds per collective call
  double nvme_read_bw = 0, nvme_write_bw = 0;  // bytes/s per node (0: no NVMe)
  double host_bw = 0;            // bytes/s between device and host memory
  double overhead = 0;           // bytes per device the framework holds (context, code, libraries)
  // Bytes more per device when the layout runs several processes (the MPI
  // library and its shared-memory transport): 0 where `overhead` includes it.
  double multi_process_overhead = 0;
  // A CPU build: a node's cores (and memory) are shared by the ranks on it,
  // so fewer ranks get more each. The peaks above are per core.
  bool shared_cores = false;
  int devices() const { return nodes * devices_per_node; }
  // Compute-tier bytes each of `ranks` ranks has: device_memory, or with
  // shared cores the node's RAM split over the ranks on it.
  double memory_per_rank(int ranks) const {
    return shared_cores ? host_memory / std::min(ranks, devices_per_node) : device_memory;
  }
};

// "local" (this machine, peaks measured now), "a100-80gb-ib200",
// "a100-80gb-ib400", "h100-80gb-ib200", "h100-80gb-ib400", or a TOML file
// (see docs/planning.md). `nodes` > 0 overrides the node count.
// `rank_threads` > 0 (local): the threads a training rank of the plan's
// layout runs its GEMMs with (train.threads, or the cores over the ranks);
// the fixed per-rank overhead is measured with that many (OpenMP and BLAS
// keep per-thread buffers), the peak FLOP/s with every core.
ClusterSpec cluster_preset(const std::string& name_or_file, int nodes = 0, int rank_threads = 0);
// A cluster file's text (docs/planning.md); `origin` names it in errors,
// which are core::InvalidArgument naming the key (plan/cluster_file.cc).
ClusterSpec parse_cluster(const std::string& text, const std::string& origin);
std::vector<std::string> cluster_preset_names();

}  // namespace po::plan
