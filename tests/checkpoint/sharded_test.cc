// Sharded checkpoints in one process: N ranks are simulated by calling the
// per-rank phase (write_shard) for r = 0..N-1 and then the commit, on a small
// fake model whose units have awkward sizes (7, a million and 3, one that is
// empty, one smaller than the rank count). Loading into every other rank
// count must give the same bits; every damaged checkpoint must give one clear
// error naming the file.
#include "checkpoint/sharded.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <vector>

#include "../test_util.h"
#include "core/error.h"
#include "parallel/shard_layout.h"
#include "test_dir.h"
#include "train/run_state.h"

using po::test::error_of;

namespace po::checkpoint {
namespace {

namespace fs = std::filesystem;
using parallel::ShardLayout;
using testing::ScratchDir;

const std::vector<int64_t> kUnits = {7, 1000003, 0, 3, 4100};
constexpr int64_t kChunk = 64 << 10;  // test-only: many chunks per slice

// The global state of the fake model: per kind, per unit, a distinct bit
// pattern per element (not just small numbers: any misplaced element shows).
struct FakeState {
  std::vector<std::vector<float>> data[3];
  explicit FakeState(uint32_t salt = 0) {
    for (int k = 0; k < 3; ++k) {
      for (size_t u = 0; u < kUnits.size(); ++u) {
        std::vector<float> v(static_cast<size_t>(kUnits[u]));
        for (size_t i = 0; i < v.size(); ++i) {
          uint32_t x = static_cast<uint32_t>(i * 2654435761u) ^ (static_cast<uint32_t>(u) << 24) ^
                       (static_cast<uint32_t>(k) << 30) ^ salt;
          x = (x & 0x807fffffu) | 0x3f000000u;  // a finite float in [0.5, 1) or (-1, -0.5]
          std::memcpy(&v[i], &x, 4);
        }
        data[k].push_back(std::move(v));
      }
    }
  }
  const float* at(StateKind k, int u, int64_t i) const {
    return data[static_cast<int>(k)][static_cast<size_t>(u)].data() + i;
  }
};

std::vector<TensorRecord> fake_tensors() {
  return {{"a", {7}, 0, 0},
          {"big.weight", {1000, 1000}, 1, 0},
          {"big.bias", {3}, 1, 1000000},
          {"c", {3}, 3, 0},
          {"d.weight", {41, 100}, 4, 0}};
}

CheckpointMeta fake_meta(int64_t step) {
  CheckpointMeta m;
  m.step = step;
  m.seed = (uint64_t{1} << 63) + 5;  // does not fit int64
  m.tokens = 123456789012ull;
  m.adam_t = step + 1;
  m.config_toml = "[model]\npreset = \"gpt2-tiny\" # \"quoted\", tab\t, ü\n";
  m.dp = 4;
  m.zero_stage = 1;
  m.tensors = fake_tensors();
  return m;
}

ShardSource source_of(const FakeState& s, const ShardLayout& layout) {
  return [&s, &layout](StateKind k, int u) { return s.at(k, u, layout.begin(u)); };
}

// Saves `state` as `ranks` simulated ranks: prepare, every rank's shard, commit.
void save_as_ranks(const std::string& dir, const FakeState& state, int ranks, int64_t step,
                   const std::vector<StateKind>& kinds = {kAllStateKinds.begin(),
                                                          kAllStateKinds.end()}) {
  SaveOptions o;
  o.kinds = kinds;
  o.chunk_bytes = kChunk;
  prepare_sharded_save(dir);
  for (int r = 0; r < ranks; ++r) {
    ShardLayout layout(kUnits, ranks, r);
    write_shard(dir, fake_meta(step), layout, source_of(state, layout), o);
  }
  commit_sharded(dir, fake_meta(step), ranks);
}

// Loads `kinds` as every rank of a `ranks` layout and expects exactly `want`'s bits.
void expect_loads_as(const std::string& dir, const FakeState& want, int ranks,
                     const std::vector<StateKind>& kinds) {
  for (int r = 0; r < ranks; ++r) {
    ShardLayout layout(kUnits, ranks, r);
    std::vector<std::vector<float>> got[3];
    for (auto& g : got)
      for (size_t u = 0; u < kUnits.size(); ++u)
        g.emplace_back(static_cast<size_t>(layout.owned(static_cast<int>(u))), -7.0f);
    Manifest m = load_sharded(
        dir, layout,
        [&](StateKind k, int u) { return got[static_cast<int>(k)][static_cast<size_t>(u)].data(); },
        kinds);
    EXPECT_EQ(m.meta.step, 5);
    for (StateKind k : kinds) {
      for (int u = 0; u < static_cast<int>(kUnits.size()); ++u) {
        const auto& g = got[static_cast<int>(k)][static_cast<size_t>(u)];
        ASSERT_EQ(std::memcmp(g.data(), want.at(k, u, layout.begin(u)), g.size() * 4), 0)
            << state_kind_name(k) << " of unit " << u << " differs for rank " << r << " of "
            << ranks << " (elements [" << layout.begin(u) << ", " << layout.end(u) << "))";
      }
    }
  }
}

void load_all_as_one(const std::string& dir) {
  expect_loads_as(dir, FakeState(), 1, {kAllStateKinds.begin(), kAllStateKinds.end()});
}

std::string bytes_of(const std::string& path) { return po::test::read_file(path); }

TEST(Sharded, FourRanksReshardToAnyRankCountBitIdentically) {
  ScratchDir d;
  const std::string dir = d / "step_00000005";
  FakeState state;
  save_as_ranks(dir, state, 4, 5);
  EXPECT_FALSE(fs::exists(staging_dir(dir)));
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"manifest.json", "rank_00000.bin", "rank_00001.bin",
                                             "rank_00002.bin", "rank_00003.bin"}));
  for (int ranks : {1, 2, 3, 4, 5})
    expect_loads_as(dir, state, ranks, {kAllStateKinds.begin(), kAllStateKinds.end()});
}

