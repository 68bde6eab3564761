// The HTTP layer's parsers and builders alone (serve/api.h): every TGI and
// OpenAI parameter and its default, each validation error naming its field,
// the chat templates, the length checks and the exact JSON of every response
// shape. No engine, no sockets.
#include <gtest/gtest.h>

#include <limits>
#include <string>

#include "serve/api.h"

namespace po::serve {
namespace {

using json = nlohmann::json;

// "param: message" of the ValidationError `fn` throws, or "no error".
template <typename F>
std::string rejection(F fn) {
  try {
    fn();
  } catch (const ValidationError& e) {
    return e.param() + ": " + e.what();
  }
  return "no error";
}

TgiRequest tgi(const std::string& body, TgiRoute route = TgiRoute::kGenerate) {
  return parse_tgi_request(body, route);
}
std::string tgi_rejection(const std::string& params, TgiRoute route = TgiRoute::kGenerate) {
  return rejection([&] { tgi(R"({"inputs":"hi","parameters":)" + params + "}", route); });
}

// ---------------------------------------------------------------------------
// TGI

TEST(TgiRequest, DefaultsAreTgisAndGreedy) {
  const TgiRequest r = tgi(R"({"inputs":"Hello"})");
  EXPECT_EQ(r.inputs, "Hello");
  EXPECT_FALSE(r.params.do_sample);
  EXPECT_EQ(r.params.temperature, 1.0);
  EXPECT_EQ(r.params.top_k, 0);
  EXPECT_EQ(r.params.top_p, 1.0);
  EXPECT_EQ(r.params.typical_p, 1.0);
  EXPECT_EQ(r.params.repetition_penalty, 1.0);
  EXPECT_EQ(r.params.frequency_penalty, 0.0);
  EXPECT_TRUE(r.params.stop.empty());
  EXPECT_FALSE(r.max_new_tokens.has_value()) << "absent max_new_tokens means up to max_total_tokens";
  EXPECT_FALSE(r.seed.has_value());
  EXPECT_EQ(r.best_of, 1);
  EXPECT_TRUE(r.details) << "details defaults to true";
  EXPECT_FALSE(r.decoder_input_details);
  EXPECT_FALSE(r.return_full_text);
  EXPECT_FALSE(r.stream);
}

TEST(TgiRequest, ReadsEveryParameter) {
  const TgiRequest r = tgi(R"({"inputs":"x","parameters":{"max_new_tokens":7,"temperature":0.5,"top_k":40,
      "top_p":0.9,"typical_p":0.8,"repetition_penalty":1.2,"frequency_penalty":-0.5,"stop":["\n","END"],
      "seed":18446744073709551615,"do_sample":true,"return_full_text":true,"details":false,
      "decoder_input_details":true,"truncate":12,"watermark":false,"top_n_tokens":0}})");
  EXPECT_EQ(r.max_new_tokens, 7);
  EXPECT_EQ(r.params.temperature, 0.5);
  EXPECT_EQ(r.params.top_k, 40);
  EXPECT_EQ(r.params.top_p, 0.9);
  EXPECT_EQ(r.params.typical_p, 0.8);
  EXPECT_EQ(r.params.repetition_penalty, 1.2);
  EXPECT_EQ(r.params.frequency_penalty, -0.5);
  EXPECT_EQ(r.params.stop, (std::vector<std::string>{"\n", "END"}));
  EXPECT_EQ(r.seed, std::numeric_limits<uint64_t>::max());
  EXPECT_TRUE(r.params.do_sample);
  EXPECT_TRUE(r.return_full_text);
  EXPECT_FALSE(r.details);
  EXPECT_TRUE(r.decoder_input_details);
}

TEST(TgiRequest, NullIsAbsent) {
  const TgiRequest r = tgi(R"({"inputs":"x","parameters":{"temperature":null,"stop":null,"seed":null,
      "max_new_tokens":null,"details":null}})");
  EXPECT_FALSE(r.params.do_sample);
  EXPECT_TRUE(r.params.stop.empty());
  EXPECT_FALSE(r.seed.has_value());
  EXPECT_FALSE(r.max_new_tokens.has_value());
  EXPECT_TRUE(r.details);
}

// TGI's server: sampling when do_sample or a warper changes the distribution.
TEST(TgiRequest, SamplesWhenAWarperIsOn) {
  struct Case {
    const char* params;
    bool sample;
  } cases[] = {
      {R"({})", false},
      {R"({"temperature":1.0})", false},
      {R"({"temperature":0.7})", true},
      {R"({"top_k":5})", true},
      {R"({"top_p":0.95})", true},
      {R"({"typical_p":0.5})", true},
      {R"({"do_sample":true})", true},
      {R"({"do_sample":false,"repetition_penalty":1.3})", false},
  };
  for (const auto& c : cases) {
    const TgiRequest r = tgi(std::string(R"({"inputs":"x","parameters":)") + c.params + "}");
    EXPECT_EQ(r.params.do_sample, c.sample) << "parameters " << c.params;
  }
}

