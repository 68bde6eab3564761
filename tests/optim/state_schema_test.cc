// Optimizer state as a schema (optim/state_schema.h): the bytes a field and a
// schema take, and pages cut by a schema's bytes (optim/paged_state.h) for a
// quantized-looking schema as well as AdamW's: whole blocks per page, fields
// 64-byte aligned, the pages never overrun, and codes and block scales keep
// their values through eviction to NVMe.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "../test_util.h"
#include "optim/adamw.h"
#include "optim/paged_state.h"
#include "optim/state_schema.h"

namespace po::test {
namespace {

using optim::PagedState;
using optim::StateDtype;
using optim::StateField;
using optim::StateSchema;

// 8-bit m and 4-bit v with absmax scales, and an fp32 master: the form an
// 8/4-bit Adam takes (no kernel here: the pages only).
constexpr StateField kQuant[] = {
    {"q8", StateDtype::kU8, 256},
    {"q4", StateDtype::kU4, 128},
    {"master", StateDtype::kF32, 0, false},
};
constexpr StateSchema kQuantSchema{"quant-test", kQuant};

TEST(StateSchema, FieldBytesAreCodesThenOneScalePerBlock) {
  EXPECT_EQ(kQuant[0].bytes(512), 512 + 2 * 4);
  EXPECT_EQ(kQuant[0].bytes(300), 300 + 2 * 4);  // the last block short
  EXPECT_EQ(kQuant[1].bytes(256), 128 + 2 * 4);
  EXPECT_EQ(kQuant[1].code_bytes(3), 2);
  EXPECT_EQ(kQuant[2].bytes(10), 40);
  EXPECT_EQ(kQuant[0].granule(), 256);
  EXPECT_EQ(kQuant[1].granule(), 128);
  EXPECT_EQ(kQuant[2].granule(), 1);
  EXPECT_EQ((StateField{"h", StateDtype::kU4}).granule(), 2);  // two codes a byte
  // Each field (and each block of scales) starting 64-byte aligned.
  EXPECT_EQ(kQuantSchema.bytes(256, 64), 256 + 64 + 128 + 64 + 1024);
  EXPECT_EQ(kQuantSchema.bytes(256), 256 + 4 + 128 + 8 + 1024);
  EXPECT_EQ(kQuantSchema.find("q4"), 1);
  EXPECT_EQ(kQuantSchema.find("adam_m"), -1);
}

TEST(StateSchema, AdamWIsTwoFp32MomentsAndTheMasterWhereBf16) {
  const StateSchema fp32 = optim::adamw_schema(false), bf16 = optim::adamw_schema(true);
  ASSERT_EQ(fp32.fields.size(), 2u);
  ASSERT_EQ(bf16.fields.size(), 3u);
  EXPECT_EQ(fp32.fields[optim::AdamW::kM].name, "adam_m");
  EXPECT_EQ(fp32.fields[optim::AdamW::kV].name, "adam_v");
  EXPECT_EQ(bf16.fields[optim::AdamW::kMaster].name, "master");
  EXPECT_FALSE(bf16.fields[optim::AdamW::kMaster].checkpointed) << "the checkpoint's params are the master";
  EXPECT_EQ(fp32.bytes(1000), 8000);
  EXPECT_EQ(bf16.bytes(1000), 12000);
  for (StateDtype d : {StateDtype::kF32, StateDtype::kBf16, StateDtype::kU8, StateDtype::kU4})
    EXPECT_EQ(optim::parse_state_dtype(optim::dtype_name(d)), d);
  EXPECT_FALSE(optim::parse_state_dtype("fp32").has_value());
}

TEST(StateSchema, PagesHoldWholeBlocksAlignedAndNeverOverrun) {
  for (size_t page : {size_t{4096}, size_t{16384}, size_t{1} << 20}) {
    const PagedState::Layout l{kQuantSchema, 0, 0};
    const auto g = PagedState::geometry(1000000, page, l);
    SCOPED_TRACE(page);
    EXPECT_EQ(g.state_elements % 256, 0);
    EXPECT_LE(kQuantSchema.bytes(g.state_elements, PagedState::kAlign), static_cast<int64_t>(page));
    // The most that fit: one more granule would not.
    EXPECT_GT(kQuantSchema.bytes(g.state_elements + 256, PagedState::kAlign), static_cast<int64_t>(page));
    for (size_t i = 0; i < kQuantSchema.fields.size(); ++i) EXPECT_EQ(g.offset[i] % 64, 0) << i;
    EXPECT_EQ(g.state_pages, static_cast<size_t>((1000000 + g.state_elements - 1) / g.state_elements));
  }
  // AdamW's pages are as before the schema: page / 8 (fp32) or / 12 (bf16), down to 16.
  EXPECT_EQ(PagedState::geometry(1, 16384, {optim::adamw_schema(false)}).state_elements, 2048);
  EXPECT_EQ(PagedState::geometry(1, 16384, {optim::adamw_schema(true)}).state_elements, 1360);
  // A state smaller per element than a paged parameter: a state page holds no
  // more than one parameter page does, so each lies in one page of each.
  constexpr StateField k8[] = {{"q8", StateDtype::kU8, 256}};
  const auto g = PagedState::geometry(100000, 16384, {StateSchema{"u8", k8}, 4, 4});
  EXPECT_EQ(g.state_elements, 4096);
  EXPECT_EQ(g.param_elements, 4096);
  EXPECT_EQ(g.param_elements % g.state_elements, 0);
  EXPECT_NE(error_of([] { (void)PagedState::geometry(10, 1024, {kQuantSchema, 0, 0}); }).find("too small a page"),
            std::string::npos);
}

// Codes and scales written through the sweep's views (a piece at a time, as
// an update over tensor pieces would) survive eviction and come back.
TEST(StateSchema, QuantizedFieldsPageThroughNvme) {
  TempDir dir;
  memory::PagerOptions o;
  o.page_bytes = 4096;
  o.compute_frames = 3;
  o.prefetch = 1;
  o.nvme_dir = dir.path().string();
  o.file_name = "q.swap";
  const int64_t n = 20 * 1536 + 700;  // many pages, the last part-filled
  PagedState st(n, {kQuantSchema, 0, 0}, o);
  const int64_t e = st.elements_per_page();
  ASSERT_GT(st.state_pages(), 6u) << "the test must evict";
  auto code8 = [](int64_t i) { return static_cast<uint8_t>(i * 31 + 7); };
  auto code4 = [](int64_t i) { return static_cast<uint8_t>((i * 5 + 3) & 15); };
  auto scale = [](int64_t block, int f) { return static_cast<float>(block) * 0.5f + static_cast<float>(f); };
  for (int pass = 0; pass < 3; ++pass) {
    int64_t seen = 0;
    st.for_each_page([&](int64_t lo, int64_t hi, const PagedState::View& page_view) {
      ASSERT_EQ(lo % e, 0);
      for (int64_t a = lo; a < hi; a += 256) {  // pieces of 256: both granules
        const PagedState::View v = st.advanced(page_view, a - lo);
        const int64_t b = std::min(hi, a + 256);
        for (int64_t i = a; i < b; ++i) {
          const auto k = static_cast<size_t>(i - a);
          auto* q8 = reinterpret_cast<uint8_t*>(v.field[0].codes);
          auto* q4 = reinterpret_cast<uint8_t*>(v.field[1].codes);
          float* master = v.f32(2);
          uint8_t& nib = q4[k / 2];
          const unsigned got4 = k % 2 ? nib >> 4 : nib & 15;
          if (pass == 0) {
            q8[k] = code8(i);
            nib = static_cast<uint8_t>(k % 2 ? (nib & 15) | (code4(i) << 4) : (nib & 0xf0) | code4(i));
            master[k] = static_cast<float>(i);
          } else {
            ASSERT_EQ(q8[k], code8(i)) << "element " << i << " pass " << pass;
            ASSERT_EQ(got4, code4(i)) << "element " << i << " pass " << pass;
            ASSERT_EQ(master[k], static_cast<float>(i)) << "element " << i;
          }
        }
        for (int f = 0; f < 2; ++f) {
          const int64_t block = kQuant[f].block, first = a / block;
          for (int64_t j = 0; j < (b - a + block - 1) / block; ++j) {
            if (pass == 0) v.field[static_cast<size_t>(f)].scales[j] = scale(first + j, f);
            else ASSERT_EQ(v.field[static_cast<size_t>(f)].scales[j], scale(first + j, f)) << "block " << first + j;
          }
        }
      }
      seen += hi - lo;
    });
    EXPECT_EQ(seen, n);
  }
  EXPECT_GT(st.take_stats().nvme_read_bytes, 0u) << "nothing was read back: the test proves nothing";
  // The element-wise field copies out; the block-scaled ones are visited by page only.
  std::vector<float> master(static_cast<size_t>(n));
  st.copy_out(2, 0, n, master.data());
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(master[static_cast<size_t>(i)], static_cast<float>(i));
  EXPECT_EQ(st.field_bytes(0), 0u);
}

}  // namespace
}  // namespace po::test