// A rank file built in memory and written with O_DIRECT (ShardImage, for
// background saves) is byte for byte the one write_shard writes, for 3 ranks
// of awkward unit sizes (files that end inside a 4096-byte block), refilled
// twice (the image is reused), from direct and from staged sources.
TEST(Sharded, ShardImageWritesTheFilesWriteShardWrites) {
  ScratchDir tmp;
  const FakeState first(1), second(2);
  constexpr int kRanks = 3;
  SaveOptions o;
  o.chunk_bytes = kChunk;
  save_as_ranks((tmp / "ref"), second, kRanks, 5);
  std::vector<std::unique_ptr<ShardImage>> images;
  for (int r = 0; r < kRanks; ++r) images.push_back(std::make_unique<ShardImage>(ShardLayout(kUnits, kRanks, r), o));
  for (const FakeState* state : {&first, &second}) {
    prepare_sharded_save((tmp / "img"));
    for (int r = 0; r < kRanks; ++r) {
      ShardLayout layout(kUnits, kRanks, r);
      images[static_cast<size_t>(r)]->set_direct_sources(r != 1);
      std::vector<float> staged;  // rank 1: one buffer reused for every slice
      images[static_cast<size_t>(r)]->fill(fake_meta(5), r != 1 ? source_of(*state, layout)
                                                                 : ShardSource([&](StateKind k, int u) {
                                                                     staged.assign(state->at(k, u, layout.begin(u)),
                                                                                   state->at(k, u, layout.end(u)));
                                                                     return staged.data();
                                                                   }));
      images[static_cast<size_t>(r)]->write((tmp / "img"));
    }
    commit_sharded((tmp / "img"), fake_meta(5), kRanks);
  }
  for (int r = 0; r < kRanks; ++r) {
    char name[32];
    std::snprintf(name, sizeof name, "rank_%05d.bin", r);
    EXPECT_EQ(bytes_of((tmp / "img") + "/" + name), bytes_of((tmp / "ref") + "/" + name))
        << name << " from the image differs from write_shard's";
  }
  EXPECT_EQ(bytes_of((tmp / "img") + "/manifest.json"), bytes_of((tmp / "ref") + "/manifest.json"));
  expect_loads_as((tmp / "img"), second, 2, {kAllStateKinds.begin(), kAllStateKinds.end()});
}

