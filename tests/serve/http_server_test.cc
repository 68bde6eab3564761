// `pagedoptim serve`'s HTTP layer over real sockets on 127.0.0.1: a tiny
// random GPT-2 behind an Engine and an HttpServer on a free port, driven by
// httplib's client and raw sockets. Every route's status and JSON shape, the
// SSE framing of both families, greedy results equal to `generate`'s and the
// same streamed or not, and bad input (malformed JSON, wrong types, limits,
// unknown routes and methods, a big body, a slow-loris client, API keys,
// overload, a client that hangs up): each answered in its family's shape,
// the server still serving after it. A tiny Llama checks the llama2 chat
// template's ids (BOS before each turn, EOS between) and /tokenize's BOS.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../data/llama_test_util.h"
#include "data/text_tokenizer.h"
#include "model/transformer.h"
#include "serve/api.h"
#include "serve/engine.h"
#include "core/http_lib.h"
#include "serve/http_server.h"
#include "serve/generate.h"
#include "serve_adapters.h"

namespace po::serve {
namespace {

using json = nlohmann::json;
using model::Transformer;
using model::TransformerConfig;

TransformerConfig tiny_gpt2() {
  TransformerConfig c = TransformerConfig::arch_defaults("gpt2");
  c.n_layer = 2;
  c.n_embd = 32;
  c.n_head = 4;
  c.vocab_size = 50257;
  c.seq_len = 96;
  c.fill_derived();
  return c;
}

// One model, tokenizer and engine for the suite; servers around it per need.
struct World {
  TransformerConfig config = tiny_gpt2();
  std::unique_ptr<data::TextTokenizer> tok = data::load_tokenizer(PO_SOURCE_DIR);
  Transformer model{config, 2, config.seq_len};
  Transformer reference{config, 1, config.seq_len};  // for serve::sample, `generate`'s decode
  std::unique_ptr<Engine> engine;
  std::unique_ptr<HttpServer> server;

  World() {
    model.init_random(11);
    reference.init_random(11);
    EngineOptions eo;
    eo.block_size = 8;
    eo.max_concurrent_requests = 6;
    engine = std::make_unique<Engine>(model, *tok, eo);
    server = start(HttpServerOptions{});
  }
  std::unique_ptr<HttpServer> start(HttpServerOptions o, Engine* e = nullptr) {
    o.port = 0;
    o.model_id = "tiny-gpt2";
    auto s = std::make_unique<HttpServer>(e ? *e : *engine, o);
    s->start();
    return s;
  }
};
World* world = nullptr;

class HttpServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!world) world = new World();
  }
  static void TearDownTestSuite() {
    delete world;
    world = nullptr;
  }
  static int port() { return world->server->port(); }
  static httplib::Client client(int p = 0) {
    httplib::Client c("127.0.0.1", p ? p : port());
    c.set_read_timeout(std::chrono::seconds(20));
    return c;
  }
  static httplib::Result post(const std::string& path, const std::string& body, int p = 0,
                              const httplib::Headers& h = {}) {
    return client(p).Post(path.c_str(), h, body, "application/json");
  }
  static httplib::Result get(const std::string& path, int p = 0, const httplib::Headers& h = {}) {
    return client(p).Get(path.c_str(), h);
  }
  // The server answers a plain request: it kept serving after whatever came before.
  static void expect_alive(const std::string& after, int p = 0) {
    auto r = get("/health", p);
    ASSERT_TRUE(r) << "no answer after " << after << ": " << httplib::to_string(r.error());
    EXPECT_EQ(r->status, 200) << "after " << after << ": " << r->body;
  }
};

// The events of an SSE body: each "data:" line of a "\n\n"-ended block.
std::vector<std::string> sse_data(const std::string& body, std::string* framing_error) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < body.size()) {
    const size_t end = body.find("\n\n", at);
    if (end == std::string::npos) {
      *framing_error = "an event not ended by a blank line: " + body.substr(at);
      return out;
    }
    const std::string block = body.substr(at, end - at);
    if (!block.starts_with("data:")) {
      *framing_error = "an event without data: " + block;
      return out;
    }
    std::string data = block.substr(5);
    if (data.starts_with(" ")) data.erase(0, 1);
    out.push_back(data);
    at = end + 2;
  }
  return out;
}

// A TGI error body of `type`, or what differs.
std::string tgi_error_shape(const std::string& body, const std::string& type) {
  const json j = json::parse(body, nullptr, false);
  if (j.is_discarded()) return "not JSON: " + body;
  if (!j.is_object() || !j.contains("error") || !j["error"].is_string() || j.value("error_type", "") != type)
    return "not {\"error\": str, \"error_type\": \"" + type + "\"}: " + body;
  return "";
}
std::string openai_error_shape(const std::string& body, const std::string& type) {
  const json j = json::parse(body, nullptr, false);
  if (j.is_discarded()) return "not JSON: " + body;
  if (!j.is_object() || !j.contains("error") || !j["error"].is_object()) return "no error object: " + body;
  const json& e = j["error"];
  for (const char* k : {"message", "type", "param", "code"})
    if (!e.contains(k)) return std::string("error has no ") + k + ": " + body;
  if (e["type"] != type) return "error type is not " + type + ": " + body;
  return "";
}

std::vector<int32_t> prompt_ids(const std::string& text) { return world->tok->encode(text); }

// The text of `ids` up to the first end-of-text (where the server stops; generate goes on).
std::string text_until_eos(const std::vector<int32_t>& ids) {
  std::vector<int32_t> kept;
  for (int32_t id : ids) {
    if (id == world->tok->eos_id()) break;
    kept.push_back(id);
  }
  return world->tok->decode(kept);
}

// ---------------------------------------------------------------------------
// Routes

TEST_F(HttpServerTest, InfoHealthModelsMetrics) {
  auto h = get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200) << h->body;
  auto p = get("/ping");
  ASSERT_TRUE(p);
  EXPECT_EQ(p->status, 200);
  auto i = get("/info");
  ASSERT_TRUE(i);
  ASSERT_EQ(i->status, 200) << i->body;
  const json info = json::parse(i->body);
  EXPECT_EQ(info["model_id"], "tiny-gpt2");
  EXPECT_EQ(info["max_concurrent_requests"], 6);
  EXPECT_EQ(info["max_total_tokens"], 96);
  EXPECT_EQ(info["max_input_tokens"], 95);
  EXPECT_EQ(info["model_dtype"], "float32");
  EXPECT_EQ(info["model_device_type"], "cpu");
  EXPECT_TRUE(info["version"].is_string()) << i->body;
  auto m = get("/v1/models");
  ASSERT_TRUE(m);
  ASSERT_EQ(m->status, 200);
  const json models = json::parse(m->body);
  EXPECT_EQ(models["object"], "list");
  ASSERT_EQ(models["data"].size(), 1u) << m->body;
  EXPECT_EQ(models["data"][0]["id"], "tiny-gpt2");
  EXPECT_EQ(models["data"][0]["object"], "model");
  EXPECT_EQ(models["data"][0]["owned_by"], "pagedoptim");
  auto x = get("/metrics");
  ASSERT_TRUE(x);
  EXPECT_EQ(x->status, 200);
  EXPECT_EQ(x->get_header_value("Content-Type"), "text/plain; version=0.0.4");
  EXPECT_NE(x->body.find("tgi_request_count"), std::string::npos) << x->body.substr(0, 300);
}

