// OpenAI's request and response shapes (api.h): /v1/completions and
// /v1/chat/completions, their streamed chunks, logprobs and errors.
#include <algorithm>
#include <cmath>
#include <string>

#include "serve/api.h"
#include "serve/api_fields.h"

namespace po::serve {

using json = nlohmann::json;
using namespace api_detail;

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

}  // namespace po::serve
