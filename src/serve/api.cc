// TGI's and OpenAI's request and response shapes (see api.h for the rules).
// TGI's messages are router/src/validation.rs's, word for word where TGI
// has one, so that clients written against TGI see what they expect.
#include "serve/api.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace po::serve {
namespace {

using json = nlohmann::json;

// The body as a JSON object, or ValidationError("body").
json parse_object(std::string_view body) {
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

std::vector<std::string> read_stop(const Fields& f, bool allow_string, int64_t max_stop) {
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

const json kEmptyObject = json::object();

// The object at `key` (absent or null: an empty one).
const json& object_field(const Fields& f, const char* key) {
  const json* v = f.get(key);
  if (!v) return kEmptyObject;
  if (!v->is_object()) f.type_error(key, "an object", *v);
  return *v;
}

constexpr int64_t kMaxTokensLimit = std::numeric_limits<int32_t>::max();

}  // namespace

// ---------------------------------------------------------------------------
// TGI

TgiRequest parse_tgi_request(std::string_view body, TgiRoute route, const ApiLimits& limits) {
  const json j = parse_object(body);
  const Fields top(j);
  TgiRequest r;
  const auto inputs = top.string("inputs");
  if (!inputs) throw ValidationError("inputs", "`inputs` is missing: the body is {\"inputs\": \"...\", \"parameters\": {...}}");
  if (inputs->empty()) throw ValidationError("inputs", "`inputs` cannot be empty");
  r.inputs = *inputs;
  r.stream = route == TgiRoute::kGenerateStream ||
             (route == TgiRoute::kCompat && top.boolean("stream").value_or(false));

  const Fields p(object_field(top, "parameters"));
  const auto best_of = p.integer("best_of", 1, limits.max_best_of,
                                 core::str_cat("`best_of` must be > 0 and <= ", limits.max_best_of), true);
  const auto temperature = p.number("temperature");
  const auto repetition_penalty = p.number("repetition_penalty");
  const auto frequency_penalty = p.number("frequency_penalty");
  const auto top_k = p.integer("top_k", 1, std::numeric_limits<int32_t>::max(),
                               "`top_k` must be strictly positive", false, false);
  const auto top_p = p.number("top_p");
  const auto typical_p = p.number("typical_p");
  const bool do_sample = p.boolean("do_sample").value_or(false);
  r.max_new_tokens = p.integer("max_new_tokens", 1, kMaxTokensLimit,
                               "`max_new_tokens` must be strictly positive", false, false);
  r.return_full_text = p.boolean("return_full_text").value_or(false);
  r.params.stop = read_stop(p, false, limits.max_stop_sequences);
  p.integer("truncate", 0, std::numeric_limits<int64_t>::max(), "`truncate` must be >= 0");  // ignored
  r.details = p.boolean("details").value_or(true);
  r.decoder_input_details = p.boolean("decoder_input_details").value_or(false);
  r.seed = p.bits64("seed", false);
  p.integer("top_n_tokens", 0, 0, "`top_n_tokens` must be >= 0 and <= 0", true);
  if (p.boolean("watermark").value_or(false))
    throw ValidationError("watermark", "`watermark` is not supported");
  p.unsupported("grammar", "grammar is not supported");
  p.unsupported("adapter_id", "`adapter_id`: adapters are not supported");

  r.best_of = best_of.value_or(1);
  // TGI's router counts a sampling parameter as given even when it is neutral.
  const bool asks_sampling = do_sample || temperature || top_k || top_p || typical_p;
  if (r.best_of > 1 && !asks_sampling)
    throw ValidationError("best_of", "you must use sampling when `best_of` is > 1");
  if (r.best_of > 1 && r.seed)
    throw ValidationError("seed", "`seed` must not be set when `best_of` > 1");
  if (r.stream && r.best_of != 1)
    throw ValidationError("best_of", "`best_of` != 1 is not supported when streaming tokens");
  if (r.stream && r.decoder_input_details)
    throw ValidationError("decoder_input_details",
                          "`decoder_input_details` == true is not supported when streaming tokens");
  r.params.prompt_logprobs = r.decoder_input_details;

  SamplingParams& s = r.params;
  s.temperature = temperature.value_or(1.0);
  if (s.temperature <= 0) throw ValidationError("temperature", "`temperature` must be strictly positive");
  s.repetition_penalty = repetition_penalty.value_or(1.0);
  if (s.repetition_penalty <= 0)
    throw ValidationError("repetition_penalty", "`repetition_penalty` must be strictly positive");
  s.frequency_penalty = frequency_penalty.value_or(0.0);
  if (s.frequency_penalty < -2 || s.frequency_penalty > 2)
    throw ValidationError("frequency_penalty", "`frequency_penalty` must be >= -2.0 and <= 2.0");
  s.top_p = top_p.value_or(1.0);
  if (top_p && (*top_p <= 0 || *top_p >= 1))
    throw ValidationError("top_p", "`top_p` must be > 0.0 and < 1.0");
  s.typical_p = typical_p.value_or(1.0);
  if (typical_p && (*typical_p <= 0 || *typical_p >= 1))
    throw ValidationError("typical_p", "`typical_p` must be > 0.0 and < 1.0");
  s.top_k = top_k.value_or(0);
  // TGI's server samples when asked to or when a warper would change the
  // distribution (utils/tokens.py: sampling = do_sample or has_warpers).
  s.do_sample = do_sample || s.temperature != 1.0 || s.top_k > 0 || s.top_p < 1.0 || s.typical_p < 1.0;
  return r;
}

std::string parse_tokenize_request(std::string_view body) {
  const json j = parse_object(body);
  const auto inputs = Fields(j).string("inputs");
  if (!inputs) throw ValidationError("inputs", "`inputs` is missing: the body is {\"inputs\": \"...\"}");
  return *inputs;
}

// ---------------------------------------------------------------------------
// OpenAI

namespace {

bool is_empty(const json& v) { return (v.is_object() || v.is_array() || v.is_string()) && v.empty(); }
bool is_text_format(const json& v) {
  return v.is_object() && v.contains("type") && v["type"] == "text";
}
bool is_one(const json& v) { return v.is_number_integer() && v.get<int64_t>() == 1; }

// The fields /v1/completions and /v1/chat/completions share.
void parse_openai_common(const Fields& f, const ApiLimits& limits, OpenAiRequest& r) {
  r.model = f.string("model").value_or("");
  const auto range = [](const char* key, double lo, double hi) {
    return core::str_cat("`", key, "` must be >= ", lo, " and <= ", hi);
  };
  const auto number_in = [&](const char* key, double lo, double hi, double fallback) {
    const double x = f.number(key).value_or(fallback);
    if (!(x >= lo && x <= hi)) throw ValidationError(key, core::str_cat(range(key, lo, hi), ", got ", x));
    return x;
  };
  SamplingParams& s = r.params;
  const double temperature = number_in("temperature", 0, 2, 1.0);
  const double top_p = number_in("top_p", 0, 1, 1.0);
  s.presence_penalty = number_in("presence_penalty", -2, 2, 0.0);
  s.frequency_penalty = number_in("frequency_penalty", -2, 2, 0.0);
  // vLLM's extra sampling parameters (its OpenAI server takes them too).
  const int64_t top_k = f.integer("top_k", -1, std::numeric_limits<int32_t>::max(),
                                  "`top_k` must be -1 (off), 0 (off) or positive").value_or(0);
  s.top_k = std::max<int64_t>(top_k, 0);
  s.repetition_penalty = f.number("repetition_penalty").value_or(1.0);
  if (s.repetition_penalty <= 0)
    throw ValidationError("repetition_penalty", "`repetition_penalty` must be strictly positive");
  s.ignore_eos = f.boolean("ignore_eos").value_or(false);
  // temperature 0 (or top_p 0: only the likeliest token is left) is greedy.
  s.do_sample = temperature > 0 && top_p > 0;
  s.temperature = s.do_sample ? temperature : 1.0;
  s.top_p = s.do_sample ? top_p : 1.0;
  s.stop = read_stop(f, true, limits.max_stop_sequences);

  r.n = f.integer("n", 1, limits.max_n, core::str_cat("`n` must be >= 1 and <= ", limits.max_n))
            .value_or(1);
  r.seed = f.bits64("seed", true);
  r.stream = f.boolean("stream").value_or(false);
  if (const json* so = f.get("stream_options")) {
    if (!r.stream)
      throw ValidationError("stream_options", "`stream_options` is only allowed when `stream` is true");
    if (!so->is_object()) f.type_error("stream_options", "an object", *so);
    r.include_usage = Fields(*so, "stream_options.").boolean("include_usage").value_or(false);
  }
  f.unsupported("logit_bias", "`logit_bias` is not supported", is_empty);
  f.unsupported("response_format", "`response_format`: only {\"type\": \"text\"} is supported",
                is_text_format);
}

std::optional<int64_t> read_max_tokens(const Fields& f, const char* key) {
  return f.integer(key, 1, kMaxTokensLimit, core::str_cat("`", key, "` must be >= 1 and <= ", kMaxTokensLimit));
}

// A message's content: a string, or an array of {"type": "text", "text": ...}
// parts (joined), or null (an assistant turn that only called tools).
std::string read_content(const json& m, const std::string& where) {
  const auto it = m.find("content");
  if (it == m.end() || it->is_null()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (!it->is_array())
    throw ValidationError(where + ".content", core::str_cat("`", where, ".content` must be a string or an array of text parts, got ", it->type_name()));
  std::string text;
  for (size_t i = 0; i < it->size(); ++i) {
    const json& part = (*it)[i];
    const std::string pw = core::str_cat(where, ".content[", i, "]");
    if (!part.is_object()) throw ValidationError(pw, core::str_cat("`", pw, "` must be an object, got ", part.type_name()));
    const Fields pf(part, pw + ".");
    if (pf.string("type").value_or("") != "text")
      throw ValidationError(pw + ".type", core::str_cat("`", pw, ".type`: only \"text\" parts are supported"));
    const auto t = pf.string("text");
    if (!t) throw ValidationError(pw + ".text", core::str_cat("`", pw, ".text` is missing"));
    text += *t;
  }
  return text;
}

}  // namespace

OpenAiRequest parse_completion_request(std::string_view body, const ApiLimits& limits) {
  const json j = parse_object(body);
  const Fields f(j);
  OpenAiRequest r;
  // OpenAI: without a prompt the model starts a new document (<|endoftext|>).
  // A prompt is text or token ids; a request holds one or a batch of them.
  if (const json* p = f.get("prompt")) {
    auto ids_of = [&](const json& a, const std::string& where) {
      OpenAiRequest::Prompt q;
      q.tokens = true;
      for (const json& t : a) {
        if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > std::numeric_limits<int32_t>::max())
          throw ValidationError("prompt", core::str_cat("`prompt`", where, ": token ids must be integers >= 0, got ", t.dump()));
        q.ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
      }
      if (q.ids.empty()) throw ValidationError("prompt", core::str_cat("`prompt`", where, ": an empty list of token ids"));
      return q;
    };
    r.prompts.clear();
    if (p->is_string()) {
      r.prompts.push_back({p->get<std::string>(), {}, false});
    } else if (p->is_array() && !p->empty() && (*p)[0].is_number()) {  // one prompt of ids
      r.prompts.push_back(ids_of(*p, ""));
    } else if (p->is_array() && !p->empty()) {  // a batch: strings or lists of ids
      for (size_t i = 0; i < p->size(); ++i) {
        const json& e = (*p)[i];
        const std::string where = core::str_cat("[", i, "]");
        if (e.is_string())
          r.prompts.push_back({e.get<std::string>(), {}, false});
        else if (e.is_array())
          r.prompts.push_back(ids_of(e, where));
        else
          throw ValidationError("prompt", core::str_cat("`prompt`", where, " must be a string or a list of token ids, got ",
                                                        e.type_name()));
      }
    } else {
      f.type_error("prompt", "a string, a list of strings, a list of token ids or a list of such lists", *p);
    }
    if (static_cast<int64_t>(r.prompts.size()) > limits.max_prompts)
      throw ValidationError("prompt", core::str_cat("`prompt`: a batch of ", r.prompts.size(),
                                                    " prompts; at most ", limits.max_prompts));
  }
  parse_openai_common(f, limits, r);
  r.max_tokens = read_max_tokens(f, "max_tokens").value_or(16);
  r.logprobs = f.integer("logprobs", 0, 5, "`logprobs` must be >= 0 and <= 5").value_or(-1);
  r.params.top_logprobs = std::max<int64_t>(r.logprobs, 0);
  r.echo = f.boolean("echo").value_or(false);
  // The prompt's tokens with their log-probabilities lead `logprobs`
  // (streamed: in the echo's chunk, sent with the first token).
  r.params.prompt_logprobs = r.echo && r.logprobs >= 0;
  f.unsupported("suffix", "`suffix` is not supported", is_empty);
  f.unsupported("best_of", "`best_of` is not supported on /v1/completions: use `n`", is_one);
  return r;
}

OpenAiRequest parse_chat_request(std::string_view body, const ApiLimits& limits) {
  const json j = parse_object(body);
  const Fields f(j);
  OpenAiRequest r;
  r.chat = true;
  const json* msgs = f.get("messages");
  if (!msgs) throw ValidationError("messages", "`messages` is missing");
  if (!msgs->is_array()) f.type_error("messages", "an array", *msgs);
  if (msgs->empty()) throw ValidationError("messages", "`messages` cannot be empty");
  for (size_t i = 0; i < msgs->size(); ++i) {
    const json& m = (*msgs)[i];
    const std::string where = core::str_cat("messages[", i, "]");
    if (!m.is_object())
      throw ValidationError(where, core::str_cat("`", where, "` must be an object, got ", m.type_name()));
    const auto role = Fields(m, where + ".").string("role");
    if (!role) throw ValidationError(where + ".role", core::str_cat("`", where, ".role` is missing"));
    ChatMessage msg;
    msg.role = *role == "developer" ? "system" : *role;  // OpenAI's newer name for system
    if (msg.role != "system" && msg.role != "user" && msg.role != "assistant")
      throw ValidationError(where + ".role",
                            core::str_cat("`", where, ".role` must be system, user or assistant, got \"",
                                          *role, "\""));
    msg.content = read_content(m, where);
    r.messages.push_back(std::move(msg));
  }
  parse_openai_common(f, limits, r);
  r.max_tokens = read_max_tokens(f, "max_tokens");
  // The newer name wins when both are given (OpenAI deprecated max_tokens).
  if (auto mct = read_max_tokens(f, "max_completion_tokens")) r.max_tokens = mct;
  const bool logprobs = f.boolean("logprobs").value_or(false);
  const auto top = f.integer("top_logprobs", 0, 20, "`top_logprobs` must be >= 0 and <= 20");
  if (top && !logprobs)
    throw ValidationError("top_logprobs", "`top_logprobs` needs `logprobs` set to true");
  r.logprobs = logprobs ? top.value_or(0) : -1;
  r.params.top_logprobs = std::max<int64_t>(r.logprobs, 0);
  f.unsupported("tools", "`tools` are not supported", is_empty);
  f.unsupported("functions", "`functions` are not supported", is_empty);
  return r;
}

// ---------------------------------------------------------------------------
// Chat templates

namespace {

// Python's str.strip(), as Meta's chat_completion applies it to each turn.
std::string strip(std::string_view s) {
  const char* ws = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return "";
  return std::string(s.substr(b, s.find_last_not_of(ws) - b + 1));
}

[[noreturn]] void order_error(std::string_view tmpl, size_t i, const std::string& why) {
  throw ValidationError(core::str_cat("messages[", i, "].role"),
                        core::str_cat("chat template ", tmpl, ": ", why, " (at messages[", i, "])"));
}

// Meta's Llama-2 chat format (llama/generation.py, chat_completion): an
// optional system message folded into the first user turn, then user and
// assistant alternating, ending with the user; each finished pair is one
// sequence "[INST] {user} [/INST] {answer} " (BOS before, EOS after).
std::vector<std::string> render_llama2(const std::vector<ChatMessage>& msgs) {
  size_t i = 0;
  std::string system;
  bool has_system = false;
  if (!msgs.empty() && msgs[0].role == "system") {
    system = msgs[0].content;
    has_system = true;
    i = 1;
  }
  std::vector<std::string> segments;
  if (i == msgs.size()) order_error("llama2", i - 1, "a user message must follow the system message");
  for (bool first = true; i < msgs.size(); i += 2, first = false) {
    if (msgs[i].role != "user") order_error("llama2", i, "roles must alternate user, assistant, user, ...");
    std::string user = msgs[i].content;
    if (first && has_system) user = "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + user;
    // Appended piecewise: GCC 12 warns (-Wrestrict, a false positive) on "lit" + string&&.
    std::string seg = "[INST] ";
    seg += strip(user);
    seg += " [/INST]";
    if (i + 1 < msgs.size()) {
      if (msgs[i + 1].role != "assistant")
        order_error("llama2", i + 1, "roles must alternate user, assistant, user, ...");
      if (i + 2 == msgs.size())
        order_error("llama2", i + 1, "the last message must be the user's");
      seg += ' ';
      seg += strip(msgs[i + 1].content);
      seg += ' ';
    }
    segments.push_back(std::move(seg));
  }
  return segments;
}

std::string render_chatml(const std::vector<ChatMessage>& msgs) {
  std::string out;
  for (const auto& m : msgs) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
  return out + "<|im_start|>assistant\n";
}

// GPT-2 has no chat format: a transcript it can continue.
std::string render_plain(const std::vector<ChatMessage>& msgs) {
  std::string out;
  for (const auto& m : msgs) {
    const char* who = m.role == "system" ? "System" : m.role == "user" ? "User" : "Assistant";
    out += std::string(who) + ": " + m.content + "\n";
  }
  return out + "Assistant:";
}

}  // namespace

std::vector<std::string> chat_template_names() { return {"llama2", "chatml", "plain"}; }

void check_chat_template(std::string_view name) {
  for (const auto& n : chat_template_names())
    if (n == name) return;
  PO_THROW(core::InvalidArgument, "chat template '", name, "' is unknown (known: llama2, chatml, plain)");
}

std::vector<std::string> render_chat_segments(std::string_view template_name,
                                              const std::vector<ChatMessage>& messages) {
  check_chat_template(template_name);
  if (messages.empty()) throw ValidationError("messages", "`messages` cannot be empty");
  if (template_name == "llama2") return render_llama2(messages);
  if (template_name == "chatml") return {render_chatml(messages)};
  return {render_plain(messages)};
}

std::string render_chat(std::string_view template_name, const std::vector<ChatMessage>& messages) {
  std::string out;
  const auto segments = render_chat_segments(template_name, messages);
  for (size_t i = 0; i < segments.size(); ++i) out += (i ? "</s><s>" : "") + segments[i];
  return out;
}

// ---------------------------------------------------------------------------
// Lengths

int64_t resolve_max_new_tokens(int64_t prompt_tokens, std::optional<int64_t> requested,
                               int64_t max_input_tokens, int64_t max_total_tokens, bool openai,
                               const std::string& param) {
  const int64_t max_new = requested ? *requested : std::max<int64_t>(0, max_total_tokens - prompt_tokens);
  const bool total_ok = prompt_tokens + std::max<int64_t>(max_new, 1) <= max_total_tokens;
  const bool input_ok = prompt_tokens <= max_input_tokens;
  if (!openai) {
    if (!total_ok)
      throw ValidationError(requested ? "max_new_tokens" : param,
                            core::str_cat("`inputs` tokens + `max_new_tokens` must be <= ", max_total_tokens,
                                          ". Given: ", prompt_tokens, " `inputs` tokens and ",
                                          std::max<int64_t>(max_new, 1), " `max_new_tokens`"));
    if (!input_ok)
      throw ValidationError(param, core::str_cat("`inputs` must have less than ", max_input_tokens,
                                                 " tokens. Given: ", prompt_tokens));
    return max_new;
  }
  if (!input_ok)
    throw ValidationError(param, core::str_cat("This model's maximum input length is ", max_input_tokens,
                                               " tokens. However, your ", param, " has ", prompt_tokens,
                                               " tokens. Please reduce the length of the ", param, "."));
  if (!total_ok)
    throw ValidationError(requested ? "max_tokens" : param,
                          core::str_cat("This model's maximum context length is ", max_total_tokens,
                                        " tokens. However, you requested ", prompt_tokens + std::max<int64_t>(max_new, 1),
                                        " tokens (", prompt_tokens, " in the ", param, ", ",
                                        std::max<int64_t>(max_new, 1),
                                        " in the completion). Please reduce the length of the ", param,
                                        " or completion."));
  return max_new;
}

// ---------------------------------------------------------------------------
// Responses

double Generation::logprob_sum() const {
  double s = 0;
  for (const auto& t : tokens) s += t.logprob;
  return s;
}

const char* tgi_finish_reason(Finish f) {
  switch (f) {
    case Finish::kLength: return "length";
    case Finish::kEos: return "eos_token";
    case Finish::kStop: return "stop_sequence";
    case Finish::kCancelled: return "cancelled";
    case Finish::kNone: break;
  }
  return "";
}

const char* openai_finish_reason(Finish f) {
  switch (f) {
    case Finish::kLength: return "length";
    case Finish::kEos:
    case Finish::kStop: return "stop";
    case Finish::kCancelled: return "abort";
    case Finish::kNone: break;
  }
  return "";
}

namespace {

json seed_json(const Generation& g) { return g.seed ? json(*g.seed) : json(nullptr); }

json tokens_json(const std::vector<GeneratedToken>& tokens) {
  json a = json::array();
  for (const auto& t : tokens) a.push_back(tgi_token_json(t, t.text));
  return a;
}

}  // namespace

json tgi_token_json(const GeneratedToken& t, std::string_view text) {
  return {{"id", t.id}, {"text", text}, {"logprob", t.logprob}, {"special", t.special}};
}

json tgi_generate_response(const Generation& g, std::string_view prefix, bool details,
                           const json& prefill, const std::vector<Generation>& others) {
  json out = {{"generated_text", std::string(prefix) + g.text}};
  if (!details) return out;  // TGI leaves "details" out rather than null
  json d = {{"finish_reason", tgi_finish_reason(g.finish)},
            {"generated_tokens", g.tokens.size()},
            {"seed", seed_json(g)},
            {"prefill", prefill},
            {"tokens", tokens_json(g.tokens)}};
  if (!others.empty()) {
    json seqs = json::array();
    for (const auto& o : others)
      seqs.push_back({{"generated_text", std::string(prefix) + o.text},
                      {"finish_reason", tgi_finish_reason(o.finish)},
                      {"generated_tokens", o.tokens.size()},
                      {"seed", seed_json(o)},
                      {"prefill", prefill},
                      {"tokens", tokens_json(o.tokens)}});
    d["best_of_sequences"] = std::move(seqs);
  }
  out["details"] = std::move(d);
  return out;
}

json tgi_stream_event(int64_t index, const GeneratedToken& t, std::string_view text,
                      const Generation* last, std::string_view prefix, bool details) {
  // TGI omits top_tokens when empty (top_n_tokens is always 0 here).
  json e = {{"index", index}, {"token", tgi_token_json(t, text)}, {"generated_text", nullptr},
            {"details", nullptr}};
  if (last) {
    e["generated_text"] = std::string(prefix) + last->text;
    if (details)
      e["details"] = {{"finish_reason", tgi_finish_reason(last->finish)},
                      {"generated_tokens", last->tokens.size()},
                      {"seed", seed_json(*last)},
                      {"input_length", last->prompt_tokens}};
  }
  return e;
}

json tgi_error(std::string_view message, std::string_view error_type) {
  return {{"error", message}, {"error_type", error_type}};
}

json usage_json(int64_t prompt_tokens, int64_t completion_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens}};
}