TEST_F(HttpServerTest, GenerateIsGreedyGeneratesTokensWithTgisShape) {
  auto r = post("/generate", R"({"inputs":"Hello world","parameters":{"max_new_tokens":12}})");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(r->get_header_value("x-compute-type"), "cpu");
  const json j = json::parse(r->body);
  ASSERT_TRUE(j.contains("details")) << r->body;
  const json& d = j["details"];
  EXPECT_EQ(d["seed"], nullptr) << "greedy";
  EXPECT_EQ(d["prefill"], json::array());
  const auto n = d["tokens"].size();
  EXPECT_EQ(r->get_header_value("x-generated-tokens"), std::to_string(n));
  // TGI's timing headers, in whole milliseconds: total = validation + queue + inference (each rounded down).
  int64_t parts = 0;
  for (const char* h : {"x-validation-time", "x-queue-time", "x-inference-time"}) {
    const std::string v = r->get_header_value(h);
    ASSERT_FALSE(v.empty()) << h << " missing";
    parts += std::stoll(v);
  }
  const int64_t total = std::stoll(r->get_header_value("x-total-time"));
  EXPECT_LE(parts, total) << "validation + queue + inference exceed the total";
  EXPECT_GE(parts + 3, total) << "validation + queue + inference fall short of the total";
  EXPECT_EQ(d["generated_tokens"], n);
  std::vector<int32_t> got;
  for (const auto& t : d["tokens"]) {
    ASSERT_TRUE(t.contains("id") && t.contains("text") && t.contains("logprob") && t.contains("special")) << t;
    got.push_back(t["id"].get<int32_t>());
  }
  serve::SampleOptions so;
  so.temperature = 0;
  so.max_new_tokens = 12;
  const std::vector<int32_t> want = serve::sample(world->reference, prompt_ids("Hello world"), so);
  ASSERT_LE(got.size(), want.size());
  for (size_t k = 0; k < got.size(); ++k) EXPECT_EQ(got[k], want[k]) << "token " << k << " differs from generate's";
  if (d["finish_reason"] == "length") {
    EXPECT_EQ(got.size(), 12u);
  } else {
    EXPECT_EQ(d["finish_reason"], "eos_token") << r->body;
  }
  EXPECT_EQ(j["generated_text"], text_until_eos(got)) << "generated_text is the decode of the tokens";
}

TEST_F(HttpServerTest, GenerateStreamHasTgisEventsAndTheSameText) {
  const std::string body = R"({"inputs":"The cat","parameters":{"max_new_tokens":10}})";
  auto plain = post("/generate", body);
  ASSERT_TRUE(plain);
  ASSERT_EQ(plain->status, 200) << plain->body;
  auto s = post("/generate_stream", body);
  ASSERT_TRUE(s);
  ASSERT_EQ(s->status, 200) << s->body;
  EXPECT_EQ(s->get_header_value("Content-Type"), "text/event-stream");
  std::string err;
  const auto events = sse_data(s->body, &err);
  ASSERT_EQ(err, "");
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(s->body.find("[DONE]"), std::string::npos) << "TGI's stream ends without [DONE]";
  EXPECT_TRUE(s->body.starts_with("data:{")) << "TGI writes no space after data:";
  std::string text;
  for (size_t i = 0; i < events.size(); ++i) {
    const json e = json::parse(events[i]);
    EXPECT_EQ(e["index"], i + 1) << events[i];
    ASSERT_TRUE(e["token"].is_object()) << events[i];
    text += e["token"]["text"].get<std::string>();
    const bool last = i + 1 == events.size();
    EXPECT_EQ(e["generated_text"].is_null(), !last) << events[i];
    EXPECT_EQ(e["details"].is_null(), !last) << events[i];
    if (last) {
      EXPECT_EQ(e["generated_text"], text) << "the events' texts add up to generated_text";
      EXPECT_EQ(e["details"]["generated_tokens"], events.size());
      EXPECT_EQ(e["details"]["input_length"], prompt_ids("The cat").size());
      EXPECT_TRUE(e["details"].contains("finish_reason") && e["details"].contains("seed")) << events[i];
    }
  }
  EXPECT_EQ(text, json::parse(plain->body)["generated_text"]) << "streaming and not give the same greedy text";
}

TEST_F(HttpServerTest, CompatRouteAnswersAnArrayOrAStream) {
  auto a = post("/", R"({"inputs":"Hi","parameters":{"max_new_tokens":3}})");
  ASSERT_TRUE(a);
  ASSERT_EQ(a->status, 200) << a->body;
  const json arr = json::parse(a->body);
  ASSERT_TRUE(arr.is_array() && arr.size() == 1u) << a->body;
  EXPECT_TRUE(arr[0].contains("generated_text"));
  auto s = post("/", R"({"inputs":"Hi","parameters":{"max_new_tokens":3},"stream":true})");
  ASSERT_TRUE(s);
  ASSERT_EQ(s->status, 200) << s->body;
  std::string err;
  const auto events = sse_data(s->body, &err);
  ASSERT_EQ(err, "");
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(json::parse(events.back())["generated_text"], arr[0]["generated_text"]);
}

TEST_F(HttpServerTest, ReturnFullTextAndSampledSeeds) {
  auto r = post("/generate", R"({"inputs":"Once","parameters":{"max_new_tokens":4,"return_full_text":true,
      "do_sample":true,"seed":5,"top_k":20}})");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  EXPECT_TRUE(j["generated_text"].get<std::string>().starts_with("Once")) << r->body;
  EXPECT_EQ(j["details"]["seed"], 5);
  auto again = post("/generate", R"({"inputs":"Once","parameters":{"max_new_tokens":4,"return_full_text":true,
      "do_sample":true,"seed":5,"top_k":20}})");
  ASSERT_TRUE(again);
  EXPECT_EQ(json::parse(again->body)["generated_text"], j["generated_text"]) << "a seed reproduces";
  auto best = post("/generate", R"({"inputs":"Once","parameters":{"max_new_tokens":4,"best_of":2,"do_sample":true}})");
  ASSERT_TRUE(best);
  ASSERT_EQ(best->status, 200) << best->body;
  EXPECT_EQ(json::parse(best->body)["details"]["best_of_sequences"].size(), 1u) << best->body;
}

