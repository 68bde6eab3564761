#include "train/trainer.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <cstdio>
#include <array>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include <unistd.h>

#include "backend/ops.h"
#include "checkpoint/atomic_file.h"
#include "checkpoint/gpt2_io.h"
#include "comm/env.h"
#include "comm/mpi/communicator.h"
#include "comm/mpi/join.h"
#include "comm/mpi/topology.h"
#include "core/cpus.h"
#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"
#include "memory/pager.h"
#include "data/loader.h"
#include "data/token_file.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "optim/schedule.h"
#include "parallel/data_parallel.h"
#include "plan/planner.h"
#include "train/metrics.h"
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

struct Plan {
  int64_t batch = 0, micro = 0, accum = 0, T = 0, steps = 0;
  int64_t dp = 1;  // data-parallel ranks; accum counts this rank's micro-batches
  int64_t eval_interval = 0, eval_batches = 0, ckpt_interval = 0, keep = 0;
};

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
  p.T = m.seq_len;
  p.steps = cfg.get_int("train.steps");
  p.eval_interval = cfg.get_int("train.eval_interval");
  p.eval_batches = cfg.get_int("train.eval_batches");
  p.ckpt_interval = cfg.get_int("train.checkpoint_interval");
  p.keep = cfg.get_int("checkpoint.keep");
  const std::string& precision = cfg.get_string("train.precision");
  PO_CHECK(precision == "fp32" || precision == "bf16", "train.precision = \"", precision,
           "\": choose \"fp32\" or \"bf16\"");
  const std::string& reduce = cfg.get_string("parallel.reduce_dtype");
  PO_CHECK(reduce == "fp32" || reduce == "bf16", "parallel.reduce_dtype = \"", reduce,
           "\": choose \"fp32\" or \"bf16\"");
  PO_CHECK(cfg.get_int("parallel.tp") * cfg.get_int("parallel.pp") * cfg.get_int("parallel.cp") ==
               1,
           "parallel.{tp,pp,cp} > 1 are not built yet (only parallel.dp)");
  return p;
}

// Refuses to mix a new run into a directory that holds another one.
void prepare_run_dir(const std::string& dir, bool resume) {
  std::error_code ec;
  const bool has_run = fs::exists(fs::path(dir) / "metrics.jsonl", ec) ||
                       !list_checkpoints((fs::path(dir) / "checkpoints").string()).empty();
  PO_CHECK(resume || !has_run, "run.dir '", dir,
           "' already holds a run; pass --resume to continue it or choose another run.dir");
  fs::create_directories(fs::path(dir) / "checkpoints", ec);
  PO_CHECK(!ec, "run.dir '", dir, "': cannot create: ", ec.message());
}

double evaluate(model::Transformer& model, const data::TokenFile& val, const Plan& p,
                std::vector<int32_t>& inputs, std::vector<int32_t>& targets) {
  double sum = 0;
  data::EvalSampler windows(val, p.T);
  // train() checked at start that data.val holds at least one batch.
  const int64_t batches = std::min(p.eval_batches, windows.num_sequences() / p.micro);
  PO_ASSERT(batches >= 1, "validation file shrank after start-up: ", val.path());
  for (int64_t b = 0; b < batches; ++b) {
    windows.fill(b * p.micro, p.micro, inputs.data(), targets.data());
    sum += model.evaluate(inputs.data(), targets.data());
  }
  return sum / static_cast<double>(batches);
}

}  // namespace

