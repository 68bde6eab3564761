#include "memory/paging_plan.h"

#include <algorithm>

namespace po::memory {

PagingPlan plan_paging(const PagingNeed& need, const PagingBudgets& b) {
  PagingPlan p;
  p.pages = need.pages;
  p.min_compute_bytes = need.fixed_bytes + need.least * b.page_bytes;
  p.compute_frames = need.pages;
  if (b.compute > 0) {
    p.compute_fits = b.compute >= p.min_compute_bytes;
    p.compute_frames = p.compute_fits ? std::min(need.pages, (b.compute - need.fixed_bytes) / b.page_bytes)
                                      : std::min(need.pages, need.least);
  }
  p.host_budget_frames = b.page_bytes > 0 ? b.host / b.page_bytes : 0;
  p.host_frames = std::min(need.pages - p.compute_frames, p.host_budget_frames);
  p.nvme_pages = need.pages - p.compute_frames - p.host_frames;
  p.nvme_fits = p.nvme_pages == 0 || b.nvme;
  return p;
}

}  // namespace po::memory