// A stop sequence taken from the middle of the greedy text (it may span
// tokens): every route and mode ends the text just before it, nothing of it
// streamed.
TEST_F(HttpServerTest, StopSequencesEndEveryRouteAlike) {
  auto full = post("/generate", R"({"inputs":"The cat","parameters":{"max_new_tokens":12}})");
  ASSERT_TRUE(full);
  ASSERT_EQ(full->status, 200) << full->body;
  const std::string text = json::parse(full->body)["generated_text"];
  size_t at = std::string::npos;
  for (size_t p = 3; p + 2 <= text.size() && at == std::string::npos; ++p)
    if (text.find(text.substr(p, 2)) == p && (static_cast<unsigned char>(text[p]) & 0xC0) != 0x80) at = p;
  // (The model and its seed are fixed, so this holds or fails every run: a
  // failure, never a skip.)
  ASSERT_NE(at, std::string::npos) << "no stop sequence that occurs once in " << text;
  const std::string stop = text.substr(at, 2), want = text.substr(0, at);
  const json stop_json = json::array({stop});

  json tgi = {{"inputs", "The cat"}, {"parameters", {{"max_new_tokens", 12}, {"stop", stop_json}}}};
  auto plain = post("/generate", tgi.dump());
  ASSERT_TRUE(plain);
  ASSERT_EQ(plain->status, 200) << plain->body;
  const json pj = json::parse(plain->body);
  EXPECT_EQ(pj["generated_text"], want) << "stop " << json(stop);
  EXPECT_EQ(pj["details"]["finish_reason"], "stop_sequence");

  auto s = post("/generate_stream", tgi.dump());
  ASSERT_TRUE(s);
  std::string err, streamed;
  const auto events = sse_data(s->body, &err);
  ASSERT_EQ(err, "");
  ASSERT_FALSE(events.empty());
  for (const auto& e : events) streamed += json::parse(e)["token"]["text"].get<std::string>();
  const json last = json::parse(events.back());
  EXPECT_EQ(streamed, want) << "the events' texts: " << s->body;
  EXPECT_EQ(last["generated_text"], want);
  EXPECT_EQ(last["details"]["finish_reason"], "stop_sequence");
  EXPECT_EQ(last["details"]["generated_tokens"], pj["details"]["generated_tokens"]);

  json oai = {{"prompt", "The cat"}, {"max_tokens", 12}, {"temperature", 0}, {"stop", stop}, {"stream", true}};
  auto o = post("/v1/completions", oai.dump());
  ASSERT_TRUE(o);
  std::string otext, finish;
  for (const auto& e : sse_data(o->body, &err)) {
    if (e == "[DONE]") continue;
    const json c = json::parse(e);
    otext += c["choices"][0]["text"].get<std::string>();
    if (!c["choices"][0]["finish_reason"].is_null()) finish = c["choices"][0]["finish_reason"];
  }
  EXPECT_EQ(otext, want);
  EXPECT_EQ(finish, "stop");
}

// decoder_input_details: the prompt's tokens with their log-probabilities
// (the first null: nothing before it); OpenAI's echo with logprobs puts the
// same numbers first in `logprobs`.
TEST_F(HttpServerTest, DecoderInputDetailsScoreThePrompt) {
  auto r = post("/generate", R"({"inputs":"Hello world, again","parameters":{"max_new_tokens":2,
      "decoder_input_details":true,"details":false}})");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json prefill = json::parse(r->body)["details"]["prefill"];
  const auto ids = prompt_ids("Hello world, again");
  ASSERT_EQ(prefill.size(), ids.size()) << r->body;
  ASSERT_GE(ids.size(), 3u);
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(prefill[i]["id"], ids[i]);
    text += prefill[i]["text"].get<std::string>();
    if (i == 0) {
      EXPECT_TRUE(prefill[i]["logprob"].is_null()) << r->body;
    } else {
      ASSERT_TRUE(prefill[i]["logprob"].is_number()) << "prompt token " << i << ": " << r->body;
      EXPECT_LE(prefill[i]["logprob"].get<double>(), 0.0) << r->body;
    }
  }
  EXPECT_EQ(text, "Hello world, again");
  auto o = post("/v1/completions", R"({"prompt":"Hello world, again","max_tokens":2,"echo":true,"logprobs":1,"temperature":0})");
  ASSERT_TRUE(o);
  ASSERT_EQ(o->status, 200) << o->body;
  const json lp = json::parse(o->body)["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), ids.size() + 2) << "the prompt's tokens, then the 2 made: " << o->body;
  EXPECT_TRUE(lp["token_logprobs"][0].is_null()) << o->body;
  EXPECT_TRUE(lp["top_logprobs"][0].is_null()) << o->body;
  EXPECT_EQ(lp["text_offset"][0], 0) << o->body;
  for (size_t i = 1; i < ids.size(); ++i) {
    EXPECT_NEAR(lp["token_logprobs"][i].get<double>(), prefill[i]["logprob"].get<double>(), 1e-5)
        << "prompt token " << i << ": TGI's and OpenAI's scores differ";
    // The likeliest token, and the prompt's own if it is not that (OpenAI: up to logprobs + 1).
    EXPECT_GE(lp["top_logprobs"][i].size(), 1u) << o->body;
    EXPECT_LE(lp["top_logprobs"][i].size(), 2u) << o->body;
    EXPECT_TRUE(lp["top_logprobs"][i].contains(lp["tokens"][i].get<std::string>())) << o->body;
  }
  EXPECT_EQ(lp["text_offset"][ids.size()], std::string("Hello world, again").size()) << o->body;
  // Streamed: the echo's chunk carries the prompt's scores, the output's follow.
  auto s = post("/v1/completions", R"({"prompt":"Hello world, again","max_tokens":2,"echo":true,"logprobs":1,
      "temperature":0,"stream":true})");
  ASSERT_TRUE(s);
  ASSERT_EQ(s->status, 200) << s->body;
  std::string err, streamed;
  json tokens = json::array(), lps = json::array();
  for (const auto& e : sse_data(s->body, &err)) {
    if (e == "[DONE]") continue;
    const json c = json::parse(e)["choices"][0];
    streamed += c["text"].get<std::string>();
    if (c["logprobs"].is_null()) continue;
    for (const auto& t : c["logprobs"]["tokens"]) tokens.push_back(t);
    for (const auto& l : c["logprobs"]["token_logprobs"]) lps.push_back(l);
  }
  EXPECT_EQ(err, "");
  EXPECT_EQ(streamed, json::parse(o->body)["choices"][0]["text"]) << s->body;
  EXPECT_EQ(tokens, lp["tokens"]) << s->body;
  ASSERT_EQ(lps.size(), lp["token_logprobs"].size()) << s->body;
  EXPECT_TRUE(lps[0].is_null()) << s->body;
  for (size_t i = 1; i < lps.size(); ++i)
    EXPECT_NEAR(lps[i].get<double>(), lp["token_logprobs"][i].get<double>(), 1e-5) << "streamed token " << i;
}

