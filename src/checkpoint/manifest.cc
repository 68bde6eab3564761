// See manifest.h. JSON is read with typed accessors that name the field path
// in every error ("slices[3].lo must be an integer"); nlohmann exceptions never
// escape. The manifest checksum is XXH3-64 of the compact dump of the parsed
// object without its "manifest_xxh3" field: parse-then-dump is canonical for
// the integers and strings a manifest holds, so whitespace does not matter but
// any edit does.
#include "checkpoint/manifest.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"

namespace po::checkpoint {
namespace {

using Json = nlohmann::ordered_json;

constexpr int64_t kMaxNumel = int64_t{1} << 48;  // elements per unit or tensor
constexpr int64_t kMaxBytes = int64_t{1} << 56;  // bytes per file
constexpr int kMaxDepth = 8;                     // JSON nesting a manifest needs: 4
constexpr const char* kChecksumKey = "manifest_xxh3";

std::string dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

// Typed access to parsed JSON; errors name the origin and the field path.
class Fields {
 public:
  explicit Fields(const std::string& origin) : origin_(origin) {}

  [[noreturn]] void fail(const std::string& path, const std::string& what) const {
    PO_THROW(core::InvalidArgument, origin_, ": ", path.empty() ? "" : "field '" + path + "' ",
             what);
  }
  static std::string join(const std::string& path, const std::string& key) {
    return path.empty() ? key : path + "." + key;
  }
  static std::string at(const std::string& path, size_t i) {
    return path + "[" + std::to_string(i) + "]";
  }

  const Json& get(const Json& obj, const std::string& path, const char* key) const {
    if (!obj.is_object()) fail(path, "must be a JSON object");
    auto it = obj.find(key);
    if (it == obj.end()) fail(join(path, key), "is missing");
    return *it;
  }
  int64_t integer(const Json& v, const std::string& path, int64_t lo, int64_t hi) const {
    if (!v.is_number_integer()) fail(path, "must be an integer");
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(hi) || static_cast<int64_t>(u) < lo)
        fail(path, core::str_cat("= ", u, " is outside [", lo, ", ", hi, "]"));
      return static_cast<int64_t>(u);
    }
    const int64_t s = v.get<int64_t>();
    if (s < lo || s > hi) fail(path, core::str_cat("= ", s, " is outside [", lo, ", ", hi, "]"));
    return s;
  }
  int64_t integer(const Json& obj, const std::string& path, const char* key, int64_t lo,
                  int64_t hi) const {
    return integer(get(obj, path, key), join(path, key), lo, hi);
  }
  uint64_t uinteger(const Json& obj, const std::string& path, const char* key) const {
    const Json& v = get(obj, path, key);
    if (!v.is_number_unsigned()) fail(join(path, key), "must be a non-negative integer");
    return v.get<uint64_t>();
  }
  std::string string(const Json& v, const std::string& path) const {
    if (!v.is_string()) fail(path, "must be a string");
    return v.get<std::string>();
  }
  std::string string(const Json& obj, const std::string& path, const char* key) const {
    return string(get(obj, path, key), join(path, key));
  }
  const Json& array(const Json& obj, const std::string& path, const char* key) const {
    const Json& v = get(obj, path, key);
    if (!v.is_array()) fail(join(path, key), "must be an array");
    return v;
  }
  uint64_t hex(const Json& v, const std::string& path) const {
    const std::string s = string(v, path);
    uint64_t out = 0;
    if (s.size() != 16) fail(path, "must be 16 hex digits");
    for (char c : s) {
      int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      if (d < 0) fail(path, "must be 16 lowercase hex digits");
      out = (out << 4) | static_cast<uint64_t>(d);
    }
    return out;
  }
  StateKind kind(const Json& v, const std::string& path) const {
    auto k = parse_state_kind(string(v, path));
    if (!k) fail(path, "= '" + v.get<std::string>() + "' is not params, adam_m or adam_v");
    return *k;
  }
  // Version 2's kind: its schema field, which must be the form this build
  // stores that kind in.
  StateKind kind_field(const Json& v, const std::string& path) const {
    const StateKind k = kind(get(v, path, "name"), join(path, "name"));
    const optim::StateField& want = state_kind_field(k);
    optim::StateField got = want;
    const std::string dtype = string(v, path, "dtype");
    const auto d = optim::parse_state_dtype(dtype);
    if (!d) fail(join(path, "dtype"), "= '" + dtype + "' is not f32, bf16, u8 or u4");
    got.dtype = *d;
    if (integer(v, path, "bits", 1, 64) != got.bits())
      fail(join(path, "bits"), core::str_cat("is not the ", got.bits(), " bits of ", dtype));
    got.block = integer(v, path, "block", 0, kMaxNumel);
    if (got != want)
      fail(path, core::str_cat("'", want.name, "' is stored as ", field_form(got),
                               "; this build reads it as ", field_form(want),
                               " (a checkpoint of another optimizer state form)"));
    return k;
  }
  static std::string field_form(const optim::StateField& f) {
    return core::str_cat(optim::dtype_name(f.dtype),
                         f.block > 0 ? core::str_cat(" with an fp32 scale per ", f.block) : "");
  }