TEST(Sharded, ManifestKeepsTheRunMetadataAndLayout) {
  ScratchDir d;
  const std::string dir = d / "ck";
  save_as_ranks(dir, FakeState(), 4, 5);
  const CheckpointMeta got = read_sharded_meta(dir), want = fake_meta(5);
  EXPECT_EQ(got.step, want.step);
  EXPECT_EQ(got.seed, want.seed);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.adam_t, want.adam_t);
  EXPECT_EQ(got.config_toml, want.config_toml);
  EXPECT_EQ(got.dp, 4);
  EXPECT_EQ(got.zero_stage, 1);
  EXPECT_EQ(got.tensors, want.tensors);
  const Manifest m = read_manifest(dir);
  EXPECT_EQ(m.writers, 4);
  EXPECT_EQ(m.unit_numel, kUnits);
  EXPECT_EQ(m.chunk_bytes, kChunk);
  for (const auto& s : m.slices) EXPECT_EQ(s.offset % kShardAlign, 0) << s.file;
  EXPECT_NO_THROW(check_tensors(m, fake_tensors(), dir));
  auto other = fake_tensors();
  other[1].shape = {1000, 999};
  EXPECT_NE(error_of([&] { check_tensors(m, other, dir); })
                .find("tensor 'big.weight' has shape "
                      "[1000, 1000] but the model's is "
                      "[1000, 999]"),
            std::string::npos);
  other = fake_tensors();
  other.pop_back();
  EXPECT_NE(error_of([&] { check_tensors(m, other, dir); }).find("'d.weight'"), std::string::npos);
}

TEST(Sharded, SingleProcessSaveWithoutCommunicator) {
  ScratchDir d;
  const std::string dir = d / "ck";
  FakeState state;
  ShardLayout one(kUnits, 1, 0);
  save_sharded(dir, fake_meta(5), one, source_of(state, one), nullptr);
  EXPECT_EQ(read_manifest(dir).chunk_bytes, kDefaultChunkBytes);
  for (int ranks : {1, 3}) expect_loads_as(dir, state, ranks, {StateKind::kAdamV});
  ShardLayout two(kUnits, 2, 0);
  EXPECT_NE(error_of([&] {
              save_sharded(dir, fake_meta(5), two, source_of(state, two), nullptr);
            }).find("needs a communicator"),
            std::string::npos);
}

TEST(Sharded, WeightsOnly) {
  ScratchDir d;
  const std::string dir = d / "ck";
  FakeState state;
  save_as_ranks(dir, state, 3, 5, {StateKind::kParams});
  expect_loads_as(dir, state, 2, {StateKind::kParams});
  const std::string e = error_of([&] { expect_loads_as(dir, state, 2, {StateKind::kAdamM}); });
  EXPECT_NE(e.find("holds no adam_m"), std::string::npos) << e;
  EXPECT_EQ(read_manifest(dir).kinds, std::vector<StateKind>{StateKind::kParams});
}

TEST(Sharded, UnitMismatchWithTheModelIsAClearError) {
  ScratchDir d;
  const std::string dir = d / "ck";
  save_as_ranks(dir, FakeState(), 2, 5);
  auto units = kUnits;
  units[3] = 4;
  ShardLayout layout(units, 1, 0);
  std::vector<float> sink(2000000);
  const std::string e = error_of([&] {
    load_sharded(dir, layout, [&](StateKind, int) { return sink.data(); }, {StateKind::kParams});
  });
  EXPECT_NE(e.find("unit 3 holds 3 elements but the model's has 4"), std::string::npos) << e;
}

