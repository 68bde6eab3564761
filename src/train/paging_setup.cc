// Paging set-up: the pager's options from memory.*, the compute tier's share
// after everything that is not paged, and the start-up table.
#include "train/paging_setup.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "memory/pager.h"
#include "memory/paging_plan.h"
#include "model/layout.h"
#include "optim/adamw.h"
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

// The log's one-screen account of the pages and where they live.
std::string paging_table(const optim::PagedState& pg, const memory::PagerOptions& o, size_t fixed,
                         size_t compute_budget, size_t lent, int rank) {
  const optim::PagedState::Geometry& geo = pg.geometry();
  const optim::StateSchema& schema = pg.schema();
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

bool setup_paging(const core::Config& cfg, parallel::PipelineExecutor& ex, const model::TransformerConfig& mcfg,
                  const parallel::PipelineSetup& setup, comm::Communicator* world, size_t context) {
  const int rank = world != nullptr ? world->rank() : 0;
  const size_t compute_budget = cfg.get_size("memory.compute_budget");
  const size_t host_budget = cfg.get_size("memory.host_budget");
  const std::string& io = cfg.get_string("memory.io");
  PO_CHECK(io == "auto" || io == "fallback", "memory.io = \"", io,
           "\": choose \"auto\" (io_uring where allowed) or \"fallback\" (pread/pwrite threads)");
  if (!setup.paged) return false;
  memory::PagerOptions o = pager_options(cfg, rank);
  const auto [pages, least] = ex.paging_pages(o.page_bytes, o.prefetch);
  parallel::PipelineExecutor::Memory fixed = parallel::PipelineExecutor::predict(mcfg, setup, ex.rank());
  fixed.buffers += context + parallel::PipelineExecutor::predict_ring_scratch(mcfg, setup, ex.rank());
  const memory::PagingPlan plan = memory::plan_paging({pages, least, fixed.total()}, paging_budgets(cfg, o.page_bytes));
  if (compute_budget > 0) {
    // Stages differ: every rank checks the budget against the rank that needs the most.
    const int64_t mine[3] = {static_cast<int64_t>(plan.min_compute_bytes),
                             static_cast<int64_t>(fixed.total()), static_cast<int64_t>(least)};
    const int ranks = world != nullptr ? world->size() : 1;
    std::vector<int64_t> all(3 * static_cast<size_t>(ranks));
    if (world != nullptr)
      world->all_gather(mine, all.data(), 6, tensor::DType::kI32);  // int64s, bit-exact
    else
      std::copy_n(mine, 3, all.data());
    int worst = 0;
    for (int k = 1; k < ranks; ++k)
      if (all[3 * static_cast<size_t>(k)] > all[3 * static_cast<size_t>(worst)]) worst = k;
    const int64_t* w = all.data() + 3 * worst;
    PO_CHECK(compute_budget >= static_cast<size_t>(w[0]), "memory.compute_budget = ", compute_budget,
             " bytes is too small for rank ", worst, "'s ", setup.schedule.ranks > 1 ? "pipeline stages" : "working set",
             ": at least ", w[0], " bytes (", w[1], " for parameters, gradients, activations and buffers + ", w[2],
             " pages of ", o.page_bytes, ")");
  }
  o.compute_frames = plan.compute_frames;
  o.host_frames = plan.host_budget_frames;
  if (host_budget > 0) tensor::set_pool_budget(tensor::Pool::kHost, host_budget);
  ex.enable_paging(o);
  if (rank != 0) return true;
  // Each chunk's pages (one at pp = 1), as its pager holds them.
  const std::vector<const optim::PagedState*> states = ex.paged_states();
  for (size_t k = 0; k < states.size(); ++k) {
    const optim::PagedState& pg = *states[k];
    PO_LOG_INFO(paging_table(pg, o, k == 0 ? fixed.total() : 0, compute_budget,
                             k == 0 ? ex.lent_frames() : 0, rank),
                states.size() > 1 ? core::str_cat("\n  (chunk ", k + 1, " of ", states.size(), " on this rank)")
                                  : std::string());
  }
  return true;
}

}  // namespace po::train
