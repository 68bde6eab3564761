// metrics.jsonl writer and the human progress line. One JSON object per line,
// flushed per line so a crashed run keeps every completed step. On a terminal
// the progress line redraws in place; otherwise plain lines are printed.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

namespace po::train {

class MetricsWriter {
 public:
  // Appends to `path` (created when absent). A last line without its
  // newline (a record cut short when the previous run was killed) is
  // dropped first; each record is then one write(2), so a kill cannot cut
  // it again between buffered pieces.
  explicit MetricsWriter(const std::string& path);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  void write(const nlohmann::json& record);

 private:
  std::string path_;
  int fd_ = -1;
};

// Progress on stdout: "step 12/100 | loss 5.4321 | 812 tok/s | ETA 1m12s".
class Progress {
 public:
  Progress();
  void step(int64_t step, int64_t total, double loss, double lr, double grad_norm,
            double tokens_per_s, double eta_s);
  // A line that must stay visible (eval results, checkpoint notices).
  void line(const std::string& text);
  void finish();

 private:
  bool tty_;
  bool open_line_ = false;
};

// Peak resident set size of this process, bytes.
uint64_t peak_rss_bytes();
// "1h02m", "3m12s", "45s".
std::string format_duration(double seconds);

}  // namespace po::train
