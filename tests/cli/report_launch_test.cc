// `pagedoptim report`: two runs (one restarted once by --max-restarts) in
// one self-contained HTML file. Its data block holds each run's curves as
// metrics.jsonl has them, the summary their numbers; headless Chromium
// (Debian's chromium) opens it and takes a screenshot, in which the curves
// are drawn in their colours.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <nlohmann/json.hpp>
#include <thread>

#include "../test_util.h"

namespace {

using po::test::read_file;
using po::test::run_command;

class Report : public po::test::TinyTraining {
 protected:
  int steps() const override { return 12; }
};

TEST_F(Report, TwoRunsInOneSelfContainedFileThatChromiumDraws) {
  train_ok("lr_high", 1, "--set train.peak_gflops=100");
  train_ok("lr_low", 1, "--set train.peak_gflops=100 --set train.lr=1e-3 --set train.min_lr=1e-4");
  // A restart in the second run's record.
  po::test::write_file(dir_ / "lr_low/events.jsonl", "{\"event\":\"restart\",\"restart\":1}\n");
  const std::string html = dir_ / "out/report.html";
  auto r = run_command(std::string(PO_BINARY) + " report " + (dir_ / "lr_high") + " " + (dir_ / "lr_low") +
                       " --out " + html);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string text = read_file(html);
  // Self-contained: nothing to fetch.
  for (const char* fetch : {"<link", "src=", "@import", "url("})
    EXPECT_EQ(text.find(fetch), std::string::npos) << "the report fetches something: " << fetch;
  // The data block carries the runs' numbers.
  const auto a = text.find("id=\"report-data\">"), b = text.find("</script>", a);
  ASSERT_NE(a, std::string::npos);
  const auto data = nlohmann::json::parse(text.substr(a + 17, b - a - 17));
  ASSERT_EQ(data.size(), 2u);
  for (const auto& run : data) {
    const std::string name = run["run"];
    const auto want = po::test::losses(dir_ / name, 12);
    ASSERT_EQ(run["loss"].size(), want.size()) << name;
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_EQ(run["loss"][i][1].get<double>(), want[i]) << name << " step " << i + 1;
    EXPECT_FALSE(run["val_loss"].empty()) << name;
    EXPECT_FALSE(run["memory"].empty()) << name;
  }
  EXPECT_EQ(data[1]["restarts"], 1);
  EXPECT_EQ(text.find("threads-warning"), std::string::npos) << "both runs ran at 1 thread per rank";
  EXPECT_NE(text.find("data-label=\"lr_high\""), std::string::npos);
  EXPECT_NE(text.find("data-label=\"lr_low val\""), std::string::npos);
  // Chromium draws it.
  const std::string png = dir_ / "report.png";
  r = run_command("timeout 120 chromium --headless --no-sandbox --disable-gpu --hide-scrollbars "
                  "--window-size=900,1400 --screenshot=" + png + " file://" + html);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // The first two series' colours are on the screen: the loss curves were drawn.
  r = run_command("/usr/bin/python3 -c \"import sys\nfrom PIL import Image\n"
                  "im = Image.open(sys.argv[1]).convert('RGB')\npx = list(im.getdata())\n"
                  "def near(c, t): return sum(abs(a - b) for a, b in zip(c, t)) < 60\n"
                  "print(im.size[0], im.size[1], sum(near(p, (31, 119, 180)) for p in px), "
                  "sum(near(p, (255, 127, 14)) for p in px), sum(p != (255, 255, 255) for p in px))\n\" " + png);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::istringstream is(r.output);
  int w = 0, h = 0, blue = 0, orange = 0, ink = 0;
  is >> w >> h >> blue >> orange >> ink;
  EXPECT_EQ(w, 900);
  EXPECT_GT(blue, 200) << "the first run's curves are not on the screenshot";
  EXPECT_GT(orange, 200) << "the second run's curves are not on the screenshot";
  EXPECT_GT(ink, 20000) << "the screenshot is nearly blank";
}

// Runs at different threads per rank are compared only to rounding: the
// report says so, on stderr and in the file.
TEST_F(Report, RunsAtDifferentThreadCountsAreFlagged) {
  train_ok("one", 1, "--set train.steps=2");
  train_ok("two", 1, "--set train.steps=2 --set train.threads=2");
  const std::string html = dir_ / "mixed.html";
  auto r = run_command(std::string(PO_BINARY) + " report " + (dir_ / "one") + " " + (dir_ / "two") +
                       " --out " + html);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("these runs mix compute threads per rank (one: 1, two: 2)"), std::string::npos)
      << r.output;
  EXPECT_NE(read_file(html).find("id=\"threads-warning\""), std::string::npos);
}

TEST_F(Report, ARunDirectoryWithoutMetricsIsNamed) {
  auto r = run_command(std::string(PO_BINARY) + " report " + (dir_ / "nothing") + " --out " + (dir_ / "r.html"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("report: " + (dir_ / "nothing") + ": no metrics.jsonl"), std::string::npos) << r.output;
}

}  // namespace