TEST(TgiRequest, StreamsByRoute) {
  EXPECT_FALSE(tgi(R"({"inputs":"x","stream":true})", TgiRoute::kGenerate).stream)
      << "/generate has no stream field";
  EXPECT_TRUE(tgi(R"({"inputs":"x"})", TgiRoute::kGenerateStream).stream);
  EXPECT_TRUE(tgi(R"({"inputs":"x","stream":true})", TgiRoute::kCompat).stream);
  EXPECT_FALSE(tgi(R"({"inputs":"x"})", TgiRoute::kCompat).stream);
  EXPECT_EQ(rejection([] { tgi(R"({"inputs":"x","stream":"yes"})", TgiRoute::kCompat); }),
            "stream: `stream` must be a boolean, got string");
}

TEST(TgiRequest, BestOfNeedsSamplingNoSeedNoStream) {
  const TgiRequest r = tgi(R"({"inputs":"x","parameters":{"best_of":2,"temperature":1.0}})");
  EXPECT_EQ(r.best_of, 2) << "a given temperature counts as sampling for best_of, as in TGI's router";
  EXPECT_EQ(tgi_rejection(R"({"best_of":2})"), "best_of: you must use sampling when `best_of` is > 1");
  EXPECT_EQ(tgi_rejection(R"({"best_of":2,"do_sample":true,"seed":1})"),
            "seed: `seed` must not be set when `best_of` > 1");
  EXPECT_EQ(tgi_rejection(R"({"best_of":2,"do_sample":true})", TgiRoute::kGenerateStream),
            "best_of: `best_of` != 1 is not supported when streaming tokens");
  EXPECT_EQ(tgi_rejection(R"({"best_of":3,"do_sample":true})"), "best_of: `best_of` must be > 0 and <= 2. Given: 3");
  EXPECT_EQ(tgi_rejection(R"({"best_of":0})"), "best_of: `best_of` must be > 0 and <= 2. Given: 0");
}

TEST(TgiRequest, EachBadParameterIsNamed) {
  struct Case {
    const char* params;
    const char* want;
  } cases[] = {
      {R"({"temperature":0})", "temperature: `temperature` must be strictly positive"},
      {R"({"temperature":-1})", "temperature: `temperature` must be strictly positive"},
      {R"({"temperature":"hot"})", "temperature: `temperature` must be a number, got string"},
      {R"({"top_k":0})", "top_k: `top_k` must be strictly positive"},
      {R"({"top_k":2.5})", "top_k: `top_k` must be an integer, got number"},
      {R"({"top_p":1.0})", "top_p: `top_p` must be > 0.0 and < 1.0"},
      {R"({"top_p":0})", "top_p: `top_p` must be > 0.0 and < 1.0"},
      {R"({"typical_p":1})", "typical_p: `typical_p` must be > 0.0 and < 1.0"},
      {R"({"repetition_penalty":0})", "repetition_penalty: `repetition_penalty` must be strictly positive"},
      {R"({"frequency_penalty":2.5})", "frequency_penalty: `frequency_penalty` must be >= -2.0 and <= 2.0"},
      {R"({"max_new_tokens":0})", "max_new_tokens: `max_new_tokens` must be strictly positive"},
      {R"({"max_new_tokens":-3})", "max_new_tokens: `max_new_tokens` must be strictly positive"},
      {R"({"max_new_tokens":"5"})", "max_new_tokens: `max_new_tokens` must be an integer, got string"},
      {R"({"max_new_tokens":99999999999})", "max_new_tokens: `max_new_tokens` must be <= 2147483647, got 99999999999"},
      {R"({"top_k":99999999999})", "top_k: `top_k` must be <= 2147483647, got 99999999999"},
      {R"({"stop":"x"})", "stop: `stop` must be an array of strings, got string"},
      {R"({"stop":["a","b","c","d","e"]})", "stop: `stop` supports up to 4 stop sequences. Given: 5"},
      {R"({"stop":[1]})", "stop: `stop[0]` must be a string, got number"},
      {R"({"stop":["a",""]})", "stop: `stop[1]` is empty"},
      {R"({"seed":-1})", "seed: `seed` must be >= 0, got -1"},
      {R"({"seed":1.5})", "seed: `seed` must be an integer, got number"},
      {R"({"do_sample":1})", "do_sample: `do_sample` must be a boolean, got number"},
      {R"({"details":"yes"})", "details: `details` must be a boolean, got string"},
      {R"({"return_full_text":[]})", "return_full_text: `return_full_text` must be a boolean, got array"},
      {R"({"truncate":-1})", "truncate: `truncate` must be >= 0"},
      {R"({"top_n_tokens":2})", "top_n_tokens: `top_n_tokens` must be >= 0 and <= 0. Given: 2"},
      {R"({"watermark":true})", "watermark: `watermark` is not supported"},
      {R"({"grammar":{"type":"json","value":{}}})", "grammar: grammar is not supported"},
      {R"({"adapter_id":5})", "adapter_id: `adapter_id` must be a string, got number"},
      {R"([])", "parameters: `parameters` must be an object, got array"},
  };
  for (const auto& c : cases) EXPECT_EQ(tgi_rejection(c.params), c.want) << "parameters " << c.params;
  EXPECT_EQ(tgi_rejection(R"({"decoder_input_details":true})", TgiRoute::kGenerateStream),
            "decoder_input_details: `decoder_input_details` == true is not supported when streaming tokens");
}

