// memory.*: whether the optimizer state (and a bf16 run's fp32 master) lives
// in pages, and how many pages each tier holds, by memory/paging_plan.h's
// policy (which the planner reports with): the compute tier keeps as many
// pages as memory.compute_budget leaves room for after the rest of this
// rank's compute-tier state (parameters, gradients, activations, the working
// buffers' bound); 0 means no compute budget (every page resident).
#pragma once

#include "core/config.h"
#include "memory/pager.h"
#include "memory/paging_plan.h"
#include "model/transformer.h"
#include "comm/communicator.h"
#include "parallel/pipeline_executor.h"
#include "train/launch.h"

namespace po::train {

// memory.* into the pager's options (the tiers' frame counts are left 0):
// page size, prefetch, direction, the NVMe directory and this rank's swap
// file name, the I/O settings.
memory::PagerOptions pager_options(const core::Config& cfg, int rank);
// Whether the run pages its optimizer state: memory.host_budget or memory.nvme_dir set.
bool pages_state(const core::Config& cfg);

// memory.*'s budgets for memory::plan_paging (the one paging policy).
memory::PagingBudgets paging_budgets(const core::Config& cfg, size_t page_bytes);

// Turns paging on in the executor when memory.host_budget or memory.nvme_dir
// is set (PipelineSetup::paged): each chunk's Adam state (a bf16 run's fp32
// master with it; ZeRO-3: its stored parameter and gradient shards) in
// pages (PipelineExecutor::enable_paging). memory.compute_budget leaves the
// compute tier what the executor's own accounting (predict, plus `context`:
// the context group's buffers, and the ring collectives' scratch) does not
// take, checked against the rank that needs the most. Returns whether the state is paged; the pages'
// one-screen table goes to the log (rank 0).
bool setup_paging(const core::Config& cfg, parallel::PipelineExecutor& ex, const model::TransformerConfig& mcfg,
                  const parallel::PipelineSetup& setup, comm::Communicator* world, size_t context);

}  // namespace po::train