namespace {

// Before MPI_Init, which cannot report a wrong launch (it aborts the process):
// the launcher must be one MPI can join, and must have started dp processes.
void check_launch(const comm::LaunchEnv& env, int64_t dp) {
  switch (env.source) {
    case comm::LaunchSource::kNone:
      PO_THROW(core::InvalidArgument, "parallel.dp = ", dp, " needs ", dp,
               " processes: use `pagedoptim train --nproc ", dp, "`, `mpirun -np ", dp,
               " pagedoptim train ...` or `srun --mpi=pmix -n ", dp, " pagedoptim train ...`");
    case comm::LaunchSource::kSlurm:
      // Debian's OpenMPI joins a Slurm step only through PMIx; under any other
      // srun plugin MPI_Init aborts with an unhelpful message.
      PO_CHECK(std::getenv("PMIX_RANK") != nullptr, "parallel.dp = ", dp,
               ": srun started this task without PMIx; run `srun --mpi=pmix ...` (or set "
               "MpiDefault=pmix in slurm.conf)");
      break;
    case comm::LaunchSource::kOpenMpi:
    case comm::LaunchSource::kTorchrun:
      break;
  }
  PO_CHECK(env.world_size == dp, "parallel.dp = ", dp, " but ", comm::launch_source_name(env.source),
           " started ", env.world_size, " processes");
}

// What each rank holds, by kind (DataParallel's ledger plus the process's
// peak RSS), gathered to every rank: one row per rank.
// "peak": the compute pool's high-water mark (every tensor::Storage the
// engine allocates, transient ones included) since set-up ended; in the
// set-up table, the peak of set-up itself.
constexpr const char* kMemoryKinds[] = {"params",      "grads", "master", "adam",  "gathered", "buckets",
                                        "activations", "pages", "host",   "total", "peak",
                                        "peak_rss"};
constexpr size_t kMemoryFields = std::size(kMemoryKinds);
using MemoryRow = std::array<uint64_t, kMemoryFields>;

// What every rank reports after a step, gathered in one collective: its
// memory and when its backward ended (for the exposed-communication split).
// Paging, per rank (all zero without): see paging_json().
constexpr const char* kPagingKinds[] = {
    "resident_compute_bytes", "resident_host_bytes", "resident_nvme_bytes",
    "nvme_read_bytes",        "nvme_written_bytes",  "host_read_bytes",
    "host_written_bytes",     "accesses",            "hits",
    "io_wait_us",             "pass_us",             "pages_updated_in_backward"};
using PagingRow = std::array<uint64_t, std::size(kPagingKinds)>;

struct RankRecord {
  MemoryRow memory;
  int64_t backward_end_ns;
  PagingRow paging;
};
static_assert(sizeof(RankRecord) % sizeof(int32_t) == 0);

PagingRow paging_row(parallel::DataParallel& dp, const memory::PagerStats& s) {
  optim::PagedAdamState* pg = dp.paged_state();
  if (pg == nullptr) return {};
  const uint64_t page = pg->page_bytes();
  return {pg->resident(memory::Tier::kCompute) * page, pg->resident(memory::Tier::kHost) * page,
          pg->resident(memory::Tier::kNvme) * page,    s.nvme_read_bytes,
          s.nvme_written_bytes,                         s.host_read_bytes,
          s.host_written_bytes,                         s.accesses,
          s.hits,                                       static_cast<uint64_t>(s.wait_s * 1e6),
          static_cast<uint64_t>(s.pass_s * 1e6),
          static_cast<uint64_t>(dp.pages_updated_in_backward())};
}

std::vector<RankRecord> gather_records(comm::Communicator* world, parallel::DataParallel& dp,
                                       const memory::PagerStats& paging = {}) {
  const parallel::MemoryReport m = dp.memory();
  const RankRecord mine = {{m.params, m.grads, m.master, m.adam, m.gathered, m.buckets,
                            m.activations, m.pages, m.host, m.total(),
                            tensor::pool_bytes_peak(tensor::Pool::kCompute), peak_rss_bytes()},
                           dp.backward_end_ns(), paging_row(dp, paging)};
  std::vector<RankRecord> rows(world ? static_cast<size_t>(world->size()) : 1);
  if (world)
    world->all_gather(&mine, rows.data(), sizeof(RankRecord) / sizeof(int32_t),
                      tensor::DType::kI32);
  else
    rows[0] = mine;
  return rows;
}

nlohmann::json memory_json(const std::vector<RankRecord>& rows) {
  nlohmann::json out = nlohmann::json::array();
  for (const RankRecord& r : rows) {
    nlohmann::json j;
    for (size_t k = 0; k < kMemoryFields; ++k) j[kMemoryKinds[k]] = r.memory[k];
    out.push_back(j);
  }
  return out;
}

// The step's collectives on the data-parallel group: {"allreduce": {"calls":
// c, "bytes": b}, ...}, operations that ran only (payload bytes: comm::Traffic).
nlohmann::json traffic_json(const comm::Traffic& t) {
  nlohmann::json out = nlohmann::json::object();
  for (int i = 0; i < comm::kNumCommOps; ++i) {
    if (t.calls[i] == 0) continue;
    out[comm::comm_op_name(static_cast<comm::CommOp>(i))] = {{"calls", t.calls[i]},
                                                             {"bytes", t.bytes[i]}};
  }
  return out;
}

std::string memory_table(const std::vector<RankRecord>& rows) {
  std::string t = "memory per rank (MiB):\n  rank";
  for (const char* k : kMemoryKinds) t += core::str_cat(" ", std::string(12 - std::min<size_t>(11, std::strlen(k)), ' '), k);
  for (size_t r = 0; r < rows.size(); ++r) {
    t += core::str_cat("\n  ", r < 10 ? "   " : "  ", r);
    for (uint64_t v : rows[r].memory) {
      char buf[32];
      std::snprintf(buf, sizeof buf, " %12.1f", static_cast<double>(v) / (1 << 20));
      t += buf;
    }
  }
  return t;
}

// A checkpoint's state kind as DataParallel names it.
parallel::DataParallel::Shard shard_of(checkpoint::StateKind k) {
  switch (k) {
    case checkpoint::StateKind::kParams: return parallel::DataParallel::Shard::kParams;
    case checkpoint::StateKind::kAdamM: return parallel::DataParallel::Shard::kAdamM;
    case checkpoint::StateKind::kAdamV: return parallel::DataParallel::Shard::kAdamV;
  }
  PO_THROW(core::Internal, "unknown checkpoint state kind");
}

// memory.*: with memory.host_budget or memory.nvme_dir set, Adam state (and
// a bf16 run's fp32 master) lives in pages. The compute tier keeps as many
// pages as memory.compute_budget leaves room for after the rest of this
// rank's compute-tier state (parameters, gradients, activations, the working
// buffers' bound); 0 means no compute budget (every page resident). Returns
// whether paging is on. Its one-screen table goes to the log at start-up.
bool setup_paging(const core::Config& cfg, parallel::DataParallel& dp,
                  const model::TransformerConfig& mcfg, const Plan& p, int rank) {
  const size_t compute_budget = cfg.get_size("memory.compute_budget");
  const size_t host_budget = cfg.get_size("memory.host_budget");
  const std::string& nvme_dir = cfg.get_string("memory.nvme_dir");
  const std::string& io = cfg.get_string("memory.io");
  PO_CHECK(io == "auto" || io == "fallback", "memory.io = \"", io,
           "\": choose \"auto\" (io_uring where allowed) or \"fallback\" (pread/pwrite threads)");
  if (host_budget == 0 && nvme_dir.empty()) {
    if (compute_budget > 0) tensor::set_pool_budget(tensor::Pool::kCompute, compute_budget);
    return false;
  }
  memory::PagerOptions o;
  o.page_bytes = cfg.get_size("memory.page_size");
  o.prefetch = static_cast<int>(cfg.get_int("memory.prefetch"));
  o.alternate = cfg.get_bool("memory.alternate");
  o.nvme_dir = nvme_dir;
  o.file_name = core::str_cat("pagedoptim-rank", rank, "-pid", static_cast<long>(getpid()), ".swap");
  o.nvme.queue_depth = static_cast<int>(cfg.get_int("memory.queue_depth"));
  o.nvme.block_bytes = cfg.get_size("memory.block_size");
  o.nvme.force_fallback = io == "fallback";
  PO_CHECK(o.page_bytes >= 4096 && o.page_bytes % 4096 == 0, "memory.page_size = ", o.page_bytes,
           " bytes: must be a multiple of 4096");
  const optim::PagedAdamState::Layout layout = dp.paging_layout();
  const int64_t numel = dp.adam().num_params();
  const optim::PagedAdamState::Geometry geo =
      optim::PagedAdamState::geometry(numel, o.page_bytes, layout);
  const size_t pages = geo.pages();
  const size_t paged_bytes = static_cast<size_t>(numel) * layout.element_bytes();
  // What the compute tier holds besides pages once set up: the ledger's count
  // of what is not paged, what else is allocated, the working buffers to come.
  const size_t predicted = dp.predicted_model_state_bytes() - paged_bytes +
                           model::Transformer::predicted_activation_bytes(mcfg, p.micro, p.T);
  // Allocations outside the engine's ledger (token files, ...).
  const size_t live = tensor::pool_bytes_live(tensor::Pool::kCompute);
  const size_t known = dp.memory().total();
  // The working buffers to come, as the planner replays them (gathers,
  // accumulators, buckets, staging, ring scratch at most: plan/planner.h).
  const plan::ModelSpec spec = plan::model_spec(mcfg, cfg.get_string("model.preset"));
  const auto working =
      static_cast<size_t>(plan::engine_working_bytes(spec, plan::layout_from_config(cfg, spec)));
  const size_t fixed = predicted + (live > known ? live - known : 0) + working;
  const size_t min_frames = optim::PagedAdamState::min_compute_frames(geo, o.prefetch);
  if (compute_budget == 0) {
    o.compute_frames = pages;
  } else {
    const size_t need = fixed + min_frames * o.page_bytes;
    PO_CHECK(compute_budget >= need, "memory.compute_budget = ", compute_budget,
             " bytes is too small for rank ", rank, "'s working set: at least ", need,
             " bytes (", fixed, " for parameters, gradients, activations and working buffers + ",
             min_frames, " pages of ", o.page_bytes, ")");
    o.compute_frames = std::min(pages, (compute_budget - fixed) / o.page_bytes);
  }
  o.host_frames = host_budget / o.page_bytes;
  if (host_budget > 0) tensor::set_pool_budget(tensor::Pool::kHost, host_budget);
  dp.enable_paging(o);
  const optim::PagedAdamState& pg = *dp.paged_state();
  const auto mib = [](double b) { return b / (1 << 20); };
  char line[256];
  std::string t = "paged optimizer state (rank " + std::to_string(rank) + "):";
  std::snprintf(line, sizeof line, "\n  %zu pages of %.1f MiB (%lld elements: Adam m, v%s)",
                geo.state_pages, mib(static_cast<double>(o.page_bytes)),
                static_cast<long long>(geo.state_elements), layout.master ? ", fp32 master" : "");
  t += line;
  if (geo.param_pages > 0) {
    std::snprintf(line, sizeof line,
                  "\n  + %zu parameter-shard pages (%lld elements) + %zu gradient-shard pages (%lld elements)",
                  geo.param_pages, static_cast<long long>(geo.param_elements), geo.grad_pages,
                  static_cast<long long>(geo.grad_elements));
    t += line;
  }
  std::snprintf(line, sizeof line, ", %.1f MiB in all", mib(static_cast<double>(pages * o.page_bytes)));
  t += line;
  std::snprintf(line, sizeof line, "\n  compute tier: %zu pages (%.1f MiB) + %.1f MiB other state%s",
                pg.compute_frames(), mib(static_cast<double>(pg.compute_frames() * o.page_bytes)),
                mib(static_cast<double>(fixed)), compute_budget ? "" : " (no budget)");
  t += line;
  std::snprintf(line, sizeof line, "\n  host tier:    %zu pages (%.1f MiB)", pg.host_frames(),
                mib(static_cast<double>(pg.host_frames() * o.page_bytes)));
  t += line;
  using F = optim::PagedAdamState::Field;
  for (const auto& [store, n] : {std::pair{pg.store(F::kM), geo.state_pages},
                                 std::pair{pg.store(F::kParam), geo.param_pages},
                                 std::pair{pg.store(F::kGrad), geo.grad_pages}}) {
    if (store == nullptr || n == 0) continue;
    std::snprintf(line, sizeof line, "\n  nvme tier:    %zu pages in %s (%s, %s, queue depth %d, %.1f MiB requests)",
                  n, store->path().c_str(),
                  store->uses_io_uring() ? "io_uring" : "pread/pwrite threads",
                  store->direct() ? "O_DIRECT" : "buffered", o.nvme.queue_depth,
                  mib(static_cast<double>(o.nvme.block_bytes)));
    t += line;
  }
  std::snprintf(line, sizeof line, "\n  prefetch %d pages, direction %s", o.prefetch,
                o.alternate ? "alternating every step" : "always forward");
  t += line;
  if (rank == 0) PO_LOG_INFO(t);
  return true;
}

// One rank's paging row as metrics: the same keys as the row, with the
// derived prefetch_hit_rate, io_wait_ms and pass_ms.
nlohmann::json paging_object(const PagingRow& r) {
  nlohmann::json j;
  for (size_t k = 0; k < 7; ++k) j[kPagingKinds[k]] = r[k];
  j["prefetch_hit_rate"] = r[7] ? static_cast<double>(r[8]) / static_cast<double>(r[7]) : 1.0;
  j["io_wait_ms"] = static_cast<double>(r[9]) / 1000;
  j["pass_ms"] = static_cast<double>(r[10]) / 1000;
  j["pages_updated_in_backward"] = r[11];
  return j;
}

// `paging`: rank 0's traffic this step; `paging_per_rank`: every rank's.
nlohmann::json paging_json(int64_t step, const std::vector<RankRecord>& rows) {
  nlohmann::json all = nlohmann::json::array();
  for (const RankRecord& r : rows) all.push_back(paging_object(r.paging));
  return {{"step", step}, {"paging", all[0]}, {"paging_per_rank", all}};
}

}  // namespace

