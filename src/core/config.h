// Run configuration: a TOML file plus `--set section.key=value` overrides,
// validated against one schema of known keys (config.cc). An unknown key, a
// value of the wrong type or out of range is an InvalidArgument naming the key
// and where it came from. Keys are dotted ("train.lr"); every known key has a
// default, so a resolved Config answers every get().
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

namespace po::core {

class Config {
 public:
  using Value = std::variant<int64_t, double, bool, std::string>;

  // Defaults for every key in the schema.
  Config();

  // Reads `path` (TOML) and applies `overrides` ("section.key=value") on top.
  static Config load(const std::string& path, const std::vector<std::string>& overrides = {});
  // Parses TOML text; `origin` names it in error messages.
  static Config parse(const std::string& toml_text, const std::string& origin);

  // Applies one "section.key=value" override.
  void set_override(const std::string& assignment);
  // Sets a key from text, parsed per the schema's type; `origin` names the source in errors.
  void set_text(const std::string& key, const std::string& text, const std::string& origin);

  int64_t get_int(const std::string& key) const;
  double get_float(const std::string& key) const;
  bool get_bool(const std::string& key) const;
  const std::string& get_string(const std::string& key) const;
  // Sizes accept integers (bytes) or strings like "512MiB", "8GiB"; result in bytes.
  uint64_t get_size(const std::string& key) const;
  // True when the key was given by the file or an override (not a default).
  bool is_set(const std::string& key) const;

  // The resolved configuration as TOML (every key, sorted by section).
  std::string to_toml() const;
  // Stable hash of the resolved configuration (for cross-rank checks later).
  uint64_t hash() const;

 private:
  const Value& get(const std::string& key) const;
  std::map<std::string, Value> values_;
  std::map<std::string, bool> set_;
};

// Parses "512MiB", "8GiB", "1.5GB", "4096" into bytes; throws InvalidArgument naming `what`.
uint64_t parse_size(const std::string& text, const std::string& what);

}  // namespace po::core
