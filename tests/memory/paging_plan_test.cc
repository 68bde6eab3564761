// The one paging policy (memory/paging_plan.h) that the trainer sizes its
// pagers with and the planner reports with.
#include <gtest/gtest.h>

#include "memory/paging_plan.h"

namespace po::memory {
namespace {

constexpr size_t kPage = 1 << 20;

TEST(PagingPlan, WithoutAComputeBudgetEveryPageStaysInTheComputeTier) {
  const PagingPlan p = plan_paging({100, 4, 50 * kPage}, {kPage, 0, 8 * kPage, false});
  EXPECT_EQ(p.compute_frames, 100u);
  EXPECT_EQ(p.host_frames, 0u);
  EXPECT_EQ(p.host_budget_frames, 8u);
  EXPECT_EQ(p.nvme_pages, 0u);
  EXPECT_EQ(p.min_compute_bytes, 54 * kPage);
  EXPECT_TRUE(p.fits());
}

TEST(PagingPlan, TheComputeTierKeepsWhatIsNotPagedThenPagesThenHostThenNvme) {
  // 60 pages of room after 40 pages' worth of other state (and a part page).
  PagingPlan p = plan_paging({100, 4, 40 * kPage + 123}, {kPage, 100 * kPage, 25 * kPage, true});
  EXPECT_EQ(p.compute_frames, 59u);
  EXPECT_EQ(p.host_frames, 25u);
  EXPECT_EQ(p.nvme_pages, 16u);
  EXPECT_TRUE(p.fits());
  // A host tier larger than what is left holds only what is left.
  p = plan_paging({100, 4, 40 * kPage}, {kPage, 100 * kPage, 1000 * kPage, false});
  EXPECT_EQ(p.compute_frames, 60u);
  EXPECT_EQ(p.host_frames, 40u);
  EXPECT_EQ(p.host_budget_frames, 1000u);
  EXPECT_EQ(p.nvme_pages, 0u);
  EXPECT_TRUE(p.fits()) << "no page needs NVMe";
  // A budget that holds every page keeps them all.
  p = plan_paging({10, 4, 0}, {kPage, 100 * kPage, 0, false});
  EXPECT_EQ(p.compute_frames, 10u);
}

TEST(PagingPlan, ShortBudgetsAreSaidApart) {
  // Below the other state plus the pagers' minimum: the compute tier does not fit.
  PagingPlan p = plan_paging({100, 4, 40 * kPage}, {kPage, 43 * kPage, 0, true});
  EXPECT_FALSE(p.compute_fits);
  EXPECT_EQ(p.min_compute_bytes, 44 * kPage);
  EXPECT_EQ(p.compute_frames, 4u) << "the planner goes on with the pagers' minimum";
  EXPECT_FALSE(p.fits());
  // Exactly the minimum fits.
  p = plan_paging({100, 4, 40 * kPage}, {kPage, 44 * kPage, 0, true});
  EXPECT_TRUE(p.compute_fits);
  EXPECT_EQ(p.compute_frames, 4u);
  EXPECT_EQ(p.nvme_pages, 96u);
  // Pages for NVMe without a swap directory.
  p = plan_paging({100, 4, 40 * kPage}, {kPage, 44 * kPage, 10 * kPage, false});
  EXPECT_TRUE(p.compute_fits);
  EXPECT_FALSE(p.nvme_fits);
  EXPECT_EQ(p.nvme_pages, 86u);
}

}  // namespace
}  // namespace po::memory
