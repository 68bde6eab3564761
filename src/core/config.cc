#include "core/config.h"

#include <toml++/toml.h>
#include <xxhash.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include "core/error.h"

namespace po::core {
namespace {

enum class Kind { kInt, kFloat, kBool, kString, kSize };

struct KeySpec {
  const char* key;
  Kind kind;
  Config::Value def;
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
};

constexpr double kInf = std::numeric_limits<double>::infinity();

// The one schema. Config structs only ever grow by appending keys.
const std::vector<KeySpec>& schema() {
  static const std::vector<KeySpec> specs = {
      {"model.preset", Kind::kString, std::string("gpt2-tiny")},
      {"model.n_layer", Kind::kInt, int64_t{0}, 0, 1024},
      {"model.n_embd", Kind::kInt, int64_t{0}, 0, 1 << 16},
      {"model.n_head", Kind::kInt, int64_t{0}, 0, 1024},
      {"model.vocab_size", Kind::kInt, int64_t{0}, 0, 1 << 24},
      {"model.seq_len", Kind::kInt, int64_t{0}, 0, 1 << 20},
      {"model.arch", Kind::kString, std::string("")},  // "" = the preset's
      {"model.n_kv_head", Kind::kInt, int64_t{0}, 0, 1024},
      {"model.ffn_hidden", Kind::kInt, int64_t{0}, 0, 1 << 20},
      {"model.norm", Kind::kString, std::string("")},       // layernorm | rmsnorm
      {"model.norm_eps", Kind::kFloat, 0.0, 0, 1},
      {"model.positions", Kind::kString, std::string("")},  // learned | rope
      {"model.rope_theta", Kind::kFloat, 0.0, 0, 1e12},
      {"model.rope_scaling_factor", Kind::kFloat, 0.0, 0, 1e6},  // Llama-3.1; 0 = off
      {"model.rope_low_freq_factor", Kind::kFloat, 1.0, 0, 1e6},
      {"model.rope_high_freq_factor", Kind::kFloat, 4.0, 0, 1e6},
      {"model.rope_original_max_position", Kind::kInt, int64_t{8192}, 1, 1 << 24},
      {"model.mlp", Kind::kString, std::string("")},  // gelu | swiglu
      {"model.bias", Kind::kBool, true},
      {"model.tie_embeddings", Kind::kBool, true},
      {"model.init", Kind::kString, std::string("random")},
      {"model.activation_checkpointing", Kind::kBool, false},
      {"model.quant", Kind::kString, std::string("")},  // "" | nf4 | int8: the frozen base (QLoRA)
      {"model.moe_experts", Kind::kInt, int64_t{0}, 0, 1 << 16},  // 0: the dense MLP (docs/moe.md)
      {"model.moe_top_k", Kind::kInt, int64_t{2}, 1, 1 << 16},
      {"model.moe_ffn_hidden", Kind::kInt, int64_t{0}, 0, 1 << 20},  // 0: model.ffn_hidden
      {"model.moe_router", Kind::kString, std::string("softmax_topk")},  // | softmax_topk_raw
      {"train.batch_size", Kind::kInt, int64_t{8}, 1, 1 << 20},
      {"train.micro_batch_size", Kind::kInt, int64_t{0}, 0, 1 << 20},
      {"train.steps", Kind::kInt, int64_t{100}, 0, 1e12},
      {"train.stop_at", Kind::kInt, int64_t{0}, 0, 1e12},  // end after this step; the schedule spans train.steps
      {"train.lr", Kind::kFloat, 6e-4, 0, 10},
      {"train.min_lr", Kind::kFloat, 6e-5, 0, 10},
      {"train.warmup_steps", Kind::kInt, int64_t{0}, 0, 1e12},
      {"train.schedule", Kind::kString, std::string("cosine")},
      {"train.weight_decay", Kind::kFloat, 0.1, 0, 10},
      {"train.beta1", Kind::kFloat, 0.9, 0, 0.999999},
      {"train.beta2", Kind::kFloat, 0.95, 0, 0.99999999},
      {"train.eps", Kind::kFloat, 1e-8, 0, 1},
      {"train.grad_clip", Kind::kFloat, 1.0, 0, kInf},
      {"train.seed", Kind::kInt, int64_t{1337}, 0, 9.2e18},
      {"train.precision", Kind::kString, std::string("fp32")},
      {"train.moe_aux_loss", Kind::kFloat, 0.0, 0, 1e3},  // the balance loss's α (docs/moe.md)
      {"train.moe_z_loss", Kind::kFloat, 0.0, 0, 1e3},    // the router z-loss's coefficient
      {"train.local_steps", Kind::kInt, int64_t{0}, 0, 1e12},  // H: inner steps per outer step; 0: none
      {"train.eval_interval", Kind::kInt, int64_t{0}, 0, 1e12},
      {"train.eval_batches", Kind::kInt, int64_t{8}, 1, 1e9},
      {"train.checkpoint_interval", Kind::kInt, int64_t{0}, 0, 1e12},
      {"train.resume", Kind::kBool, false},
      {"train.threads", Kind::kInt, int64_t{0}, 0, 4096},
      {"train.log_interval", Kind::kInt, int64_t{1}, 1, 1e12},
      {"train.peak_gflops", Kind::kFloat, 0.0, 0, 1e9},
      {"train.trace", Kind::kString, std::string("")},
      {"train.metrics_port", Kind::kInt, int64_t{0}, 0, 65535},  // 0: off (train/live_metrics.h)
      {"train.metrics_host", Kind::kString, std::string("127.0.0.1")},
      {"train.stop_signal", Kind::kString, std::string("USR1")},  // train/stop.h: besides TERM and INT
      {"train.stop_timeout", Kind::kFloat, 600.0, 0, 1e9},        // seconds from a stop request to abort  // pp > 1: the last step as Chrome trace JSON
      {"data.train", Kind::kString, std::string("")},
      {"data.val", Kind::kString, std::string("")},
      {"data.split", Kind::kString, std::string("none")},  // | iid | by_source | dirichlet:α (data/split.h)
      {"data.split_clients", Kind::kInt, int64_t{1}, 1, 1 << 20},  // K; this run's share: federated.client_id
      {"data.pack", Kind::kBool, false},  // SFT data (data/sft.h): whole examples side by side in a row
      {"run.dir", Kind::kString, std::string("runs/default")},
      {"checkpoint.keep", Kind::kInt, int64_t{2}, 1, 1e6},
      {"checkpoint.async", Kind::kBool, false},  // train/async_checkpoint.h
      {"parallel.dp", Kind::kInt, int64_t{1}, 1, 1 << 20},
      {"parallel.tp", Kind::kInt, int64_t{1}, 1, 1 << 20},
      {"parallel.pp", Kind::kInt, int64_t{1}, 1, 1 << 20},
      {"parallel.cp", Kind::kInt, int64_t{1}, 1, 1 << 20},
      {"parallel.replicas", Kind::kInt, int64_t{1}, 1, 1 << 20},  // DiLoCo's workers (docs/diloco.md)
      {"parallel.cp_mode", Kind::kString, std::string("ring")},         // parallel/context_parallel.h
      {"parallel.cp_balance", Kind::kString, std::string("zigzag")},   // | "contiguous"
      {"parallel.sequence_parallel", Kind::kBool, false},
      {"parallel.tp_overlap", Kind::kBool, false},
      {"parallel.zero_stage", Kind::kInt, int64_t{0}, 0, 3},
      {"parallel.schedule", Kind::kString, std::string("1f1b")},
      {"parallel.micro_batches", Kind::kInt, int64_t{1}, 1, 1 << 20},
      {"parallel.virtual_stages", Kind::kInt, int64_t{2}, 1, 256},
      {"parallel.stage_layers", Kind::kString, std::string()},
      {"parallel.vocab_parallel", Kind::kBool, false},
      {"parallel.bucket_size", Kind::kSize, std::string("25MiB")},
      {"parallel.overlap_comm", Kind::kBool, true},
      {"parallel.prefetch", Kind::kInt, int64_t{1}, 0, 1024},
      {"parallel.reduce_dtype", Kind::kString, std::string("fp32")},
      {"parallel.timeout", Kind::kFloat, 600.0, 0, kInf},
      {"memory.compute_budget", Kind::kSize, std::string("0")},
      {"memory.host_budget", Kind::kSize, std::string("0")},
      {"memory.nvme_dir", Kind::kString, std::string("")},
      {"memory.page_size", Kind::kSize, std::string("4MiB")},  // docs/benchmarks.md, page size
      {"memory.prefetch", Kind::kInt, int64_t{2}, 0, 1024},
      {"memory.alternate", Kind::kBool, true},
      {"memory.queue_depth", Kind::kInt, int64_t{8}, 1, 4096},
      {"memory.block_size", Kind::kSize, std::string("4MiB")},  // docs/benchmarks.md: one request per page
      {"memory.io", Kind::kString, std::string("auto")},
      {"memory.update_in_backward", Kind::kBool, false},  // docs/benchmarks.md: slower here
      {"memory.lend_activations", Kind::kBool, true},  // docs/paging.md: lent frames
      {"optim.name", Kind::kString, std::string("adamw")},  // | "sgd" (no state; docs/diloco.md)
      {"optim.state_bits", Kind::kInt, int64_t{32}, 4, 32},  // 32 | 8 | 4 (docs/optim_bits.md)
      {"optim.block_size", Kind::kInt, int64_t{0}, 0, 4096},  // 0: 256 at 8 bits, 128 at 4
      // What keeps 32-bit moments: tensor names, "token_embedding", "head" (an untied head's)
      {"optim.state_bits_exclude", Kind::kString, std::string("token_embedding head")},
      // The outer step of train.local_steps (optim/outer.h; docs/diloco.md)
      {"outer.optimizer", Kind::kString, std::string("nesterov")},  // | sgd | adam | yogi
      {"outer.lr", Kind::kFloat, 0.7, 0, 1e3},
      {"outer.momentum", Kind::kFloat, 0.9, 0, 0.999999},  // SGD's and Nesterov's μ, Adam's and Yogi's β1
      {"outer.beta2", Kind::kFloat, 0.99, 0, 0.99999999},
      {"outer.eps", Kind::kFloat, 1e-8, 0, 1},
      {"outer.exchange_dtype", Kind::kString, std::string("fp32")},  // | bf16 | int8
      {"outer.fragments", Kind::kInt, int64_t{1}, 1, 1 << 16},
      {"outer.paged", Kind::kBool, true},  // with memory.nvme_dir: the outer state in pages on it
      // Federation across jobs (train/federation.h; docs/diloco.md).
      {"federated.algorithm", Kind::kString, std::string("fedavg")},  // | fedadam | fedyogi | diloco
      {"federated.rounds", Kind::kInt, int64_t{10}, 1, 1e9},
      {"federated.min_clients", Kind::kInt, int64_t{1}, 1, 1 << 20},
      {"federated.round_timeout", Kind::kFloat, 3600.0, 0.001, 1e9},  // seconds from a round's opening
      {"federated.server_lr", Kind::kFloat, 0.0, 0, 1e3},             // 0: the algorithm's default
      {"federated.listen", Kind::kString, std::string("127.0.0.1:7077")},  // serve: HOST:PORT (port 0: any)
      {"federated.secret_file", Kind::kString, std::string("")},  // or PAGEDOPTIM_FEDERATE_SECRET
      {"federated.key_file", Kind::kString, std::string("")},     // join: this client's key, 64 hex digits
      {"federated.client_id", Kind::kInt, int64_t{0}, 0, 4294967295.0},
      {"federated.tls_cert", Kind::kString, std::string("")},  // serve: PEM; empty: an ephemeral self-signed one
      {"federated.tls_key", Kind::kString, std::string("")},
      {"federated.tls_ca", Kind::kString, std::string("")},  // join: verify the coordinator's certificate
      {"federated.connect_timeout", Kind::kFloat, 120.0, 0, 1e9},  // join: seconds to keep dialling
      // Low-rank adapters (model/config.h LoraConfig; docs/finetuning.md)
      {"lora.r", Kind::kInt, int64_t{0}, 0, 1 << 16},  // 0: off, every parameter trains
      {"lora.alpha", Kind::kFloat, 8.0, 0, 1e9},
      {"lora.dropout", Kind::kFloat, 0.0, 0, 1},
      {"lora.targets", Kind::kString, std::string("")},  // "" = the family's default
      {"lora.rslora", Kind::kBool, false},
      {"lora.dora", Kind::kBool, false},
      {"lora.init", Kind::kString, std::string("")},  // "": A Kaiming-uniform, B = 0
  };
  return specs;
}

const KeySpec* find_spec(const std::string& key) {
  for (const auto& s : schema())
    if (key == s.key) return &s;
  return nullptr;
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kInt: return "an integer";
    case Kind::kFloat: return "a number";
    case Kind::kBool: return "true or false";
    case Kind::kString: return "a string";
    case Kind::kSize: return "a size such as 512MiB";
  }
  return "?";
}

void check_range(const KeySpec& spec, double v, const std::string& origin) {
  PO_CHECK(std::isfinite(v) || spec.max == kInf, origin, ": ", spec.key, " must be finite");
  PO_CHECK(v >= spec.min && v <= spec.max, origin, ": ", spec.key, " = ", v,
           " is out of range [", spec.min, ", ", spec.max, "]");
}

// Converts a parsed TOML node into the schema's type.
Config::Value from_node(const KeySpec& spec, const toml::node& node, const std::string& origin) {
  auto bad = [&]() {
    PO_THROW(InvalidArgument, origin, ": ", spec.key, " must be ", kind_name(spec.kind));
  };
  switch (spec.kind) {
    case Kind::kInt: {
      if (!node.is_integer()) bad();  // (before value<>: a float out of int64's range converts with UB)
      auto v = node.value<int64_t>();
      if (!v) bad();
      check_range(spec, static_cast<double>(*v), origin);
      return *v;
    }
    case Kind::kFloat: {
      auto v = node.value<double>();
      if (!v) bad();
      check_range(spec, *v, origin);
      return *v;
    }
    case Kind::kBool: {
      auto v = node.value<bool>();
      if (!v) bad();
      return *v;
    }
    case Kind::kString: {
      auto v = node.value<std::string>();
      if (!v || !node.is_string()) bad();
      return *v;
    }
    case Kind::kSize: {
      if (node.is_integer()) {
        int64_t v = *node.value<int64_t>();
        PO_CHECK(v >= 0, origin, ": ", spec.key, " must not be negative");
        return std::to_string(v);
      }
      auto v = node.value<std::string>();
      if (!v) bad();
      parse_size(*v, origin + ": " + spec.key);
      return *v;
    }
  }
  bad();
  return {};
}

void flatten(const toml::table& table, const std::string& prefix,
             std::vector<std::pair<std::string, const toml::node*>>& out) {
  for (const auto& [k, node] : table) {
    std::string key = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (const auto* sub = node.as_table())
      flatten(*sub, key, out);
    else
      out.emplace_back(key, &node);
  }
}

std::string value_to_toml(const Config::Value& v) {
  std::ostringstream os;
  if (auto* i = std::get_if<int64_t>(&v)) os << *i;
  else if (auto* d = std::get_if<double>(&v)) {
    os.precision(17);
    os << *d;
    std::string s = os.str();
    if (s.find_first_of(".eE") == std::string::npos && s.find("inf") == std::string::npos) s += ".0";
    return s;
  } else if (auto* b = std::get_if<bool>(&v)) os << (*b ? "true" : "false");
  else os << toml::value<std::string>(std::get<std::string>(v));
  return os.str();
}

}  // namespace