TEST(Sharded, TruncatedRankFileIsNamed) {
  ScratchDir d;
  const std::string dir = d / "ck";
  save_as_ranks(dir, FakeState(), 4, 5);
  const std::string f = dir + "/rank_00002.bin";
  fs::resize_file(f, fs::file_size(f) - 1000);
  const std::string e = error_of([&] { load_all_as_one(dir); });
  EXPECT_NE(e.find("rank_00002.bin: truncated"), std::string::npos) << e;
  EXPECT_NE(format_manifest(dir).find("TRUNCATED"), std::string::npos);
}

TEST(Sharded, ManifestNamingAMissingFileIsNamed) {
  ScratchDir d;
  const std::string dir = d / "ck";
  save_as_ranks(dir, FakeState(), 4, 5);
  fs::remove(dir + "/rank_00001.bin");
  const std::string e = error_of([&] { load_all_as_one(dir); });
  EXPECT_NE(e.find("rank_00001.bin: missing (manifest.json names it as rank 1's shard file)"),
            std::string::npos)
      << e;
  EXPECT_NE(format_manifest(dir).find("rank_00001.bin  MISSING"), std::string::npos)
      << format_manifest(dir);
  // A layout that needs nothing from rank 1's file still loads.
  ShardLayout layout(kUnits, 4, 3);
  std::vector<float> sink(300000);
  EXPECT_NO_THROW(
      load_sharded(dir, layout, [&](StateKind, int) { return sink.data(); }, {StateKind::kParams}));
}

TEST(Sharded, FlippedByteIsAChecksumErrorNamingFileAndOffset) {
  ScratchDir d;
  const std::string dir = d / "ck";
  save_as_ranks(dir, FakeState(), 4, 5);
  const Manifest m = read_manifest(dir);
  // A byte in the middle of rank 3's adam_m slice of the big unit.
  const SliceRecord* s = nullptr;
  for (const auto& x : m.slices)
    if (x.kind == StateKind::kAdamM && x.unit == 1 && x.rank == 3) s = &x;
  ASSERT_NE(s, nullptr);
  const int64_t flip = s->offset + 3 * kChunk + 1234;
  std::string bytes = bytes_of(dir + "/rank_00003.bin");
  bytes[static_cast<size_t>(flip)] ^= 0x10;
  po::test::write_file(dir + "/rank_00003.bin", bytes);
  const int64_t c0 = s->offset + 3 * kChunk;
  const std::string e = error_of([&] { load_all_as_one(dir); });
  EXPECT_NE(e.find(core::str_cat("rank_00003.bin: checksum mismatch in bytes [", c0, ", ",
                                 c0 + kChunk, ") (adam_m of unit 1")),
            std::string::npos)
      << e;
  // Params and the other chunks are still good: a reader that does not touch
  // the damaged chunk does not fail.
  EXPECT_NO_THROW(expect_loads_as(dir, FakeState(), 3, {StateKind::kParams, StateKind::kAdamV}));
}

TEST(Sharded, DamagedManifestIsAClearError) {
  ScratchDir d;
  const std::string dir = d / "ck";
  save_as_ranks(dir, FakeState(), 2, 5);
  const std::string path = dir + "/manifest.json";
  const std::string good = bytes_of(path);
  std::string edited = good;
  const size_t pos = edited.find("\"step\": 5");
  ASSERT_NE(pos, std::string::npos) << good;
  edited[pos + 8] = '6';
  po::test::write_file(path, edited);
  std::string e = error_of([&] { read_manifest(dir); });
  EXPECT_NE(e.find("manifest.json: manifest checksum mismatch"), std::string::npos) << e;
  po::test::write_file(path, good.substr(0, good.size() / 2));
  e = error_of([&] { read_manifest(dir); });
  EXPECT_NE(e.find("manifest.json: not valid JSON"), std::string::npos) << e;
  fs::remove(path);
  e = error_of([&] { read_manifest(dir); });
  EXPECT_NE(e.find("manifest.json: missing"), std::string::npos) << e;
  // Whitespace does not matter to the checksum.
  std::string spaced;
  for (char c : good) spaced += c == '\n' ? std::string("\n  ") : std::string(1, c);
  po::test::write_file(path, spaced);
  EXPECT_NO_THROW(read_manifest(dir));
}

