// train.metrics_port (train/live_metrics.h): while two ranks train, rank 0
// serves /metrics on 127.0.0.1 only; the exposition parses with the
// Prometheus project's own Python parser (python3-prometheus-client), and its
// loss is one metrics.jsonl recorded. A port that cannot be bound is an error
// naming the key.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <thread>

#include "../test_util.h"

namespace {

using po::test::read_file;
using po::test::run_command;

class LiveMetricsRun : public po::test::TinyTraining {};

TEST_F(LiveMetricsRun, RankZeroServesPrometheusTextWhileTraining) {
  const int port = po::test::free_tcp_port();
  const std::string run = dir_ / "live";
  const std::string cmd = std::string("exec ") + PO_BINARY + " train -c " + config_ + " --set run.dir=" + run +
                          " --set train.steps=100000 --set train.checkpoint_interval=0 --set train.peak_gflops=100" +
                          " --set train.metrics_port=" + std::to_string(port) + " --nproc 2 > " + run + ".log 2>&1";
  const pid_t pid = fork();
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  const std::string url = "http://127.0.0.1:" + std::to_string(port) + "/metrics";
  std::string text;
  for (int i = 0; i < 300 && text.find("pagedoptim_train_loss ") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    text = run_command("curl -s --max-time 2 " + url).output;
  }
  // Parsed by the Prometheus client library's parser: every family, its samples.
  const std::string dump = dir_ / "metrics.txt";
  po::test::write_file(dump, text);
  const auto parsed = run_command(
      "/usr/bin/python3 -c \"import sys\nfrom prometheus_client.parser import text_string_to_metric_families as f\n"
      "fams = list(f(open(sys.argv[1]).read()))\nfor m in fams:\n  for s in m.samples: print(s.name, s.value)\n\" " +
      dump);
  // The address: rank 0 alone, on loopback alone.
  const std::string ip = run_command("hostname -I | awk '{print $1}'").output;
  const std::string other = ip.empty() || ip == "\n" ? "" : ip.substr(0, ip.find('\n'));
  const auto elsewhere = other.empty() ? po::test::CommandResult{}
                                       : run_command("curl -s --max-time 2 http://" + other + ":" + std::to_string(port) + "/metrics");
  kill(pid, SIGTERM);
  waitpid(pid, nullptr, 0);
  ASSERT_NE(text.find("pagedoptim_train_loss "), std::string::npos) << "no loss at " << url << ":\n" << text << "\n"
                                                                    << read_file(run + ".log");
  ASSERT_EQ(parsed.exit_code, 0) << "the Prometheus parser refused the exposition:\n" << parsed.output << "\n" << text;
  for (const char* name : {"pagedoptim_train_loss ", "pagedoptim_train_tokens_per_s ", "pagedoptim_train_mfu ",
                           "pagedoptim_train_step_ms ", "pagedoptim_train_exposed_comm_ms ",
                           "pagedoptim_train_memory_per_rank_total "})
    EXPECT_NE(parsed.output.find(name), std::string::npos) << name << " missing from:\n" << parsed.output;
  // Both ranks' memory, from rank 0's endpoint.
  EXPECT_NE(text.find("pagedoptim_train_memory_per_rank_total{rank=\"1\"}"), std::string::npos) << text;
  // The served loss is one the run recorded.
  const auto at = parsed.output.find("pagedoptim_train_loss ");
  const double served = std::stod(parsed.output.substr(at + 22));
  bool recorded = false;
  for (const auto& r : po::test::read_metrics_so_far(run))  // the run may be writing
    recorded = recorded || (r.contains("loss") && r["loss"].get<double>() == served);
  EXPECT_TRUE(recorded) << "served loss " << served << " is in no record of metrics.jsonl";
  if (!other.empty() && other.rfind("127.", 0) != 0) {
    EXPECT_EQ(elsewhere.output.find("pagedoptim_train"), std::string::npos)
        << "the endpoint answered on " << other << ", not only on 127.0.0.1";
  }
}

TEST_F(LiveMetricsRun, AnAddressThatCannotBeBoundIsNamed) {
  auto r = run_train("bad", 1, "--set train.metrics_port=9 --set train.metrics_host=203.0.113.7");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("train.metrics_host = \"203.0.113.7\", train.metrics_port = 9: cannot listen there"),
            std::string::npos)
      << r.output;
}

}  // namespace
