// The run's launch: batch plan, MPI world, CPU threads, run directory.
// Checks come before the side effects they guard (MPI_Init, run.dir).
#include "train/launch.h"

#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "backend/ops.h"
#include "comm/env.h"
#include "comm/mesh.h"
#include "comm/mpi/communicator.h"
#include "comm/mpi/join.h"
#include "comm/mpi/topology.h"
#include "core/cpus.h"
#include "core/error.h"
#include "data/token_file.h"
#include "optim/adamw.h"
#include "train/optim_keys.h"
#include "core/log.h"
#include "parallel/context_parallel.h"
#include "parallel/pipeline_schedule.h"
#include "plan/capabilities.h"
#include "train/run_state.h"

namespace po::train {
namespace fs = std::filesystem;
namespace ops = po::backend::cpu;
namespace {

// XXH3 of this process's executable: ranks must run the same build.
uint64_t binary_hash() {
  std::ifstream f("/proc/self/exe", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return XXH3_64bits(bytes.data(), bytes.size());
}

// Every rank must have resolved the same config and run the same binary;
// otherwise the run stops before training, naming the ranks that differ.
void check_ranks_agree(comm::Communicator& world, const core::Config& cfg) {
  const uint64_t mine[2] = {cfg.hash(), binary_hash()};
  std::vector<uint64_t> all(2 * static_cast<size_t>(world.size()));
  world.all_gather(mine, all.data(), 4, tensor::DType::kI32);  // 2 x u64 as 4 x i32
  std::string config_ranks, binary_ranks;
  for (int r = 1; r < world.size(); ++r) {
    if (all[2 * r] != all[0]) config_ranks += (config_ranks.empty() ? "" : ", ") + std::to_string(r);
    if (all[2 * r + 1] != all[1])
      binary_ranks += (binary_ranks.empty() ? "" : ", ") + std::to_string(r);
  }
  PO_CHECK(config_ranks.empty(), "rank(s) ", config_ranks,
           " resolved a different config than rank 0 (compare their --set and config files)");
  PO_CHECK(binary_ranks.empty(), "rank(s) ", binary_ranks,
           " run a different pagedoptim binary than rank 0 (rebuild or redeploy the same build)");
}

// "parallel.dp = 2" or "parallel.dp × parallel.tp = 2 × 2 = 4": the keys behind a world size.
std::string world_keys(const Plan& p) {
  if (p.replicas > 1)
    return core::str_cat("parallel.replicas × parallel.dp × parallel.tp × parallel.pp × parallel.cp = ", p.replicas,
                         " × ", p.dp, " × ", p.tp, " × ", p.pp, " × ", p.cp, " = ", p.world());
  if (p.cp > 1)
    return core::str_cat("parallel.dp × parallel.tp × parallel.pp × parallel.cp = ", p.dp, " × ",
                         p.tp, " × ", p.pp, " × ", p.cp, " = ", p.world());
  if (p.tp == 1 && p.pp == 1) return core::str_cat("parallel.dp = ", p.dp);
  if (p.pp == 1)
    return core::str_cat("parallel.dp × parallel.tp = ", p.dp, " × ", p.tp, " = ", p.world());
  return core::str_cat("parallel.dp × parallel.tp × parallel.pp = ", p.dp, " × ", p.tp, " × ",
                       p.pp, " = ", p.world());
}

// Before MPI_Init, which cannot report a wrong launch (it aborts the process):
// the launcher must be one MPI can join, and must have started dp × tp processes.
void check_launch(const comm::LaunchEnv& env, const Plan& p) {
  const int64_t n = p.world();
  switch (env.source) {
    case comm::LaunchSource::kNone:
      PO_THROW(core::InvalidArgument, world_keys(p), " needs ", n,
               " processes: use `pagedoptim train --nproc ", n, "`, `mpirun -np ", n,
               " pagedoptim train ...` or `srun --mpi=pmix -n ", n, " pagedoptim train ...`");
    case comm::LaunchSource::kSlurm:
      // Debian's OpenMPI joins a Slurm step only through PMIx; under any other
      // srun plugin MPI_Init aborts with an unhelpful message.
      PO_CHECK(std::getenv("PMIX_RANK") != nullptr, world_keys(p),
               ": srun started this task without PMIx; run `srun --mpi=pmix ...` (or set "
               "MpiDefault=pmix in slurm.conf)");
      break;
    case comm::LaunchSource::kOpenMpi:
    case comm::LaunchSource::kTorchrun:
      break;
  }
  PO_CHECK(env.world_size == n, world_keys(p), " but ", comm::launch_source_name(env.source),
           " started ", env.world_size, " processes");
}

}  // namespace

Plan make_plan(const core::Config& cfg, const model::TransformerConfig& m) {
  Plan p;
  p.batch = cfg.get_int("train.batch_size");
  p.micro = cfg.get_int("train.micro_batch_size");
  if (p.micro == 0) p.micro = p.batch;
  PO_CHECK(p.batch % p.micro == 0, "train.batch_size = ", p.batch,
           " must be a multiple of train.micro_batch_size = ", p.micro);
  p.dp = cfg.get_int("parallel.dp");
  PO_CHECK(p.batch % (p.dp * p.micro) == 0, "train.batch_size = ", p.batch,
           " must be a multiple of parallel.dp × train.micro_batch_size = ", p.dp, " × ",
           p.micro);
  p.accum = p.batch / (p.dp * p.micro);
  p.replicas = cfg.get_int("parallel.replicas");
  p.local_steps = cfg.get_int("train.local_steps");
  PO_CHECK(p.replicas == 1 || p.local_steps > 0, "parallel.replicas = ", p.replicas,
           " trains replicas that meet every train.local_steps steps: set it (DiLoCo's is 500; docs/diloco.md)");
  PO_CHECK(p.local_steps == 0 || !cfg.get_bool("checkpoint.async"),
           "checkpoint.async with train.local_steps: not built yet (docs/diloco.md)");
  p.T = m.seq_len;
  p.steps = cfg.get_int("train.steps");
  p.stop_at = cfg.get_int("train.stop_at");
  p.eval_interval = cfg.get_int("train.eval_interval");
  p.eval_batches = cfg.get_int("train.eval_batches");
  p.ckpt_interval = cfg.get_int("train.checkpoint_interval");
  p.keep = cfg.get_int("checkpoint.keep");
  const std::string& precision = cfg.get_string("train.precision");
  PO_CHECK(precision == "fp32" || precision == "bf16", "train.precision = \"", precision,
           "\": choose \"fp32\", \"bf16\" or \"auto\"");
  const std::string& reduce = cfg.get_string("parallel.reduce_dtype");
  PO_CHECK(reduce == "fp32" || reduce == "bf16", "parallel.reduce_dtype = \"", reduce,
           "\": choose \"fp32\" or \"bf16\"");
  p.pp = cfg.get_int("parallel.pp");
  p.cp = cfg.get_int("parallel.cp");
  (void)parallel::parse_cp_mode(cfg.get_string("parallel.cp_mode"));
  const std::string balance = cfg.get_string("parallel.cp_balance");
  PO_CHECK(balance == "zigzag" || balance == "contiguous", "parallel.cp_balance = \"", balance,
           "\": choose \"zigzag\" or \"contiguous\"");
  if (p.cp > 1) {
    const int64_t chunks = balance == "zigzag" ? 2 * p.cp : p.cp;
    PO_CHECK(p.T % chunks == 0, "parallel.cp = ", p.cp, " with parallel.cp_balance = \"", balance,
             "\" cuts model.seq_len = ", p.T, " into ", chunks, " equal chunks, which it must divide");
  }
  const int64_t mb = cfg.get_int("parallel.micro_batches");
  PO_CHECK(mb == 1 || mb == p.accum, "parallel.micro_batches = ", mb, " but train.batch_size / ",
           "(parallel.dp × train.micro_batch_size) = ", p.batch, " / (", p.dp, " × ", p.micro,
           ") = ", p.accum, " micro-batches per data-parallel rank; leave it unset or make them agree");
  if (p.pp > 1) {
    const std::string schedule = cfg.get_string("parallel.schedule");
    parallel::pipeline::check_schedule(parallel::pipeline::parse_schedule(schedule),
                                       static_cast<int>(p.pp), static_cast<int>(p.accum),
                                       static_cast<int>(cfg.get_int("parallel.virtual_stages")));
    if (cfg.get_bool("parallel.vocab_parallel"))
      PO_CHECK(p.pp <= 8, "parallel.vocab_parallel spreads the head's 8 vocabulary pieces over at ",
               "most 8 pipeline ranks, not parallel.pp = ", p.pp);
  }
  // What the engine does not build: the table `plan` reads too.
  plan::Layout wanted;
  wanted.dp = static_cast<int>(p.dp);
  wanted.tp = static_cast<int>(cfg.get_int("parallel.tp"));
  wanted.pp = static_cast<int>(p.pp);
  wanted.cp = static_cast<int>(p.cp);
  wanted.zero_stage = static_cast<int>(cfg.get_int("parallel.zero_stage"));
  wanted.bf16 = precision == "bf16";
  wanted.vocab_parallel = cfg.get_bool("parallel.vocab_parallel");
  wanted.paging = cfg.get_size("memory.compute_budget") > 0 || !cfg.get_string("memory.nvme_dir").empty();
  wanted.state_bits = train::adamw_config(cfg).state_bits;  // (checks the optim.* keys)
  wanted.lora_r = cfg.get_int("lora.r");
  wanted.lora_dropout = wanted.lora_r > 0 && cfg.get_float("lora.dropout") > 0.0;
  wanted.sft = !cfg.get_string("data.train").empty() &&
               std::filesystem::exists(data::mask_path(cfg.get_string("data.train")));
  wanted.pack = cfg.get_bool("data.pack");
  wanted.moe_experts = m.moe.experts;
  if (p.pp > 1) wanted.schedule = parallel::pipeline::parse_schedule(cfg.get_string("parallel.schedule"));
  if (const auto refused = plan::refusals(wanted); !refused.empty())
    PO_THROW(core::InvalidArgument, refused.front().message());
  p.tp = cfg.get_int("parallel.tp");
  PO_CHECK(p.tp >= 1, "parallel.tp must be >= 1, got ", p.tp);
  (void)m.shard(p.tp);  // the heads, kv heads and MLP must split: errors name the keys
  PO_CHECK(!m.sequence_parallel || p.tp == 1 || p.micro * p.T % p.tp == 0,
           "parallel.sequence_parallel splits the micro-batch's ", p.micro * p.T,
           " tokens (train.micro_batch_size × model.seq_len = ", p.micro, " × ", p.T,
           ") over parallel.tp = ", p.tp, " ranks, which must divide them");
  return p;
}

// Gradients are summed over ranks in buckets during the backward of each
// step's last micro-batch (parallel/pipeline_grad_sync.cc).
Launch::Launch(const core::Config& cfg, const Plan& p) {
  const int64_t n = p.world();
  if (n > 1) {
    const comm::LaunchEnv env = comm::detect_launch_env();
    check_launch(env, p);
    comm::mpi::MpiOptions mo;
    mo.timeout = std::chrono::milliseconds(
        static_cast<int64_t>(cfg.get_float("parallel.timeout") * 1000.0));
    // mpirun / srun: MPI_COMM_WORLD; torchrun-style: the rendezvous and join.
    auto mpi_world = comm::mpi::join_world_from_env(env, mo.timeout, mo);
    mpi_session = std::make_unique<comm::mpi::Session>();  // MPI is up by now; this finalizes it
    local_ranks = comm::mpi::ranks_on_this_node(mpi_world->handle());
    world = std::move(mpi_world);
    PO_CHECK(world->size() == n, world_keys(p), " but ", world->size(),
             " processes were launched");
    check_ranks_agree(*world, cfg);
  }
  const int global = world ? world->rank() : 0;
  leader = global == 0;
  if (p.replicas > 1) {
    // The slowest axis: replica ρ is ranks [ρ·R, (ρ+1)·R) of the job's.
    const int per = static_cast<int>(p.replica_world());
    replica = global / per;
    everyone = std::move(world);
    across = everyone->split(global % per, replica, core::str_cat("outer", global % per));
    if (per > 1) world = everyone->split(replica, global % per, core::str_cat("replica", replica));
  }
  rank = world ? world->rank() : 0;
  dp_rank = rank;  // at tp = 1
  if (world && (p.tp > 1 || p.pp > 1 || p.cp > 1)) {
    // Megatron's rank order: tp fastest, so a tensor group is consecutive
    // ranks; pp slowest, so a stage is a block of dp × tp ranks.
    const comm::DeviceMesh mesh(static_cast<int>(p.replica_world()), {.dp = static_cast<int>(p.dp),
                                                      .tp = static_cast<int>(p.tp),
                                                      .pp = static_cast<int>(p.pp),
                                                      .cp = static_cast<int>(p.cp)});
    const comm::MeshCoords at = mesh.coords(rank);
    dp_rank = at.dp;
    tp_rank = at.tp;
    pp_rank = at.pp;
    cp_rank = at.cp;
    meshed = true;
    auto group = [&](comm::Axis axis, const char* name) -> std::unique_ptr<comm::Communicator> {
      auto g = world->split(mesh.group_color(rank, axis), mesh.rank_in_group(rank, axis),
                            core::str_cat(name, mesh.group_color(rank, axis)));
      if (g->size() == 1) return nullptr;
      return g;
    };
    data = p.cp > 1 ? group(comm::Axis::kDataContext, "dp-cp") : group(comm::Axis::kData, "dp");
    context = group(comm::Axis::kContext, "cp");
    tensor = group(comm::Axis::kTensor, "tp");
    pipeline = group(comm::Axis::kPipeline, "pp");
  }
  if (job()) {
    // Rank 0 reports; the others speak only to warn or fail, and say who they are.
    core::set_log_prefix("[rank " + std::to_string(global) + "] ");
    if (!leader && core::log_level() < core::LogLevel::kWarn)
      core::set_log_level(core::LogLevel::kWarn);
  }
}

Launch::~Launch() = default;

std::string resolve_precision(core::Config& cfg) {
  const std::string precision = cfg.get_string("train.precision");
  if (precision != "auto") return precision;
  const std::string chosen = ops::native_bf16_gemm() ? "bf16" : "fp32";
  cfg.set_text("train.precision", "\"" + chosen + "\"",
               "train.precision = \"auto\" on this CPU");
  return chosen;
}

int setup_compute(const core::Config& cfg, int local_ranks) {
  int threads = static_cast<int>(cfg.get_int("train.threads"));
  if (threads == 0) threads = std::max(1, core::usable_cpus() / local_ranks);
  ops::set_num_threads(threads);
  // bf16: parameters and gradients stored in bf16 (the executor), the
  // products of every linear layer (and the tied head) in bf16 with f32
  // accumulation; fp32 master weights and Adam state for the update.
  const bool bf16 = cfg.get_string("train.precision") == "bf16";
  ops::set_gemm_precision(bf16 ? ops::GemmPrecision::kBF16 : ops::GemmPrecision::kF32);
  if (bf16 && !ops::native_bf16_gemm())
    PO_LOG_WARN("train.precision = \"bf16\": this CPU/BLAS has no native bf16 GEMM; products "
                "are rounded to bf16 but run in f32 (no speed-up)");
  return threads;
}

void prepare_run_dir(const std::string& dir, bool resume) {
  std::error_code ec;
  const bool has_run = fs::exists(fs::path(dir) / "metrics.jsonl", ec) ||
                       !list_checkpoints((fs::path(dir) / "checkpoints").string()).empty();
  PO_CHECK(resume || !has_run, "run.dir '", dir,
           "' already holds a run; pass --resume to continue it or choose another run.dir");
  fs::create_directories(fs::path(dir) / "checkpoints", ec);
  PO_CHECK(!ec, "run.dir '", dir, "': cannot create: ", ec.message());
}

}  // namespace po::train
