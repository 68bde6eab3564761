// The NVMe store and the pager in one process: pages keep their contents
// through passes that evict them every time (compute tier of a few frames,
// with and without a host tier, io_uring and the thread-pool fallback); the
// direction of the passes is measured (hits, NVMe reads per pass); a byte
// flipped in the swap file is caught by the page checksum and named; swap
// files are gone once the store is; too small a compute tier is refused with
// the minimum.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "../test_util.h"
#include "core/error.h"
#include "memory/nvme_store.h"
#include "memory/pager.h"
#include "tensor/tensor.h"

namespace fs = std::filesystem;
using po::memory::NvmeOptions;
using po::memory::NvmeStore;
using po::memory::Pager;
using po::memory::PagerOptions;

namespace {

constexpr size_t kPage = 16384;

PagerOptions options(const std::string& dir, size_t compute, size_t host, bool fallback) {
  PagerOptions o;
  o.page_bytes = kPage;
  o.compute_frames = compute;
  o.host_frames = host;
  o.prefetch = 2;
  o.nvme_dir = dir;
  o.file_name = "test.swap";
  o.nvme.queue_depth = 4;
  o.nvme.block_bytes = 8192;  // two requests per page
  o.nvme.force_fallback = fallback;
  return o;
}

TEST(NvmeStore, RoundTripAndTheFileGoesAway) {
  po::test::TempDir dir;
  for (bool fallback : {false, true}) {
    std::string path;
    {
      NvmeOptions o;
      o.queue_depth = 3;
      o.block_bytes = 4096;
      o.force_fallback = fallback;
      NvmeStore store(dir.path().string(), "s.swap", 8, kPage, o);
      path = store.path();
      EXPECT_EQ(store.uses_io_uring(), !fallback);
      po::tensor::Storage a(kPage * 8 + (2u << 20)), b(kPage * 8 + (2u << 20));
      auto* src = static_cast<uint8_t*>(a.data());
      for (size_t i = 0; i < kPage * 8; ++i) src[i] = static_cast<uint8_t>(i * 7 + 3);
      std::vector<NvmeStore::Ticket> t;
      for (size_t s = 0; s < 8; ++s) t.push_back(store.write(s, src + s * kPage));
      for (auto x : t) store.wait(x);
      t.clear();
      auto* dst = static_cast<uint8_t*>(b.data());
      for (size_t s = 0; s < 8; ++s) t.push_back(store.read(7 - s, dst + s * kPage));
      for (auto x : t) store.wait(x);
      for (size_t s = 0; s < 8; ++s)
        ASSERT_EQ(std::memcmp(dst + s * kPage, src + (7 - s) * kPage, kPage), 0)
            << (fallback ? "fallback" : "io_uring") << ": slot " << 7 - s << " read back differs";
      EXPECT_EQ(store.bytes_written(), 8 * kPage);
      EXPECT_EQ(store.bytes_read(), 8 * kPage);
      EXPECT_TRUE(fs::exists(path));
    }
    EXPECT_FALSE(fs::exists(path)) << path << " left behind";
  }
}

// Pages hold k*1000 + i in element i; a pass adds 1 to every element.
void run_passes(Pager& pager, size_t pages, int passes) {
  const size_t n = kPage / sizeof(float);
  for (int pass = 0; pass < passes; ++pass)
    pager.for_each([&](size_t page, char* data) {
      auto* f = reinterpret_cast<float*>(data);
      for (size_t i = 0; i < n; ++i) f[i] += 1.0f;
      (void)page;
    });
  for (size_t p = 0; p < pages; ++p)
    pager.access(p, [&](char* data) {
      const auto* f = reinterpret_cast<const float*>(data);
      for (size_t i = 0; i < n; i += 97)
        ASSERT_EQ(f[i], static_cast<float>(p * 1000 + i % 1000 + passes))
            << "page " << p << " element " << i << " after " << passes << " passes";
    }, false);
}

TEST(Pager, PagesSurviveEvictionInEveryConfiguration) {
  po::test::TempDir dir;
  const size_t pages = 40, n = kPage / sizeof(float);
  struct Case {
    size_t compute, host;
    bool fallback, alternate;
  };
  for (const Case& c : {Case{4, 0, false, true}, Case{4, 0, true, true}, Case{6, 10, false, true},
                        Case{4, 0, false, false}, Case{40, 0, false, true}}) {
    PagerOptions o = options(dir.path().string(), c.compute, c.host, c.fallback);
    o.alternate = c.alternate;
    Pager pager(pages, o);
    for (size_t p = 0; p < pages; ++p)
      pager.access(p, [&](char* data) {
        auto* f = reinterpret_cast<float*>(data);
        for (size_t i = 0; i < n; ++i) f[i] = static_cast<float>(p * 1000 + i % 1000);
      }, true);
    run_passes(pager, pages, 5);
    const auto s = pager.take_stats();
    if (c.compute < pages && c.host == 0) {
      EXPECT_GT(s.nvme_read_bytes, 0u) << "compute " << c.compute << ": nothing was paged";
      EXPECT_GT(s.nvme_written_bytes, 0u);
    }
    if (c.host > 0) {
      EXPECT_GT(s.host_read_bytes, 0u) << "the host tier was not used";
    }
  }
}

// The direction of the passes, measured rather than assumed: with F of N
// pages resident, no prefetch and exact (Belady) eviction, a fixed direction
// keeps F - 1 pages of the cyclic scan resident (an LRU cache would keep
// none), and so does alternating; alternating saves one NVMe read per pass
// (the page the previous pass ended on). The pager's decisions do not depend
// on I/O timing, so the counts are exact.
TEST(Pager, AlternatingDirectionSavesOneReadPerPass) {
  po::test::TempDir dir;
  const size_t pages = 40;
  double rate[2];
  uint64_t read[2];
  for (int alt = 0; alt < 2; ++alt) {
    PagerOptions o = options(dir.path().string(), 10, 0, false);
    o.alternate = alt == 1;
    o.prefetch = 0;  // hits only from residency
    Pager pager(pages, o);
    pager.for_each([](size_t, char* d) { d[0] = 1; });
    (void)pager.take_stats();
    for (int pass = 0; pass < 4; ++pass) pager.for_each([](size_t, char* d) { d[1] += 1; });
    const auto s = pager.take_stats();
    rate[alt] = s.hit_rate();
    read[alt] = s.nvme_read_bytes;
  }
  std::printf("hit rate without prefetch: fixed direction %.3f, alternating %.3f; nvme read %llu vs %llu bytes\n",
              rate[0], rate[1], static_cast<unsigned long long>(read[0]),
              static_cast<unsigned long long>(read[1]));
  EXPECT_DOUBLE_EQ(rate[0], 9.0 / 40) << "fixed direction: F - 1 hits per pass";
  EXPECT_DOUBLE_EQ(rate[1], 9.0 / 40) << "alternating: F - 1 hits per pass";
  EXPECT_EQ(read[0] - read[1], 4 * kPage) << "alternating should read one page less per pass";
}

// Lent frames, as a training step lends them: between passes regions of
// "activation" memory are lent (the backward), the pager reads the next
// pass's first pages into them; the pass runs; the forward claims each region
// and scribbles over it at once. Pages keep their contents through every
// pass; the pages read ahead are the next pass's first ones (hits); the
// traffic is the same in two runs (decisions follow the calls, not I/O
// timing); what was lent is exactly the whole aligned pages of each region.
TEST(Pager, LentFramesReadAheadAndAreGivenBackWhole) {
  po::test::TempDir dir;
  const size_t pages = 40, n = kPage / sizeof(float);
  constexpr int kRegions = 3;
  // Regions of 4.5, 3.5 and 6 pages, at an offset that is not page-aligned.
  const size_t region_bytes[kRegions] = {kPage * 9 / 2, kPage * 7 / 2, kPage * 6};
  po::tensor::Storage acts(kPage * 16);
  struct Result {
    uint64_t read = 0, written = 0, lent_read = 0, hits = 0, accesses = 0;
  };
  auto run = [&](bool fallback) {
    Pager pager(pages, options(dir.path().string(), 4, 0, fallback));
    for (size_t p = 0; p < pages; ++p)
      pager.access(p, [&](char* data) {
        auto* f = reinterpret_cast<float*>(data);
        for (size_t i = 0; i < n; ++i) f[i] = static_cast<float>(p * 1000 + i % 1000);
      }, true);
    (void)pager.take_stats();
    Result r;
    const int passes = 6;
    for (int pass = 0; pass < passes; ++pass) {
      // The backward: regions freed last first; each lent region is read into.
      char* base = static_cast<char*>(acts.data()) + 1000;
      size_t lent = 0;
      std::vector<char*> starts;
      for (size_t b : region_bytes) {
        starts.push_back(base);
        base += b;
      }
      for (int g = kRegions; g-- > 0;) lent += pager.lend(g, starts[g], region_bytes[g]);
      EXPECT_EQ(lent, 4u + 3u + 5u) << "whole 4096-aligned pages of each region";
      EXPECT_EQ(pager.usable_frames(), 4u + lent);
      const auto before = pager.take_stats();
      r.lent_read += before.lent_read_bytes;
      pager.for_each([&](size_t, char* data) {
        auto* f = reinterpret_cast<float*>(data);
        for (size_t i = 0; i < n; ++i) f[i] += 1.0f;
      });
      const auto s = pager.take_stats();
      r.read += before.nvme_read_bytes + s.nvme_read_bytes;
      r.written += before.nvme_written_bytes + s.nvme_written_bytes;
      r.hits += s.hits;
      r.accesses += s.accesses;
      // The forward: each region claimed, then overwritten by its owner.
      for (int g = 0; g < kRegions; ++g) {
        pager.claim(g);
        std::memset(starts[g], 0xA5, region_bytes[g]);
      }
      EXPECT_EQ(pager.usable_frames(), 4u);
    }
    for (size_t p = 0; p < pages; ++p)
      pager.access(p, [&](char* data) {
        const auto* f = reinterpret_cast<const float*>(data);
        for (size_t i = 0; i < n; i += 97)
          ASSERT_EQ(f[i], static_cast<float>(p * 1000 + i % 1000 + passes))
              << (fallback ? "fallback" : "io_uring") << ": page " << p << " element " << i;
      }, false);
    return r;
  };
  const Result a = run(false), b = run(false), c = run(true);
  std::printf("lent frames: read %llu (of which ahead %llu), written %llu bytes, hit rate %.3f\n",
              static_cast<unsigned long long>(a.read), static_cast<unsigned long long>(a.lent_read),
              static_cast<unsigned long long>(a.written),
              static_cast<double>(a.hits) / static_cast<double>(a.accesses));
  // 12 lent frames each pass, filled between passes (and the own frames
  // left writing at the previous pass's end).
  EXPECT_GE(a.lent_read, 6 * 12 * kPage) << "every lent frame should be read into ahead of the pass";
  EXPECT_EQ(a.lent_read, b.lent_read) << "reads ahead differ between two identical runs";
  EXPECT_GE(a.hits, 6u * 16u) << "the 16 resident pages at a pass's start should all be hits";
  EXPECT_EQ(a.read, b.read) << "NVMe reads differ between two identical runs";
  EXPECT_EQ(a.written, b.written) << "NVMe writes differ between two identical runs";
  EXPECT_EQ(a.read, c.read) << "io_uring and the thread fallback read different pages";
}

TEST(Pager, AFlippedByteInTheSwapFileIsNamed) {
  po::test::TempDir dir;
  const size_t pages = 12;
  Pager pager(pages, options(dir.path().string(), 4, 0, false));
  pager.for_each([](size_t p, char* d) { std::memset(d, static_cast<int>(p + 1), kPage); });
  pager.for_each([](size_t, char* d) { d[5] ^= 1; });  // pass 2 (reverse): pages 0.. end on NVMe
  ASSERT_NE(pager.store(), nullptr);
  const std::string path = pager.store()->path();
  // The reverse pass ended with pages 3..0 resident; 4..11 are on NVMe and
  // the next (forward) pass reads page 8 from there.
  {
    const int fd = ::open(path.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    char b = 0;
    ASSERT_EQ(::pread(fd, &b, 1, static_cast<off_t>(8 * kPage + 100)), 1);
    b ^= 0x40;
    ASSERT_EQ(::pwrite(fd, &b, 1, static_cast<off_t>(8 * kPage + 100)), 1);
    ::fsync(fd);
    ::close(fd);
  }
  try {
    pager.for_each([](size_t, char* d) { d[6] ^= 1; });
    FAIL() << "a flipped byte in " << path << " went unnoticed";
  } catch (const po::core::IoError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("page 8"), std::string::npos) << msg;
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find("nvme tier"), std::string::npos) << msg;
    EXPECT_NE(msg.find("checksum"), std::string::npos) << msg;
  }
}

