// Paging set-up: the pager's options from memory.*, the compute tier's share
// after everything that is not paged, and the start-up table.
#include "train/paging_setup.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>

#include "core/error.h"
#include "core/log.h"
#include "memory/pager.h"
#include "memory/paging_plan.h"
#include "model/layout.h"
#include "optim/adamw.h"
#include "parallel/context_parallel.h"
#include "parallel/working_set.h"
#include "tensor/tensor.h"

namespace po::train {

memory::PagingBudgets paging_budgets(const core::Config& cfg, size_t page_bytes) {
  return {page_bytes, cfg.get_size("memory.compute_budget"), cfg.get_size("memory.host_budget"),
          !cfg.get_string("memory.nvme_dir").empty()};
}

bool pages_state(const core::Config& cfg) {
  return cfg.get_size("memory.host_budget") > 0 || !cfg.get_string("memory.nvme_dir").empty();
}

memory::PagerOptions pager_options(const core::Config& cfg, int rank) {
  memory::PagerOptions o;
  o.page_bytes = cfg.get_size("memory.page_size");
  o.prefetch = static_cast<int>(cfg.get_int("memory.prefetch"));
  o.alternate = cfg.get_bool("memory.alternate");
  o.nvme_dir = cfg.get_string("memory.nvme_dir");
  o.file_name = core::str_cat("pagedoptim-rank", rank, "-pid", static_cast<long>(getpid()), ".swap");
  o.nvme.queue_depth = static_cast<int>(cfg.get_int("memory.queue_depth"));
  o.nvme.block_bytes = cfg.get_size("memory.block_size");
  o.nvme.force_fallback = cfg.get_string("memory.io") == "fallback";
  PO_CHECK(o.page_bytes >= 4096 && o.page_bytes % 4096 == 0, "memory.page_size = ", o.page_bytes,
           " bytes: must be a multiple of 4096");
  return o;
}

namespace {

// What the compute tier holds besides pages once set up: the ledger's count
// of what is not paged (all but `paged_bytes`), what else is allocated, the
// working buffers to come.
size_t unpaged_compute_bytes(const core::Config& cfg, parallel::DataParallel& dp,
                             const model::TransformerConfig& mcfg, const Plan& p,
                             size_t paged_bytes) {
  const size_t predicted = dp.predicted_model_state_bytes() - paged_bytes +
                           model::Transformer::predicted_activation_bytes(mcfg, p.micro, p.T / p.cp, p.tp);
  // Allocations outside the engine's ledger (token files, ...).
  const size_t live = tensor::pool_bytes_live(tensor::Pool::kCompute);
  const size_t known = dp.memory().total();
  // The working buffers to come (gathers, accumulators, buckets, staging,
  // ring scratch at most), counted by parallel/working_set.h, which the
  // planner reports too.
  const parallel::DataParallelOptions& d = dp.options();
  parallel::WorkingSetOptions wo;
  wo.ranks = static_cast<int>(p.dp * p.cp);  // ZeRO shards over dp × cp
  wo.context = p.cp > 1;
  wo.zero_stage = d.zero_stage;
  const optim::AdamWConfig& adam = dp.adam().config();
  wo.align = adam.state_bits < 32 ? adam.block_size : 1;  // the shard cut, as DataParallel's
  wo.prefetch = d.prefetch;
  wo.bf16 = d.param_dtype == tensor::DType::kBF16;
  wo.reduce_bf16 = d.reduce_dtype == tensor::DType::kBF16;
  wo.overlap = d.overlap;
  wo.paged = true;  // set-up runs only for a paged run
  wo.micro = p.micro;
  wo.seq = p.T / p.cp;  // this rank's rows of each sequence
  wo.accum = p.accum;
  wo.bucket_bytes = d.bucket_bytes;
  wo.tp = static_cast<int>(p.tp);
  wo.sequence_parallel = mcfg.sequence_parallel;
  const auto working = static_cast<size_t>(parallel::working_set(mcfg, wo).total());
  // Context parallel's ring (or gather) buffers, allocated at the first forward.
  const model::TransformerConfig local = mcfg.shard(static_cast<int>(p.tp));
  const size_t ring = p.cp > 1 ? parallel::ContextParallelOps::predicted_buffer_bytes(
                                     parallel::parse_cp_mode(cfg.get_string("parallel.cp_mode")),
                                     static_cast<int>(p.cp), p.micro, p.T / p.cp,
                                     local.n_kv_head * local.head_dim())
                               : 0;
  // A frozen base under adapters (f32, allocated when it is loaded, after this).
  size_t base = 0;
  if (mcfg.lora.on() && mcfg.quant == model::WeightQuant::kNone)
    base = static_cast<size_t>(model::Layout(mcfg).base_num_params()) * sizeof(float);
  return predicted + (live > known ? live - known : 0) + working + ring + base;
}

// The log's one-screen account of the pages and where they live.
std::string paging_table(const optim::PagedState& pg, const memory::PagerOptions& o,
                         const optim::PagedState::Geometry& geo, const optim::StateSchema& schema, size_t fixed,
                         size_t compute_budget, size_t lent, int rank) {
  const size_t pages = geo.pages();
  const auto mib = [](double b) { return b / (1 << 20); };
  char line[256];
  std::string t = "paged optimizer state (rank " + std::to_string(rank) + "):";
  std::string fields;
  for (const optim::StateField& f : schema.fields) {
    fields += core::str_cat(fields.empty() ? "" : ", ", f.name, " ", optim::dtype_name(f.dtype));
    if (f.block > 0) fields += core::str_cat(" + fp32 scale", f.cut_blocks ? "s (2)" : "", " per ", f.block);
  }
  std::snprintf(line, sizeof line, "\n  %zu pages of %.1f MiB (%lld elements of %.*s: %s)", geo.state_pages,
                mib(static_cast<double>(o.page_bytes)), static_cast<long long>(geo.state_elements),
                static_cast<int>(schema.name.size()), schema.name.data(), fields.c_str());
  t += line;
  if (geo.param_pages > 0) {
    std::snprintf(line, sizeof line,
                  "\n  + %zu parameter-shard pages (%lld elements) + %zu gradient-shard pages (%lld elements)",
                  geo.param_pages, static_cast<long long>(geo.param_elements), geo.grad_pages,
                  static_cast<long long>(geo.grad_elements));
    t += line;
  }
  if (geo.side_pages > 0) {
    std::snprintf(line, sizeof line, "\n  + %zu side pages (%lld elements of fp32 Adam m, v: the 32-bit tensors')",
                  geo.side_pages, static_cast<long long>(geo.side_elements));
    t += line;
  }
  std::snprintf(line, sizeof line, ", %.1f MiB in all", mib(static_cast<double>(pages * o.page_bytes)));
  t += line;
  std::snprintf(line, sizeof line, "\n  compute tier: %zu pages (%.1f MiB) + %.1f MiB other state%s",
                pg.compute_frames(), mib(static_cast<double>(pg.compute_frames() * o.page_bytes)),
                mib(static_cast<double>(fixed)), compute_budget ? "" : " (no budget)");
  t += line;
  if (lent > 0) {
    std::snprintf(line, sizeof line,
                  "\n              + %zu frames (%.1f MiB) of activations lent every backward "
                  "(memory.lend_activations)",
                  lent, mib(static_cast<double>(lent * o.page_bytes)));
    t += line;
  }
  std::snprintf(line, sizeof line, "\n  host tier:    %zu pages (%.1f MiB)", pg.host_frames(),
                mib(static_cast<double>(pg.host_frames() * o.page_bytes)));
  t += line;
  for (const auto& [store, n] : {std::pair{pg.store(optim::AdamW::kM), geo.state_pages},
                                 std::pair{pg.store(optim::PagedState::kParam), geo.param_pages},
                                 std::pair{pg.store(optim::PagedState::kGrad), geo.grad_pages}}) {
    if (store == nullptr || n == 0) continue;
    std::snprintf(line, sizeof line, "\n  nvme tier:    %zu pages in %s (%s, %s, queue depth %d, %.1f MiB requests)",
                  n, store->path().c_str(),
                  store->uses_io_uring() ? "io_uring" : "pread/pwrite threads",
                  store->direct() ? "O_DIRECT" : "buffered", o.nvme.queue_depth,
                  mib(static_cast<double>(o.nvme.block_bytes)));
    t += line;
  }
  std::snprintf(line, sizeof line, "\n  prefetch %d pages or as many as free frames allow, direction %s", o.prefetch,
                o.alternate ? "alternating every step" : "always forward");
  t += line;
  return t;
}

}  // namespace

bool setup_paging(const core::Config& cfg, parallel::DataParallel& dp,
                  const model::TransformerConfig& mcfg, const Plan& p, int rank) {
  const size_t compute_budget = cfg.get_size("memory.compute_budget");
  const size_t host_budget = cfg.get_size("memory.host_budget");
  const std::string& io = cfg.get_string("memory.io");
  PO_CHECK(io == "auto" || io == "fallback", "memory.io = \"", io,
           "\": choose \"auto\" (io_uring where allowed) or \"fallback\" (pread/pwrite threads)");
  if (!pages_state(cfg)) {
    if (compute_budget > 0) tensor::set_pool_budget(tensor::Pool::kCompute, compute_budget);
    return false;
  }
  memory::PagerOptions o = pager_options(cfg, rank);
  const optim::AdamW& adam = dp.adam();
  const optim::PagedState::Layout layout = adam.paged_layout(dp.paging_layout());
  const optim::PagedState::Geometry geo =
      optim::PagedState::geometry(adam.paged_numel(dp.paging_layout()), o.page_bytes, layout);
  const auto paged_bytes = static_cast<size_t>(adam.ledger_paged_bytes(dp.paging_layout()));
  const size_t fixed = unpaged_compute_bytes(cfg, dp, mcfg, p, paged_bytes);
  const size_t min_frames = optim::PagedState::min_compute_frames(geo, o.prefetch);
  const memory::PagingPlan plan =
      memory::plan_paging({geo.pages(), min_frames, fixed}, paging_budgets(cfg, o.page_bytes));
  PO_CHECK(plan.compute_fits, "memory.compute_budget = ", compute_budget,
           " bytes is too small for rank ", rank, "'s working set: at least ", plan.min_compute_bytes,
           " bytes (", fixed, " for parameters, gradients, activations and working buffers + ",
           min_frames, " pages of ", o.page_bytes, ")");
  o.compute_frames = plan.compute_frames;
  o.host_frames = plan.host_budget_frames;
  if (host_budget > 0) tensor::set_pool_budget(tensor::Pool::kHost, host_budget);
  dp.enable_paging(o);
  const std::string t =
      paging_table(*dp.paged_state(), o, geo, layout.schema, fixed, compute_budget, dp.lent_frames(), rank);
  if (rank == 0) PO_LOG_INFO(t);
  return true;
}

}  // namespace po::train