TEST(Sharded, ManifestInvariantsAreChecked) {
  ScratchDir d;
  const std::string dir = d / "ck";
  save_as_ranks(dir, FakeState(), 2, 5);
  const Manifest good = read_manifest(dir);
  auto expect_invalid = [&](const std::function<void(Manifest&)>& edit, const std::string& needle) {
    Manifest m = good;
    edit(m);
    const std::string e = error_of([&] { parse_manifest(manifest_to_json(m), "m.json"); });
    EXPECT_NE(e.find(needle), std::string::npos) << "wanted '" << needle << "', got: " << e;
  };
  expect_invalid([](Manifest& m) { m.slices.pop_back(); }, "no slice holds elements");
  expect_invalid([](Manifest& m) { m.slices[1].hi -= 1; },
                 "params of unit 1: no slice holds elements [500001, 500002)");
  expect_invalid([](Manifest& m) { m.slices[0].file = "../../etc/passwd"; }, "not listed");
  expect_invalid([](Manifest& m) { m.files[0].name = "../x"; }, "not a plain file name");
  expect_invalid([](Manifest& m) { m.files[1].bytes = 100; }, "past the header");
  expect_invalid([](Manifest& m) { m.slices[0].xxh3.pop_back(); }, "checksums for");
  expect_invalid([](Manifest& m) { m.meta.tensors[0].shape = {8}; }, "lie outside unit 0");
  expect_invalid([](Manifest& m) { m.meta.tensors[2].offset = 999999; }, "overlap in unit 1");
  expect_invalid([](Manifest& m) { m.slices[0].offset += 1; }, "-aligned range");
  std::string e = error_of([] { parse_manifest("{\"format\": \"x\"}", "m.json"); });
  EXPECT_NE(e.find("m.json: format 'x'"), std::string::npos) << e;
  e = error_of([] { parse_manifest("[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]", "m.json"); });
  EXPECT_NE(e.find("nested deeper"), std::string::npos) << e;
  const std::string text = manifest_to_json(good);
  std::string v3 = text;
  v3.replace(v3.find("\"version\": 2"), 12, "\"version\": 3");
  e = error_of([&] { parse_manifest(v3, "m.json", false); });
  EXPECT_NE(e.find("format version 3 (this build reads versions 1 to 2"), std::string::npos) << e;
  std::string neg = text;
  neg.replace(neg.find("\"step\": 5"), 9, "\"step\": -5");
  e = error_of([&] { parse_manifest(neg, "m.json", false); });
  EXPECT_NE(e.find("field 'step' = -5 is outside"), std::string::npos) << e;
}

// Version 2 records each kind as its schema field and the optimizer's schema.
TEST(Sharded, ManifestRecordsEachKindAsItsSchemaField) {
  ScratchDir d;
  const std::string dir = d / "ck";
  save_as_ranks(dir, FakeState(), 2, 5);
  const nlohmann::json j = nlohmann::json::parse(bytes_of(dir + "/manifest.json"));
  EXPECT_EQ(j["version"], 2);
  EXPECT_EQ(j["optimizer"], "adamw");
  ASSERT_EQ(j["kinds"].size(), 3u) << j["kinds"].dump();
  const char* names[] = {"params", "adam_m", "adam_v"};
  for (size_t i = 0; i < 3; ++i)
    EXPECT_EQ(j["kinds"][i], (nlohmann::json{{"name", names[i]}, {"dtype", "f32"}, {"bits", 32}, {"block", 0}}))
        << j["kinds"].dump();
}

