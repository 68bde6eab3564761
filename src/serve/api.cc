// What the TGI and OpenAI shapes share (api.h): the token budget of a
// request, a generation's log-probability, the JSON and SSE text. The shapes
// themselves: api_tgi.cc, api_openai.cc; chat templates: chat_template.cc.
#include <algorithm>
#include <string>

#include "serve/api.h"

namespace po::serve {

using json = nlohmann::json;

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


std::string dump_json(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string sse_event(const json& j, bool space) {
  return (space ? "data: " : "data:") + dump_json(j) + "\n\n";
}

}  // namespace po::serve