uint64_t parse_size(const std::string& text, const std::string& what) {
  size_t pos = 0;
  double number = 0;
  try {
    number = std::stod(text, &pos);
  } catch (const std::exception&) {
    PO_THROW(InvalidArgument, what, ": cannot parse size '", text, "' (use e.g. 512MiB or 8GiB)");
  }
  std::string unit = text.substr(pos);
  while (!unit.empty() && unit.front() == ' ') unit.erase(unit.begin());
  double mult = 0;
  if (unit.empty() || unit == "B") mult = 1;
  else if (unit == "KiB") mult = 1024.0;
  else if (unit == "MiB") mult = 1024.0 * 1024;
  else if (unit == "GiB") mult = 1024.0 * 1024 * 1024;
  else if (unit == "TiB") mult = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "KB" || unit == "kB") mult = 1e3;
  else if (unit == "MB") mult = 1e6;
  else if (unit == "GB") mult = 1e9;
  else if (unit == "TB") mult = 1e12;
  PO_CHECK(mult > 0, what, ": unknown size unit '", unit, "' in '", text, "'");
  PO_CHECK(number >= 0 && std::isfinite(number), what, ": size must be >= 0, got '", text, "'");
  // 2^64 bytes and above do not fit a uint64_t: the cast would be undefined
  // behaviour (found by fuzz/cluster_fuzz.cc under UBSan).
  const double bytes = number * mult;
  PO_CHECK(bytes < 0x1p64, what, ": size '", text, "' is too large (at most 2^64 - 1 bytes)");
  return static_cast<uint64_t>(bytes);
}