TEST(TgiRequest, BadBodiesAreNamed) {
  EXPECT_EQ(rejection([] { tgi(R"({"inputs":""})"); }), "inputs: `inputs` cannot be empty");
  EXPECT_EQ(rejection([] { tgi(R"({"inputs":5})"); }), "inputs: `inputs` must be a string, got number");
  EXPECT_EQ(rejection([] { tgi(R"({"parameters":{}})"); }).substr(0, 27), "inputs: `inputs` is missing");
  EXPECT_EQ(rejection([] { tgi(R"(["hi"])"); }), "body: the request body must be a JSON object, got array");
  const std::string bad = rejection([] { tgi(R"({"inputs":"hi",)"); });
  EXPECT_EQ(bad.substr(0, 42), "body: the request body is not valid JSON: ") << bad;
  EXPECT_EQ(bad.find("[json.exception"), std::string::npos) << "nlohmann's id is noise to a client: " << bad;
  EXPECT_EQ(rejection([] { tgi(""); }).substr(0, 40), "body: the request body is not valid JSON");
  EXPECT_EQ(rejection([] { tgi("{\"inputs\":\"\xff\"}"); }).substr(0, 40), "body: the request body is not valid JSON")
      << "invalid UTF-8 in a string is malformed JSON";
}

TEST(TgiRequest, TokenizeReadsInputs) {
  EXPECT_EQ(parse_tokenize_request(R"({"inputs":"a b","parameters":{"x":1}})"), "a b");
  EXPECT_EQ(parse_tokenize_request(R"({"inputs":""})"), "");
  EXPECT_EQ(rejection([] { parse_tokenize_request(R"({"text":"a"})"); }).substr(0, 27), "inputs: `inputs` is missing");
}

// ---------------------------------------------------------------------------
// OpenAI

std::string completion_rejection(const std::string& fields) {
  return rejection([&] { parse_completion_request(R"({"model":"m","prompt":"hi",)" + fields + "}"); });
}
std::string chat_rejection(const std::string& body) {
  return rejection([&] { parse_chat_request(body); });
}

TEST(OpenAiCompletion, DefaultsAreOpenAis) {
  const OpenAiRequest r = parse_completion_request(R"({"model":"gpt2","prompt":"Once"})");
  EXPECT_FALSE(r.chat);
  EXPECT_EQ(r.model, "gpt2");
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0].text, "Once");
  EXPECT_FALSE(r.prompts[0].tokens);
  EXPECT_EQ(r.max_tokens, 16) << "OpenAI's completions default";
  EXPECT_TRUE(r.params.do_sample) << "temperature 1 samples by default";
  EXPECT_EQ(r.params.temperature, 1.0);
  EXPECT_EQ(r.params.top_p, 1.0);
  EXPECT_EQ(r.params.presence_penalty, 0.0);
  EXPECT_EQ(r.params.frequency_penalty, 0.0);
  EXPECT_EQ(r.n, 1);
  EXPECT_EQ(r.logprobs, -1);
  EXPECT_FALSE(r.echo);
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.include_usage);
  EXPECT_FALSE(r.seed.has_value());
  const auto none = parse_completion_request(R"({"model":"m"})").prompts;
  ASSERT_EQ(none.size(), 1u);
  EXPECT_EQ(none[0].text, "") << "no prompt: a new document";
  EXPECT_FALSE(none[0].tokens);
  EXPECT_EQ(parse_completion_request(R"({"prompt":["one"]})").prompts[0].text, "one");
}

// OpenAI's four shapes of `prompt`: a string, a list of token ids, and a
// batch of either (mixed too).
TEST(OpenAiCompletion, PromptsAsTextTokenIdsAndBatches) {
  const auto ids = parse_completion_request(R"({"prompt":[15496,11,995]})").prompts;
  ASSERT_EQ(ids.size(), 1u);
  EXPECT_TRUE(ids[0].tokens);
  EXPECT_EQ(ids[0].ids, (std::vector<int32_t>{15496, 11, 995}));
  const auto batch = parse_completion_request(R"({"prompt":["a","b c"]})").prompts;
  ASSERT_EQ(batch.size(), 2u);
  EXPECT_EQ(batch[1].text, "b c");
  const auto mixed = parse_completion_request(R"({"prompt":[[1,2],"x",[3]]})").prompts;
  ASSERT_EQ(mixed.size(), 3u);
  EXPECT_EQ(mixed[0].ids, (std::vector<int32_t>{1, 2}));
  EXPECT_FALSE(mixed[1].tokens);
  EXPECT_EQ(mixed[2].ids, (std::vector<int32_t>{3}));
  ApiLimits two;
  two.max_prompts = 2;
  EXPECT_EQ(rejection([&] { parse_completion_request(R"({"prompt":["a","b","c"]})", two); }),
            "prompt: `prompt`: a batch of 3 prompts; at most 2");
}

