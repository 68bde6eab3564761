// Training checkpoints of a real (tiny) GPT-2: a one-process save loads back
// bit-identically, into one process or as the shards of any rank count; a
// model of another shape is refused naming the tensor; checkpoint paths
// resolve from run directories and refuse what is not a checkpoint.
#include "train/run_state.h"
#include "train/metrics.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <vector>

#include "../test_util.h"
#include "core/error.h"
#include "parallel/shard_layout.h"

using po::test::error_of;

namespace po::train {
namespace {

namespace fs = std::filesystem;
using checkpoint::StateKind;

model::TransformerConfig tiny(int64_t n_embd = 32) {
  model::TransformerConfig c;
  c.n_layer = 2;
  c.n_embd = n_embd;
  c.n_head = 2;
  c.vocab_size = 64;
  c.seq_len = 16;
  c.validate();
  return c;
}

optim::AdamW make_opt(const model::Transformer& model) {
  std::vector<optim::ParamRange> ranges;
  for (const auto& info : model.param_infos())
    ranges.push_back({info.offset, info.numel(), info.decay});
  return optim::AdamW({}, ranges, model.num_params());
}

void fill(float* p, int64_t n, float base) {
  for (int64_t i = 0; i < n; ++i) p[i] = base + static_cast<float>(i % 977) * 1e-3f;
}

std::vector<int64_t> units_of(const model::Transformer& model) {
  std::vector<int64_t> u;
  for (int i = 0; i < model.num_units(); ++i) u.push_back(model.unit_numel(i));
  return u;
}

struct Saved {
  po::test::TempDir dir;
  model::Transformer model{tiny(), 1, 16};
  optim::AdamW opt = make_opt(model);
  std::string path = checkpoint_path(dir.path().string(), 7);
  Saved() {
    model.init_random(3);
    fill(opt.m(), model.num_params(), 0.5f);
    fill(opt.v(), model.num_params(), 2.0f);
    opt.set_steps_taken(7);
    save_checkpoint(path, model, opt, {7, 42, 9000, 0}, "[train]\nseed = 42\n");
  }
};

TEST(RunState, OneProcessSaveLoadsBackBitIdentically) {
  Saved s;
  EXPECT_TRUE(fs::exists(s.path + "/manifest.json")) << s.path;
  model::Transformer model(tiny(), 1, 16);
  optim::AdamW opt = make_opt(model);
  const TrainState st = load_checkpoint(s.path, model, &opt);
  EXPECT_EQ(st.step, 7);
  EXPECT_EQ(st.seed, 42u);
  EXPECT_EQ(st.tokens, 9000u);
  EXPECT_EQ(opt.steps_taken(), 7);
  const size_t bytes = static_cast<size_t>(model.num_params()) * 4;
  EXPECT_EQ(std::memcmp(model.params(), s.model.params(), bytes), 0);
  EXPECT_EQ(std::memcmp(opt.m(), s.opt.m(), bytes), 0);
  EXPECT_EQ(std::memcmp(opt.v(), s.opt.v(), bytes), 0);
  EXPECT_EQ(checkpoint_config(s.path).get_int("train.seed"), 42);
  // Weights only (export, generate).
  model::Transformer weights(tiny(), 1, 16);
  load_checkpoint(s.path, weights, nullptr);
  EXPECT_EQ(std::memcmp(weights.params(), s.model.params(), bytes), 0);
}

TEST(RunState, ShardsOfAnyRankCountLoad) {
  Saved s;
  for (int ranks : {2, 3}) {
    for (int r = 0; r < ranks; ++r) {
      parallel::ShardLayout layout(units_of(s.model), ranks, r);
      std::vector<float> m(static_cast<size_t>(layout.local_numel()), -1.0f);
      const TrainState st = load_checkpoint_sharded(
          s.path, s.model, layout,
          [&](StateKind, int u) { return m.data() + layout.local_offset(u); }, nullptr,
          {StateKind::kAdamM});
      EXPECT_EQ(st.adam_t, 7);
      for (int u = 0; u < layout.num_units(); ++u)
        ASSERT_EQ(std::memcmp(m.data() + layout.local_offset(u),
                              s.opt.m() + s.model.unit_offset(u) + layout.begin(u),
                              static_cast<size_t>(layout.owned(u)) * 4),
                  0)
            << "adam_m of unit " << u << " as rank " << r << " of " << ranks;
    }
  }
}

TEST(RunState, AnotherModelShapeIsRefusedNamingTheTensor) {
  Saved s;
  model::Transformer wider(tiny(48), 1, 16);
  const std::string e = error_of([&] { load_checkpoint(s.path, wider, nullptr); });
  EXPECT_NE(e.find("tensor 'wte.weight' has shape [64, 32] but the model's is [64, 48]"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("model.* settings differ"), std::string::npos) << e;
}

TEST(RunState, ResolveCheckpoint) {
  Saved s;
  const std::string run = s.dir.path().string();
  EXPECT_EQ(resolve_checkpoint(run), s.path);
  EXPECT_EQ(resolve_checkpoint(s.path), s.path);
  EXPECT_NE(error_of([&] { resolve_checkpoint(run + "/nope"); }).find("no such checkpoint"),
            std::string::npos);
  fs::create_directories(run + "/checkpoints/step_00000009");
  EXPECT_NE(error_of([&] {
              resolve_checkpoint(run + "/checkpoints/step_00000009");
            }).find("not a complete checkpoint"),
            std::string::npos);
  po::test::write_file(run + "/old.ckpt", "x");
  EXPECT_NE(
      error_of([&] { resolve_checkpoint(run + "/old.ckpt"); }).find("checkpoints are directories"),
      std::string::npos);
}

// A run killed while writing a metrics record leaves a line without its
// newline; the resumed run's writer drops it before appending, so every line
// of metrics.jsonl stays JSON (Preemption's soak read one such line).
TEST(MetricsWriter, DropsARecordCutShortByAKill) {
  po::test::TempDir dir;
  const std::string path = (dir.path() / "metrics.jsonl").string();
  {
    std::FILE* f = std::fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("{\"step\":1}\n{\"step\":2,\"lo", f);
    std::fclose(f);
  }
  {
    MetricsWriter w(path);
    w.write({{"step", 2}});
  }
  const auto lines = po::test::read_metrics(dir.path());
  ASSERT_EQ(lines.size(), 2u) << "the cut-short record should be gone, the new one appended";
  EXPECT_EQ(lines[0]["step"], 1);
  EXPECT_EQ(lines[1]["step"], 2);
  {  // only a cut-short record: the file starts over
    std::FILE* f = std::fopen(path.c_str(), "w");
    std::fputs("{\"st", f);
    std::fclose(f);
    MetricsWriter w(path);
    w.write({{"step", 3}});
  }
  const auto again = po::test::read_metrics(dir.path());
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0]["step"], 3);
}

}  // namespace
}  // namespace po::train
