// TGI's request and response shapes (api.h). TGI's messages are
// router/src/validation.rs's, word for word where TGI has one, so that
// clients written against TGI see what they expect.
#include <string>

#include "serve/api.h"
#include "serve/api_fields.h"

namespace po::serve {

using json = nlohmann::json;
using namespace api_detail;

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
  // A --lora adapter by name (TGI's multi-LoRA); checked against the loaded ones when submitted.
  r.params.adapter = p.string("adapter_id").value_or("");

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

}  // namespace po::serve