TEST(OpenAiCompletion, ReadsEveryParameter) {
  const OpenAiRequest r = parse_completion_request(R"({"prompt":"x","max_tokens":5,"temperature":0.3,
      "top_p":0.5,"n":3,"stop":"\n","seed":-1,"logprobs":2,"echo":true,"presence_penalty":1.5,
      "frequency_penalty":-2,"stream":true,"stream_options":{"include_usage":true},"top_k":-1,
      "repetition_penalty":1.1,"ignore_eos":true,"user":"u","best_of":1,"logit_bias":{}})");
  EXPECT_EQ(r.max_tokens, 5);
  EXPECT_TRUE(r.params.do_sample);
  EXPECT_EQ(r.params.temperature, 0.3);
  EXPECT_EQ(r.params.top_p, 0.5);
  EXPECT_EQ(r.n, 3);
  EXPECT_EQ(r.params.stop, std::vector<std::string>{"\n"});
  EXPECT_EQ(r.seed, std::numeric_limits<uint64_t>::max()) << "a negative seed keeps its bits";
  EXPECT_EQ(r.logprobs, 2);
  EXPECT_TRUE(r.echo);
  EXPECT_EQ(r.params.presence_penalty, 1.5);
  EXPECT_EQ(r.params.frequency_penalty, -2.0);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(r.params.top_k, 0) << "vLLM's -1 is off";
  EXPECT_EQ(r.params.repetition_penalty, 1.1);
  EXPECT_TRUE(r.params.ignore_eos);
}

TEST(OpenAiCompletion, TemperatureZeroOrTopPZeroIsGreedy) {
  for (const char* f : {R"({"temperature":0})", R"({"top_p":0})", R"({"temperature":0,"top_p":0.3})"}) {
    json j = json::parse(f);
    j["prompt"] = "x";
    const OpenAiRequest r = parse_completion_request(j.dump());
    EXPECT_FALSE(r.params.do_sample) << f;
    EXPECT_EQ(r.params.temperature, 1.0) << f << ": the engine wants > 0 even when it is unused";
    EXPECT_EQ(r.params.top_p, 1.0) << f;
  }
}

TEST(OpenAiCompletion, EachBadParameterIsNamed) {
  struct Case {
    const char* fields;
    const char* want;
  } cases[] = {
      {R"("temperature":2.5)", "temperature: `temperature` must be >= 0 and <= 2, got 2.5"},
      {R"("temperature":-0.1)", "temperature: `temperature` must be >= 0 and <= 2, got -0.1"},
      {R"("top_p":1.5)", "top_p: `top_p` must be >= 0 and <= 1, got 1.5"},
      {R"("presence_penalty":-3)", "presence_penalty: `presence_penalty` must be >= -2 and <= 2, got -3"},
      {R"("frequency_penalty":2.1)", "frequency_penalty: `frequency_penalty` must be >= -2 and <= 2, got 2.1"},
      {R"("n":0)", "n: `n` must be >= 1 and <= 16"},
      {R"("n":17)", "n: `n` must be >= 1 and <= 16"},
      {R"("max_tokens":0)", "max_tokens: `max_tokens` must be >= 1 and <= 2147483647"},
      {R"("max_tokens":"9")", "max_tokens: `max_tokens` must be an integer, got string"},
      {R"("stop":["a","b","c","d","e"])", "stop: `stop` supports up to 4 stop sequences. Given: 5"},
      {R"("stop":7)", "stop: `stop` must be a string or an array of strings, got number"},
      {R"("stop":"")", "stop: `stop[0]` is empty"},
      {R"("seed":"1")", "seed: `seed` must be an integer, got string"},
      {R"("logprobs":6)", "logprobs: `logprobs` must be >= 0 and <= 5"},
      {R"("logprobs":true)", "logprobs: `logprobs` must be an integer, got boolean"},
      {R"("echo":1)", "echo: `echo` must be a boolean, got number"},
      {R"("stream_options":{"include_usage":true})", "stream_options: `stream_options` is only allowed when `stream` is true"},
      {R"("stream":true,"stream_options":{"include_usage":1})",
       "stream_options.include_usage: `stream_options.include_usage` must be a boolean, got number"},
      {R"("suffix":"end")", "suffix: `suffix` is not supported"},
      {R"("best_of":2)", "best_of: `best_of` is not supported on /v1/completions: use `n`"},
      {R"("logit_bias":{"50256":-100})", "logit_bias: `logit_bias` is not supported"},
      {R"("response_format":{"type":"json_object"})",
       "response_format: `response_format`: only {\"type\": \"text\"} is supported"},
      {R"("top_k":-2)", "top_k: `top_k` must be -1 (off), 0 (off) or positive"},
      {R"("repetition_penalty":0)", "repetition_penalty: `repetition_penalty` must be strictly positive"},
      {R"("model":3)", "model: `model` must be a string, got number"},
  };
  for (const auto& c : cases) EXPECT_EQ(completion_rejection(c.fields), c.want) << "fields " << c.fields;
  EXPECT_EQ(rejection([] { parse_completion_request(R"({"prompt":[1,-2,3]})"); }),
            "prompt: `prompt`: token ids must be integers >= 0, got -2");
  EXPECT_EQ(rejection([] { parse_completion_request(R"({"prompt":["a",[1,1.5]]})"); }),
            "prompt: `prompt`[1]: token ids must be integers >= 0, got 1.5");
  EXPECT_EQ(rejection([] { parse_completion_request(R"({"prompt":["a",[]]})"); }),
            "prompt: `prompt`[1]: an empty list of token ids");
  EXPECT_EQ(rejection([] { parse_completion_request(R"({"prompt":["a",7]})"); }),
            "prompt: `prompt`[1] must be a string or a list of token ids, got number");
  EXPECT_EQ(rejection([] { parse_completion_request(R"({"prompt":5})"); }),
            "prompt: `prompt` must be a string, a list of strings, a list of token ids or a list of such lists, got number");
  EXPECT_EQ(rejection([] { parse_completion_request(R"({"prompt":[]})"); }),
            "prompt: `prompt` must be a string, a list of strings, a list of token ids or a list of such lists, got array");
}

