#include "train/live_metrics.h"

#include <atomic>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "core/error.h"
#include "core/http_lib.h"

namespace po::train {
namespace {

std::atomic<LiveMetrics*> g_active{nullptr};
constexpr std::string_view kPrefix = "pagedoptim_train";

std::string metric_name(const std::string& s) {
  std::string out;
  for (char c : s) out += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return out;
}

void flatten(const nlohmann::json& v, const std::string& name, const std::string& labels,
             std::map<std::string, std::map<std::string, double>>& out) {
  if (v.is_number() || v.is_boolean()) {
    const double x = v.is_boolean() ? (v.get<bool>() ? 1.0 : 0.0) : v.get<double>();
    if (std::isfinite(x)) out[name][labels] = x;
  } else if (v.is_object()) {
    for (const auto& [k, child] : v.items()) flatten(child, name + "_" + metric_name(k), labels, out);
  } else if (v.is_array()) {
    const bool objects = !v.empty() && v[0].is_object();
    for (size_t i = 0; i < v.size(); ++i) {
      const std::string l = core::str_cat(labels, labels.empty() ? "" : ",", objects ? "rank" : "i", "=\"", i, "\"");
      flatten(v[i], name, l, out);
    }
  }
}

}  // namespace

struct LiveMetrics::Server {
  httplib::Server svr;
};

LiveMetrics::LiveMetrics(const std::string& host, int port) : server_(std::make_unique<Server>()) {
  httplib::Server& svr = server_->svr;
  svr.set_idle_interval(1, 0);  // the accept loop wakes once a second, not every 10 ms
  svr.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(text(), "text/plain; version=0.0.4; charset=utf-8");
  });
  port_ = port == 0 ? svr.bind_to_any_port(host) : (svr.bind_to_port(host, port) ? port : -1);
  PO_CHECK(port_ > 0, "train.metrics_host = \"", host, "\", train.metrics_port = ", port,
           ": cannot listen there (in use, or not an address of this host)");
  thread_ = std::thread([this] { server_->svr.listen_after_bind(); });
  g_active = this;
}

LiveMetrics::~LiveMetrics() {
  LiveMetrics* self = this;
  g_active.compare_exchange_strong(self, nullptr);
  server_->svr.stop();
  if (thread_.joinable()) thread_.join();
}

LiveMetrics* LiveMetrics::active() { return g_active.load(); }

void LiveMetrics::update(const nlohmann::json& record) {
  std::map<std::string, std::map<std::string, double>> fresh;
  flatten(record, std::string(kPrefix), "", fresh);
  std::lock_guard lock(mu_);
  for (auto& [name, by_labels] : fresh)
    for (auto& [labels, v] : by_labels) values_[name][labels] = v;
}

std::string LiveMetrics::text() const {
  std::ostringstream out;
  out.precision(17);
  std::lock_guard lock(mu_);
  for (const auto& [name, by_labels] : values_) {
    out << "# HELP " << name << " The latest " << name.substr(kPrefix.size() + 1) << " of metrics.jsonl.\n"
        << "# TYPE " << name << " gauge\n";
    for (const auto& [labels, v] : by_labels)
      out << name << (labels.empty() ? "" : "{" + labels + "}") << " " << v << "\n";
  }
  return out.str();
}

}  // namespace po::train
