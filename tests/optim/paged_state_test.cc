// PagedState: where each field lives. With parameter and gradient shards
// paged (ZeRO-Infinity) each has pages of its own, so reading the parameters
// moves parameter bytes only, not the Adam moments or gradients beside them;
// every field keeps its values through evictions; gradients consumed by an
// update come back as zeros without I/O.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <vector>

#include "../test_util.h"
#include "optim/adamw.h"
#include "optim/paged_state.h"

namespace po::test {
namespace {

using optim::PagedState;
struct F {
  static constexpr PagedState::Field kM = optim::AdamW::kM, kV = optim::AdamW::kV,
                                     kMaster = optim::AdamW::kMaster, kParam = PagedState::kParam,
                                     kGrad = PagedState::kGrad;
};
PagedState::Layout adam(bool master, size_t param_bytes, size_t grad_bytes) {
  return {optim::adamw_schema(master), param_bytes, grad_bytes};
}
constexpr size_t kPage = 16384;

memory::PagerOptions options(const std::string& dir, size_t compute_frames) {
  memory::PagerOptions o;
  o.page_bytes = kPage;
  o.compute_frames = compute_frames;
  o.prefetch = 1;
  o.nvme_dir = dir;
  o.file_name = "t.swap";
  return o;
}

TEST(PagedState, ParameterAndGradientPagesOfTheirOwn) {
  const PagedState::Layout fp32 = adam(false, 4, 4);
  auto g = PagedState::geometry(100000, kPage, fp32);
  EXPECT_EQ(g.state_elements, 2048);  // 16 KiB / (4 + 4) bytes
  EXPECT_EQ(g.param_elements, 4096);  // 16 KiB / 4, a multiple of E
  EXPECT_EQ(g.grad_elements, 4096);
  EXPECT_EQ(g.state_pages, 49u);
  EXPECT_EQ(g.param_pages, 25u);
  EXPECT_EQ(g.grad_pages, 25u);
  const PagedState::Layout bf16 = adam(true, 2, 2);
  g = PagedState::geometry(100000, kPage, bf16);
  EXPECT_EQ(g.state_elements, 1360);      // 16 KiB / 12 bytes, down to a multiple of 16
  EXPECT_EQ(g.param_elements, 6 * 1360);  // 16 KiB / 2 bytes holds 6 state pages' elements
  EXPECT_EQ(PagedState::geometry(100000, kPage, adam(false, 0, 0)).param_pages, 0u);
  EXPECT_EQ(PagedState::min_compute_frames(g, 1), 9u);  // 3 per pager
}

// Reading every parameter of a cold state moves the shard pages only.
TEST(PagedState, ParametersAreReadWithoutTheMoments) {
  TempDir dir;
  const int64_t n = 64 * 2048;  // 64 state pages, 32 parameter and 32 gradient pages (fp32)
  PagedState st(n, adam(false, 4, 4), options(dir.path().string(), 12));
  std::vector<float> values(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) values[static_cast<size_t>(i)] = static_cast<float>(i) * 0.5f;
  st.copy_in(F::kParam, 0, n, values.data());
  std::vector<float> m(static_cast<size_t>(n), 1.0f);
  st.copy_in(F::kM, 0, n, m.data());
  // Push everything out: walk the moments (their pages evict the parameters').
  std::vector<float> out(static_cast<size_t>(n));
  st.copy_out(F::kV, 0, n, out.data());
  st.copy_out(F::kGrad, 0, n, out.data());
  (void)st.take_stats();
  st.copy_out(F::kParam, 0, n, out.data());
  const memory::PagerStats s = st.take_stats();
  EXPECT_EQ(out, values);
  // At most the 32 parameter pages are read; pages shared with the moments
  // would have read 16 bytes per element.
  EXPECT_LE(s.nvme_read_bytes, 32 * kPage) << "parameters read with more than themselves";
  EXPECT_GT(s.nvme_read_bytes, 0u) << "the parameters were not evicted: the test proves nothing";
  ASSERT_NE(st.store(F::kParam), nullptr);
  EXPECT_NE(st.store(F::kM)->path(), st.store(F::kParam)->path());
}

// An update consumes the gradients: their pages come back as zeros, and
// the next step's first additions read nothing from NVMe.
TEST(PagedState, ConsumedGradientsCostNoReads) {
  TempDir dir;
  const int64_t n = 64 * 2048;
  PagedState st(n, adam(false, 4, 4), options(dir.path().string(), 12));
  std::vector<float> g(static_cast<size_t>(n), 0.25f), out(static_cast<size_t>(n));
  st.copy_in(F::kGrad, 0, n, g.data());
  st.for_each_page([&](int64_t lo, int64_t hi, const PagedState::View& v) {
    std::memset(v.grad, 0, static_cast<size_t>(hi - lo) * 4);  // what an update does
  }, true);
  (void)st.take_stats();
  st.copy_out(F::kGrad, 0, n, out.data());
  for (float x : out) ASSERT_EQ(x, 0.0f);
  EXPECT_EQ(st.take_stats().nvme_read_bytes, 0u) << "consumed gradients were read back";
}

// The sweep sees every field of its elements, and what it writes stays.
TEST(PagedState, SweepSeesStateAndShardsTogether) {
  TempDir dir;
  const int64_t n = 40 * 1360 + 77;
  PagedState st(n, adam(true, 2, 2), options(dir.path().string(), 7));
  std::vector<uint16_t> p(static_cast<size_t>(n)), gr(static_cast<size_t>(n));
  std::vector<float> master(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    p[static_cast<size_t>(i)] = static_cast<uint16_t>(i & 0x7fff);
    gr[static_cast<size_t>(i)] = static_cast<uint16_t>((i * 7) & 0x7fff);
    master[static_cast<size_t>(i)] = static_cast<float>(i);
  }
  st.copy_in(F::kParam, 0, n, p.data());
  st.copy_in(F::kGrad, 0, n, gr.data());
  st.copy_in(F::kMaster, 0, n, master.data());
  for (int pass = 0; pass < 2; ++pass) {
    int64_t seen = 0;
    st.for_each_page([&](int64_t lo, int64_t hi, const PagedState::View& v) {
      for (int64_t i = lo; i < hi; ++i) {
        const auto k = static_cast<size_t>(i - lo);
        ASSERT_EQ(static_cast<uint16_t*>(v.param)[k], p[static_cast<size_t>(i)]) << "element " << i;
        ASSERT_EQ(static_cast<uint16_t*>(v.grad)[k], gr[static_cast<size_t>(i)]) << "element " << i;
        ASSERT_EQ(v.f32(F::kMaster)[k], master[static_cast<size_t>(i)]) << "element " << i;
        v.f32(F::kM)[k] += 1.0f;
        static_cast<uint16_t*>(v.param)[k] ^= 1;
      }
      seen += hi - lo;
    });
    EXPECT_EQ(seen, n);
    for (auto& x : p) x ^= 1;
  }
  std::vector<float> m(static_cast<size_t>(n));
  st.copy_out(F::kM, 0, n, m.data());
  for (float x : m) ASSERT_EQ(x, 2.0f);
  std::vector<uint16_t> back(static_cast<size_t>(n));
  st.copy_out(F::kParam, 0, n, back.data());
  EXPECT_EQ(back, p);
}

}  // namespace
}  // namespace po::test