// A kind stored in a form this build does not read it in (another optimizer
// state's, say 8-bit moments) is named with both forms, never misread.
TEST(Sharded, AKindInAnotherFormOrAnotherOptimizerIsNamed) {
  ScratchDir d;
  const std::string dir = d / "ck";
  save_as_ranks(dir, FakeState(), 2, 5);
  const nlohmann::ordered_json good = nlohmann::ordered_json::parse(bytes_of(dir + "/manifest.json"));
  auto error_with = [&](const std::function<void(nlohmann::ordered_json&)>& edit) {
    nlohmann::ordered_json j = good;
    edit(j);
    return error_of([&] { parse_manifest(j.dump(), "m.json", false); });
  };
  std::string e = error_with([](auto& j) {
    j["kinds"][1]["dtype"] = "u8";
    j["kinds"][1]["bits"] = 8;
    j["kinds"][1]["block"] = 256;
  });
  EXPECT_NE(e.find("m.json: field 'kinds[1]' 'adam_m' is stored as u8 with an fp32 scale per 256; "
                   "this build reads it as f32"),
            std::string::npos)
      << e;
  e = error_with([](auto& j) { j["kinds"][2]["bits"] = 16; });
  EXPECT_NE(e.find("field 'kinds[2].bits' is not the 32 bits of f32"), std::string::npos) << e;
  e = error_with([](auto& j) { j["kinds"][0]["dtype"] = "f64"; });
  EXPECT_NE(e.find("field 'kinds[0].dtype' = 'f64' is not f32, bf16, u8 or u4"), std::string::npos) << e;
  e = error_with([](auto& j) { j["optimizer"] = "adam8bit"; });
  EXPECT_NE(e.find("m.json: optimizer state 'adam8bit' (this build writes and reads adamw)"),
            std::string::npos)
      << e;
  e = error_with([](auto& j) { j["kinds"][1] = "adam_m"; });  // version 1's form in version 2
  EXPECT_NE(e.find("field 'kinds[1]' must be a JSON object"), std::string::npos) << e;
  e = error_with([](auto& j) { j.erase("optimizer"); });
  EXPECT_NE(e.find("field 'optimizer' is missing"), std::string::npos) << e;
}

// Version 1 (kinds as bare names, no optimizer: AdamW's fp32 state) reads
// into the same manifest; tests/train/old_checkpoint_launch_test resumes
// real version-1 checkpoints written by older builds.
TEST(Sharded, VersionOneManifestsAreRead) {
  ScratchDir d;
  const std::string dir = d / "ck";
  save_as_ranks(dir, FakeState(), 3, 5);
  const std::string text = bytes_of(dir + "/manifest.json");
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(text);
  j["version"] = 1;
  j.erase("optimizer");
  j["kinds"] = {"params", "adam_m", "adam_v"};
  const Manifest v1 = parse_manifest(j.dump(), "v1.json", false), v2 = parse_manifest(text, "v2.json");
  EXPECT_EQ(v1.version, 1);
  EXPECT_EQ(v1.optimizer, "adamw");
  EXPECT_EQ(v1.kinds, v2.kinds);
  EXPECT_EQ(v1.data_bytes(), v2.data_bytes());
  ASSERT_EQ(v1.slices.size(), v2.slices.size());
  for (size_t i = 0; i < v1.slices.size(); ++i) EXPECT_EQ(v1.slices[i].bytes(), v2.slices[i].bytes()) << i;
  // Written again, it is version 2.
  EXPECT_EQ(parse_manifest(manifest_to_json(v1), "again.json").version, 2);
}

TEST(Sharded, FormatManifestIsReadable) {
  ScratchDir d;
  const std::string dir = d / "ck";
  save_as_ranks(dir, FakeState(), 4, 5);
  const std::string text = format_manifest(dir);
  for (const char* needle :
       {"step 5, tokens 123456789012, adam_t 6",
        "written by 4 rank(s) (parallel.dp = 4, zero_stage = 1)",
        "format pagedoptim-sharded-checkpoint v2", "state of adamw: params f32, adam_m f32, adam_v f32;",
        "big.weight", "[1000, 1000]", "rank_00003.bin", "slices (", "[750003, 1000003)"})
    EXPECT_NE(text.find(needle), std::string::npos) << "lacks '" << needle << "':\n" << text;
}

