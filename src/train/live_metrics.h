// train.metrics_port: a Prometheus endpoint on rank 0 while the run trains.
// Every record the run writes to metrics.jsonl also updates it, so the live
// view and the file never disagree: each numeric field becomes a gauge
// `pagedoptim_train_<field>` holding its latest value (nested objects add
// their keys to the name; arrays become a label, `rank` for per-rank
// records: memory per tier, paging). It listens on train.metrics_host
// (127.0.0.1 unless told otherwise) and answers GET /metrics.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

namespace po::train {

class LiveMetrics {
 public:
  // Listens at once; an address or port that cannot be bound is an error
  // naming train.metrics_host / train.metrics_port.
  LiveMetrics(const std::string& host, int port);
  ~LiveMetrics();
  LiveMetrics(const LiveMetrics&) = delete;
  LiveMetrics& operator=(const LiveMetrics&) = delete;

  int port() const { return port_; }
  void update(const nlohmann::json& record);
  // The exposition text of the latest values.
  std::string text() const;

  // The exporter of this process, if one is listening (MetricsWriter feeds it).
  static LiveMetrics* active();

 private:
  struct Server;
  std::unique_ptr<Server> server_;
  std::thread thread_;
  int port_ = 0;
  mutable std::mutex mu_;
  std::map<std::string, std::map<std::string, double>> values_;  // name -> labels -> value
};

}  // namespace po::train