TEST(OpenAiChat, ReadsMessagesAndParameters) {
  const OpenAiRequest r = parse_chat_request(R"({"model":"m","messages":[
      {"role":"developer","content":"Be brief."},{"role":"user","content":"Hi","name":"ann"},
      {"role":"assistant","content":[{"type":"text","text":"Hel"},{"type":"text","text":"lo"}]},
      {"role":"assistant","content":null},{"role":"user","content":"More"}],
      "max_tokens":9,"max_completion_tokens":12,"logprobs":true,"top_logprobs":3,"temperature":0,"tools":[]})");
  EXPECT_TRUE(r.chat);
  ASSERT_EQ(r.messages.size(), 5u);
  EXPECT_EQ(r.messages[0].role, "system") << "developer is OpenAI's newer name for system";
  EXPECT_EQ(r.messages[0].content, "Be brief.");
  EXPECT_EQ(r.messages[2].content, "Hello") << "text parts join";
  EXPECT_EQ(r.messages[3].content, "") << "a null content is empty";
  EXPECT_EQ(r.max_tokens, 12) << "max_completion_tokens wins over max_tokens";
  EXPECT_EQ(r.logprobs, 3);
  EXPECT_FALSE(r.params.do_sample);
  const OpenAiRequest d = parse_chat_request(R"({"messages":[{"role":"user","content":"x"}]})");
  EXPECT_FALSE(d.max_tokens.has_value()) << "chat without max_tokens: up to the context";
  EXPECT_EQ(d.logprobs, -1);
  EXPECT_EQ(parse_chat_request(R"({"messages":[{"role":"user","content":"x"}],"logprobs":true})").logprobs, 0);
}

TEST(OpenAiChat, EachBadFieldIsNamed) {
  struct Case {
    const char* body;
    const char* want;
  } cases[] = {
      {R"({})", "messages: `messages` is missing"},
      {R"({"messages":[]})", "messages: `messages` cannot be empty"},
      {R"({"messages":{"role":"user"}})", "messages: `messages` must be an array, got object"},
      {R"({"messages":["hi"]})", "messages[0]: `messages[0]` must be an object, got string"},
      {R"({"messages":[{"content":"x"}]})", "messages[0].role: `messages[0].role` is missing"},
      {R"({"messages":[{"role":"user","content":"x"},{"role":"tool","content":"y"}]})",
       "messages[1].role: `messages[1].role` must be system, user or assistant, got \"tool\""},
      {R"({"messages":[{"role":"user","content":5}]})",
       "messages[0].content: `messages[0].content` must be a string or an array of text parts, got number"},
      {R"({"messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]})",
       "messages[0].content[0].type: `messages[0].content[0].type`: only \"text\" parts are supported"},
      {R"({"messages":[{"role":"user","content":[{"type":"text"}]}]})",
       "messages[0].content[0].text: `messages[0].content[0].text` is missing"},
      {R"({"messages":[{"role":"user","content":"x"}],"top_logprobs":2})",
       "top_logprobs: `top_logprobs` needs `logprobs` set to true"},
      {R"({"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":21})",
       "top_logprobs: `top_logprobs` must be >= 0 and <= 20"},
      {R"({"messages":[{"role":"user","content":"x"}],"max_completion_tokens":0})",
       "max_completion_tokens: `max_completion_tokens` must be >= 1 and <= 2147483647"},
      {R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]})",
       "tools: `tools` are not supported"},
  };
  for (const auto& c : cases) EXPECT_EQ(chat_rejection(c.body), c.want) << "body " << c.body;
}

// ---------------------------------------------------------------------------
// Chat templates

std::vector<ChatMessage> chat(std::initializer_list<std::pair<const char*, const char*>> m) {
  std::vector<ChatMessage> out;
  for (const auto& [role, content] : m) out.push_back({role, content});
  return out;
}

TEST(ChatTemplate, Llama2IsMetasFormat) {
  EXPECT_EQ(render_chat("llama2", chat({{"user", "Hi"}})), "[INST] Hi [/INST]");
  EXPECT_EQ(render_chat("llama2", chat({{"system", "Be brief."}, {"user", "Hi"}})),
            "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]");
  const auto turns = chat({{"system", "S"}, {"user", " Hi "}, {"assistant", " Hello\n"}, {"user", "More"}});
  EXPECT_EQ(render_chat_segments("llama2", turns),
            (std::vector<std::string>{"[INST] <<SYS>>\nS\n<</SYS>>\n\n Hi [/INST] Hello ", "[INST] More [/INST]"}))
      << "each finished turn is a sequence of its own; Meta's chat_completion strips the system block and the "
         "user's text as one string, so the user's leading space stays";
  EXPECT_EQ(render_chat("llama2", turns), "[INST] <<SYS>>\nS\n<</SYS>>\n\n Hi [/INST] Hello </s><s>[INST] More [/INST]");
}