// A batch of prompts, as text and as token ids, with n = 2: choice k·2 + j
// is prompt k's j-th; a prompt given as ids completes as its text does; echo
// gives each its own prompt; usage counts each prompt once; streamed, the
// chunks carry the same indices and texts. An id outside the vocabulary is
// a 400 naming the prompt.
TEST_F(HttpServerTest, CompletionsTakeABatchOfTextAndTokenIdPrompts) {
  const auto ids = prompt_ids("A B C");
  json ids_json = json::array();
  for (int32_t id : ids) ids_json.push_back(id);
  json body = {{"prompt", json::array({"The cat", ids_json})}, {"max_tokens", 6}, {"temperature", 0},
               {"n", 2}, {"echo", true}};
  auto r = post("/v1/completions", body.dump());
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  ASSERT_EQ(j["choices"].size(), 4u) << r->body;
  for (size_t c = 0; c < 4; ++c) EXPECT_EQ(j["choices"][c]["index"], c);
  EXPECT_EQ(j["usage"]["prompt_tokens"], prompt_ids("The cat").size() + ids.size()) << r->body;
  auto single = [&](const std::string& prompt) {
    auto o = post("/v1/completions", json{{"prompt", prompt}, {"max_tokens", 6}, {"temperature", 0}}.dump());
    EXPECT_TRUE(o && o->status == 200);
    return json::parse(o->body)["choices"][0]["text"].get<std::string>();
  };
  const std::string cat = single("The cat"), abc = single("A B C");
  EXPECT_EQ(j["choices"][0]["text"], "The cat" + cat);
  EXPECT_EQ(j["choices"][1]["text"], "The cat" + cat);
  EXPECT_EQ(j["choices"][2]["text"], "A B C" + abc) << "the ids' prompt, echoed as their text, completes as the text";
  EXPECT_EQ(j["choices"][3]["text"], "A B C" + abc);

  body["stream"] = true;
  auto s = post("/v1/completions", body.dump());
  ASSERT_TRUE(s);
  ASSERT_EQ(s->status, 200) << s->body;
  std::string err;
  std::vector<std::string> texts(4);
  for (const auto& e : sse_data(s->body, &err)) {
    if (e == "[DONE]") continue;
    const json c = json::parse(e);
    texts.at(c["choices"][0]["index"].get<size_t>()) += c["choices"][0]["text"].get<std::string>();
  }
  EXPECT_EQ(err, "");
  for (size_t c = 0; c < 4; ++c) EXPECT_EQ(texts[c], j["choices"][c]["text"]) << "streamed choice " << c;

  auto bad = post("/v1/completions", R"({"prompt":["x",[1,99999999]],"max_tokens":2})");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400) << bad->body;
  EXPECT_EQ(openai_error_shape(bad->body, "invalid_request_error"), "") << bad->body;
  EXPECT_NE(bad->body.find("`prompt[1]`: token id 99999999 is outside the vocabulary"), std::string::npos) << bad->body;
}

TEST_F(HttpServerTest, TokenizeGivesIdsAndOffsets) {
  auto r = post("/tokenize", R"({"inputs":"Hello world"})");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  const auto ids = prompt_ids("Hello world");
  ASSERT_EQ(j.size(), ids.size()) << r->body;
  std::string joined;
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(j[i]["id"], ids[i]);
    EXPECT_EQ(j[i]["start"], joined.size());
    joined += j[i]["text"].get<std::string>();
    EXPECT_EQ(j[i]["stop"], joined.size());
  }
  EXPECT_EQ(joined, "Hello world");
}

TEST_F(HttpServerTest, CompletionsStreamedOrNotGiveTheSameText) {
  const std::string body = R"({"model":"x","prompt":"A B C","max_tokens":8,"temperature":0})";
  auto r = post("/v1/completions", body);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["model"], "tiny-gpt2");
  EXPECT_TRUE(j["id"].get<std::string>().starts_with("cmpl-")) << r->body;
  ASSERT_EQ(j["choices"].size(), 1u);
  const std::string text = j["choices"][0]["text"];
  const int64_t completion = j["usage"]["completion_tokens"];
  EXPECT_EQ(j["usage"]["prompt_tokens"], prompt_ids("A B C").size());
  EXPECT_EQ(j["usage"]["total_tokens"], j["usage"]["prompt_tokens"].get<int64_t>() + completion);
  serve::SampleOptions so;
  so.temperature = 0;
  so.max_new_tokens = completion;
  const auto want = serve::sample(world->reference, prompt_ids("A B C"), so);
  EXPECT_EQ(text, text_until_eos(want)) << "greedy completions equal generate's";

  auto s = post("/v1/completions", R"({"prompt":"A B C","max_tokens":8,"temperature":0,"stream":true,
      "stream_options":{"include_usage":true}})");
  ASSERT_TRUE(s);
  ASSERT_EQ(s->status, 200) << s->body;
  std::string err;
  const auto events = sse_data(s->body, &err);
  ASSERT_EQ(err, "");
  ASSERT_GE(events.size(), 3u) << s->body;
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_TRUE(s->body.ends_with("data: [DONE]\n\n"));
  std::string streamed, finish;
  for (size_t i = 0; i + 2 < events.size(); ++i) {
    const json c = json::parse(events[i]);
    EXPECT_EQ(c["object"], "text_completion");
    EXPECT_TRUE(c.contains("usage") && c["usage"].is_null()) << "include_usage: usage is null until the end";
    streamed += c["choices"][0]["text"].get<std::string>();
    if (!c["choices"][0]["finish_reason"].is_null()) finish = c["choices"][0]["finish_reason"];
  }
  const json usage = json::parse(events[events.size() - 2]);
  EXPECT_EQ(usage["choices"], json::array());
  EXPECT_EQ(usage["usage"]["completion_tokens"], completion);
  EXPECT_EQ(streamed, text);
  EXPECT_EQ(finish, j["choices"][0]["finish_reason"]);
}

TEST_F(HttpServerTest, ChatStreamedOrNotGiveTheSameText) {
  const std::string msgs = R"("messages":[{"role":"system","content":"Be terse."},{"role":"user","content":"Hi"}])";
  auto r = post("/v1/chat/completions", "{" + msgs + R"(,"max_tokens":6,"temperature":0})");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  const std::string content = j["choices"][0]["message"]["content"];
  const auto ids = prompt_ids("System: Be terse.\nUser: Hi\nAssistant:");
  EXPECT_EQ(j["usage"]["prompt_tokens"], ids.size()) << "the plain template's prompt";
  serve::SampleOptions so;
  so.temperature = 0;
  so.max_new_tokens = j["usage"]["completion_tokens"];
  EXPECT_EQ(content, text_until_eos(serve::sample(world->reference, ids, so)));

  auto s = post("/v1/chat/completions", "{" + msgs + R"(,"max_tokens":6,"temperature":0,"stream":true})");
  ASSERT_TRUE(s);
  ASSERT_EQ(s->status, 200) << s->body;
  std::string err;
  const auto events = sse_data(s->body, &err);
  ASSERT_EQ(err, "");
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events.back(), "[DONE]");
  const json first = json::parse(events[0]);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant") << "the first delta carries the role";
  std::string streamed;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const json c = json::parse(events[i]);
    EXPECT_FALSE(c.contains("usage")) << "no include_usage: no usage field";
    const json& d = c["choices"][0]["delta"];
    if (d.contains("content")) streamed += d["content"].get<std::string>();
  }
  const json last = json::parse(events[events.size() - 2]);
  EXPECT_EQ(last["choices"][0]["delta"], json::object()) << "the finishing chunk's delta is empty";
  EXPECT_EQ(last["choices"][0]["finish_reason"], j["choices"][0]["finish_reason"]);
  EXPECT_EQ(streamed, content);
}