TEST(Sharded, InterruptedSaveLeavesThePreviousCheckpointNewest) {
  ScratchDir d;
  const std::string ckpts = d / "checkpoints";
  const std::string one = ckpts + "/step_00000001", two = ckpts + "/step_00000002";
  FakeState state;
  save_as_ranks(one, state, 4, 5);
  // A save of step 2 dies after two of four ranks wrote their shards.
  prepare_sharded_save(two);
  for (int r = 0; r < 2; ++r) {
    ShardLayout layout(kUnits, 4, r);
    write_shard(two, fake_meta(5), layout, source_of(state, layout));
  }
  EXPECT_NE(error_of([&] {
              commit_sharded(two, fake_meta(5), 4);
            }).find("rank_00002.json: missing (rank 2 did not finish writing its shard)"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(two));
  EXPECT_EQ(train::list_checkpoints(ckpts), std::vector<std::string>{one});
  EXPECT_EQ(train::resolve_checkpoint(d.path().string()), one);
  load_all_as_one(one);
  // The next save of step 2 succeeds and leaves no staging directory.
  FakeState other(77);
  save_as_ranks(two, other, 2, 5);
  EXPECT_FALSE(fs::exists(staging_dir(two)));
  EXPECT_EQ(train::list_checkpoints(ckpts), (std::vector<std::string>{one, two}));
  expect_loads_as(two, other, 3, {kAllStateKinds.begin(), kAllStateKinds.end()});
  // Saving over an existing checkpoint replaces it whole.
  save_as_ranks(two, state, 3, 5);
  expect_loads_as(two, state, 1, {kAllStateKinds.begin(), kAllStateKinds.end()});
  EXPECT_EQ(read_manifest(two).writers, 3);
}

TEST(Sharded, KeepRetainsTheNewestAndRemovesStaleStaging) {
  ScratchDir d;
  const std::string ckpts = d / "checkpoints";
  FakeState state;
  ShardLayout one(kUnits, 1, 0);
  for (int step : {1, 2, 3, 10, 100000000}) {
    const std::string dir = train::checkpoint_path(d.path().string(), step);
    save_sharded(dir, fake_meta(step), one, source_of(state, one), nullptr,
                 {.kinds = {StateKind::kParams}});
  }
  prepare_sharded_save(ckpts + "/step_00000011");  // a crashed save's staging directory
  // A removal killed half-way: the old checkpoint was moved aside first, so
  // what is left is not a checkpoint (its manifest names a shard now gone).
  fs::rename(ckpts + "/step_00000001", ckpts + "/step_00000001.old");
  fs::remove(ckpts + "/step_00000001.old/rank_00000.bin");
  EXPECT_EQ(train::list_checkpoints(ckpts).front(), ckpts + "/step_00000002")
      << "a half-removed checkpoint is listed";
  train::remove_old_checkpoints(ckpts, 2);
  EXPECT_EQ(train::list_checkpoints(ckpts),
            (std::vector<std::string>{ckpts + "/step_00000010", ckpts + "/step_100000000"}));
  EXPECT_FALSE(fs::exists(ckpts + "/step_00000011.tmp"));
  EXPECT_FALSE(fs::exists(ckpts + "/step_00000001.old")) << "a half-removed checkpoint stays";
  for (const char* gone : {"/step_00000002", "/step_00000003"})
    EXPECT_FALSE(fs::exists(ckpts + gone + std::string(".old")) || fs::exists(ckpts + gone)) << gone;
  EXPECT_EQ(train::resolve_checkpoint(d.path().string()), ckpts + "/step_100000000");
}

}  // namespace
}  // namespace po::checkpoint
