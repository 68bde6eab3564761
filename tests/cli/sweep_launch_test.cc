// `pagedoptim sweep` run here: a 2 x 2 grid trains four runs (two at a
// time), each with its point's values; --status tabulates them; a bad value
// fails before anything trains, naming its point; a failing point does not
// stop the others. (The Slurm array job: tests/train/slurm_launch_test.cc.)
#include <gtest/gtest.h>

#include "../test_util.h"
#include "core/config.h"

namespace {

namespace fs = std::filesystem;
using po::test::read_file;
using po::test::run_command;

class Sweep : public po::test::TinyTraining {
 protected:
  int steps() const override { return 4; }
  std::string sweep(const std::string& args) const {
    return std::string(PO_BINARY) + " sweep -c " + config_ + " --dir " + (dir_ / "sw") +
           " --set train.peak_gflops=100 " + args;
  }
};

TEST_F(Sweep, TwoByTwoGridTrainsFourRunsAndStatusShowsThem) {
  auto r = run_command(sweep("--grid train.lr=1e-3,3e-4 --grid model.n_layer=1,2 --parallel 2"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<std::pair<std::string, std::pair<double, int64_t>>> want = {
      {"p000_lr=1e-3_n_layer=1", {1e-3, 1}}, {"p001_lr=1e-3_n_layer=2", {1e-3, 2}},
      {"p002_lr=3e-4_n_layer=1", {3e-4, 1}}, {"p003_lr=3e-4_n_layer=2", {3e-4, 2}}};
  for (const auto& [name, v] : want) {
    const std::string run = dir_ / ("sw/" + name);
    const auto cfg = po::core::Config::load(run + "/config.toml");
    EXPECT_DOUBLE_EQ(cfg.get_float("train.lr"), v.first) << name;
    EXPECT_EQ(cfg.get_int("model.n_layer"), v.second) << name;
    EXPECT_EQ(po::test::losses(run, 4).size(), 4u) << name;
  }
  // Points with different learning rates trained differently.
  EXPECT_NE(po::test::losses(dir_ / ("sw/" + want[0].first), 4).back(),
            po::test::losses(dir_ / ("sw/" + want[2].first), 4).back());
  r = run_command(std::string(PO_BINARY) + " sweep --status " + (dir_ / "sw"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const auto& [name, v] : want) {
    const auto at = r.output.find(name);
    ASSERT_NE(at, std::string::npos) << r.output;
    const std::string line = r.output.substr(at, r.output.find('\n', at) - at);
    EXPECT_NE(line.find("complete"), std::string::npos) << line;
    EXPECT_NE(line.find("4/4"), std::string::npos) << line;
    // Its last loss, as metrics.jsonl has it.
    const double last = po::test::losses(dir_ / ("sw/" + name), 4).back();
    EXPECT_NE(line.find(std::to_string(last).substr(0, 6)), std::string::npos) << line << " vs " << last;
  }
}

TEST_F(Sweep, ABadValueFailsBeforeAnythingTrainsNamingItsPoint) {
  auto r = run_command(sweep("--grid train.lr=1e-3,oops"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("sweep point p001_lr=oops: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("train.lr"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "sw/p000_lr=1e-3/metrics.jsonl")) << "a point trained anyway";
  r = run_command(sweep("--grid train.lr"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--grid 'train.lr': expected section.key=v1,v2,..."), std::string::npos) << r.output;
  r = run_command(std::string(PO_BINARY) + " sweep --status " + (dir_ / "nothing"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("no sweep.json there"), std::string::npos) << r.output;
}

TEST_F(Sweep, AFailingPointDoesNotStopTheOthers) {
  // data.train of the second point does not exist: it fails when it starts.
  auto r = run_command(sweep("--grid data.train=" + train_ + "," + (dir_ / "missing.bin")));
  EXPECT_NE(r.exit_code, 0) << r.output;
  r = run_command(std::string(PO_BINARY) + " sweep --status " + (dir_ / "sw"));
  const auto first = r.output.find("p000_");
  const auto second = r.output.find("p001_");
  ASSERT_NE(first, std::string::npos) << r.output;
  ASSERT_NE(second, std::string::npos) << r.output;
  EXPECT_NE(r.output.substr(first, second - first).find("complete"), std::string::npos) << r.output;
  EXPECT_NE(r.output.substr(second).find("failed"), std::string::npos) << r.output;
}

}  // namespace