TEST_F(HttpServerTest, LogprobsCarryTheEnginesAlternatives) {
  auto r = post("/v1/completions", R"({"prompt":"A B","max_tokens":3,"temperature":0,"logprobs":3})");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json lp = json::parse(r->body)["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), lp["top_logprobs"].size()) << lp.dump();
  for (size_t i = 0; i < lp["tokens"].size(); ++i) {
    const json& top = lp["top_logprobs"][i];
    EXPECT_EQ(top.size(), 3u) << "greedy: the chosen token is the likeliest of the 3: " << top.dump();
    ASSERT_TRUE(top.contains(lp["tokens"][i].get<std::string>())) << top.dump();
    EXPECT_EQ(top[lp["tokens"][i].get<std::string>()], lp["token_logprobs"][i]);
  }
  auto c = post("/v1/chat/completions",
                R"({"messages":[{"role":"user","content":"x"}],"max_tokens":2,"logprobs":true,"top_logprobs":2})");
  ASSERT_TRUE(c);
  ASSERT_EQ(c->status, 200) << c->body;
  const json chat = json::parse(c->body);
  ASSERT_FALSE(chat["choices"][0]["logprobs"]["content"].empty()) << c->body;
  for (const auto& item : chat["choices"][0]["logprobs"]["content"])
    EXPECT_GE(item["top_logprobs"].size(), 2u) << item.dump();
}

TEST_F(HttpServerTest, NChoicesWithASeedReproduce) {
  const std::string body = R"({"prompt":"x","max_tokens":5,"n":3,"seed":9,"top_k":50})";
  auto a = post("/v1/completions", body);
  auto b = post("/v1/completions", body);
  ASSERT_TRUE(a && b);
  ASSERT_EQ(a->status, 200) << a->body;
  const json ja = json::parse(a->body), jb = json::parse(b->body);
  ASSERT_EQ(ja["choices"].size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(ja["choices"][i]["index"], i);
    EXPECT_EQ(ja["choices"][i]["text"], jb["choices"][i]["text"]) << "choice " << i << " with seed 9 + " << i;
  }
  auto s = post("/v1/completions", R"({"prompt":"x","max_tokens":5,"n":3,"seed":9,"top_k":50,"stream":true})");
  ASSERT_TRUE(s);
  std::string err;
  std::vector<std::string> texts(3);
  for (const auto& e : sse_data(s->body, &err)) {
    if (e == "[DONE]") continue;
    const json c = json::parse(e);
    texts[c["choices"][0]["index"].get<size_t>()] += c["choices"][0]["text"].get<std::string>();
  }
  ASSERT_EQ(err, "");
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(texts[i], ja["choices"][i]["text"]) << "choice " << i << " streamed";
}

// ---------------------------------------------------------------------------
// Bad input: each in its family's shape, the server serving after it.

// " x" `n` times: n GPT-2 tokens.
std::string words(int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += " x";
  return s;
}

// --lora adapters over HTTP: TGI's parameters.adapter_id and OpenAI's
// `model` pick one (the responses name it), each gives its merged model's
// greedy text; the served model's id is the base; /v1/models lists the
// adapters; an unknown adapter is TGI's 422 and OpenAI's 404 model_not_found.
TEST_F(HttpServerTest, AdaptersByAdapterIdAndModel) {
  auto a = test_adapters::random_adapter(world->model, {"c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"}, false, 31);
  EngineOptions eo;
  eo.block_size = 8;
  eo.adapters = {{"a", a.get()}};
  Engine e(world->model, *world->tok, eo);
  auto s = world->start(HttpServerOptions{}, &e);
  const std::string want = text_until_eos(test_adapters::merged_greedy(*a, prompt_ids("Hello world"), 12));
  serve::SampleOptions so;
  so.temperature = 0;
  so.max_new_tokens = 12;
  const std::string base = text_until_eos(serve::sample(world->reference, prompt_ids("Hello world"), so));
  ASSERT_NE(want, base) << "the adapter should change the text";
  auto t = post("/generate", R"({"inputs":"Hello world","parameters":{"max_new_tokens":12,"adapter_id":"a"}})",
                s->port());
  ASSERT_TRUE(t);
  ASSERT_EQ(t->status, 200) << t->body;
  EXPECT_EQ(json::parse(t->body)["generated_text"], want) << "TGI's adapter_id";
  for (const char* model : {"a", "tiny-gpt2"}) {
    auto o = post("/v1/completions",
                  json{{"model", model}, {"prompt", "Hello world"}, {"max_tokens", 12}, {"temperature", 0}}.dump(),
                  s->port());
    ASSERT_TRUE(o);
    ASSERT_EQ(o->status, 200) << o->body;
    const json j = json::parse(o->body);
    EXPECT_EQ(j["choices"][0]["text"], std::string(model) == "a" ? want : base) << "OpenAI's model " << model;
    EXPECT_EQ(j["model"], model);
  }
  auto m = get("/v1/models", s->port());
  ASSERT_TRUE(m);
  const json list = json::parse(m->body)["data"];
  ASSERT_EQ(list.size(), 2u) << m->body;
  EXPECT_EQ(list[1]["id"], "a");
  EXPECT_EQ(list[1]["parent"], "tiny-gpt2");
  auto bad = post("/generate", R"({"inputs":"x","parameters":{"adapter_id":"zzz"}})", s->port());
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 422) << bad->body;
  EXPECT_EQ(tgi_error_shape(bad->body, "validation"), "");
  EXPECT_NE(bad->body.find("adapter 'zzz' is not loaded"), std::string::npos) << bad->body;
  auto bad2 = post("/v1/completions", R"({"model":"zzz","prompt":"x"})", s->port());
  ASSERT_TRUE(bad2);
  EXPECT_EQ(bad2->status, 404) << bad2->body;
  EXPECT_EQ(openai_error_shape(bad2->body, "invalid_request_error"), "");
  EXPECT_EQ(json::parse(bad2->body)["error"]["code"], "model_not_found") << bad2->body;
  s->stop();
}

