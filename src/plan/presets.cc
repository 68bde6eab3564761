#include "plan/presets.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <thread>
#include <vector>

#include "backend/ops.h"
#include "core/error.h"

namespace po::plan {

std::vector<int64_t> ModelSpec::unit_numels() const { return engine.unit_numels(); }

int64_t ModelSpec::num_params() const { return engine.num_params(); }

double ModelSpec::flops_per_token(int64_t T) const {
  if (engine.moe.on()) return engine.flops_per_token(T);  // (the k experts a row runs)
  return 6.0 * static_cast<double>(num_params()) + 12.0 * static_cast<double>(n_layer * n_embd * T);
}

ModelSpec model_spec(const model::TransformerConfig& config, const std::string& name) {
  const model::TransformerConfig c = config.resolved();
  c.validate();
  ModelSpec m;
  m.name = name;
  m.arch = c.arch == "llama" ? Arch::kLlama : Arch::kGPT2;
  m.n_layer = c.n_layer;
  m.n_embd = c.n_embd;
  m.n_head = c.n_head;
  m.n_kv_head = c.n_kv_head;
  m.ffn = c.ffn_hidden;
  m.vocab = c.vocab_size;
  m.seq_len = c.seq_len;
  m.tied_head = c.tie_embeddings;
  m.engine = c;
  return m;
}

ModelSpec model_preset(const std::string& name) {
  return model_spec(model::TransformerConfig::preset(name), name);
}

std::vector<std::string> model_preset_names() { return model::TransformerConfig::preset_names(); }

namespace {

// DGX-class nodes: 8 GPUs on NVLink, one InfiniBand NIC per GPU. Peaks are
// the datasheets' dense numbers; bus bandwidths are what nccl-tests reaches
// on such nodes (about 230 GB/s all-reduce busbw on A100 NVLink 3, 450 on
// H100 NVLink 4; about 90% of the NIC's line rate between nodes).
ClusterSpec dgx(const std::string& name, bool h100, int ib_gbps) {
  ClusterSpec c;
  c.name = name;
  c.source = h100 ? "H100 SXM 80GB datasheet, NVLink 4, " : "A100 SXM 80GB datasheet, NVLink 3, ";
  c.source += std::to_string(ib_gbps) + " Gb/s InfiniBand per GPU";
  c.devices_per_node = 8;
  c.device_memory = 80 * kGiB;
  c.host_memory = (h100 ? 2048 : 1024) * kGiB;
  c.peak_flops_bf16 = h100 ? 989e12 : 312e12;
  c.peak_flops_fp32 = h100 ? 67e12 : 19.5e12;
  c.efficiency = 0.55;
  c.intra_bw = h100 ? 450e9 : 230e9;
  c.inter_bw = 0.9 * ib_gbps / 8.0 * 1e9;
  c.latency = 15e-6;
  c.nvme_read_bw = h100 ? 25e9 : 12e9;
  c.nvme_write_bw = h100 ? 12e9 : 6e9;
  c.host_bw = h100 ? 50e9 : 25e9;
  c.overhead = 1.5 * kGiB;  // CUDA context, NCCL channels, cuBLAS workspace
  return c;
}

double mem_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  double kb = 0;
  std::string unit;
  while (f >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return 0;
}

// Best of 3 copies of 64 MiB: the bandwidth of one core's memcpy.
double measure_memcpy_bw() {
  const size_t n = size_t{64} << 20;
  std::vector<char> a(n, 1), b(n, 0);
  double best = 1e30;
  for (int rep = 0; rep < 4; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(b.data(), a.data(), n);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rep > 0) best = std::min(best, s);
  }
  return static_cast<double>(n) / best;
}

// This machine: one "device" per core (the engine runs one rank per core),
// each with its share of the measured GEMM peak and of the available RAM.
// Ranks exchange data through shared memory: an all-reduce's bus bandwidth
// is about half a memcpy's (each byte is copied in and out). NVMe numbers are
// this VM's fio results (docs/benchmarks.md).
// This process's peak resident set since the last reset_peak_rss() (VmHWM),
// in bytes; 0 when /proc does not say.
double peak_rss_bytes() {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.starts_with("VmHWM:")) return std::stod(line.substr(6)) * 1024.0;  // kB
  return 0;
}