 private:
  const std::string& origin_;
};

Json slice_to_json(const SliceRecord& s) {
  Json h = Json::array();
  for (uint64_t x : s.xxh3) h.push_back(hex64(x));
  return Json{{"kind", state_kind_name(s.kind)},
              {"unit", s.unit},
              {"rank", s.rank},
              {"lo", s.lo},
              {"hi", s.hi},
              {"file", s.file},
              {"offset", s.offset},
              {"xxh3", std::move(h)}};
}

SliceRecord slice_from_json(const Fields& f, const Json& j, const std::string& path) {
  SliceRecord s;
  s.kind = f.kind(f.get(j, path, "kind"), Fields::join(path, "kind"));
  s.unit = static_cast<int>(f.integer(j, path, "unit", 0, 1 << 30));
  s.rank = static_cast<int>(f.integer(j, path, "rank", 0, 1 << 30));
  s.lo = f.integer(j, path, "lo", 0, kMaxNumel);
  s.hi = f.integer(j, path, "hi", 0, kMaxNumel);
  s.file = f.string(j, path, "file");
  s.offset = f.integer(j, path, "offset", 0, kMaxBytes);
  const Json& h = f.array(j, path, "xxh3");
  for (size_t i = 0; i < h.size(); ++i)
    s.xxh3.push_back(f.hex(h[i], Fields::at(Fields::join(path, "xxh3"), i)));
  return s;
}

Json file_to_json(const FileRecord& r) {
  return Json{{"name", r.name}, {"rank", r.rank}, {"bytes", r.bytes}};
}

FileRecord file_from_json(const Fields& f, const Json& j, const std::string& path) {
  FileRecord r;
  r.name = f.string(j, path, "name");
  r.rank = static_cast<int>(f.integer(j, path, "rank", 0, 1 << 30));
  r.bytes = f.integer(j, path, "bytes", 0, kMaxBytes);
  return r;
}

// Version 2: each kind as its schema field.
Json kinds_to_json(const std::vector<StateKind>& kinds) {
  Json a = Json::array();
  for (StateKind k : kinds) {
    const optim::StateField& f = state_kind_field(k);
    a.push_back(Json{{"name", std::string(f.name)},
                     {"dtype", std::string(optim::dtype_name(f.dtype))},
                     {"bits", f.bits()},
                     {"block", f.block}});
  }
  return a;
}

// Version 1's kinds are bare names (fp32); version 2's are fields.
std::vector<StateKind> kinds_from_json(const Fields& f, const Json& j, int version) {
  std::vector<StateKind> out;
  const Json& a = f.array(j, "", "kinds");
  for (size_t i = 0; i < a.size(); ++i) {
    const std::string path = Fields::at("kinds", i);
    out.push_back(version == 1 ? f.kind(a[i], path) : f.kind_field(a[i], path));
  }
  return out;
}

std::vector<int64_t> numel_from_json(const Fields& f, const Json& j) {
  std::vector<int64_t> out;
  const Json& a = f.array(j, "", "unit_numel");
  for (size_t i = 0; i < a.size(); ++i)
    out.push_back(f.integer(a[i], Fields::at("unit_numel", i), 0, kMaxNumel));
  return out;
}

// Parses `text` as JSON, refusing nesting deeper than a manifest needs (so
// hostile input cannot recurse deeply in later dumps).
Json parse_json(std::string_view text, const std::string& origin) {
  auto depth_guard = [&](int depth, Json::parse_event_t, Json&) {
    if (depth > kMaxDepth)
      PO_THROW(core::InvalidArgument, origin, ": JSON nested deeper than ", kMaxDepth, " levels");
    return true;
  };
  try {
    return Json::parse(text.begin(), text.end(), depth_guard);
  } catch (const Json::exception& e) {
    PO_THROW(core::InvalidArgument, origin, ": not valid JSON (", e.what(), ")");
  }
}

