// The paging policy, in one place: how a rank's pages are spread over the
// tiers, given what its compute tier holds besides pages and the budgets
// (memory.compute_budget, memory.host_budget, memory.nvme_dir). The trainer
// (train/paging_setup.cc at pp = 1, train/pipeline_train.cc at pp > 1) sizes
// its pagers with it and the planner (plan/replay.cc, plan/analytic.cc)
// reports with it, so the plan's frames are the run's.
//
// The policy: without a compute budget every page stays in the compute tier.
// With one, the compute tier keeps what is not paged, then as many pages as
// the rest holds; it must hold at least the pagers' minimum (the page in
// use, its prefetch, the write-back). The pages it cannot hold go to the
// host tier, up to its budget, and the rest to NVMe.
#pragma once

#include <cstddef>

namespace po::memory {

// What one rank pages.
struct PagingNeed {
  size_t pages = 0;        // all its pages (every pager's)
  size_t least = 0;        // the fewest compute frames its pagers work with
  size_t fixed_bytes = 0;  // what its compute tier holds besides pages
};

struct PagingBudgets {
  size_t page_bytes = 0;
  size_t compute = 0;  // 0: no budget
  size_t host = 0;     // 0: no host tier
  bool nvme = false;   // a swap directory is set
};

struct PagingPlan {
  size_t pages = 0;
  size_t compute_frames = 0;     // pages in the compute tier (the pagers' minimum where the budget is short)
  size_t host_frames = 0;        // pages the host tier holds
  size_t host_budget_frames = 0; // frames the host budget allows (the pagers cap them at their pages)
  size_t nvme_pages = 0;         // the rest
  size_t min_compute_bytes = 0;  // the smallest compute budget that trains: fixed + least pages
  bool compute_fits = true;      // no compute budget, or one of at least min_compute_bytes
  bool nvme_fits = true;         // no page needs NVMe, or a swap directory is set
  bool fits() const { return compute_fits && nvme_fits; }
};

PagingPlan plan_paging(const PagingNeed& need, const PagingBudgets& budgets);

}  // namespace po::memory
