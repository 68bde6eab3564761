// The helpers the launch tests judge runs with: a missing or unreadable
// metrics file, and a curve of the wrong length, fail the test instead of
// reading as an empty curve that "matches" another empty one.
#include "test_util.h"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

namespace po::test {
namespace {

// The message of the std::exception `fn` throws ("" when none).
std::string thrown(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(TestUtil, MissingMetricsFileIsAnErrorNamingIt) {
  TempDir dir;
  const std::string run = dir / "never_ran";
  const std::string e = thrown([&] { losses(run, 20); });
  EXPECT_NE(e.find("cannot read metrics file " + run + "/metrics.jsonl"), std::string::npos) << e;
  EXPECT_NE(thrown([&] { read_metrics(run); }), "");
  EXPECT_NE(thrown([&] { last_metric(run, "memory_per_rank"); }), "");
}

// A run still writing its metrics: the last line may be cut short.
TEST(TestUtil, MetricsSoFarLeaveALineBeingWrittenForLater) {
  TempDir dir;
  write_file(dir / "metrics.jsonl", "{\"step\": 1, \"loss\": 2.5}\n{\"step\": 2, \"imbal");
  EXPECT_NE(thrown([&] { read_metrics(dir.path().string()); }), "") << "a cut line in a finished run must fail";
  const auto so_far = read_metrics_so_far(dir.path().string());
  ASSERT_EQ(so_far.size(), 1u) << "the complete record, and not the one being written";
  EXPECT_EQ(so_far[0]["step"], 1);
  write_file(dir / "metrics.jsonl", "{\"step\": 1}\nnot json\n");
  EXPECT_NE(thrown([&] { read_metrics_so_far(dir.path().string()); }).find("metrics.jsonl:2: not JSON"), std::string::npos)
      << "a complete line that is not JSON is still an error";
}

TEST(TestUtil, CallersStateTheNumberOfSteps) {
  TempDir dir;
  write_file(dir / "metrics.jsonl", "{\"step\":1,\"loss\":4.5}\n{\"step\":2,\"loss\":4.25}\n"
                                    "{\"step\":2,\"val_loss\":4.4}\n");
  const auto l = losses(dir.path().string(), 2);
  ASSERT_EQ(l.size(), 2u);
  EXPECT_EQ(l[1], 4.25);
  EXPECT_EQ(metric(dir.path().string(), "val_loss", 1).at(0), 4.4);
  const std::string e = thrown([&] { losses(dir.path().string(), 3); });
  EXPECT_NE(e.find("metrics.jsonl: expected 3 'loss' values, found 2"), std::string::npos) << e;
  EXPECT_NE(thrown([&] { metric(dir.path().string(), "grad_norm", 2); }).find("found 0"),
            std::string::npos);
}

TEST(TestUtil, MalformedMetricsLineNamesFileAndLine) {
  TempDir dir;
  write_file(dir / "metrics.jsonl", "{\"loss\":1}\n{\"loss\":\n");
  const std::string e = thrown([&] { losses(dir.path().string(), 1); });
  EXPECT_NE(e.find("metrics.jsonl:2: not JSON"), std::string::npos) << e;
}

TEST(TestUtil, EmptyCurvesDoNotMatch) {
  EXPECT_FATAL_FAILURE(expect_same_curve({}, {}, "two empty runs"), "both curves are empty");
  EXPECT_FATAL_FAILURE(expect_same_curve({1.0}, {}, "one empty run"), "one empty run");
  EXPECT_NONFATAL_FAILURE(expect_same_curve({1.0, 2.0}, {1.0, 2.1}, "drift"), "drift: step 2");
  expect_same_curve({1.0, 2.0}, {1.0, 2.0}, "equal");
}

}  // namespace
}  // namespace po::test