Config::Config() {
  for (const auto& s : schema()) values_[s.key] = s.def;
}

Config Config::parse(const std::string& toml_text, const std::string& origin) {
  toml::table table;
  try {
    table = toml::parse(toml_text, origin);
  } catch (const toml::parse_error& e) {
    const auto& src = e.source();
    PO_THROW(InvalidArgument, origin, ":", src.begin.line, ":", src.begin.column, ": ",
             e.description());
  }
  Config cfg;
  std::vector<std::pair<std::string, const toml::node*>> flat;
  flatten(table, "", flat);
  for (const auto& [key, node] : flat) {
    const KeySpec* spec = find_spec(key);
    PO_CHECK(spec != nullptr, origin, ": unknown config key '", key, "'");
    cfg.values_[key] = from_node(*spec, *node, origin);
    cfg.set_[key] = true;
  }
  return cfg;
}

Config Config::load(const std::string& path, const std::vector<std::string>& overrides) {
  toml::table table;
  std::ifstream probe(path);
  PO_CHECK(probe.good(), path, ": cannot open config file");
  std::stringstream ss;
  ss << probe.rdbuf();
  Config cfg = parse(ss.str(), path);
  for (const auto& o : overrides) cfg.set_override(o);
  return cfg;
}

void Config::set_override(const std::string& assignment) {
  auto eq = assignment.find('=');
  PO_CHECK(eq != std::string::npos && eq > 0, "--set '", assignment,
           "': expected section.key=value");
  set_text(assignment.substr(0, eq), assignment.substr(eq + 1), "--set");
}