// Starts peak_rss_bytes() again from the current resident set (Linux: 5 to clear_refs).
void reset_peak_rss() { std::ofstream("/proc/self/clear_refs") << "5"; }

ClusterSpec local(int rank_threads) {
  ClusterSpec c;
  c.name = "local";
  c.devices_per_node = std::max(1u, std::thread::hardware_concurrency());
  // Measured, not assumed: this process is the engine's binary and has just
  // run the GEMM probe a training run also runs at start, with a rank's
  // threads, so its peak resident size is what a rank holds besides its
  // model state (code, libraries, oneDNN's JIT kernels, per-thread buffers,
  // the probe's matrices, C++ runtime).
  const int all = backend::cpu::num_threads();
  double fixed = 0;
  if (rank_threads > 0 && rank_threads != all) {
    backend::cpu::set_num_threads(rank_threads);
    reset_peak_rss();
    (void)backend::cpu::measure_gemm_peak_gflops();
    fixed = peak_rss_bytes();
    backend::cpu::set_num_threads(all);
  } else {
    reset_peak_rss();
  }
  const double gemm = backend::cpu::measure_gemm_peak_gflops() * 1e9;
  if (fixed == 0) fixed = peak_rss_bytes();
  c.peak_flops_fp32 = gemm / c.devices_per_node;
  // bf16 runs its GEMMs on bf16 operands (oneDNN, AVX512-BF16 where present).
  c.peak_flops_bf16 =
      backend::cpu::measure_gemm_peak_gflops(backend::cpu::GemmPrecision::kBF16) * 1e9 / c.devices_per_node;
  c.efficiency = 0.85;  // the engine's measured MFU on bench-small here (docs/planning.md)
  c.shared_cores = true;
  c.host_memory = mem_available_bytes();
  c.device_memory = c.host_memory / c.devices_per_node;
  c.intra_bw = measure_memcpy_bw() / 2;
  c.inter_bw = c.intra_bw;
  c.latency = 20e-6;
  c.nvme_read_bw = 1.16e9;
  c.nvme_write_bw = 1.79e9;
  c.host_bw = c.intra_bw;
  c.overhead = fixed > 0 ? fixed : 0.19 * kGiB;
  // OpenMPI and its shared-memory transport, per rank (measured 2026-12-01 by
  // plan_vs_engine_launch_test: 63 MiB alone, 75 MiB per rank under mpirun).
  c.multi_process_overhead = 12.0 * (1 << 20);
  c.source = "measured now: sgemm " + std::to_string(static_cast<int>(gemm / 1e9)) +
             " GFLOP/s, bf16 GEMM " +
             std::to_string(static_cast<int>(c.peak_flops_bf16 * c.devices_per_node / 1e9)) +
             " GFLOP/s on all cores; memcpy; RAM available";
  return c;
}

}  // namespace

std::vector<std::string> cluster_preset_names() {
  return {"local", "a100-80gb-ib200", "a100-80gb-ib400", "h100-80gb-ib200", "h100-80gb-ib400"};
}

ClusterSpec cluster_preset(const std::string& name, int nodes, int rank_threads) {
  ClusterSpec c;
  if (name == "local") {
    c = local(rank_threads);
  } else if (name.starts_with("a100-80gb-ib") || name.starts_with("h100-80gb-ib")) {
    const std::string ib = name.substr(std::strlen("a100-80gb-ib"));
    PO_CHECK(ib == "200" || ib == "400", "--cluster ", name, ": InfiniBand is ib200 or ib400");
    c = dgx(name, name[0] == 'h', std::stoi(ib));
  } else if (name.find('/') != std::string::npos || name.ends_with(".toml")) {
    std::ifstream f(name, std::ios::binary);
    PO_CHECK(f.good(), "--cluster ", name, ": cannot read the file");
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    c = parse_cluster(text, name);
  } else {
    std::string known;
    for (const auto& n : cluster_preset_names()) known += (known.empty() ? "" : ", ") + n;
    PO_THROW(core::InvalidArgument, "--cluster: unknown preset '", name, "' (known: ", known,
             "; or a TOML file)");
  }
  if (nodes > 0) c.nodes = nodes;
  return c;
}

}  // namespace po::plan