void check_config(const core::Config& cfg) { (void)make_plan(cfg, resolve_model_config(cfg)); }

TrainResult train(const core::Config& cfg) {
  const model::TransformerConfig mcfg = resolve_model_config(cfg);
  const Plan p = make_plan(cfg, mcfg);
  const std::string run_dir = cfg.get_string("run.dir");
  const bool resume = cfg.get_bool("train.resume");
  const uint64_t seed = static_cast<uint64_t>(cfg.get_int("train.seed"));

  // Data parallel: one process per rank, launched by mpirun (or srun with
  // OpenMPI's PMIx). Gradients are summed over ranks in buckets during the
  // backward of each step's last micro-batch (see on_unit_ready below).
  std::optional<comm::mpi::Session> mpi_session;  // declared first: finalized last
  std::unique_ptr<comm::Communicator> world;
  int local_ranks = 1;  // ranks sharing this node's CPUs
  if (p.dp > 1) {
    const comm::LaunchEnv env = comm::detect_launch_env();
    check_launch(env, p.dp);
    comm::mpi::MpiOptions mo;
    mo.timeout = std::chrono::milliseconds(
        static_cast<int64_t>(cfg.get_float("parallel.timeout") * 1000.0));
    // mpirun / srun: MPI_COMM_WORLD; torchrun-style: the rendezvous and join.
    auto mpi_world = comm::mpi::join_world_from_env(env, mo.timeout, mo);
    mpi_session.emplace();  // MPI is up by now; the session finalizes it
    local_ranks = comm::mpi::ranks_on_this_node(mpi_world->handle());
    world = std::move(mpi_world);
    PO_CHECK(world->size() == p.dp, "parallel.dp = ", p.dp, " but ", world->size(),
             " processes were launched");
    check_ranks_agree(*world, cfg);
  }
  const int rank = world ? world->rank() : 0;
  const bool leader = rank == 0;  // only rank 0 writes the run directory
  if (world) {
    // Rank 0 reports; the others speak only to warn or fail, and say who they are.
    core::set_log_prefix("[rank " + std::to_string(rank) + "] ");
    if (!leader && core::log_level() < core::LogLevel::kWarn)
      core::set_log_level(core::LogLevel::kWarn);
  }

  int threads = static_cast<int>(cfg.get_int("train.threads"));
  if (threads == 0) threads = std::max(1, core::usable_cpus() / local_ranks);
  ops::set_num_threads(threads);
  // bf16: parameters and gradients stored in bf16 (DataParallel), the
  // products of every linear layer (and the tied head) in bf16 with f32
  // accumulation; fp32 master weights and Adam state for the update.
  const bool bf16 = cfg.get_string("train.precision") == "bf16";
  ops::set_gemm_precision(bf16 ? ops::GemmPrecision::kBF16 : ops::GemmPrecision::kF32);
  if (bf16 && !ops::native_bf16_gemm())
    PO_LOG_WARN("train.precision = \"bf16\": this CPU/BLAS has no native bf16 GEMM; products "
                "are rounded to bf16 but run in f32 (no speed-up)");

  // Validate every input before touching run.dir.
  PO_CHECK(!cfg.get_string("data.train").empty(), "data.train is not set (a token file from ",
           "`pagedoptim prepare`)");
  for (const char* key : {"data.train", "data.val"}) {
    const std::string& path = cfg.get_string(key);
    std::error_code ec;
    PO_CHECK(path.empty() || fs::is_regular_file(path, ec), key, " = '", path,
             "': no such file (make token files with `pagedoptim prepare`)");
  }
  const std::string& init = cfg.get_string("model.init");
  {
    std::error_code ec;
    PO_CHECK(init == "random" || fs::is_regular_file(init, ec) || fs::is_directory(init, ec),
             "model.init = '", init,
             "': no such file (give \"random\", a .safetensors file, a Hugging Face model "
             "directory or a llama2.c .bin)");
  }
  data::TokenFile train_data(cfg.get_string("data.train"), static_cast<int32_t>(mcfg.vocab_size));
  std::unique_ptr<data::TokenFile> val_data;
  if (!cfg.get_string("data.val").empty())
    val_data = std::make_unique<data::TokenFile>(cfg.get_string("data.val"),
                                                 static_cast<int32_t>(mcfg.vocab_size));
  data::BatchSampler sampler(train_data, p.T, seed);
  if (val_data) {  // fail now, not at the first evaluation
    data::EvalSampler windows(*val_data, p.T);
    PO_CHECK(windows.num_sequences() >= p.micro, "data.val = '", val_data->path(), "' has ",
             val_data->size(), " tokens: too few for one validation batch of ", p.micro, " x ",
             p.T + 1);
  }

  optim::LrSchedule sched;
  sched.kind = cfg.get_string("train.schedule");
  sched.lr = cfg.get_float("train.lr");
  sched.min_lr = cfg.get_float("train.min_lr");
  sched.warmup_steps = cfg.get_int("train.warmup_steps");
  sched.total_steps = p.steps;
  sched.validate();

  model::Transformer model(mcfg, p.micro, p.T);
  optim::AdamWConfig ocfg;
  ocfg.beta1 = cfg.get_float("train.beta1");
  ocfg.beta2 = cfg.get_float("train.beta2");
  ocfg.eps = cfg.get_float("train.eps");
  ocfg.weight_decay = cfg.get_float("train.weight_decay");
  ocfg.grad_clip = cfg.get_float("train.grad_clip");
  parallel::DataParallelOptions dpo;
  dpo.zero_stage = static_cast<int>(cfg.get_int("parallel.zero_stage"));
  dpo.overlap = cfg.get_bool("parallel.overlap_comm");
  dpo.bucket_bytes = cfg.get_size("parallel.bucket_size");
  dpo.prefetch = static_cast<int>(cfg.get_int("parallel.prefetch"));
  dpo.update_in_backward = cfg.get_bool("memory.update_in_backward");
  dpo.param_dtype = bf16 ? tensor::DType::kBF16 : tensor::DType::kF32;
  dpo.reduce_dtype = cfg.get_string("parallel.reduce_dtype") == "bf16" ? tensor::DType::kBF16
                                                                         : tensor::DType::kF32;
  parallel::DataParallel dp(model, ocfg, world.get(), dpo);
  optim::AdamW& opt = dp.adam();
  const bool paging = setup_paging(cfg, dp, mcfg, p, rank);

  TrainState state;
  state.seed = seed;
  const std::string ckpt_dir = (fs::path(run_dir) / "checkpoints").string();
  auto existing = list_checkpoints(ckpt_dir);
  // Checkpoints load into any layout: full parameters first (every stage
  // starts from them; ZeRO-3 keeps its shard at shard_params()), then this
  // rank's Adam state (stage 0: all of it).
  const parallel::ShardLayout whole(dp.layout().unit_numels(), 1, 0);
  const bool resuming = resume && !existing.empty();
  if (resuming) {
    state = load_checkpoint_sharded(
        existing.back(), model, whole,
        [&](checkpoint::StateKind, int u) { return model.params() + model.unit_offset(u); },
        world.get(), {checkpoint::StateKind::kParams});
    PO_CHECK(state.seed == seed, existing.back(), ": written with train.seed = ", state.seed,
             ", but the config says ", seed, " (batches would differ)");
    PO_LOG_INFO("resuming from ", existing.back(), " at step ", state.step);
  }
  if (!resuming && init == "random" && dpo.zero_stage == 3) {
    // Unit by unit into the shards: the whole fp32 model never exists.
    dp.shard_params_from([&](int u, float* dst) { model.init_random_unit(seed, u, dst); });
  } else if (!resuming) {
    if (init == "random")
      model.init_random(seed);
    else
      load_model_weights(init, model);
  }
  dp.shard_params();  // ZeRO-3: from here on each rank holds only its shard
  if (resuming) {
    const bool full = dpo.zero_stage == 0;  // stage 0 keeps all of m and v on every rank
    // Paged state is not addressable: each unit's shard is loaded into a
    // staging buffer and copied into the pages when the next one is asked for.
    std::vector<float> staged;
    std::optional<std::pair<checkpoint::StateKind, int>> pending;
    auto flush = [&] {
      if (!pending) return;
      dp.write_shard(shard_of(pending->first), pending->second, staged.data());
      pending.reset();
    };
    load_checkpoint_sharded(
        existing.back(), model, full ? whole : dp.layout(),
        [&](checkpoint::StateKind k, int u) -> float* {
          if (paging) {
            flush();
            staged.assign(static_cast<size_t>(dp.layout().owned(u)), 0.0f);
            pending = std::make_pair(k, u);
            return staged.data();
          }
          if (full)
            return (k == checkpoint::StateKind::kAdamM ? opt.m() : opt.v()) + model.unit_offset(u);
          return k == checkpoint::StateKind::kAdamM ? dp.adam_m_shard(u) : dp.adam_v_shard(u);
        },
        world.get(), {checkpoint::StateKind::kAdamM, checkpoint::StateKind::kAdamV});
    flush();
    opt.set_steps_taken(state.adam_t);
  }
  const std::string config_toml = cfg.to_toml();
  if (leader) {
    prepare_run_dir(run_dir, resume);
    checkpoint::write_file_atomic((fs::path(run_dir) / "config.toml").string(),
                                  config_toml.data(), config_toml.size());
  }

  const double peak_gflops = cfg.get_float("train.peak_gflops") > 0
                                 ? cfg.get_float("train.peak_gflops")
                                 : ops::measure_gemm_peak_gflops();
  // The compute budget holds from here on (set up is done: the whole fp32
  // model has given way to shards, the GEMM probe's matrices are freed).
  if (paging) tensor::set_pool_budget(tensor::Pool::kCompute, cfg.get_size("memory.compute_budget"));
  // The memory ledger: this rank's model states (DESIGN.md's formulas for the
  // stage and precision) + activations. Working buffers (gathers,
  // accumulators, buckets) are not predicted here; the planner does that.
  const size_t predicted = dp.predicted_model_state_bytes() +
                           model::Transformer::predicted_activation_bytes(mcfg, p.micro, p.T);
  PO_LOG_INFO("model ", mcfg.n_layer, "L/", mcfg.n_embd, "C/", mcfg.n_head, "H vocab ",
              mcfg.vocab_size, " seq ", p.T, ": ", model.num_params(), " parameters; batch ",
              p.batch, " = ", p.accum, " x ", p.micro, "; ", threads, " threads, BLAS ",
              ops::blas_name(), " (sgemm peak ", static_cast<int>(peak_gflops), " GFLOP/s)");

  {
    const auto rows = gather_records(world.get(), dp);
    if (leader) PO_LOG_INFO(memory_table(rows));
  }
  // From here "peak" is the training steps' own (the planner's prediction).
  tensor::reset_pool_peak(tensor::Pool::kCompute);

  std::optional<MetricsWriter> metrics;
  if (leader) metrics.emplace((fs::path(run_dir) / "metrics.jsonl").string());
  Progress progress;
  std::vector<int32_t> inputs(static_cast<size_t>(p.micro * p.T));
  std::vector<int32_t> targets(inputs.size());
  const double tokens_per_step = static_cast<double>(p.batch * p.T);  // global, all ranks
  const float grad_scale = static_cast<float>(1.0 / (tokens_per_step));
  TrainResult result;
  result.run_dir = run_dir;
  result.leader = leader;
  double timed_s = 0;
  int64_t timed_steps = 0;

  // Every rank writes what it owns, in parallel (stage 0: a 1/N slice of the
  // replicated state), and rank 0 commits the manifest.
  auto save = [&]() {
    core::Timer t;
    TrainState st = state;
    st.adam_t = opt.steps_taken();
    std::vector<float> staged;
    save_checkpoint_sharded(checkpoint_path(run_dir, state.step), model, dp.layout(),
                            [&](checkpoint::StateKind k, int u) -> const float* {
                              if (paging) {  // copied out of the pages, one slice at a time
                                staged.resize(static_cast<size_t>(dp.layout().owned(u)));
                                dp.read_shard(shard_of(k), u, staged.data());
                                return staged.data();
                              }
                              switch (k) {
                                case checkpoint::StateKind::kParams: return dp.param_shard(u);
                                case checkpoint::StateKind::kAdamM: return dp.adam_m_shard(u);
                                case checkpoint::StateKind::kAdamV: return dp.adam_v_shard(u);
                              }
                              return nullptr;
                            },
                            st, config_toml, world.get());
    if (!leader) return;
    remove_old_checkpoints(ckpt_dir, p.keep);
    progress.line(core::str_cat("checkpoint step ", state.step, " saved in ",
                                static_cast<int>(t.seconds() * 1000), " ms"));
  };

  for (int64_t step = state.step; step < p.steps; ++step) {
    core::Timer step_timer;
    const comm::Traffic traffic_before = world ? world->traffic() : comm::Traffic{};
    model.zero_grads();
    const double lr = sched.at(step);
    dp.set_step_lr(lr);  // paged, unclipped: pages update during the backward
    double loss = 0;
    for (int64_t micro = 0; micro < p.accum; ++micro) {
      // This rank's slice of the step's global batch: layout-independent data.
      const int64_t first = (rank * p.accum + micro) * p.micro;
      sampler.fill(step, first, p.micro, inputs.data(), targets.data());
      // Gradients are final after the last micro-batch: reduce them as they come.
      const bool last_micro = micro == p.accum - 1;
      dp.start_micro_batch(last_micro);
      loss += model.forward_backward(inputs.data(), targets.data(), grad_scale,
                                     last_micro ? dp.unit_ready() : std::function<void(int)>(),
                                     last_micro && dp.defer_embedding());
      if (last_micro) dp.backward_done(inputs.data());
    }
    const double norm = dp.step(lr);
    // What this step's training moved (not the reporting below).
    const comm::Traffic traffic =
        world ? world->traffic().since(traffic_before) : comm::Traffic{};
    const double comm_wait_s = dp.comm_wait_seconds();
    const memory::PagerStats paging_stats = paging ? dp.paged_state()->take_stats() : memory::PagerStats{};
    if (world) {
      float l = static_cast<float>(loss);
      world->allreduce(&l, 1, tensor::DType::kF32, comm::ReduceOp::kSum);
      loss = l;
    }
    loss /= static_cast<double>(p.accum * p.dp);
    const double dt = step_timer.seconds();
    state.step = step + 1;
    state.tokens += static_cast<uint64_t>(tokens_per_step);
    if (step > 0 || p.steps == 1) {  // the first step pays one-time costs
      timed_s += dt;
      ++timed_steps;
    }
    const double tps = tokens_per_step / dt;
    // Each rank measured the peak of its own share of the cores.
    const double mfu = tps * mcfg.flops_per_token(p.T) / (peak_gflops * 1e9 * p.dp);
    result.last_loss = loss;
    const auto records = gather_records(world.get(), dp, paging_stats);
    // Exposed communication: how long it ran on after the LAST rank finished
    // its backward (waiting for a slower rank is imbalance, not communication;
    // the steady clock is shared on one node, so this is exact there).
    double exposed_ms = comm_wait_s * 1000, imbalance_ms = 0;
    if (world) {
      const auto [lo, hi] = std::minmax_element(
          records.begin(), records.end(), [](const RankRecord& a, const RankRecord& b) {
            return a.backward_end_ns < b.backward_end_ns;
          });
      exposed_ms =
          std::max<double>(0, static_cast<double>(dp.wait_end_ns() - hi->backward_end_ns) / 1e6);
      imbalance_ms = static_cast<double>(hi->backward_end_ns - lo->backward_end_ns) / 1e6;
    }
    // ZeRO-3 gathers parameters from every rank: all ranks evaluate.
    const bool eval_now = val_data && ((p.eval_interval > 0 && state.step % p.eval_interval == 0) ||
                                       state.step == p.steps);
    const double vl = eval_now && (leader || dpo.zero_stage == 3)
                          ? evaluate(model, *val_data, p, inputs, targets) : 0.0;
    // Every rank saves its part (a collective), before the leader-only reporting.
    if ((p.ckpt_interval > 0 && state.step % p.ckpt_interval == 0) || state.step == p.steps)
      save();
    if (!leader) continue;
    metrics->write({{"step", state.step},
                   {"loss", loss},
                   {"lr", lr},
                   {"grad_norm", norm},
                   {"tokens_per_s", tps},
                   {"mfu", mfu},
                   {"step_ms", dt * 1000},
                   {"comm_wait_ms", comm_wait_s * 1000},
                   {"exposed_comm_ms", exposed_ms},
                   {"imbalance_ms", imbalance_ms},
                   {"tokens", state.tokens},
                   {"peak_rss_bytes", peak_rss_bytes()},
                   {"predicted_bytes", predicted},
                   {"comm", traffic_json(traffic)},
                   {"memory_per_rank", memory_json(records)}});
    if (paging) metrics->write(paging_json(state.step, records));
    const double avg = timed_steps > 0 ? timed_s / timed_steps : dt;
    if (state.step % cfg.get_int("train.log_interval") == 0 || state.step == p.steps)
      progress.step(state.step, p.steps, loss, lr, norm, tps,
                    avg * static_cast<double>(p.steps - state.step));
    if (eval_now) {
      result.last_val_loss = vl;
      metrics->write({{"step", state.step}, {"val_loss", vl}});
      progress.line(core::str_cat("step ", state.step, " | val loss ", vl));
    }
  }
  progress.finish();
  result.steps = state.step;
  return result;
}

}  // namespace po::train