TEST(ChatTemplate, Llama2RejectsOrdersItCannotExpress) {
  EXPECT_EQ(rejection([] { render_chat("llama2", chat({{"assistant", "x"}, {"user", "y"}})); }),
            "messages[0].role: chat template llama2: roles must alternate user, assistant, user, ... (at messages[0])");
  EXPECT_EQ(rejection([] { render_chat("llama2", chat({{"user", "x"}, {"user", "y"}})); }),
            "messages[1].role: chat template llama2: roles must alternate user, assistant, user, ... (at messages[1])");
  EXPECT_EQ(rejection([] { render_chat("llama2", chat({{"user", "x"}, {"assistant", "y"}})); }),
            "messages[1].role: chat template llama2: the last message must be the user's (at messages[1])");
  EXPECT_EQ(rejection([] { render_chat("llama2", chat({{"system", "x"}})); }),
            "messages[0].role: chat template llama2: a user message must follow the system message (at messages[0])");
  EXPECT_EQ(rejection([] { render_chat("llama2", chat({{"user", "x"}, {"assistant", "y"}, {"system", "z"}})); }),
            "messages[2].role: chat template llama2: roles must alternate user, assistant, user, ... (at messages[2])");
}

TEST(ChatTemplate, ChatmlAndPlain) {
  const auto m = chat({{"system", "S"}, {"user", "Hi"}, {"assistant", "Yo"}, {"user", "Again"}});
  EXPECT_EQ(render_chat("chatml", m),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n"
            "<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(render_chat("plain", m), "System: S\nUser: Hi\nAssistant: Yo\nUser: Again\nAssistant:");
  EXPECT_EQ(render_chat_segments("plain", m).size(), 1u);
  EXPECT_EQ(render_chat_segments("chatml", m).size(), 1u);
}

TEST(ChatTemplate, UnknownNameIsAConfigErrorNamingIt) {
  try {
    render_chat("vicuna", chat({{"user", "x"}}));
    FAIL() << "an unknown template rendered";
  } catch (const ValidationError& e) {
    FAIL() << "an unknown template is the server's configuration, not the request's: " << e.what();
  } catch (const core::InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()), "chat template 'vicuna' is unknown (known: llama2, chatml, plain)");
  }
  EXPECT_NO_THROW(check_chat_template("chatml"));
  EXPECT_THROW(check_chat_template(""), core::InvalidArgument);
}

// ---------------------------------------------------------------------------
// Lengths

TEST(Lengths, TgisChecksAndMessages) {
  EXPECT_EQ(resolve_max_new_tokens(10, 20, 100, 200, false, "inputs"), 20);
  EXPECT_EQ(resolve_max_new_tokens(10, std::nullopt, 100, 200, false, "inputs"), 190) << "absent: up to max_total";
  EXPECT_EQ(rejection([] { resolve_max_new_tokens(190, 20, 199, 200, false, "inputs"); }),
            "max_new_tokens: `inputs` tokens + `max_new_tokens` must be <= 200. Given: 190 `inputs` tokens and 20 "
            "`max_new_tokens`");
  EXPECT_EQ(rejection([] { resolve_max_new_tokens(150, 10, 100, 200, false, "inputs"); }),
            "inputs: `inputs` must have less than 100 tokens. Given: 150");
  EXPECT_EQ(rejection([] { resolve_max_new_tokens(250, 10, 100, 200, false, "inputs"); }).substr(0, 16),
            "max_new_tokens: ")
      << "TGI checks the total before the input";
  EXPECT_EQ(rejection([] { resolve_max_new_tokens(200, std::nullopt, 200, 200, false, "inputs"); }),
            "inputs: `inputs` tokens + `max_new_tokens` must be <= 200. Given: 200 `inputs` tokens and 1 `max_new_tokens`")
      << "no room for one token";
}

TEST(Lengths, OpenAisMessages) {
  EXPECT_EQ(resolve_max_new_tokens(10, std::nullopt, 100, 200, true, "messages"), 190);
  EXPECT_EQ(rejection([] { resolve_max_new_tokens(150, 10, 100, 200, true, "messages"); }),
            "messages: This model's maximum input length is 100 tokens. However, your messages has 150 tokens. Please "
            "reduce the length of the messages.");
  EXPECT_EQ(rejection([] { resolve_max_new_tokens(50, 160, 100, 200, true, "prompt"); }),
            "max_tokens: This model's maximum context length is 200 tokens. However, you requested 210 tokens (50 in "
            "the prompt, 160 in the completion). Please reduce the length of the prompt or completion.");
}

// ---------------------------------------------------------------------------
// Responses

GeneratedToken token(int32_t id, const char* text, float logprob, bool special = false) {
  GeneratedToken t;
  t.id = id;
  t.text = text;
  t.logprob = logprob;
  t.special = special;
  return t;
}