namespace {

json openai_object(const OpenAiMeta& m, const char* object) {
  return {{"id", m.id}, {"object", object}, {"created", m.created}, {"model", m.model},
          {"system_fingerprint", "pagedoptim"}};
}

// The likeliest tokens of one step as (text, logprob), at most `k`: the
// engine's alternatives named by `text_of`, the chosen token always among
// them (OpenAI: "up to logprobs + 1"); without `text_of`, the chosen alone.
std::vector<std::pair<std::string, float>> alternatives(const GeneratedToken& t, int64_t k,
                                                        const TokenText& text_of) {
  std::vector<std::pair<std::string, float>> out;
  bool chosen = false;
  if (text_of)
    for (const auto& [id, lp] : t.top) {
      if (static_cast<int64_t>(out.size()) >= k) break;
      chosen = chosen || id == t.id;
      out.emplace_back(id == t.id ? t.text : text_of(id), lp);
    }
  if (!chosen && k > 0) out.emplace_back(t.text, t.logprob);
  return out;
}

json byte_values(const std::string& s) {
  json bytes = json::array();
  for (unsigned char c : s) bytes.push_back(c);
  return bytes;
}

// Completions' logprobs: {tokens, token_logprobs, top_logprobs, text_offset}.
json completion_logprobs(const std::vector<GeneratedToken>& tokens, int64_t logprobs, int64_t offset,
                         const TokenText& text_of) {
  json toks = json::array(), lps = json::array(), tops = json::array(), offs = json::array();
  for (const auto& t : tokens) {
    toks.push_back(t.text);
    if (std::isnan(t.logprob)) {  // the prompt's first token: nothing before it
      lps.push_back(nullptr);
      tops.push_back(nullptr);
    } else {
      lps.push_back(t.logprob);
      json top = json::object();
      for (const auto& [text, lp] : alternatives(t, logprobs, text_of)) top[text] = lp;
      tops.push_back(std::move(top));
    }
    offs.push_back(offset);
    offset += static_cast<int64_t>(t.text.size());
  }
  return {{"tokens", toks}, {"token_logprobs", lps}, {"top_logprobs", logprobs > 0 ? tops : json(nullptr)},
          {"text_offset", offs}};
}

// Chat's logprobs: {content: [{token, logprob, bytes, top_logprobs}]}.
json chat_logprobs(const std::vector<GeneratedToken>& tokens, int64_t logprobs, const TokenText& text_of) {
  json content = json::array();
  for (const auto& t : tokens) {
    json top = json::array();
    for (const auto& [text, lp] : alternatives(t, logprobs, text_of))
      top.push_back({{"token", text}, {"logprob", lp}, {"bytes", byte_values(text)}});
    content.push_back(
        {{"token", t.text}, {"logprob", t.logprob}, {"bytes", byte_values(t.text)}, {"top_logprobs", std::move(top)}});
  }
  return {{"content", std::move(content)}};
}

json finish_json(Finish f) { return f == Finish::kNone ? json(nullptr) : json(openai_finish_reason(f)); }

int64_t completion_tokens(const std::vector<Generation>& choices) {
  int64_t n = 0;
  for (const auto& g : choices) n += static_cast<int64_t>(g.tokens.size());
  return n;
}

}  // namespace

