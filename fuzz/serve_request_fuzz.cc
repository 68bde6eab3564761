// Fuzzes the HTTP layer's request parsers (serve/api.h): the first byte picks
// TGI's /generate, /generate_stream, / or /tokenize, OpenAI's completions or
// chat; the rest is the body. Bad input may only raise po::core::Error. A
// request that parses must be one the engine takes (the ranges SamplingParams
// documents), and must render (chat) and serialise (the response builders,
// fed the prompt's bytes as token text, which may end inside a character).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <string_view>

#include "core/error.h"
#include "serve/api.h"

namespace {

using namespace po::serve;

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "accepted request breaks an invariant: %s\n", what);
  std::abort();
}

void check_params(const SamplingParams& s) {
  if (!(s.temperature > 0)) fail("temperature <= 0");
  if (!(s.top_p > 0 && s.top_p <= 1)) fail("top_p outside (0, 1]");
  if (!(s.typical_p > 0 && s.typical_p <= 1)) fail("typical_p outside (0, 1]");
  if (s.top_k < 0) fail("top_k < 0");
  if (!(s.repetition_penalty > 0)) fail("repetition_penalty <= 0");
  if (!(std::fabs(s.frequency_penalty) <= 2 && std::fabs(s.presence_penalty) <= 2)) fail("penalty outside [-2, 2]");
  if (s.stop.size() > 4) fail("more than 4 stop sequences");
  for (const auto& st : s.stop)
    if (st.empty()) fail("empty stop sequence");
}

// The builders over text from the input: they must not throw on any bytes.
void build_responses(const std::string& text) {
  Generation g;
  g.text = text;
  GeneratedToken t;
  t.id = 7;
  t.text = text;
  t.logprob = -0.5f;
  t.top = {{7, -0.5f}, {8, -1.5f}};
  g.tokens = {t, t};
  const TokenText text_of = [&](int32_t) { return text; };
  g.finish = Finish::kStop;
  g.prompt_tokens = 3;
  const OpenAiMeta m{"cmpl-x", text, 1};
  (void)dump_json(tgi_generate_response(g, text, true, nlohmann::json::array(), {g}));
  (void)sse_event(tgi_stream_event(1, t, text, &g, text, true), false);
  Generation echoed = g;
  echoed.echo = text;
  echoed.prompt = {t, t};
  echoed.prompt[0].logprob = std::numeric_limits<float>::quiet_NaN();
  (void)dump_json(completion_response(m, {g, echoed}, 6, 2, text_of));
  (void)dump_json(chat_response(m, {g}, 1, text_of));
  (void)sse_event(chat_chunk(m, 0, true, text, g.tokens, Finish::kNone, 3, true, text_of), true);
  (void)sse_event(completion_chunk(m, 1, text, g.tokens, Finish::kLength, 1, false, 4, text_of), true);
  (void)dump_json(openai_error(text, "invalid_request_error", text, ""));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int which = data[0] % 6;
  const std::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    switch (which) {
      case 0:
      case 1:
      case 2: {
        const TgiRoute route = which == 0 ? TgiRoute::kGenerate
                               : which == 1 ? TgiRoute::kGenerateStream
                                            : TgiRoute::kCompat;
        const TgiRequest r = parse_tgi_request(body, route);
        check_params(r.params);
        if (r.inputs.empty()) fail("empty inputs");
        if (r.max_new_tokens && *r.max_new_tokens < 1) fail("max_new_tokens < 1");
        if (r.best_of < 1 || r.best_of > 2) fail("best_of outside [1, 2]");
        if (r.stream && r.best_of != 1) fail("best_of with streaming");
        if (route == TgiRoute::kGenerate && r.stream) fail("/generate streams");
        build_responses(r.inputs);
        try {
          (void)resolve_max_new_tokens(static_cast<int64_t>(r.inputs.size()), r.max_new_tokens, 512,
                                       1024, false, "inputs");
        } catch (const ValidationError&) {
        }
        break;
      }
      case 3:
        build_responses(parse_tokenize_request(body));
        break;
      case 4:
      case 5: {
        const OpenAiRequest r = which == 4 ? parse_completion_request(body) : parse_chat_request(body);
        check_params(r.params);
        if (r.n < 1 || r.n > 16) fail("n outside [1, 16]");
        if (r.max_tokens && *r.max_tokens < 1) fail("max_tokens < 1");
        if (!r.stream && r.include_usage) fail("include_usage without stream");
        if (r.chat) {
          if (r.messages.empty()) fail("no messages");
          for (const char* t : {"llama2", "chatml", "plain"}) {
            try {
              build_responses(render_chat(t, r.messages));
            } catch (const ValidationError&) {
            }
          }
        } else {
          if (r.prompts.empty()) fail("no prompts");
          for (const auto& p : r.prompts) {
            if (p.tokens && p.ids.empty()) fail("an empty list of token ids");
            for (int32_t id : p.ids)
              if (id < 0) fail("a negative token id");
            build_responses(p.text);
          }
        }
        break;
      }
    }
  } catch (const po::core::Error&) {
  }
  return 0;
}