Generation generation() {
  Generation g;
  g.text = " world!";
  g.tokens = {token(995, " world", -0.5f), token(0, "!", -0.25f)};
  g.finish = Finish::kLength;
  g.seed = 42;
  g.prompt_tokens = 3;
  return g;
}

TEST(Responses, FinishReasons) {
  EXPECT_STREQ(tgi_finish_reason(Finish::kLength), "length");
  EXPECT_STREQ(tgi_finish_reason(Finish::kEos), "eos_token");
  EXPECT_STREQ(tgi_finish_reason(Finish::kStop), "stop_sequence");
  EXPECT_STREQ(openai_finish_reason(Finish::kLength), "length");
  EXPECT_STREQ(openai_finish_reason(Finish::kEos), "stop");
  EXPECT_STREQ(openai_finish_reason(Finish::kStop), "stop");
}

TEST(Responses, TgiGenerateIsTgisShape) {
  const Generation g = generation();
  EXPECT_EQ(tgi_generate_response(g, "", true), json::parse(R"({"generated_text":" world!","details":{
      "finish_reason":"length","generated_tokens":2,"seed":42,"prefill":[],
      "tokens":[{"id":995,"text":" world","logprob":-0.5,"special":false},
                {"id":0,"text":"!","logprob":-0.25,"special":false}]}})"));
  EXPECT_EQ(tgi_generate_response(g, "Hello", false), json::parse(R"({"generated_text":"Hello world!"})"))
      << "without details TGI leaves the key out; return_full_text puts the prompt first";
  Generation greedy = g;
  greedy.seed.reset();
  Generation other = g;
  other.text = "?";
  other.finish = Finish::kEos;
  const json j = tgi_generate_response(greedy, "", true, json::array(), {other});
  EXPECT_EQ(j["details"]["seed"], nullptr) << "a greedy request reports no seed";
  ASSERT_EQ(j["details"]["best_of_sequences"].size(), 1u) << j.dump();
  EXPECT_EQ(j["details"]["best_of_sequences"][0]["generated_text"], "?");
  EXPECT_EQ(j["details"]["best_of_sequences"][0]["finish_reason"], "eos_token");
}

TEST(Responses, TgiStreamEvents) {
  const Generation g = generation();
  EXPECT_EQ(tgi_stream_event(1, g.tokens[0], " world"), json::parse(R"({"index":1,
      "token":{"id":995,"text":" world","logprob":-0.5,"special":false},"generated_text":null,"details":null})"));
  EXPECT_EQ(tgi_stream_event(2, g.tokens[1], "!", &g, "Hi", true), json::parse(R"({"index":2,
      "token":{"id":0,"text":"!","logprob":-0.25,"special":false},"generated_text":"Hi world!",
      "details":{"finish_reason":"length","generated_tokens":2,"seed":42,"input_length":3}})"));
  EXPECT_EQ(tgi_stream_event(2, g.tokens[1], "!", &g, "", false)["details"], nullptr);
  EXPECT_EQ(sse_event(json{{"a", 1}}, false), "data:{\"a\":1}\n\n");
  EXPECT_EQ(sse_event(json{{"a", 1}}, true), "data: {\"a\":1}\n\n");
}

TEST(Responses, OpenAiCompletionAndChat) {
  const OpenAiMeta m{"cmpl-1", "gpt2", 1700000000};
  const Generation g = generation();
  EXPECT_EQ(completion_response(m, {g}, 3, -1), json::parse(R"({"id":"cmpl-1","object":"text_completion",
      "created":1700000000,"model":"gpt2","system_fingerprint":"pagedoptim",
      "choices":[{"index":0,"text":" world!","logprobs":null,"finish_reason":"length"}],
      "usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}})"));
  Generation ge = g;
  ge.echo = "Hello";
  const json lp = completion_response(m, {ge}, 3, 1)["choices"][0];
  EXPECT_EQ(lp["text"], "Hello world!") << "echo";
  EXPECT_EQ(lp["logprobs"], json::parse(R"({"tokens":[" world","!"],"token_logprobs":[-0.5,-0.25],
      "top_logprobs":[{" world":-0.5},{"!":-0.25}],"text_offset":[5,11]})"));
  // With the prompt scored (echo and logprobs): its tokens lead, the first null.
  Generation gp = ge;
  gp.prompt.resize(2);
  gp.prompt[0].text = "Hel";
  gp.prompt[0].logprob = std::numeric_limits<float>::quiet_NaN();
  gp.prompt[1].text = "lo";
  gp.prompt[1].logprob = -2;
  EXPECT_EQ(completion_response(m, {gp}, 3, 1)["choices"][0]["logprobs"],
            json::parse(R"({"tokens":["Hel","lo"," world","!"],"token_logprobs":[null,-2,-0.5,-0.25],
      "top_logprobs":[null,{"lo":-2},{" world":-0.5},{"!":-0.25}],"text_offset":[0,3,5,11]})"));
  Generation g2 = g;
  g2.finish = Finish::kStop;
  EXPECT_EQ(chat_response(m, {g, g2}, -1), json::parse(R"({"id":"cmpl-1","object":"chat.completion",
      "created":1700000000,"model":"gpt2","system_fingerprint":"pagedoptim",
      "choices":[{"index":0,"message":{"role":"assistant","content":" world!"},"logprobs":null,"finish_reason":"length"},
                 {"index":1,"message":{"role":"assistant","content":" world!"},"logprobs":null,"finish_reason":"stop"}],
      "usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}})"))
      << "the prompt counts once for n choices";
  EXPECT_EQ(chat_response(m, {g}, 0)["choices"][0]["logprobs"], json::parse(R"({"content":[
      {"token":" world","logprob":-0.5,"bytes":[32,119,111,114,108,100],"top_logprobs":[]},
      {"token":"!","logprob":-0.25,"bytes":[33],"top_logprobs":[]}]})"));
}