json completion_response(const OpenAiMeta& m, const std::vector<Generation>& choices, int64_t prompt_tokens,
                         int64_t logprobs, const TokenText& text_of) {
  json out = openai_object(m, "text_completion");
  json cs = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const Generation& g = choices[i];
    json lps = nullptr;
    if (logprobs >= 0 && !g.prompt.empty()) {  // echo: the prompt's scored tokens first
      std::vector<GeneratedToken> all = g.prompt;
      all.insert(all.end(), g.tokens.begin(), g.tokens.end());
      lps = completion_logprobs(all, logprobs, 0, text_of);
    } else if (logprobs >= 0) {
      lps = completion_logprobs(g.tokens, logprobs, static_cast<int64_t>(g.echo.size()), text_of);
    }
    cs.push_back({{"index", i},
                  {"text", g.echo + g.text},
                  {"logprobs", std::move(lps)},
                  {"finish_reason", finish_json(g.finish)}});
  }
  out["choices"] = std::move(cs);
  out["usage"] = usage_json(prompt_tokens, completion_tokens(choices));
  return out;
}

json chat_response(const OpenAiMeta& m, const std::vector<Generation>& choices, int64_t logprobs,
                   const TokenText& text_of) {
  json out = openai_object(m, "chat.completion");
  json cs = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const Generation& g = choices[i];
    cs.push_back({{"index", i},
                  {"message", {{"role", "assistant"}, {"content", g.text}}},
                  {"logprobs", logprobs >= 0 ? chat_logprobs(g.tokens, logprobs, text_of) : json(nullptr)},
                  {"finish_reason", finish_json(g.finish)}});
  }
  out["choices"] = std::move(cs);
  out["usage"] = usage_json(choices.empty() ? 0 : choices[0].prompt_tokens, completion_tokens(choices));
  return out;
}