// One line per top-level field; arrays of objects one element per line.
std::string pretty(const Json& j) {
  std::string out = "{\n";
  bool first = true;
  for (const auto& [key, value] : j.items()) {
    if (!first) out += ",\n";
    first = false;
    out += dump(Json(key)) + ": ";
    if (value.is_array() && !value.empty() && value.front().is_object()) {
      out += "[\n";
      for (size_t i = 0; i < value.size(); ++i) out += (i ? ",\n " : " ") + dump(value[i]);
      out += "\n]";
    } else {
      out += dump(value);
    }
  }
  return out + "\n}\n";
}

bool plain_file_name(const std::string& s) {
  if (s.empty() || s.size() > 255 || s == "." || s == "..") return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-';
  });
}

}  // namespace

static_assert(optim::adamw_schema(false).name == kOptimizerSchema);
static_assert(state_kind_field(StateKind::kAdamM) == optim::adamw_schema(false).fields[0] &&
              state_kind_field(StateKind::kAdamV) == optim::adamw_schema(false).fields[1]);

const char* state_kind_name(StateKind k) { return state_kind_field(k).name.data(); }

std::optional<StateKind> parse_state_kind(std::string_view name) {
  for (StateKind k : kAllStateKinds)
    if (name == state_kind_name(k)) return k;
  return std::nullopt;
}

int64_t TensorRecord::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool Manifest::has(StateKind k) const {
  return std::find(kinds.begin(), kinds.end(), k) != kinds.end();
}

const FileRecord* Manifest::file(const std::string& name) const {
  for (const auto& f : files)
    if (f.name == name) return &f;
  return nullptr;
}

int64_t Manifest::data_bytes() const {
  int64_t n = 0;
  for (const auto& s : slices) n += s.bytes();
  return n;
}