// OpenAI's alternatives: the engine's likeliest tokens named by the
// tokenizer, the chosen one always listed (up to logprobs + 1 entries).
TEST(Responses, LogprobAlternatives) {
  const OpenAiMeta m{"cmpl-1", "gpt2", 1};
  Generation g = generation();
  // Log-probabilities exact in float and double, so that the JSON compares equal.
  g.tokens[0].top = {{7, -0.125f}, {995, -0.5f}, {8, -0.875f}};  // the chosen token second
  g.tokens[1].top = {{5, -0.0625f}, {6, -0.03125f}};             // the chosen token not among them
  const TokenText text_of = [](int32_t id) { return std::string(1, 't') + std::to_string(id); };
  EXPECT_EQ(completion_response(m, {g}, 3, 2, text_of)["choices"][0]["logprobs"]["top_logprobs"],
            json::parse(R"([{"t7":-0.125," world":-0.5},{"t5":-0.0625,"t6":-0.03125,"!":-0.25}])"));
  const json content = chat_response(m, {g}, 1, text_of)["choices"][0]["logprobs"]["content"];
  EXPECT_EQ(content[0]["top_logprobs"], json::parse(R"([{"token":"t7","logprob":-0.125,"bytes":[116,55]},
      {"token":" world","logprob":-0.5,"bytes":[32,119,111,114,108,100]}])"))
      << "top_logprobs 1: the likeliest, then the chosen one";
  EXPECT_EQ(content[1]["top_logprobs"].size(), 2u) << content.dump();
  EXPECT_EQ(parse_completion_request(R"({"logprobs":3})").params.top_logprobs, 3) << "the engine is asked for them";
  EXPECT_EQ(parse_chat_request(R"({"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":4})")
                .params.top_logprobs,
            4);
  EXPECT_EQ(parse_completion_request(R"({})").params.top_logprobs, 0);
}

TEST(Responses, OpenAiChunks) {
  const OpenAiMeta m{"chatcmpl-1", "gpt2", 5};
  const std::string head = R"("id":"chatcmpl-1","created":5,"model":"gpt2","system_fingerprint":"pagedoptim",)";
  EXPECT_EQ(chat_chunk(m, 0, true, "", {}, Finish::kNone, -1, false),
            json::parse("{" + head + R"("object":"chat.completion.chunk",
      "choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]})"));
  EXPECT_EQ(chat_chunk(m, 1, false, "Hi", {}, Finish::kNone, -1, true),
            json::parse("{" + head + R"("object":"chat.completion.chunk",
      "choices":[{"index":1,"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null}],"usage":null})"));
  EXPECT_EQ(chat_chunk(m, 0, false, "", {}, Finish::kEos, -1, false)["choices"][0],
            json::parse(R"({"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"})"))
      << "the last chunk's delta is empty";
  EXPECT_EQ(completion_chunk(m, 0, "ab", {}, Finish::kLength, -1, false),
            json::parse("{" + head + R"("object":"text_completion",
      "choices":[{"index":0,"text":"ab","logprobs":null,"finish_reason":"length"}]})"));
  EXPECT_EQ(usage_chunk(m, true, 4, 6), json::parse("{" + head + R"("object":"chat.completion.chunk",
      "choices":[],"usage":{"prompt_tokens":4,"completion_tokens":6,"total_tokens":10}})"));
}

TEST(Responses, ErrorShapes) {
  EXPECT_EQ(tgi_error("Model is overloaded", "overloaded"),
            json::parse(R"({"error":"Model is overloaded","error_type":"overloaded"})"));
  EXPECT_EQ(openai_error("bad", "invalid_request_error", "temperature", ""),
            json::parse(R"({"error":{"message":"bad","type":"invalid_request_error","param":"temperature","code":null}})"));
  EXPECT_EQ(openai_error("no key", "invalid_request_error", "", "invalid_api_key"),
            json::parse(R"({"error":{"message":"no key","type":"invalid_request_error","param":null,"code":"invalid_api_key"}})"));
}

// A token's own bytes may end inside a character: replaced, never thrown.
TEST(Responses, InvalidUtf8IsReplacedNotThrown) {
  const GeneratedToken t = token(1, "\xe4\xbd", -1.0f);
  std::string out;
  ASSERT_NO_THROW(out = dump_json(tgi_token_json(t, t.text)));
  EXPECT_NE(out.find("\xef\xbf\xbd"), std::string::npos) << out;
  EXPECT_EQ(json::parse(out)["id"], 1) << "the replaced text still parses: " << out;
}

}  // namespace
}  // namespace po::serve
