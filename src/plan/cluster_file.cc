// The cluster file of `pagedoptim plan --cluster FILE.toml`. Kept apart from
// the presets (which measure this machine through the kernels) so that the
// parser builds without them (fuzz/cluster_fuzz.cc).
#include <algorithm>
#include <cmath>
#include <toml++/toml.h>

#include "core/config.h"
#include "core/error.h"
#include "plan/presets.h"

namespace po::plan {
namespace {

class Reader {
 public:
  Reader(const toml::table& t, const std::string& origin) : t_(t), origin_(origin) {}

  // A number in [lo, hi]; `dflt` when absent and not required.
  double number(const char* key, double dflt, bool required, double lo, double hi) const {
    const toml::node* n = t_.get(key);
    if (n == nullptr) {
      PO_CHECK(!required, origin_, ": [cluster] ", key, " is missing");
      return dflt;
    }
    const auto v = n->value<double>();
    PO_CHECK(v.has_value(), origin_, ": [cluster] ", key, " must be a number");
    PO_CHECK(std::isfinite(*v) && *v >= lo && *v <= hi, origin_, ": [cluster] ", key, " = ", *v,
             " is out of range [", lo, ", ", hi, "]");
    return *v;
  }
  // A size ("80GiB" or a number of bytes), at most 1 PiB.
  double size(const char* key, double dflt, bool required) const {
    const toml::node* n = t_.get(key);
    if (n == nullptr) {
      PO_CHECK(!required, origin_, ": [cluster] ", key, " is missing");
      return dflt;
    }
    double v = 0;
    if (auto s = n->value<std::string>())
      v = static_cast<double>(core::parse_size(*s, origin_ + ": [cluster] " + key));
    else if (auto d = n->value<double>())
      v = *d;
    else
      PO_THROW(core::InvalidArgument, origin_, ": [cluster] ", key, " must be a size such as \"80GiB\"");
    PO_CHECK(std::isfinite(v) && v >= 0 && v <= 1024 * 1024 * kGiB, origin_, ": [cluster] ", key,
             " = ", v, " bytes is out of range");
    return v;
  }

 private:
  const toml::table& t_;
  const std::string& origin_;
};

}  // namespace

ClusterSpec parse_cluster(const std::string& text, const std::string& origin) {
  toml::table root;
  try {
    root = toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    PO_THROW(core::InvalidArgument, origin, ":", e.source().begin.line, ": ", e.description());
  }
  const toml::table* t = root["cluster"].as_table();
  PO_CHECK(t != nullptr, origin, ": no [cluster] table");
  static const char* kKeys[] = {"name",             "nodes",           "devices_per_node",
                                "device_memory",    "host_memory",     "peak_tflops_bf16",
                                "peak_tflops_fp32", "efficiency",      "intra_node_GBps",
                                "inter_node_GBps",  "latency_us",      "nvme_read_GBps",
                                "nvme_write_GBps",  "host_GBps",       "overhead"};
  for (const auto& [k, v] : *t) {
    const auto key = std::string(k.str());
    PO_CHECK(std::find(std::begin(kKeys), std::end(kKeys), key) != std::end(kKeys), origin,
             ": [cluster] unknown key '", key, "'");
  }
  const Reader r(*t, origin);
  ClusterSpec c;
  const toml::node* name = t->get("name");
  PO_CHECK(name == nullptr || name->is_string(), origin, ": [cluster] name must be a string");
  c.name = name ? name->value_or(std::string(origin)) : origin;
  c.source = origin;
  c.nodes = static_cast<int>(r.number("nodes", 1, false, 1, 1e6));
  c.devices_per_node = static_cast<int>(r.number("devices_per_node", 0, true, 1, 4096));
  c.device_memory = r.size("device_memory", 0, true);
  c.host_memory = r.size("host_memory", 0, false);
  c.peak_flops_bf16 = r.number("peak_tflops_bf16", 0, true, 1e-6, 1e6) * 1e12;
  c.peak_flops_fp32 = r.number("peak_tflops_fp32", c.peak_flops_bf16 / 1e12 / 16, false, 1e-6, 1e6) * 1e12;
  c.efficiency = r.number("efficiency", 0.5, false, 1e-3, 1);
  c.intra_bw = r.number("intra_node_GBps", 0, true, 1e-6, 1e6) * 1e9;
  c.inter_bw = r.number("inter_node_GBps", c.intra_bw / 1e9, false, 1e-6, 1e6) * 1e9;
  c.latency = r.number("latency_us", 15, false, 0, 1e6) * 1e-6;
  c.nvme_read_bw = r.number("nvme_read_GBps", 0, false, 0, 1e6) * 1e9;
  c.nvme_write_bw = r.number("nvme_write_GBps", c.nvme_read_bw / 1e9, false, 0, 1e6) * 1e9;
  c.host_bw = r.number("host_GBps", 25, false, 1e-6, 1e6) * 1e9;
  c.overhead = r.size("overhead", 1.5 * kGiB, false);
  PO_CHECK(c.device_memory > 0, origin, ": [cluster] device_memory must be > 0");
  return c;
}

}  // namespace po::plan
