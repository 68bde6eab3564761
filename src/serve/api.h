// The HTTP APIs' request parsers and response builders: TGI's routes
// (/generate, /generate_stream, /, /tokenize) and OpenAI's (/v1/completions,
// /v1/chat/completions), their JSON shapes, the chat templates and the length
// checks. Pure functions over text and JSON, apart from the engine and the
// server, so that the fuzzer (fuzz/serve_request_fuzz.cc) links them alone.
//
// Rules the parsers keep:
//   - a request that parses is one the engine takes: every field has its
//     type and range checked here, with TGI's limits on TGI routes
//     (router/src/validation.rs) and OpenAI's on /v1;
//   - anything wrong throws ValidationError, one line naming the field
//     (param() holds it for OpenAI's error shape); nothing else escapes;
//   - unknown fields are ignored (as TGI and vLLM do); known fields this
//     engine cannot honour (grammar, tools, logit_bias...) are rejected
//     rather than silently dropped;
//   - null is the same as absent.
// Sampling (TGI's server, utils/tokens.py): a TGI request samples when
// do_sample is true or temperature != 1, top_k > 0, top_p < 1 or typical_p < 1;
// otherwise it is greedy. An OpenAI request samples unless temperature is 0
// (its default is 1) or top_p is 0.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "data/chat_format.h"

#include "core/error.h"
#include "serve/types.h"

namespace po::serve {

// A request that is malformed or out of range: HTTP 422 on TGI's routes, 400
// on OpenAI's. param() is the offending field ("temperature",
// "messages[1].role", "body" for JSON that does not parse).
class ValidationError : public core::InvalidArgument {
 public:
  ValidationError(std::string param, const std::string& message)
      : core::InvalidArgument(message), param_(std::move(param)) {}
  const std::string& param() const { return param_; }