TEST(Pager, TooSmallAComputeTierIsRefusedWithTheMinimum) {
  po::test::TempDir dir;
  try {
    Pager pager(10, options(dir.path().string(), 3, 0, false));
    FAIL() << "3 frames accepted with prefetch 2";
  } catch (const po::core::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("at least 4"), std::string::npos) << e.what();
  }
  PagerOptions o = options("", 4, 0, false);
  try {
    Pager pager(10, o);
    FAIL() << "pages beyond the compute tier without memory.nvme_dir";
  } catch (const po::core::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("memory.nvme_dir"), std::string::npos) << e.what();
  }
}

TEST(TensorPools, AComputeBudgetRefusesAllocationsBeyondIt) {
  using po::tensor::Pool;
  const size_t before = po::tensor::pool_bytes_live(Pool::kCompute);
  po::tensor::set_pool_budget(Pool::kCompute, before + (1 << 20));
  {
    po::tensor::Storage ok(512 << 10);
    EXPECT_THROW(po::tensor::Storage(1 << 20), po::core::OutOfMemory);
    EXPECT_EQ(po::tensor::pool_bytes_live(Pool::kCompute), before + (512 << 10));
  }
  po::tensor::set_pool_budget(Pool::kCompute, 0);
  po::tensor::Storage big(4 << 20);  // no budget: fine
  EXPECT_EQ(po::tensor::pool_bytes_live(Pool::kHost), 0u);
}

}  // namespace

// Frames split over several pagers (a pipeline rank's chunks): each keeps
// its own minimum, the rest goes in proportion to pages, the shares add up
// to the frames given, and nobody gets more than its pages.
TEST(SplitFrames, EachPagerKeepsItsOwnMinimum) {
  const std::vector<size_t> pages = {40, 10, 30};
  const std::vector<size_t> least = {3, 9, 4};  // (the second: a pager of several fields)
  const std::vector<size_t> out = po::memory::split_frames(20, pages, least);
  ASSERT_EQ(out.size(), 3u);
  size_t sum = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_GE(out[i], least[i]) << "pager " << i << " got " << out[i] << " frames, below its minimum " << least[i];
    EXPECT_LE(out[i], pages[i]) << "pager " << i << " got more frames than pages";
    sum += out[i];
  }
  EXPECT_EQ(sum, 20u) << "the shares do not add up to the frames given";
  // One minimum for all (the scalar form) gives what the vector of it gives.
  EXPECT_EQ(po::memory::split_frames(20, pages, 4), po::memory::split_frames(20, pages, std::vector<size_t>{4, 4, 4}));
  // Everything fits: every pager holds all its pages.
  EXPECT_EQ(po::memory::split_frames(100, pages, least), pages);
}