json completion_chunk(const OpenAiMeta& m, int64_t index, std::string_view text,
                      const std::vector<GeneratedToken>& tokens, Finish finish, int64_t logprobs,
                      bool usage_null, int64_t text_offset, const TokenText& text_of) {
  json out = openai_object(m, "text_completion");
  out["choices"] = json::array({{{"index", index},
                                 {"text", text},
                                 {"logprobs", logprobs >= 0 ? completion_logprobs(tokens, logprobs, text_offset, text_of)
                                                            : json(nullptr)},
                                 {"finish_reason", finish_json(finish)}}});
  if (usage_null) out["usage"] = nullptr;
  return out;
}

json chat_chunk(const OpenAiMeta& m, int64_t index, bool role, std::string_view text,
                const std::vector<GeneratedToken>& tokens, Finish finish, int64_t logprobs,
                bool usage_null, const TokenText& text_of) {
  json out = openai_object(m, "chat.completion.chunk");
  json delta = json::object();
  if (role) delta["role"] = "assistant";
  // The last chunk's delta is empty, as OpenAI's is.
  if (role || !text.empty() || finish == Finish::kNone) delta["content"] = text;
  out["choices"] = json::array({{{"index", index},
                                 {"delta", std::move(delta)},
                                 {"logprobs", logprobs >= 0 ? chat_logprobs(tokens, logprobs, text_of) : json(nullptr)},
                                 {"finish_reason", finish_json(finish)}}});
  if (usage_null) out["usage"] = nullptr;
  return out;
}

json usage_chunk(const OpenAiMeta& m, bool chat, int64_t prompt_tokens, int64_t completion_tokens) {
  json out = openai_object(m, chat ? "chat.completion.chunk" : "text_completion");
  out["choices"] = json::array();
  out["usage"] = usage_json(prompt_tokens, completion_tokens);
  return out;
}

json openai_error(std::string_view message, std::string_view type, std::string_view param,
                  std::string_view code) {
  return {{"error",
           {{"message", message},
            {"type", type},
            {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code.empty() ? json(nullptr) : json(code)}}}};
}

std::string dump_json(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string sse_event(const json& j, bool space) {
  return (space ? "data: " : "data:") + dump_json(j) + "\n\n";
}

}  // namespace po::serve
