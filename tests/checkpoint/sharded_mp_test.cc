// Sharded checkpoints written by real processes (tests/CMakeLists.txt runs
// this under mpirun at 1, 2, 3, 4 and 8 ranks): every rank writes its own
// shard file in parallel through save_sharded over the world, then every rank
// loads the checkpoint under other rank counts and checks the bits. A rank
// that fails while saving makes every rank fail and leaves no checkpoint.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "../mpi_world.h"
#include "../test_util.h"
#include "checkpoint/sharded.h"
#include "comm/mpi/communicator.h"
#include "core/error.h"
#include "parallel/shard_layout.h"

namespace po::checkpoint {
namespace {

namespace fs = std::filesystem;
using parallel::ShardLayout;


const std::vector<int64_t> kUnits = {5, 300007, 2, 0, 1031};

float value(StateKind k, int u, int64_t i) {
  return static_cast<float>(i % 1000) + 1000.0f * static_cast<float>(u) +
         0.25f * static_cast<float>(static_cast<int>(k));
}

// A scratch directory that rank 0 creates and every rank knows; rank 0 removes it.
class SharedDir {
 public:
  SharedDir() {
    std::vector<int32_t> buf(64, 0);
    if (po::test::MpiWorld::world().rank() == 0) {
      std::string tmpl = (fs::temp_directory_path() / "po_mp_ckpt_XXXXXX").string();
      EXPECT_NE(mkdtemp(tmpl.data()), nullptr);
      std::memcpy(buf.data(), tmpl.c_str(), std::min<size_t>(tmpl.size(), 255));
    }
    po::test::MpiWorld::world().broadcast(buf.data(), buf.size(), tensor::DType::kI32, 0);
    path_ = reinterpret_cast<const char*>(buf.data());
  }
  ~SharedDir() {
    po::test::MpiWorld::world().barrier();
    std::error_code ec;
    if (po::test::MpiWorld::world().rank() == 0) fs::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

CheckpointMeta meta() {
  CheckpointMeta m;
  m.step = 9;
  m.dp = po::test::MpiWorld::world().size();
  m.zero_stage = 1;
  m.config_toml = "[parallel]\n";
  return m;
}

TEST(ShardedMp, EveryRankWritesItsShardAndAnyLayoutLoads) {
  SharedDir d;
  const std::string dir = d / "step_00000009";
  const int n = po::test::MpiWorld::world().size(), rank = po::test::MpiWorld::world().rank();
  ShardLayout layout(kUnits, n, rank);
  std::vector<std::vector<float>> mine[3];  // [kind][unit]: this rank's shard
  for (int k = 0; k < 3; ++k) {
    for (int u = 0; u < layout.num_units(); ++u) {
      auto& v = mine[k].emplace_back();
      for (int64_t i = layout.begin(u); i < layout.end(u); ++i)
        v.push_back(value(static_cast<StateKind>(k), u, i));
    }
  }
  SaveOptions o;
  o.chunk_bytes = 4096;
  save_sharded(
      dir, meta(), layout, [&](StateKind k, int u) { return mine[static_cast<int>(k)][u].data(); },
      &po::test::MpiWorld::world(), o);
  // Complete on every rank as soon as save_sharded returns.
  EXPECT_TRUE(fs::exists(dir + "/manifest.json"));
  EXPECT_FALSE(fs::exists(staging_dir(dir)));
  const Manifest m = read_manifest(dir);
  EXPECT_EQ(m.writers, n);
  EXPECT_EQ(m.meta.dp, n);
  for (int ranks : {1, 2, 3, n + 1}) {
    ShardLayout target(kUnits, ranks, rank % ranks);
    std::vector<std::vector<float>> got(kUnits.size());
    for (int u = 0; u < target.num_units(); ++u) got[u].resize(target.owned(u));
    load_sharded(dir, target, [&](StateKind, int u) { return got[u].data(); }, {StateKind::kAdamV});
    for (int u = 0; u < target.num_units(); ++u)
      for (int64_t i = target.begin(u); i < target.end(u); ++i)
        ASSERT_EQ(got[u][i - target.begin(u)], value(StateKind::kAdamV, u, i))
            << "unit " << u << " element " << i << " loaded as rank " << rank % ranks << " of "
            << ranks << " from " << n << " writers";
  }
}

TEST(ShardedMp, OneFailingRankFailsEveryRankAndLeavesNoCheckpoint) {
  SharedDir d;
  const std::string dir = d / "step_00000009";
  const int n = po::test::MpiWorld::world().size(), rank = po::test::MpiWorld::world().rank();
  ShardLayout layout(kUnits, n, rank);
  std::vector<float> big(400000, 1.0f);
  const std::string error = po::test::error_of([&] {
    save_sharded(
        dir, meta(), layout, [&](StateKind, int) { return rank == n - 1 ? nullptr : big.data(); },
        &po::test::MpiWorld::world());
  });
  if (rank == n - 1)
    EXPECT_NE(error.find("no source for params"), std::string::npos) << error;
  else
    EXPECT_NE(error.find(core::str_cat("rank ", n - 1, " failed")), std::string::npos) << error;
  po::test::MpiWorld::world().barrier();
  EXPECT_FALSE(fs::exists(dir));
  EXPECT_FALSE(fs::exists(staging_dir(dir)));
}

}  // namespace
}  // namespace po::checkpoint