TEST_F(HttpServerTest, ValidationErrorsAre422OnTgiAnd400OnOpenAi) {
  struct Case {
    const char* path;
    std::string body;
    int status;
    const char* param;  // OpenAI's param ("" for TGI)
  } cases[] = {
      {"/generate", R"({"inputs":"x","parameters":{"temperature":0}})", 422, ""},
      {"/generate", R"({"inputs":"x","parameters":{"top_k":"many"}})", 422, ""},
      {"/generate", R"({"inputs":"x",)", 422, ""},
      {"/generate", "", 422, ""},
      {"/generate_stream", R"({"inputs":"x","parameters":{"max_new_tokens":0}})", 422, ""},
      {"/generate", R"({"inputs":")" + words(200) + R"("})", 422, ""},  // past max_input_tokens
      {"/generate", R"({"inputs":"x","parameters":{"max_new_tokens":96}})", 422, ""},  // past max_total_tokens
      {"/tokenize", R"({"input":"x"})", 422, ""},
      {"/v1/completions", R"({"prompt":"x","temperature":3})", 400, "temperature"},
      {"/v1/completions", R"({"prompt":"x","max_tokens":"8"})", 400, "max_tokens"},
      {"/v1/completions", "not json", 400, "body"},
      {"/v1/completions", R"({"prompt":"x","max_tokens":200})", 400, "max_tokens"},
      {"/v1/chat/completions", R"({"messages":[{"role":"bot","content":"x"}]})", 400, "messages[0].role"},
      {"/v1/chat/completions", R"({"messages":"hi"})", 400, "messages"},
  };
  for (const auto& c : cases) {
    auto r = post(c.path, c.body);
    ASSERT_TRUE(r) << c.path << " " << c.body;
    EXPECT_EQ(r->status, c.status) << c.path << " " << c.body << " -> " << r->body;
    if (c.status == 422) {
      EXPECT_EQ(tgi_error_shape(r->body, "validation"), "") << c.path << " " << c.body;
    } else {
      EXPECT_EQ(openai_error_shape(r->body, "invalid_request_error"), "") << c.path << " " << c.body;
      EXPECT_EQ(json::parse(r->body)["error"]["param"], c.param) << r->body;
    }
    expect_alive(std::string(c.path) + " " + c.body);
  }
}

TEST_F(HttpServerTest, UnknownRoutesAndMethods) {
  struct Case {
    const char* method;
    const char* path;
    int status;
    bool openai;
  } cases[] = {
      {"GET", "/nope", 404, false},       {"POST", "/v1/nope", 404, true},
      {"GET", "/generate", 405, false},   {"POST", "/health", 405, false},
      {"DELETE", "/v1/models", 405, true}, {"PUT", "/v1/completions", 405, true},
      {"GET", "/v1/chat/completions", 405, true}, {"PATCH", "/info", 405, false},
  };
  for (const auto& c : cases) {
    httplib::Request req;
    req.method = c.method;
    req.path = c.path;
    if (std::string(c.method) != "GET") {
      req.body = "{}";
      req.set_header("Content-Type", "application/json");
    }
    httplib::Response res;
    httplib::Error err;
    ASSERT_TRUE(client().send(req, res, err)) << c.method << " " << c.path << ": " << httplib::to_string(err);
    EXPECT_EQ(res.status, c.status) << c.method << " " << c.path << ": " << res.body;
    const char* type = c.status == 404 ? "not_found" : "method_not_allowed";
    if (c.openai) {
      EXPECT_EQ(openai_error_shape(res.body, "invalid_request_error"), "") << c.method << " " << c.path;
    } else {
      EXPECT_EQ(tgi_error_shape(res.body, type), "") << c.method << " " << c.path;
    }
    if (c.status == 405) {
      EXPECT_FALSE(res.get_header_value("Allow").empty()) << c.method << " " << c.path;
    }
    expect_alive(std::string(c.method) + " " + c.path);
  }
}

// A raw request on a socket; returns everything the server sent before closing.
std::string raw_exchange(int port, const std::string& request, std::chrono::milliseconds wait) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return "connect failed";
  }
  ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  timeval tv{static_cast<time_t>(wait.count() / 1000), static_cast<suseconds_t>((wait.count() % 1000) * 1000)};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.find("\r\n\r\n") != std::string::npos && out.find("Content-Length: ") != std::string::npos) {
      const size_t cl = std::stoul(out.substr(out.find("Content-Length: ") + 16));
      if (out.size() >= out.find("\r\n\r\n") + 4 + cl) break;
    }
  }
  ::close(fd);
  return out;
}

TEST_F(HttpServerTest, MethodsHttplibDoesNotRouteAnd400s) {
  const std::string r = raw_exchange(port(), "FROB /generate HTTP/1.1\r\nHost: x\r\n\r\n", std::chrono::seconds(5));
  EXPECT_TRUE(r.starts_with("HTTP/1.1 405")) << r;
  EXPECT_NE(r.find("\"error_type\":\"method_not_allowed\""), std::string::npos) << r;
  const std::string bad = raw_exchange(port(), "GET /health HTTP/1.1\r\nHost x\r\nBroken\r\n\r\n", std::chrono::seconds(5));
  EXPECT_TRUE(bad.starts_with("HTTP/1.1 ")) << bad;
  expect_alive("malformed requests");
}

TEST_F(HttpServerTest, TooLargeBodiesAre413) {
  HttpServerOptions o;
  o.max_body_bytes = 4096;
  auto small = world->start(o);
  const std::string big = R"({"inputs":")" + std::string(10000, 'a') + R"("})";
  auto r = post("/generate", big, small->port());
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 413) << r->body;
  EXPECT_EQ(tgi_error_shape(r->body, "payload_too_large"), "");
  auto o2 = post("/v1/completions", R"({"prompt":")" + std::string(10000, 'a') + R"("})", small->port());
  ASSERT_TRUE(o2) << httplib::to_string(o2.error());
  EXPECT_EQ(o2->status, 413);
  EXPECT_EQ(openai_error_shape(o2->body, "invalid_request_error"), "");
  expect_alive("a 413", small->port());
}

TEST_F(HttpServerTest, ApiKeyGuardsEveryRouteButHealth) {
  HttpServerOptions o;
  o.api_key = "sekret";
  auto guarded = world->start(o);
  const int p = guarded->port();
  auto none = post("/generate", R"({"inputs":"x","parameters":{"max_new_tokens":2}})", p);
  ASSERT_TRUE(none);
  EXPECT_EQ(none->status, 401);
  EXPECT_EQ(tgi_error_shape(none->body, "unauthorized"), "");
  auto wrong = post("/v1/completions", R"({"prompt":"x","max_tokens":2})", p, {{"Authorization", "Bearer nope"}});
  ASSERT_TRUE(wrong);
  EXPECT_EQ(wrong->status, 401);
  EXPECT_EQ(openai_error_shape(wrong->body, "invalid_request_error"), "");
  EXPECT_EQ(json::parse(wrong->body)["error"]["code"], "invalid_api_key");
  auto m = get("/metrics", p);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 401) << "every route but /health and /ping";
  auto right = post("/v1/completions", R"({"prompt":"x","max_tokens":2})", p, {{"Authorization", "Bearer sekret"}});
  ASSERT_TRUE(right);
  EXPECT_EQ(right->status, 200) << right->body;
  auto h = get("/health", p);
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  auto ping = get("/ping", p);
  ASSERT_TRUE(ping);
  EXPECT_EQ(ping->status, 200);
}