 private:
  std::string param_;
};

// The server's limits the parsers apply (TGI's launcher flags of the same names).
struct ApiLimits {
  int64_t max_stop_sequences = 4;
  int64_t max_best_of = 2;
  int64_t max_n = 16;  // OpenAI's n
  int64_t max_prompts = 64;  // completions: prompts in one request (a batch)
};

// ---------------------------------------------------------------------------
// TGI

enum class TgiRoute {
  kGenerate,        // POST /generate: never streams
  kGenerateStream,  // POST /generate_stream: always streams
  kCompat,          // POST /: streams when the body says "stream": true
};

struct TgiRequest {
  std::string inputs;
  // Everything but max_new_tokens and seed, which need the prompt's length
  // and the server's random seed (resolve_max_new_tokens, the server).
  SamplingParams params;
  std::optional<int64_t> max_new_tokens;  // absent: up to max_total_tokens
  std::optional<uint64_t> seed;           // absent: a random one
  int64_t best_of = 1;
  bool stream = false;
  bool details = true;
  bool decoder_input_details = false;
  bool return_full_text = false;
};

// `body` is the request's bytes. Throws ValidationError.
TgiRequest parse_tgi_request(std::string_view body, TgiRoute route, const ApiLimits& limits = {});
// POST /tokenize: {"inputs": str, "parameters": {...}} (parameters ignored).
std::string parse_tokenize_request(std::string_view body);

// ---------------------------------------------------------------------------
// OpenAI

using data::ChatMessage;  // data/chat_format.h: the templates serving and SFT data share

// /v1/completions and /v1/chat/completions.
struct OpenAiRequest {
  bool chat = false;
  std::string model;                  // echoed nowhere: responses name the served model
  // Completions: the prompts (OpenAI's `prompt`: a string, a list of token
  // ids, or a batch of either); choice k·n + j is prompt k's j-th. Absent:
  // one empty text (a new document).
  struct Prompt {
    std::string text;
    std::vector<int32_t> ids;
    bool tokens = false;  // given as ids (checked against the vocabulary by the server)
  };
  std::vector<Prompt> prompts{Prompt{}};
  std::vector<ChatMessage> messages;  // chat
  SamplingParams params;              // max_new_tokens and seed: see below
  // Completions: 16 when absent (OpenAI's default); chat: absent means up
  // to max_total_tokens.
  std::optional<int64_t> max_tokens;
  std::optional<uint64_t> seed;  // choice i uses seed + i; absent: a random one
  int64_t n = 1;
  // Log-probabilities of the chosen tokens: -1 none; k >= 0 asked for them
  // with the k likeliest tokens each (completions' logprobs = k, chat's
  // logprobs = true with top_logprobs = k; params.top_logprobs = k).
  int64_t logprobs = -1;
  bool echo = false;  // completions: the prompt precedes the text
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
};

OpenAiRequest parse_completion_request(std::string_view body, const ApiLimits& limits = {});
OpenAiRequest parse_chat_request(std::string_view body, const ApiLimits& limits = {});

// ---------------------------------------------------------------------------
// Chat templates: "llama2" (Meta's Llama-2 chat format), "chatml", "plain" (GPT-2).

std::vector<std::string> chat_template_names();
// Throws InvalidArgument naming `name` and the known ones.
void check_chat_template(std::string_view name);
// The prompt of `messages` as text segments. Each segment starts a sequence:
// the caller puts BOS before each (where the tokenizer has one) and EOS
// between two, which is how Llama-2 chat separates finished turns
// ("... {answer} </s><s>[INST] ..."): the ids, not the text "</s><s>", which
// the tokenizer would encode as characters. chatml and plain make one
// segment. Throws ValidationError (param "messages") for an order of roles
// the template cannot express, InvalidArgument for an unknown template.
std::vector<std::string> render_chat_segments(std::string_view template_name,
                                              const std::vector<ChatMessage>& messages);
// The same as one string, segments joined by "</s><s>" (for reading and tests).
std::string render_chat(std::string_view template_name, const std::vector<ChatMessage>& messages);

// ---------------------------------------------------------------------------
// Lengths

// The number of new tokens a request of `prompt_tokens` may make, or throws
// ValidationError: TGI's checks and messages (the total first, then the
// input), or with `openai` OpenAI's context-length message. `requested`
// absent: everything up to max_total_tokens. `param` names the prompt's
// field ("inputs", "prompt", "messages").
int64_t resolve_max_new_tokens(int64_t prompt_tokens, std::optional<int64_t> requested,
                               int64_t max_input_tokens, int64_t max_total_tokens, bool openai,
                               const std::string& param);

// ---------------------------------------------------------------------------
// Responses

// What one sequence of a request produced.
struct Generation {
  std::string text;                    // the released text: no stop sequence
  std::vector<GeneratedToken> tokens;  // every token made, EOS included
  Finish finish = Finish::kNone;
  std::optional<uint64_t> seed;  // the seed it sampled with; absent when greedy
  int64_t prompt_tokens = 0;
  // With prompt_logprobs: every prompt token with its text, the first with a
  // NaN logprob (nothing before it: null in JSON), the others scored.
  std::vector<GeneratedToken> prompt;
  std::string echo;  // completions with echo: the prompt's text, before the output's
  double logprob_sum() const;
};

// TGI's names: "length", "eos_token", "stop_sequence" ("cancelled").
const char* tgi_finish_reason(Finish f);
// OpenAI's: "length", "stop" ("abort" for a cancelled request, as vLLM).
const char* openai_finish_reason(Finish f);

// TGI's Token: {id, text, logprob, special}.
nlohmann::json tgi_token_json(const GeneratedToken& t, std::string_view text);
// TGI's GenerateResponse {generated_text, details?}: `prefix` precedes the text
// (return_full_text), `prefill` is details.prefill (decoder_input_details),
// `others` the other best_of sequences (details.best_of_sequences).
nlohmann::json tgi_generate_response(const Generation& g, std::string_view prefix, bool details,
                                     const nlohmann::json& prefill = nlohmann::json::array(),
                                     const std::vector<Generation>& others = {});
// TGI's StreamResponse for one token: `text` is what this token released
// (whole characters, held-back text excluded), so the events' texts add up
// to generated_text. `last` (the final event) carries generated_text (with
// `prefix`) and, with `details`, {finish_reason, generated_tokens, seed,
// input_length}.
nlohmann::json tgi_stream_event(int64_t index, const GeneratedToken& t, std::string_view text,
                                const Generation* last = nullptr, std::string_view prefix = {},
                                bool details = true);
// {"error": message, "error_type": type}: validation, generation,
// overloaded, unauthorized, not_found, ...
nlohmann::json tgi_error(std::string_view message, std::string_view error_type);

// The text of a token id, for the alternatives of OpenAI's logprobs (the
// server passes the tokenizer's piece_bytes); null: alternatives left out.
using TokenText = std::function<std::string(int32_t)>;

// Fields every OpenAI object of one request shares.
struct OpenAiMeta {
  std::string id;     // "cmpl-…" / "chatcmpl-…"
  std::string model;  // the served model's id
  int64_t created = 0;  // Unix seconds
};
nlohmann::json usage_json(int64_t prompt_tokens, int64_t completion_tokens);
// A whole text_completion / chat.completion, usage included (completions:
// `prompt_tokens` of every prompt once, however many choices share it, as
// OpenAI counts; chat: the one prompt's); a choice's Generation::echo
// precedes its text (completions' echo).
// With logprobs >= 0 each choice carries its tokens' log-probabilities and
// their alternatives (GeneratedToken::top), named by `text_of`; with its
// prompt scored (Generation::prompt), the prompt's tokens come first.
nlohmann::json completion_response(const OpenAiMeta& m, const std::vector<Generation>& choices,
                                   int64_t prompt_tokens, int64_t logprobs, const TokenText& text_of = {});
nlohmann::json chat_response(const OpenAiMeta& m, const std::vector<Generation>& choices,
                             int64_t logprobs, const TokenText& text_of = {});
// One stream chunk of choice `index`: `text` new text, `tokens` the tokens
// it came with (for logprobs), `finish` kNone until the choice's last chunk.
// `usage_null` adds "usage": null (stream_options.include_usage).
nlohmann::json completion_chunk(const OpenAiMeta& m, int64_t index, std::string_view text,
                                const std::vector<GeneratedToken>& tokens, Finish finish,
                                int64_t logprobs, bool usage_null, int64_t text_offset = 0,
                                const TokenText& text_of = {});
// Chat: `role` adds "role": "assistant" to the delta (each choice's first chunk).
nlohmann::json chat_chunk(const OpenAiMeta& m, int64_t index, bool role, std::string_view text,
                          const std::vector<GeneratedToken>& tokens, Finish finish,
                          int64_t logprobs, bool usage_null, const TokenText& text_of = {});
// The last chunk of an include_usage stream: no choices, the usage.
nlohmann::json usage_chunk(const OpenAiMeta& m, bool chat, int64_t prompt_tokens,
                           int64_t completion_tokens);
// {"error": {message, type, param, code}}; empty param or code is null.
nlohmann::json openai_error(std::string_view message, std::string_view type,
                            std::string_view param = {}, std::string_view code = {});

// JSON text, invalid UTF-8 (a token's own bytes may end inside a character)
// replaced by U+FFFD rather than thrown.
std::string dump_json(const nlohmann::json& j);
// One server-sent event: "data:" JSON "\n\n" (TGI writes no space after the
// colon, OpenAI one; clients read both).
std::string sse_event(const nlohmann::json& j, bool space);

}  // namespace po::serve