void Config::set_text(const std::string& key, const std::string& text, const std::string& origin) {
  const KeySpec* spec = find_spec(key);
  PO_CHECK(spec != nullptr, origin, ": unknown config key '", key, "'");
  // Parse the value as a TOML value; bare words become strings.
  toml::table t;
  try {
    t = toml::parse("v = " + text);
  } catch (const toml::parse_error&) {
    t = toml::table{};
    t.insert("v", text);
  }
  const toml::node* node = t.get("v");
  if (spec->kind == Kind::kString || spec->kind == Kind::kSize) {
    if (!node->is_string() && !(spec->kind == Kind::kSize && node->is_integer())) {
      t.insert_or_assign("v", text);
      node = t.get("v");
    }
  }
  values_[key] = from_node(*spec, *node, origin);
  set_[key] = true;
}

const Config::Value& Config::get(const std::string& key) const {
  auto it = values_.find(key);
  PO_ASSERT(it != values_.end(), "config key not in schema: ", key);
  return it->second;
}

int64_t Config::get_int(const std::string& key) const { return std::get<int64_t>(get(key)); }
double Config::get_float(const std::string& key) const { return std::get<double>(get(key)); }
bool Config::get_bool(const std::string& key) const { return std::get<bool>(get(key)); }
const std::string& Config::get_string(const std::string& key) const {
  return std::get<std::string>(get(key));
}
uint64_t Config::get_size(const std::string& key) const {
  return parse_size(std::get<std::string>(get(key)), key);
}
bool Config::is_set(const std::string& key) const { return set_.count(key) > 0; }

std::string Config::to_toml() const {
  std::ostringstream os;
  std::string section;
  for (const auto& [key, value] : values_) {
    auto dot = key.find('.');
    std::string sec = key.substr(0, dot);
    if (sec != section) {
      os << (section.empty() ? "" : "\n") << "[" << sec << "]\n";
      section = sec;
    }
    os << key.substr(dot + 1) << " = " << value_to_toml(value) << "\n";
  }
  return os.str();
}

uint64_t Config::hash() const {
  std::string text = to_toml();
  return XXH3_64bits(text.data(), text.size());
}

}  // namespace po::core