TEST_F(HttpServerTest, OverloadedIs429AtOnceInEachShape) {
  EngineOptions eo;
  eo.block_size = 8;
  eo.max_concurrent_requests = 1;
  Engine drained(world->model, *world->tok, eo);
  drained.drain(std::chrono::milliseconds(0));  // admits nothing from now on
  auto s = world->start(HttpServerOptions{}, &drained);
  const auto t0 = std::chrono::steady_clock::now();
  auto t = post("/generate", R"({"inputs":"x"})", s->port());
  auto o = post("/v1/chat/completions", R"({"messages":[{"role":"user","content":"x"}]})", s->port());
  ASSERT_TRUE(t && o);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2)) << "a 429 is immediate";
  EXPECT_EQ(t->status, 429) << t->body;
  EXPECT_EQ(tgi_error_shape(t->body, "overloaded"), "");
  EXPECT_EQ(o->status, 429) << o->body;
  EXPECT_EQ(openai_error_shape(o->body, "rate_limit_error"), "");
  s->stop();
}

// More streams than --max-concurrent-requests at once: each is a 429 or
// completes; none hangs or fails otherwise.
TEST_F(HttpServerTest, PastTheLimitRequestsGet429AndTheRestComplete) {
  constexpr int kRequests = 12;  // the engine admits 6
  std::vector<std::thread> threads;
  std::vector<int> status(kRequests, 0);
  std::vector<std::string> bodies(kRequests);
  for (int i = 0; i < kRequests; ++i)
    threads.emplace_back([&, i] {
      auto r = post("/v1/completions", R"({"prompt":"count","max_tokens":24,"ignore_eos":true,"stream":true})");
      if (r) {
        status[i] = r->status;
        bodies[i] = r->body;
      }
    });
  for (auto& t : threads) t.join();
  int ok = 0, rejected = 0;
  for (int i = 0; i < kRequests; ++i) {
    if (status[i] == 200) {
      ++ok;
      EXPECT_TRUE(bodies[i].ends_with("data: [DONE]\n\n")) << "request " << i << " did not complete: " << bodies[i];
    } else {
      ++rejected;
      EXPECT_EQ(status[i], 429) << "request " << i << ": " << bodies[i];
      EXPECT_EQ(openai_error_shape(bodies[i], "rate_limit_error"), "") << "request " << i;
    }
  }
  EXPECT_GE(ok, 1) << ok << " completed, " << rejected << " rejected";
  RecordProperty("completed", ok);
  RecordProperty("rejected", rejected);
  expect_alive("a burst past the limit");
}

TEST_F(HttpServerTest, ADroppedStreamIsCancelled) {
  const int64_t before = world->engine->stats().cancelled;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = R"({"prompt":"drop me","max_tokens":90,"ignore_eos":true,"stream":true})";
  req.set_header("Content-Type", "application/json");
  int chunks = 0;
  req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) { return ++chunks < 2; };  // hang up
  httplib::Response res;
  httplib::Error err;
  client().send(req, res, err);
  EXPECT_GE(chunks, 1);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (world->engine->stats().cancelled == before && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(world->engine->stats().cancelled, before + 1) << "the engine was not told the client left";
  expect_alive("a dropped stream");
}

// A server around its own engine and model, as the suite's but admitting
// 128 at once (declared last, the server stops first).
struct OwnServer {
  Transformer model{world->config, 2, world->config.seq_len};
  std::unique_ptr<Engine> engine;
  std::unique_ptr<HttpServer> server;
  OwnServer() {
    model.init_random(11);
    EngineOptions eo;
    eo.block_size = 8;
    engine = std::make_unique<Engine>(model, *world->tok, eo);
    server = world->start(HttpServerOptions{}, engine.get());
  }
  int port() const { return server->port(); }
};

// 32 concurrent greedy requests of different lengths over the three
// generating routes: each equals `generate`'s tokens, as it does alone.
TEST_F(HttpServerTest, ThirtyTwoConcurrentGreedyRequestsEqualGenerate) {
  OwnServer own;
  const int p = own.port();
  static const char* kWords[] = {"the", "cat", "sat", "on", "a", "mat", "while", "rain", "fell", "outside"};
  struct Case {
    std::string route, prompt;
    int n;
    std::string got, want;
  };
  std::vector<Case> cases(32);
  for (size_t i = 0; i < cases.size(); ++i) {
    Case& c = cases[i];
    c.route = i % 3 == 0 ? "/generate" : i % 3 == 1 ? "/v1/completions" : "/v1/chat/completions";
    c.prompt = "Once";
    for (size_t w = 0; w < 1 + (i * 5) % 23; ++w) c.prompt += std::string(" ") + kWords[(i + w * 3) % 10];
    c.n = 3 + static_cast<int>(i % 7) * 4;
  }
  std::vector<std::thread> threads;
  for (Case& c : cases)
    threads.emplace_back([&c, p] {
      const std::string prompt = json(c.prompt).dump(), n = std::to_string(c.n);
      const std::string body =
          c.route == "/generate"
              ? R"({"inputs":)" + prompt + R"(,"parameters":{"max_new_tokens":)" + n + "}}"
          : c.route == "/v1/completions"
              ? R"({"prompt":)" + prompt + R"(,"max_tokens":)" + n + R"(,"temperature":0})"
              : R"({"messages":[{"role":"user","content":)" + prompt + R"(}],"max_tokens":)" + n +
                    R"(,"temperature":0})";
      auto r = post(c.route, body, p);
      if (!r || r->status != 200) {
        c.got = "HTTP error: " + (r ? std::to_string(r->status) + " " + r->body : httplib::to_string(r.error()));
        return;
      }
      const json j = json::parse(r->body);
      c.got = c.route == "/generate"          ? j["generated_text"].get<std::string>()
              : c.route == "/v1/completions" ? j["choices"][0]["text"].get<std::string>()
                                             : j["choices"][0]["message"]["content"].get<std::string>();
    });
  for (auto& t : threads) t.join();
  for (Case& c : cases) {
    std::vector<int32_t> ids = prompt_ids(c.route == "/v1/chat/completions"
                                              ? render_chat("plain", {{"user", c.prompt}})
                                              : c.prompt);
    serve::SampleOptions so;
    so.temperature = 0;
    so.max_new_tokens = c.n;
    EXPECT_EQ(c.got, text_until_eos(serve::sample(world->reference, ids, so)))
        << c.route << " with a prompt of " << ids.size() << " tokens and " << c.n << " new, among 32 at once";
  }
  EXPECT_EQ(own.engine->stats().finished, 32);
}

