// The JSON reading the TGI and OpenAI request parsers share (api_tgi.cc,
// api_openai.cc): typed field access whose errors name the field as the
// API's clients spell it. Internal to serve/.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "serve/api.h"

namespace po::serve::api_detail {

using json = nlohmann::json;

// The body as a JSON object, or ValidationError("body").
inline json parse_object(std::string_view body) {
  json j;
  try {
    j = json::parse(body.begin(), body.end());
  } catch (const json::exception& e) {
    // nlohmann's "[json.exception.parse_error.101] parse error at ...": the
    // bracketed id says nothing to a client.
    std::string what = e.what();
    if (const size_t p = what.find("] "); what.starts_with("[json.exception") && p != std::string::npos)
      what = what.substr(p + 2);
    throw ValidationError("body", "the request body is not valid JSON: " + what);
  }
  if (!j.is_object())
    throw ValidationError("body", core::str_cat("the request body must be a JSON object, got ",
                                                j.type_name()));
  return j;
}

// One JSON object's fields read by name, each with its type checked; null
// reads as absent. Messages name the field as `name`.
class Fields {
 public:
  explicit Fields(const json& obj, std::string prefix = "") : obj_(obj), prefix_(std::move(prefix)) {}

  const json* get(const char* key) const {
    const auto it = obj_.find(key);
    if (it == obj_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  std::string param(const char* key) const { return prefix_ + key; }

  [[noreturn]] void type_error(const char* key, const char* want, const json& got) const {
    throw ValidationError(param(key), core::str_cat("`", param(key), "` must be ", want, ", got ",
                                                    got.type_name()));
  }
  std::optional<bool> boolean(const char* key) const {
    const json* v = get(key);
    if (!v) return std::nullopt;
    if (!v->is_boolean()) type_error(key, "a boolean", *v);
    return v->get<bool>();
  }
  std::optional<double> number(const char* key) const {
    const json* v = get(key);
    if (!v) return std::nullopt;
    if (!v->is_number()) type_error(key, "a number", *v);
    return v->get<double>();
  }
  // An integer in [lo, hi]; `range` is the message's wording of the bounds,
  // followed by ". Given: x" with `given` (TGI's wording for some fields).
  // Where `range` names only the lower bound (TGI's "strictly positive"), a
  // value above hi says "must be <= hi" instead.
  std::optional<int64_t> integer(const char* key, int64_t lo, int64_t hi, const std::string& range,
                                 bool given = false, bool range_names_hi = true) const {
    const json* v = get(key);
    if (!v) return std::nullopt;
    if (!v->is_number_integer()) type_error(key, "an integer", *v);
    const bool too_big = (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(hi)) ||
                         (!v->is_number_unsigned() && v->get<int64_t>() > hi);
    const int64_t x = too_big ? hi : v->get<int64_t>();
    if (too_big || x < lo) {
      const std::string shown = v->is_number_unsigned() ? std::to_string(v->get<uint64_t>())
                                                        : std::to_string(v->get<int64_t>());
      if (too_big && !range_names_hi)
        throw ValidationError(param(key), core::str_cat("`", param(key), "` must be <= ", hi, ", got ", shown));
      throw ValidationError(param(key), given ? range + ". Given: " + shown : range);
    }
    return x;
  }
  // Any 64-bit integer, its bits as unsigned (a seed).
  std::optional<uint64_t> bits64(const char* key, bool allow_negative) const {
    const json* v = get(key);
    if (!v) return std::nullopt;
    if (!v->is_number_integer()) type_error(key, "an integer", *v);
    if (v->is_number_unsigned()) return v->get<uint64_t>();
    const int64_t x = v->get<int64_t>();
    if (x < 0 && !allow_negative)
      throw ValidationError(param(key), core::str_cat("`", param(key), "` must be >= 0, got ", x));
    return static_cast<uint64_t>(x);
  }
  std::optional<std::string> string(const char* key) const {
    const json* v = get(key);
    if (!v) return std::nullopt;
    if (!v->is_string()) type_error(key, "a string", *v);
    return v->get<std::string>();
  }
  // Rejects a field that is present and not `neutral` (an engine feature we
  // lack: answering without it would be silently wrong).
  void unsupported(const char* key, const std::string& why,
                   bool (*neutral)(const json&) = nullptr) const {
    const json* v = get(key);
    if (v && !(neutral && neutral(*v))) throw ValidationError(param(key), why);
  }

 private:
  const json& obj_;
  std::string prefix_;
};

inline std::vector<std::string> read_stop(const Fields& f, bool allow_string, int64_t max_stop) {
  std::vector<std::string> stop;
  const json* v = f.get("stop");
  if (!v) return stop;
  if (allow_string && v->is_string()) {
    stop.push_back(v->get<std::string>());
  } else if (v->is_array()) {
    if (static_cast<int64_t>(v->size()) > max_stop)
      throw ValidationError("stop", core::str_cat("`stop` supports up to ", max_stop,
                                                  " stop sequences. Given: ", v->size()));
    for (size_t i = 0; i < v->size(); ++i) {
      if (!(*v)[i].is_string())
        throw ValidationError("stop", core::str_cat("`stop[", i, "]` must be a string, got ",
                                                    (*v)[i].type_name()));
      stop.push_back((*v)[i].get<std::string>());
    }
  } else {
    f.type_error("stop", allow_string ? "a string or an array of strings" : "an array of strings", *v);
  }
  // An empty stop sequence would match before the first token.
  for (size_t i = 0; i < stop.size(); ++i)
    if (stop[i].empty())
      throw ValidationError("stop", core::str_cat("`stop[", i, "]` is empty"));
  return stop;
}

inline const json kEmptyObject = json::object();

// The object at `key` (absent or null: an empty one).
inline const json& object_field(const Fields& f, const char* key) {
  const json* v = f.get(key);
  if (!v) return kEmptyObject;
  if (!v->is_object()) f.type_error(key, "an object", *v);
  return *v;
}

inline constexpr int64_t kMaxTokensLimit = std::numeric_limits<int32_t>::max();

}  // namespace po::serve::api_detail