int64_t num_chunks(int64_t bytes, int64_t chunk_bytes) {
  return (bytes + chunk_bytes - 1) / chunk_bytes;
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

namespace {

void validate_tensors(const Manifest& m, const std::string& origin) {
  std::set<std::string> names;
  std::vector<const TensorRecord*> order;
  for (size_t i = 0; i < m.meta.tensors.size(); ++i) {
    const TensorRecord& t = m.meta.tensors[i];
    const std::string where = core::str_cat(origin, ": tensors[", i, "] '", t.name, "'");
    PO_CHECK(!t.name.empty(), where, ": empty name");
    PO_CHECK(names.insert(t.name).second, where, ": duplicate name");
    PO_CHECK(t.unit >= 0 && t.unit < static_cast<int>(m.unit_numel.size()), where, ": unit ",
             t.unit, " is not in [0, ", m.unit_numel.size(), ")");
    int64_t n = 1;
    for (int64_t d : t.shape) {
      PO_CHECK(d >= 0 && d <= kMaxNumel && (d == 0 || n <= kMaxNumel / d), where,
               ": shape too large");
      n *= d;
    }
    PO_CHECK(t.offset >= 0 && t.offset <= m.unit_numel[t.unit] - n, where, ": elements [", t.offset,
             ", ", t.offset + n, ") lie outside unit ", t.unit, " (", m.unit_numel[t.unit],
             " elements)");
    order.push_back(&t);
  }
  std::sort(order.begin(), order.end(), [](const TensorRecord* a, const TensorRecord* b) {
    return a->unit != b->unit ? a->unit < b->unit : a->offset < b->offset;
  });
  for (size_t i = 1; i < order.size(); ++i) {
    const TensorRecord &a = *order[i - 1], &b = *order[i];
    PO_CHECK(a.unit != b.unit || a.offset + a.numel() <= b.offset, origin, ": tensors '", a.name,
             "' and '", b.name, "' overlap in unit ", a.unit);
  }
}

void validate_files(const Manifest& m, const std::string& origin) {
  PO_CHECK(m.writers >= 1 && m.files.size() == static_cast<size_t>(m.writers), origin, ": ",
           m.files.size(), " files for ", m.writers, " writer rank(s)");
  std::set<std::string> names;
  for (size_t i = 0; i < m.files.size(); ++i) {
    const FileRecord& f = m.files[i];
    const std::string where = core::str_cat(origin, ": files[", i, "] '", f.name, "'");
    PO_CHECK(plain_file_name(f.name), where, ": not a plain file name");
    PO_CHECK(names.insert(f.name).second, where, ": listed twice");
    PO_CHECK(f.rank == static_cast<int>(i), where, ": rank ", f.rank, ", expected ", i);
    PO_CHECK(f.bytes >= kShardHeaderBytes && f.bytes <= kMaxBytes, where, ": ", f.bytes,
             " bytes is not a valid shard file size");
  }
}

void validate_slices(const Manifest& m, const std::string& origin) {
  std::map<std::string, std::vector<const SliceRecord*>> by_file;
  std::map<std::pair<int, int>, std::vector<const SliceRecord*>> by_unit;  // (kind, unit)
  for (size_t i = 0; i < m.slices.size(); ++i) {
    const SliceRecord& s = m.slices[i];
    const std::string where = core::str_cat(origin, ": slices[", i, "] (", state_kind_name(s.kind),
                                            ", unit ", s.unit, ")");
    PO_CHECK(m.has(s.kind), where, ": kind not listed in 'kinds'");
    PO_CHECK(s.unit >= 0 && s.unit < static_cast<int>(m.unit_numel.size()), where,
             ": unit is not in [0, ", m.unit_numel.size(), ")");
    PO_CHECK(s.lo >= 0 && s.lo < s.hi && s.hi <= m.unit_numel[s.unit], where, ": elements [", s.lo,
             ", ", s.hi, ") are not a non-empty range inside the unit (", m.unit_numel[s.unit],
             " elements)");
    const FileRecord* f = m.file(s.file);
    PO_CHECK(f != nullptr, where, ": file '", s.file, "' is not listed in 'files'");
    PO_CHECK(s.rank == f->rank, where, ": rank ", s.rank, " but '", s.file, "' is rank ", f->rank,
             "'s file");
    PO_CHECK(
        s.offset >= kShardAlign && s.offset % kShardAlign == 0 && s.offset <= f->bytes - s.bytes(),
        where, ": bytes [", s.offset, ", ", s.offset + s.bytes(), ") are not a ", kShardAlign,
        "-aligned range past the header of '", s.file, "' (", f->bytes, " bytes)");
    PO_CHECK(static_cast<int64_t>(s.xxh3.size()) == num_chunks(s.bytes(), m.chunk_bytes), where,
             ": ", s.xxh3.size(), " checksums for ", num_chunks(s.bytes(), m.chunk_bytes),
             " chunks");
    by_file[s.file].push_back(&s);
    by_unit[{static_cast<int>(s.kind), s.unit}].push_back(&s);
  }
  for (auto& [file, v] : by_file) {
    std::sort(v.begin(), v.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
    for (size_t i = 1; i < v.size(); ++i)
      PO_CHECK(v[i - 1]->offset + v[i - 1]->bytes() <= v[i]->offset, origin,
               ": slices overlap in '", file, "' at byte ", v[i]->offset);
  }
  for (StateKind k : m.kinds) {
    for (int u = 0; u < static_cast<int>(m.unit_numel.size()); ++u) {
      auto& v = by_unit[{static_cast<int>(k), u}];
      std::sort(v.begin(), v.end(), [](auto* a, auto* b) { return a->lo < b->lo; });
      int64_t next = 0;
      for (const SliceRecord* s : v) {
        PO_CHECK(s->lo == next, origin, ": ", state_kind_name(k), " of unit ", u,
                 s->lo > next ? ": no slice holds elements [" : ": slices overlap at elements [",
                 std::min(next, s->lo), ", ", std::max(next, s->lo), ")");
        next = s->hi;
      }
      PO_CHECK(next == m.unit_numel[u], origin, ": ", state_kind_name(k), " of unit ", u,
               ": no slice holds elements [", next, ", ", m.unit_numel[u], ")");
    }
  }
}

}  // namespace

namespace {

void check_version(int version, const std::string& origin) {
  PO_CHECK(version >= kOldestShardedFormatVersion && version <= kShardedFormatVersion, origin,
           ": format version ", version, " (this build reads versions ", kOldestShardedFormatVersion,
           " to ", kShardedFormatVersion, version > kShardedFormatVersion ? "; written by a newer PagedOptim?" : "",
           ")");
}

}  // namespace

void validate_manifest(const Manifest& m, const std::string& origin) {
  check_version(m.version, origin);
  PO_CHECK(m.optimizer == kOptimizerSchema, origin, ": optimizer state '", m.optimizer,
           "' (this build writes and reads ", kOptimizerSchema, ")");
  const CheckpointMeta& meta = m.meta;
  PO_CHECK(meta.step >= 0 && meta.adam_t >= 0, origin, ": negative step or adam_t");
  PO_CHECK(meta.dp >= 1 && meta.zero_stage >= 0 && meta.zero_stage <= 3, origin,
           ": layout dp = ", meta.dp, ", zero_stage = ", meta.zero_stage, " is not valid");
  PO_CHECK(!m.unit_numel.empty(), origin, ": no units");
  for (int64_t n : m.unit_numel)
    PO_CHECK(n >= 0 && n <= kMaxNumel, origin, ": a unit of ", n, " elements");
  PO_CHECK(m.chunk_bytes >= 4 && m.chunk_bytes % 4 == 0 && m.chunk_bytes <= kMaxBytes, origin,
           ": checksum chunk of ", m.chunk_bytes, " bytes (must be a positive multiple of 4)");
  PO_CHECK(!m.kinds.empty(), origin, ": no state kinds");
  for (size_t i = 0; i < m.kinds.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      PO_CHECK(m.kinds[i] != m.kinds[j], origin, ": kind '", state_kind_name(m.kinds[i]),
               "' listed twice");
  validate_tensors(m, origin);
  validate_files(m, origin);
  validate_slices(m, origin);
}

namespace {

Json manifest_json(const Manifest& m) {
  Json tensors = Json::array(), files = Json::array(), slices = Json::array(), numel = m.unit_numel;
  for (const auto& t : m.meta.tensors)
    tensors.push_back(Json{{"name", t.name},
                           {"shape", t.shape},
                           {"unit", t.unit},
                           {"offset", t.offset},
                           {"dtype", "f32"}});
  for (const auto& f : m.files) files.push_back(file_to_json(f));
  for (const auto& s : m.slices) slices.push_back(slice_to_json(s));
  Json j;
  j["format"] = kShardedFormatName;
  j["version"] = kShardedFormatVersion;  // a manifest read from an older version is written as this one
  j["step"] = m.meta.step;
  j["seed"] = m.meta.seed;
  j["tokens"] = m.meta.tokens;
  j["adam_t"] = m.meta.adam_t;
  j["layout"] = Json{{"dp", m.meta.dp}, {"zero_stage", m.meta.zero_stage}, {"writers", m.writers}};
  if (m.meta.threads > 0) j["layout"]["threads"] = m.meta.threads;  // absent in older manifests
  j["unit_numel"] = std::move(numel);
  j["optimizer"] = m.optimizer;
  j["kinds"] = kinds_to_json(m.kinds);
  j["checksum"] = Json{{"algorithm", "xxh3-64"}, {"chunk_bytes", m.chunk_bytes}};
  j["tensors"] = std::move(tensors);
  j["files"] = std::move(files);
  j["slices"] = std::move(slices);
  j["config"] = m.meta.config_toml;
  return j;
}

uint64_t canonical_hash(const Json& j) {
  const std::string s = dump(j);
  return XXH3_64bits(s.data(), s.size());
}

}  // namespace

std::string manifest_to_json(const Manifest& m) {
  validate_manifest(m, "manifest to write");
  Json j = manifest_json(m);
  const uint64_t h = canonical_hash(j);
  j[kChecksumKey] = hex64(h);
  return pretty(j);
}

Manifest parse_manifest(std::string_view text, const std::string& origin, bool verify_checksum) {
  Json j = parse_json(text, origin);
  Fields f(origin);
  if (!j.is_object()) f.fail("", "is not a JSON object");
  const std::string format = f.string(j, "", "format");
  PO_CHECK(format == kShardedFormatName, origin, ": format '", format, "' is not '",
           kShardedFormatName, "'");
  Manifest m;
  m.version = static_cast<int>(f.integer(j, "", "version", 0, 1 << 30));
  check_version(m.version, origin);
  if (verify_checksum) {
    const uint64_t want = f.hex(f.get(j, "", kChecksumKey), kChecksumKey);
    j.erase(kChecksumKey);
    const uint64_t got = canonical_hash(j);
    PO_CHECK(got == want, origin, ": manifest checksum mismatch (stored ", hex64(want),
             ", computed ", hex64(got), "): the manifest was edited or is corrupt");
  }
  CheckpointMeta& meta = m.meta;
  meta.step = f.integer(j, "", "step", 0, INT64_MAX);
  meta.seed = f.uinteger(j, "", "seed");
  meta.tokens = f.uinteger(j, "", "tokens");
  meta.adam_t = f.integer(j, "", "adam_t", 0, INT64_MAX);
  const Json& layout = f.get(j, "", "layout");
  meta.dp = static_cast<int>(f.integer(layout, "layout", "dp", 1, 1 << 30));
  meta.zero_stage = static_cast<int>(f.integer(layout, "layout", "zero_stage", 0, 3));
  m.writers = static_cast<int>(f.integer(layout, "layout", "writers", 1, 1 << 30));
  if (layout.is_object() && layout.contains("threads"))
    meta.threads = static_cast<int>(f.integer(layout, "layout", "threads", 1, 1 << 20));
  m.unit_numel = numel_from_json(f, j);
  if (m.version >= 2) m.optimizer = f.string(j, "", "optimizer");  // version 1: AdamW's
  m.kinds = kinds_from_json(f, j, m.version);
  const Json& checksum = f.get(j, "", "checksum");
  const std::string algo = f.string(checksum, "checksum", "algorithm");
  PO_CHECK(algo == "xxh3-64", origin, ": checksum algorithm '", algo, "' is not xxh3-64");
  m.chunk_bytes = f.integer(checksum, "checksum", "chunk_bytes", 4, kMaxBytes);
  const Json& tensors = f.array(j, "", "tensors");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string path = Fields::at("tensors", i);
    TensorRecord t;
    t.name = f.string(tensors[i], path, "name");
    const Json& shape = f.array(tensors[i], path, "shape");
    for (size_t d = 0; d < shape.size(); ++d)
      t.shape.push_back(f.integer(shape[d], Fields::at(path + ".shape", d), 0, kMaxNumel));
    t.unit = static_cast<int>(f.integer(tensors[i], path, "unit", 0, 1 << 30));
    t.offset = f.integer(tensors[i], path, "offset", 0, kMaxNumel);
    const std::string dtype = f.string(tensors[i], path, "dtype");
    if (dtype != "f32") f.fail(path + ".dtype", "= '" + dtype + "' (only f32 is written)");
    meta.tensors.push_back(std::move(t));
  }
  const Json& files = f.array(j, "", "files");
  for (size_t i = 0; i < files.size(); ++i)
    m.files.push_back(file_from_json(f, files[i], Fields::at("files", i)));
  const Json& slices = f.array(j, "", "slices");
  for (size_t i = 0; i < slices.size(); ++i)
    m.slices.push_back(slice_from_json(f, slices[i], Fields::at("slices", i)));
  meta.config_toml = f.string(j, "", "config");
  validate_manifest(m, origin);
  return m;
}

std::string shard_record_to_json(const ShardRecord& r) {
  Json slices = Json::array();
  for (const auto& s : r.slices) slices.push_back(slice_to_json(s));
  Json j;
  j["rank"] = r.rank;
  j["ranks"] = r.ranks;
  j["unit_numel"] = r.unit_numel;
  j["kinds"] = kinds_to_json(r.kinds);
  j["chunk_bytes"] = r.chunk_bytes;
  j["file"] = file_to_json(r.file);
  j["slices"] = std::move(slices);
  return pretty(j);
}

ShardRecord parse_shard_record(std::string_view text, const std::string& origin) {
  Json j = parse_json(text, origin);
  Fields f(origin);
  ShardRecord r;
  r.rank = static_cast<int>(f.integer(j, "", "rank", 0, 1 << 30));
  r.ranks = static_cast<int>(f.integer(j, "", "ranks", 1, 1 << 30));
  r.unit_numel = numel_from_json(f, j);
  r.kinds = kinds_from_json(f, j, kShardedFormatVersion);  // written by this build
  r.chunk_bytes = f.integer(j, "", "chunk_bytes", 4, kMaxBytes);
  r.file = file_from_json(f, f.get(j, "", "file"), "file");
  const Json& slices = f.array(j, "", "slices");
  for (size_t i = 0; i < slices.size(); ++i)
    r.slices.push_back(slice_from_json(f, slices[i], Fields::at("slices", i)));
  return r;
}

}  // namespace po::checkpoint