// 20 clients hang up mid-stream: each is cancelled at the engine's next
// step and its blocks freed, as /metrics shows.
TEST_F(HttpServerTest, TwentyDroppedStreamsFreeTheirBlocks) {
  OwnServer own;
  const int p = own.port();
  auto metric = [&](const std::string& name) {
    auto r = get("/metrics", p);
    if (!r) return -1.0;
    const size_t at = r->body.find("\n" + name + " ");
    return at == std::string::npos ? -1.0 : std::stod(r->body.substr(at + name.size() + 2));
  };
  std::atomic<int> streaming{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 20; ++i)
    threads.emplace_back([&, i] {
      httplib::Request req;
      req.method = "POST";
      req.path = "/v1/completions";
      req.body = R"({"prompt":"drop number )" + std::to_string(i) + R"(","max_tokens":80,"ignore_eos":true,"stream":true})";
      req.set_header("Content-Type", "application/json");
      int chunks = 0;
      req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) {
        if (++chunks == 2) ++streaming;
        // Hang up once all 20 stream (their blocks held at once).
        while (chunks >= 2 && streaming < 20) std::this_thread::sleep_for(std::chrono::milliseconds(2));
        return chunks < 3;
      };
      httplib::Response res;
      httplib::Error err;
      client(p).send(req, res, err);
    });
  for (auto& t : threads) t.join();
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (metric("tgi_request_cancelled") < 20 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(metric("tgi_request_cancelled"), 20) << "not every dropped client was cancelled";
  EXPECT_EQ(metric("pagedoptim_kv_blocks_used"), 0) << "a cancelled request's blocks are still held";
  EXPECT_EQ(metric("tgi_request_success"), 0) << "a dropped request ran to its end";
  expect_alive("20 dropped streams", p);
}

TEST_F(HttpServerTest, SlowLorisIsDroppedAtTheDeadline) {
  HttpServerOptions o;
  o.request_timeout = std::chrono::milliseconds(400);
  o.read_timeout = std::chrono::milliseconds(300);
  auto s = world->start(o);
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(s->port()));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  const std::string head = "POST /generate HTTP/1.1\r\nHost: x\r\nX-Slow: ";
  ::send(fd, head.data(), head.size(), MSG_NOSIGNAL);
  // One byte every 100 ms: each within the read timeout, the whole past the deadline.
  const auto t0 = std::chrono::steady_clock::now();
  bool closed = false;
  std::string answer;
  for (int i = 0; i < 30 && !closed; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ::send(fd, "a", 1, MSG_NOSIGNAL);
    char buf[1024];
    ssize_t n;
    while ((n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT)) > 0) answer.append(buf, static_cast<size_t>(n));
    closed = n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
  }
  ::close(fd);
  EXPECT_TRUE(closed) << "a client trickling its headers held the connection for 3 s";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(2000));
  EXPECT_TRUE(answer.empty() || answer.starts_with("HTTP/1.1 408")) << answer;
  expect_alive("a slow-loris client", s->port());
}

TEST_F(HttpServerTest, HealthIs503UntilAModelIsAttached) {
  HttpServerOptions o;
  o.port = 0;
  HttpServer loading(o);
  loading.start();
  auto h = get("/health", loading.port());
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 503);
  EXPECT_EQ(tgi_error_shape(h->body, "healthcheck"), "");
  auto g = post("/generate", R"({"inputs":"x"})", loading.port());
  ASSERT_TRUE(g);
  EXPECT_EQ(g->status, 503);
  auto v = post("/v1/completions", R"({"prompt":"x"})", loading.port());
  ASSERT_TRUE(v);
  EXPECT_EQ(v->status, 503);
  EXPECT_EQ(openai_error_shape(v->body, "service_unavailable"), "");
  loading.attach(*world->engine);
  auto ready = get("/health", loading.port());
  ASSERT_TRUE(ready);
  EXPECT_EQ(ready->status, 200);
  loading.set_draining();
  auto draining = get("/health", loading.port());
  ASSERT_TRUE(draining);
  EXPECT_EQ(draining->status, 503) << "a draining server tells balancers to stop";
}

// Llama-2: the chat template's segments are sequences of their own (BOS
// before each, EOS between: the ids, not the text "</s><s>"), and /tokenize
// lists BOS and offsets without the dummy-prefix space.
TEST(HttpServerLlama, ChatTurnsAreBosAndEosIdsAndTokenizeHasBos) {
  const std::string dir = data::testing::llama_fixture_dir();
  ASSERT_FALSE(dir.empty()) << data::testing::kLlamaSetupHint;
  const auto tok = data::load_tokenizer(dir + "/tokenizer.json");
  TransformerConfig c = TransformerConfig::arch_defaults("llama");
  c.n_layer = 2;
  c.n_embd = 32;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.vocab_size = 32000;
  c.seq_len = 96;
  c.fill_derived();
  Transformer model(c, 1, c.seq_len), reference(c, 1, c.seq_len);
  model.init_random(5);
  reference.init_random(5);
  EngineOptions eo;
  eo.block_size = 8;
  Engine engine(model, *tok, eo);
  HttpServerOptions o;
  o.port = 0;
  o.chat_template = "llama2";
  HttpServer server(engine, o);
  server.start();
  httplib::Client cli("127.0.0.1", server.port());
  cli.set_read_timeout(std::chrono::seconds(20));

  std::vector<int32_t> ids = {*tok->bos_id()};
  for (int32_t id : tok->encode("[INST] <<SYS>>\nS\n<</SYS>>\n\nHi [/INST] Hello ")) ids.push_back(id);
  ids.push_back(tok->eos_id());
  ids.push_back(*tok->bos_id());
  for (int32_t id : tok->encode("[INST] More [/INST]")) ids.push_back(id);
  auto r = cli.Post("/v1/chat/completions", R"({"messages":[{"role":"system","content":"S"},
      {"role":"user","content":"Hi"},{"role":"assistant","content":"Hello"},{"role":"user","content":"More"}],
      "max_tokens":5,"temperature":0})", "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  EXPECT_EQ(j["usage"]["prompt_tokens"], ids.size()) << "BOS, turn 1, EOS, BOS, turn 2";
  serve::SampleOptions so;
  so.temperature = 0;
  so.max_new_tokens = j["usage"]["completion_tokens"];
  so.stop_token = tok->eos_id();  // as `generate` does for Llama
  std::vector<int32_t> want = serve::sample(reference, ids, so);
  if (!want.empty() && want.back() == tok->eos_id()) want.pop_back();
  EXPECT_EQ(j["choices"][0]["message"]["content"], tok->decode(want));

  auto t = cli.Post("/tokenize", R"({"inputs":"Hello world"})", "application/json");
  ASSERT_TRUE(t);
  ASSERT_EQ(t->status, 200) << t->body;
  const json tj = json::parse(t->body);
  ASSERT_GE(tj.size(), 2u) << t->body;
  EXPECT_EQ(tj[0], json::parse(R"({"id":1,"text":"","start":0,"stop":0})")) << "BOS first";
  std::string joined;
  for (size_t i = 1; i < tj.size(); ++i) {
    EXPECT_EQ(tj[i]["start"], joined.size()) << t->body;
    joined += tj[i]["text"].get<std::string>();
  }
  EXPECT_EQ(joined, "Hello world");
}

}  // namespace
}  // namespace po::serve
