// The routes of `pagedoptim serve` (see http_server.h for the rules).
//
// Every handler runs through handle(): body read under max_body_bytes, API
// key checked, exceptions turned into the route family's error shape. A
// request's engine streams live in a Streams, which cancels whatever is
// unfinished when it goes, so that no path (an error, a client gone, the
// server stopping) leaves a request generating for nobody.
//
// Streaming: httplib calls the content provider again and again on the
// handler's thread while the response is open; each call waits up to 50 ms
// for the engine and writes what came. A failed write or a closed socket
// cancels the request.
#include "serve/http_server.h"

#include <cmath>
#include <limits>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "core/error.h"
#include "core/log.h"
#include "serve/api.h"
#include "serve/engine.h"
#include "serve/http_streams.h"
#include "serve/http_transport.h"

namespace po::serve {
namespace {

using json = nlohmann::json;
using httplib::ContentReader;
using httplib::DataSink;
using httplib::Request;
using httplib::Response;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// The version /info reports (TGI reports its release).
constexpr const char* kVersion = "0.1.0";

enum class Api { kTgi, kOpenAi };
Api api_of(const std::string& path) {
  return path == "/v1" || path.starts_with("/v1/") ? Api::kOpenAi : Api::kTgi;
}

// One kind of failure in both families' words.
struct ErrorKind {
  int tgi_status, openai_status;
  const char* tgi_type;
  const char* openai_type;
  const char* openai_code;
};
constexpr ErrorKind kValidation{422, 400, "validation", "invalid_request_error", ""};
constexpr ErrorKind kBadRequest{400, 400, "bad_request", "invalid_request_error", ""};
constexpr ErrorKind kUnauthorized{401, 401, "unauthorized", "invalid_request_error", "invalid_api_key"};
constexpr ErrorKind kNotFound{404, 404, "not_found", "invalid_request_error", "unknown_url"};
constexpr ErrorKind kModelNotFound{404, 404, "not_found", "invalid_request_error", "model_not_found"};
constexpr ErrorKind kMethod{405, 405, "method_not_allowed", "invalid_request_error", "method_not_allowed"};
constexpr ErrorKind kTimeout{408, 408, "request_timeout", "invalid_request_error", "request_timeout"};
constexpr ErrorKind kTooLarge{413, 413, "payload_too_large", "invalid_request_error", "request_too_large"};
constexpr ErrorKind kOverloaded{429, 429, "overloaded", "rate_limit_error", "rate_limit_exceeded"};
constexpr ErrorKind kGeneration{424, 500, "generation", "server_error", ""};
constexpr ErrorKind kIncomplete{500, 500, "incomplete_generation", "server_error", ""};
constexpr ErrorKind kInternal{500, 500, "internal", "server_error", ""};
constexpr ErrorKind kUnavailable{503, 503, "unhealthy", "service_unavailable", ""};

void send_json(Response& res, int status, const json& j) {
  res.status = status;
  res.set_content(dump_json(j), "application/json");
}

void send_error(Response& res, Api api, const ErrorKind& k, const std::string& message,
                const std::string& param = "") {
  if (api == Api::kTgi)
    send_json(res, k.tgi_status, tgi_error(message, k.tgi_type));
  else
    send_json(res, k.openai_status, openai_error(message, k.openai_type, param, k.openai_code));
}

// A failure a handler reports with its kind (the others are mapped by type).
struct HttpError : std::runtime_error {
  HttpError(const ErrorKind& k, const std::string& message) : std::runtime_error(message), kind(k) {}
  const ErrorKind& kind;
};
// The client hung up: nobody to answer.
struct ClientGone {};

struct Route {
  const char* path;
  const char* method;
};
constexpr Route kRoutes[] = {
    {"/", "POST"},           {"/generate", "POST"}, {"/generate_stream", "POST"},    {"/tokenize", "POST"},
    {"/info", "GET"},        {"/health", "GET"},    {"/ping", "GET"},                {"/metrics", "GET"},
    {"/v1/models", "GET"},   {"/v1/completions", "POST"}, {"/v1/chat/completions", "POST"},
};
const char* allowed_method(const std::string& path) {
  for (const auto& r : kRoutes)
    if (path == r.path) return r.method;
  return nullptr;
}

// Comparing a secret in time independent of where it differs.
bool same_secret(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i % std::max<size_t>(1, b.size())]);
  return diff == 0;
}

int64_t utf8_chars(const std::string& s) {
  int64_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}


}  // namespace

struct HttpServer::Impl {
  explicit Impl(HttpServerOptions opts);

  HttpServerOptions o;
  std::atomic<Engine*> engine{nullptr};
  std::atomic<bool> draining{false}, stopping{false}, listen_done{false};
  Transport svr;
  std::thread thread;
  int bound_port = -1;
  std::mutex rng_mu;
  std::mt19937_64 rng{std::random_device{}()};
  const int64_t created = static_cast<int64_t>(std::time(nullptr));

  using BodyHandler = std::function<void(const Request&, const std::string&, Response&)>;
  void routes();
  void handle(const Request& req, Response& res, const ContentReader* reader, const BodyHandler& fn);
  enum class BodyRead { kOk, kTooLarge, kFailed };
  BodyRead read_body(const Request& req, const ContentReader& reader, std::string& body) const;
  bool authorized(const Request& req) const;
  void no_route(const std::string& method, const std::string& path, Response& res) const;
  httplib::Server::HandlerResponse on_error(const Request& req, Response& res) const;

  // The engine, or 503 while the model loads (and, for `admitting`, while draining).
  Engine& engine_ref(bool admitting = true) const;
  ApiLimits limits() const { return {o.max_stop_sequences, o.max_best_of, o.max_n}; }
  uint64_t random_u64();
  std::vector<int32_t> encode_prompt(Engine& e, const std::string& text) const;
  std::vector<int32_t> encode_chat(Engine& e, const std::vector<ChatMessage>& messages) const;
  Streams submit(Engine& e, const std::vector<int32_t>& ids, const SamplingParams& p, int64_t count,
                 uint64_t seed) const;
  std::vector<Generation> collect(Streams& ss, const SamplingParams& p, uint64_t seed) const;

  void health(Response& res) const;
  void info(Response& res) const;
  void models(Response& res) const;
  void metrics(Response& res) const;
  void tokenize(const std::string& body, Response& res) const;
  void tgi_generate(const std::string& body, Response& res, TgiRoute route);
  template <class State>
  void send_events(Response& res, std::shared_ptr<State> st, const char* what);
  void tgi_stream(Response& res, Streams ss, TgiRequest r, int64_t prompt_tokens, uint64_t seed);
  void openai(const std::string& body, Response& res, bool chat);
  void openai_stream(Response& res, Streams ss, OpenAiRequest r, OpenAiMeta meta, int64_t prompt_tokens,
                     std::vector<OpenAiStreamState::Echo> echoes,
                     Engine& e);
};

HttpServer::Impl::Impl(HttpServerOptions opts)
    : o(std::move(opts)),
      svr(TransportOptions{o.read_timeout, o.request_timeout, o.write_timeout, std::chrono::seconds(5), 100,
                           o.max_body_bytes + (64 << 10)}) {
  check_chat_template(o.chat_template);
  svr.set_payload_max_length(o.max_body_bytes);
  svr.set_error_handler(httplib::Server::HandlerWithResponse(
      [this](const Request& req, Response& res) { return on_error(req, res); }));
  svr.set_exception_handler([](const Request& req, Response& res, std::exception_ptr ep) {
    std::string what = "unknown exception";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    send_error(res, api_of(req.path), kInternal, what);
  });
  routes();
}

void HttpServer::Impl::routes() {
  auto post = [this](const char* path, BodyHandler fn) {
    svr.Post(path, [this, fn](const Request& req, Response& res, const ContentReader& reader) {
      handle(req, res, &reader, fn);
    });
  };
  auto get = [this](const char* path, BodyHandler fn) {
    svr.Get(path, [this, fn](const Request& req, Response& res) { handle(req, res, nullptr, fn); });
  };
  post("/generate", [this](const Request&, const std::string& b, Response& s) { tgi_generate(b, s, TgiRoute::kGenerate); });
  post("/generate_stream",
       [this](const Request&, const std::string& b, Response& s) { tgi_generate(b, s, TgiRoute::kGenerateStream); });
  post("/", [this](const Request&, const std::string& b, Response& s) { tgi_generate(b, s, TgiRoute::kCompat); });
  post("/tokenize", [this](const Request&, const std::string& b, Response& s) { tokenize(b, s); });
  post("/v1/completions", [this](const Request&, const std::string& b, Response& s) { openai(b, s, false); });
  post("/v1/chat/completions", [this](const Request&, const std::string& b, Response& s) { openai(b, s, true); });
  get("/health", [this](const Request&, const std::string&, Response& s) { health(s); });
  get("/ping", [this](const Request&, const std::string&, Response& s) { health(s); });
  get("/info", [this](const Request&, const std::string&, Response& s) { info(s); });
  get("/metrics", [this](const Request&, const std::string&, Response& s) { metrics(s); });
  get("/v1/models", [this](const Request&, const std::string&, Response& s) { models(s); });
  // Everything else: 404, or 405 on a known path; bodies are read (and
  // bounded) first so that the connection stays usable.
  const BodyHandler none = [this](const Request& q, const std::string&, Response& s) {
    no_route(q.method, q.path, s);
  };
  auto any_with_body = [this, none](const Request& req, Response& res, const ContentReader& reader) {
    handle(req, res, &reader, none);
  };
  post(".*", none);
  get(".*", none);
  svr.Put(".*", any_with_body);
  svr.Patch(".*", any_with_body);
  svr.Delete(".*", any_with_body);
  svr.Options(".*", [this, none](const Request& req, Response& res) { handle(req, res, nullptr, none); });
}

void HttpServer::Impl::handle(const Request& req, Response& res, const ContentReader* reader,
                              const BodyHandler& fn) {
  const Api api = api_of(req.path);
  Connection* conn = current_connection();
  std::string body;
  if (reader) {
    const BodyRead r = read_body(req, *reader, body);
    if (r != BodyRead::kOk) {
      // What is left of the body must not be read as the next request.
      if (conn) conn->close_after();
      if (r == BodyRead::kTooLarge)
        send_error(res, api, kTooLarge, core::str_cat("the request body exceeds ", o.max_body_bytes, " bytes"));
      else if (conn && conn->timed_out())
        send_error(res, api, kTimeout, "the request body did not arrive in time");
      else
        send_error(res, api, kBadRequest, "the request body could not be read");
      return;
    }
  }
  if (!authorized(req)) {
    res.set_header("WWW-Authenticate", "Bearer");
    send_error(res, api, kUnauthorized,
               api == Api::kTgi ? "Unauthorized: send the API key as `Authorization: Bearer KEY`"
                                : "Incorrect API key provided: send it as `Authorization: Bearer KEY`");
    return;
  }
  try {
    fn(req, body, res);
  } catch (const ValidationError& e) {
    send_error(res, api, kValidation, e.what(), e.param());
  } catch (const HttpError& e) {
    send_error(res, api, e.kind, e.what());
  } catch (const Overloaded& e) {
    send_error(res, api, kOverloaded, e.what());
  } catch (const ClientGone&) {
    if (conn) conn->close_after();
    send_error(res, api, kBadRequest, "the client closed the connection");
  } catch (const core::InvalidArgument& e) {
    // The engine's own checks (submit): out of range for it.
    send_error(res, api, kValidation, e.what());
  } catch (const std::exception& e) {
    PO_LOG_WARN("serve: ", req.method, " ", req.path, " failed: ", e.what());
    send_error(res, api, kInternal, e.what());
  }
}

HttpServer::Impl::BodyRead HttpServer::Impl::read_body(const Request& req, const ContentReader& reader,
                                                       std::string& body) const {
  std::string te = req.get_header_value("Transfer-Encoding");
  std::transform(te.begin(), te.end(), te.begin(), [](unsigned char c) { return std::tolower(c); });
  if (req.has_header("Content-Length")) {
    const std::string v = req.get_header_value("Content-Length");
    char* end = nullptr;
    errno = 0;
    const unsigned long long n = std::strtoull(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || errno != 0 || v[0] == '-') return BodyRead::kFailed;
    // Refused before reading: a client may declare gigabytes.
    if (n > o.max_body_bytes) return BodyRead::kTooLarge;
    if (n == 0) return BodyRead::kOk;
  } else if (te.find("chunked") == std::string::npos) {
    return BodyRead::kOk;  // no body (httplib would otherwise read until the connection closes)
  }
  bool over = false;
  const bool ok = reader([&](const char* d, size_t n) {
    if (body.size() + n > o.max_body_bytes) {
      over = true;
      return false;
    }
    body.append(d, n);
    return true;
  });
  if (over) return BodyRead::kTooLarge;
  return ok ? BodyRead::kOk : BodyRead::kFailed;
}

bool HttpServer::Impl::authorized(const Request& req) const {
  if (o.api_key.empty() || req.path == "/health" || req.path == "/ping") return true;
  return same_secret(req.get_header_value("Authorization"), "Bearer " + o.api_key);
}

void HttpServer::Impl::no_route(const std::string& method, const std::string& path, Response& res) const {
  const Api api = api_of(path);
  if (const char* m = allowed_method(path)) {
    res.set_header("Allow", std::strcmp(m, "GET") == 0 ? "GET, HEAD" : m);
    send_error(res, api, kMethod, core::str_cat("method ", method, " is not allowed on ", path, " (use ", m, ")"));
  } else {
    send_error(res, api, kNotFound, core::str_cat("no route ", method, " ", path));
  }
}

// Errors httplib answers itself (a malformed request line or header, a
// method it does not route, a request past its deadline): the same JSON shapes.
httplib::Server::HandlerResponse HttpServer::Impl::on_error(const Request& req, Response& res) const {
  if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;  // ours
  // A method httplib does not know fails the request line before the path is set.
  const std::string path = req.path.empty() ? req.target.substr(0, req.target.find('?')) : req.path;
  const Api api = api_of(path);
  Connection* conn = current_connection();
  const int status = res.status;
  static const char* const routed[] = {"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"};
  const bool routed_method = std::find(std::begin(routed), std::end(routed), req.method) != std::end(routed);
  if (conn && conn->timed_out()) {
    conn->close_after();
    send_error(res, api, kTimeout, "the request did not arrive in time");
  } else if (status == 400 && !req.method.empty() && !routed_method && path.starts_with("/") &&
             (req.version == "HTTP/1.1" || req.version == "HTTP/1.0")) {
    no_route(req.method, path, res);
  } else if (status == 413) {
    if (conn) conn->close_after();
    send_error(res, api, kTooLarge, core::str_cat("the request body exceeds ", o.max_body_bytes, " bytes"));
  } else if (status == 404) {
    no_route(req.method, path, res);
  } else {
    send_error(res, api, status < 500 ? kBadRequest : kInternal,
               core::str_cat("HTTP ", status, ": the request could not be handled (malformed request line or headers?)"));
    res.status = status;
  }
  return httplib::Server::HandlerResponse::Handled;
}

Engine& HttpServer::Impl::engine_ref(bool admitting) const {
  Engine* e = engine.load();
  if (!e) throw HttpError(kUnavailable, "the model is loading");
  if (admitting && draining) throw HttpError(kUnavailable, "the server is shutting down");
  return *e;
}

uint64_t HttpServer::Impl::random_u64() {
  std::lock_guard lock(rng_mu);
  return rng();
}

// As `pagedoptim generate` does: BOS first where the family has one; GPT-2's
// empty prompt is <|endoftext|>, its document separator.
std::vector<int32_t> HttpServer::Impl::encode_prompt(Engine& e, const std::string& text) const {
  std::vector<int32_t> ids;
  if (const auto bos = e.tokenizer().bos_id()) ids.push_back(*bos);
  for (int32_t id : e.encode(text)) ids.push_back(id);
  if (ids.empty()) ids.push_back(e.tokenizer().eos_id());
  return ids;
}

// A rendered chat: each segment a sequence of its own, EOS between two
// (Llama-2's "</s><s>" as ids).
std::vector<int32_t> HttpServer::Impl::encode_chat(Engine& e, const std::vector<ChatMessage>& messages) const {
  std::vector<int32_t> ids;
  const auto segments = render_chat_segments(o.chat_template, messages);
  for (size_t i = 0; i < segments.size(); ++i) {
    if (i > 0) ids.push_back(e.tokenizer().eos_id());
    if (const auto bos = e.tokenizer().bos_id()) ids.push_back(*bos);
    for (int32_t id : e.encode(segments[i])) ids.push_back(id);
  }
  return ids;
}

namespace {

// With prompt_logprobs: the engine's scores of prompt tokens 1.. become every
// prompt token with its text, the first unscored (a NaN logprob).
void name_prompt(std::vector<Generation>& gens, const std::vector<int32_t>& ids, Engine& e) {
  for (Generation& g : gens) {
    std::vector<GeneratedToken> all(1);
    all[0].id = ids.empty() ? 0 : ids[0];
    all[0].logprob = std::numeric_limits<float>::quiet_NaN();
    for (auto& t : g.prompt) all.push_back(std::move(t));
    for (GeneratedToken& t : all) t.text = e.tokenizer().piece_bytes(t.id);
    g.prompt = std::move(all);
  }
}

}  // namespace

// `count` requests of one prompt, choice i with seed + i (one prefill shared).
Streams HttpServer::Impl::submit(Engine& e, const std::vector<int32_t>& ids, const SamplingParams& p,
                                 int64_t count, uint64_t seed) const {
  std::vector<SamplingParams> ps(static_cast<size_t>(count), p);
  for (size_t i = 0; i < ps.size(); ++i) ps[i].seed = seed + i;
  if (count == 1) return Streams({e.submit(ids, ps[0])});
  return Streams(e.submit_n(ids, ps));
}

// Waits for every stream to finish; the client is looked at every kPoll.
std::vector<Generation> HttpServer::Impl::collect(Streams& ss, const SamplingParams& p, uint64_t seed) const {
  std::vector<Generation> gens(ss.size());
  for (size_t i = 0; i < ss.size(); ++i) {
    gens[i].prompt_tokens = ss[i].prompt_tokens();
    if (p.do_sample) gens[i].seed = seed + i;
  }
  std::string error;
  bool cancelled = false;
  Connection* conn = current_connection();
  while (!ss.all_done()) {
    bool waited = false;
    for (size_t i = 0; i < ss.size(); ++i) {
      if (ss.done(i)) continue;
      Update u;
      const bool got = ss[i].next(u, waited ? milliseconds(0) : kPoll);
      waited = true;
      if (!got) continue;
      for (auto& t : u.prompt) gens[i].prompt.push_back(std::move(t));
      for (auto& t : u.tokens) gens[i].tokens.push_back(std::move(t));
      gens[i].text += u.text;
      if (u.finish == Finish::kNone) continue;
      ss.mark_done(i);
      gens[i].finish = u.finish;
      if (!u.error.empty()) error = u.error;
      if (u.finish == Finish::kCancelled) cancelled = true;
    }
    if (stopping || (conn && conn->peer_closed())) throw ClientGone{};  // ~Streams cancels
  }
  if (!error.empty()) throw HttpError(kGeneration, "Request failed during generation: " + error);
  if (cancelled) throw HttpError(kIncomplete, kCancelledMessage);
  return gens;
}

// ---------------------------------------------------------------------------
// TGI

void HttpServer::Impl::health(Response& res) const {
  if (!engine.load())
    send_json(res, 503, tgi_error("Loading model", "healthcheck"));
  else if (draining)
    send_json(res, 503, tgi_error("Shutting down", "healthcheck"));
  else
    send_json(res, 200, {{"status", "ok"}});
}

void HttpServer::Impl::info(Response& res) const {
  Engine& e = engine_ref(false);
  const EngineOptions& eo = e.options();
  send_json(res, 200,
            {{"model_id", o.model_id},
             {"model_sha", nullptr},
             {"model_dtype", "float32"},
             {"model_device_type", "cpu"},
             {"model_pipeline_tag", "text-generation"},
             {"max_concurrent_requests", eo.max_concurrent_requests},
             {"max_best_of", o.max_best_of},
             {"max_stop_sequences", o.max_stop_sequences},
             {"max_input_tokens", eo.max_input_tokens},
             {"max_input_length", eo.max_input_tokens},  // TGI's older name
             {"max_total_tokens", eo.max_total_tokens},
             {"max_batch_total_tokens", eo.max_batch_total_tokens},
             {"kv_block_size", eo.block_size},
             {"chat_template", o.chat_template},
             {"validation_workers", 1},
             {"max_client_batch_size", 1},
             {"router", "pagedoptim"},
             {"version", kVersion},
             {"sha", nullptr},
             {"docker_label", nullptr}});
}

// The served model, then each --lora adapter (its parent the model, as vLLM lists them).
void HttpServer::Impl::models(Response& res) const {
  json data = json::array({{{"id", o.model_id}, {"object", "model"}, {"created", created}, {"owned_by", "pagedoptim"}}});
  for (const auto& a : engine_ref(false).options().adapters)
    data.push_back({{"id", a.first}, {"object", "model"}, {"created", created}, {"owned_by", "pagedoptim"},
                    {"parent", o.model_id}});
  send_json(res, 200, {{"object", "list"}, {"data", data}});
}

void HttpServer::Impl::metrics(Response& res) const {
  res.status = 200;
  res.set_content(engine_ref(false).metrics_text(), "text/plain; version=0.0.4");
}

// TGI's /tokenize: [{id, text, start, stop}] with byte offsets into the input.
void HttpServer::Impl::tokenize(const std::string& body, Response& res) const {
  Engine& e = engine_ref();
  const std::string text = parse_tokenize_request(body);
  const std::vector<int32_t> ids = e.encode(text);
  json out = json::array();
  if (const auto bos = e.tokenizer().bos_id()) out.push_back({{"id", *bos}, {"text", ""}, {"start", 0}, {"stop", 0}});
  size_t at = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    // decode() of the first token drops Llama's dummy-prefix space, as the input has none.
    const std::string piece = i == 0 ? e.decode({ids[0]}) : e.tokenizer().piece_bytes(ids[i]);
    out.push_back({{"id", ids[i]}, {"text", piece}, {"start", at}, {"stop", at + piece.size()}});
    at += piece.size();
  }
  send_json(res, 200, out);
}

void HttpServer::Impl::tgi_generate(const std::string& body, Response& res, TgiRoute route) {
  Engine& e = engine_ref();
  const auto v0 = Clock::now();  // validation: parsing, tokenizing, the length checks
  TgiRequest r = parse_tgi_request(body, route, limits());
  const std::vector<int32_t> ids = encode_prompt(e, r.inputs);
  const auto n = static_cast<int64_t>(ids.size());
  r.params.max_new_tokens = resolve_max_new_tokens(n, r.max_new_tokens, e.options().max_input_tokens,
                                                   e.options().max_total_tokens, false, "inputs");
  const uint64_t seed = r.seed ? *r.seed : random_u64();
  const auto t0 = Clock::now();
  const double validation_s = std::chrono::duration<double>(t0 - v0).count();
  Streams ss = submit(e, ids, r.params, r.best_of, seed);
  res.set_header("x-compute-type", "cpu");
  res.set_header("x-compute-characters", std::to_string(utf8_chars(r.inputs)));
  if (r.stream) return tgi_stream(res, std::move(ss), std::move(r), n, seed);

  std::vector<Generation> gens = collect(ss, r.params, seed);
  // best_of: the sequence with the highest sum of token log-probabilities (TGI's choice).
  size_t best = 0;
  for (size_t i = 1; i < gens.size(); ++i)
    if (gens[i].logprob_sum() > gens[best].logprob_sum()) best = i;
  std::vector<Generation> others;
  for (size_t i = 0; i < gens.size(); ++i)
    if (i != best) others.push_back(gens[i]);
  json prefill = json::array();
  if (r.decoder_input_details) {  // the prompt's tokens with their log-probabilities, the first null
    name_prompt(gens, ids, e);
    for (const GeneratedToken& t : gens[best].prompt)
      prefill.push_back({{"id", t.id}, {"text", t.text}, {"logprob", std::isnan(t.logprob) ? json(nullptr) : json(t.logprob)}});
  }
  json out = tgi_generate_response(gens[best], r.return_full_text ? r.inputs : "",
                                   r.details || r.decoder_input_details, prefill, others);
  if (route == TgiRoute::kCompat) out = json::array({out});  // TGI's POST / answers a list
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  const auto generated = static_cast<int64_t>(gens[best].tokens.size());
  // TGI's timing headers (milliseconds but x-compute-time): the queue is
  // arrival to admission, the inference admission to the end.
  const double queue_s = std::max(0.0, ss[best].queue_seconds());
  res.set_header("x-compute-time", std::to_string(secs));
  res.set_header("x-total-time", std::to_string(static_cast<int64_t>((secs + validation_s) * 1000)));
  res.set_header("x-validation-time", std::to_string(static_cast<int64_t>(validation_s * 1000)));
  res.set_header("x-queue-time", std::to_string(static_cast<int64_t>(queue_s * 1000)));
  res.set_header("x-inference-time", std::to_string(static_cast<int64_t>(std::max(0.0, secs - queue_s) * 1000)));
  res.set_header("x-time-per-token", std::to_string(static_cast<int64_t>(secs * 1000 / std::max<int64_t>(1, generated))));
  res.set_header("x-prompt-tokens", std::to_string(n));
  res.set_header("x-generated-tokens", std::to_string(generated));
  send_json(res, 200, out);
}


// Server-sent events from a stream state's poll() until it is finished; a
// client that is gone, or a server stopping, ends the response, and the
// releaser cancels what still runs.
template <class State>
void HttpServer::Impl::send_events(Response& res, std::shared_ptr<State> st, const char* what) {
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, st, what](size_t, DataSink& sink) {
        try {
          if (stopping || !sink.is_writable()) return false;  // the releaser cancels
          const std::string out = st->poll();
          if (!out.empty() && !sink.write(out.data(), out.size())) return false;
          if (st->finished) sink.done();
          return true;
        } catch (const std::exception& e) {
          PO_LOG_WARN("serve: ", what, " failed: ", e.what());
          return false;
        }
      },
      [st](bool) { st->ss.cancel(); });
}

void HttpServer::Impl::tgi_stream(Response& res, Streams ss, TgiRequest r, int64_t prompt_tokens, uint64_t seed) {
  auto st = std::make_shared<TgiStreamState>(std::move(ss), std::move(r));
  st->prompt_tokens = prompt_tokens;
  st->max_total = engine_ref(false).options().max_total_tokens;
  st->gen.prompt_tokens = prompt_tokens;
  if (st->r.params.do_sample) st->gen.seed = seed;
  send_events(res, st, "a TGI stream");
}

// ---------------------------------------------------------------------------
// OpenAI

void HttpServer::Impl::openai(const std::string& body, Response& res, bool chat) {
  Engine& e = engine_ref();
  OpenAiRequest r = chat ? parse_chat_request(body, limits()) : parse_completion_request(body, limits());
  // `model`: a --lora adapter's name picks it; the served model's id (or,
  // with no adapter loaded, any name) is the base; with adapters loaded
  // another name is an unknown model (404, as OpenAI answers).
  std::string adapter;
  if (e.has_adapter(r.model)) {
    adapter = r.model;
  } else if (!e.options().adapters.empty() && !r.model.empty() && r.model != o.model_id) {
    std::string names;
    for (const auto& a : e.options().adapters) names += ", " + a.first;
    throw HttpError(kModelNotFound, core::str_cat("The model `", r.model, "` does not exist: this server has ",
                                                  o.model_id, names));
  }
  r.params.adapter = adapter;
  // Every prompt's ids, checked (lengths, the vocabulary) before any is submitted.
  struct Job {
    std::vector<int32_t> ids;
    SamplingParams params;
    std::string echo;
  };
  std::vector<Job> jobs;
  const int64_t V = e.vocab_size();
  const size_t count = chat ? 1 : r.prompts.size();
  for (size_t k = 0; k < count; ++k) {
    Job j{chat ? encode_chat(e, r.messages) : std::vector<int32_t>{}, r.params, ""};
    const std::string param = chat ? "messages" : count > 1 ? core::str_cat("prompt[", k, "]") : "prompt";
    if (!chat) {
      const OpenAiRequest::Prompt& p = r.prompts[k];
      if (p.tokens) {
        for (int32_t id : p.ids)
          if (id >= V)
            throw ValidationError("prompt", core::str_cat("`", param, "`: token id ", id, " is outside the vocabulary of ", V));
        j.ids = p.ids;
      } else {
        j.ids = encode_prompt(e, p.text);
      }
      if (r.echo) j.echo = p.tokens ? e.tokenizer().decode(p.ids) : p.text;
    }
    j.params.max_new_tokens = resolve_max_new_tokens(static_cast<int64_t>(j.ids.size()), r.max_tokens,
                                                     e.options().max_input_tokens, e.options().max_total_tokens,
                                                     true, param);
    jobs.push_back(std::move(j));
  }
  // Choice k·n + i: prompt k's i-th, with seed + k·n + i.
  const uint64_t seed = r.seed ? *r.seed : random_u64();
  Streams ss({});
  std::vector<OpenAiStreamState::Echo> echoes;
  int64_t prompt_tokens = 0;
  for (size_t k = 0; k < jobs.size(); ++k) {
    ss.append(submit(e, jobs[k].ids, jobs[k].params, r.n, seed + k * static_cast<uint64_t>(r.n)));
    echoes.resize(ss.size(), {jobs[k].echo, jobs[k].ids.empty() ? 0 : jobs[k].ids[0]});
    prompt_tokens += static_cast<int64_t>(jobs[k].ids.size());
  }
  char id[32];
  std::snprintf(id, sizeof id, "%s%016llx", chat ? "chatcmpl-" : "cmpl-", static_cast<unsigned long long>(random_u64()));
  const OpenAiMeta meta{id, adapter.empty() ? o.model_id : adapter, static_cast<int64_t>(std::time(nullptr))};
  if (r.stream) return openai_stream(res, std::move(ss), std::move(r), meta, prompt_tokens, std::move(echoes), e);
  std::vector<Generation> gens = collect(ss, r.params, seed);
  const TokenText text_of = [&e](int32_t id) { return e.tokenizer().piece_bytes(id); };
  if (chat) return send_json(res, 200, chat_response(meta, gens, r.logprobs, text_of));
  for (size_t c = 0; c < gens.size(); ++c) {
    const Job& j = jobs[c / static_cast<size_t>(r.n)];
    if (r.params.prompt_logprobs) {
      std::vector<Generation> one{std::move(gens[c])};
      name_prompt(one, j.ids, e);
      gens[c] = std::move(one[0]);
    }
    gens[c].echo = j.echo;
  }
  send_json(res, 200, completion_response(meta, gens, prompt_tokens, r.logprobs, text_of));
}

void HttpServer::Impl::openai_stream(Response& res, Streams ss, OpenAiRequest r, OpenAiMeta meta,
                                     int64_t prompt_tokens, std::vector<OpenAiStreamState::Echo> echoes, Engine& e) {
  send_events(res,
              std::make_shared<OpenAiStreamState>(std::move(ss), std::move(r), std::move(meta), prompt_tokens,
                                                  std::move(echoes),
                                                  [&e](int32_t id) { return e.tokenizer().piece_bytes(id); }),
              "an OpenAI stream");
}

// ---------------------------------------------------------------------------

HttpServer::HttpServer(HttpServerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}

HttpServer::HttpServer(Engine& engine, HttpServerOptions options) : HttpServer(std::move(options)) {
  attach(engine);
}

HttpServer::~HttpServer() { stop(); }

void HttpServer::attach(Engine& engine) { impl_->engine = &engine; }

void HttpServer::set_draining() { impl_->draining = true; }

void HttpServer::start() {
  Impl& m = *impl_;
  PO_CHECK(!m.thread.joinable(), "HttpServer::start: already started");
  const Engine* e = m.engine.load();
  const int threads = m.o.threads > 0 ? m.o.threads
                                      : static_cast<int>((e ? e->options().max_concurrent_requests : 128) + 8);
  m.svr.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  errno = 0;
  m.bound_port = m.o.port == 0 ? m.svr.bind_to_any_port(m.o.host)
                               : (m.svr.bind_to_port(m.o.host, m.o.port) ? m.o.port : -1);
  if (m.bound_port < 0)
    PO_THROW(core::IoError, "--host ", m.o.host, " --port ", m.o.port, ": cannot listen there (",
             errno ? std::strerror(errno) : "address not usable", ")");
  m.svr.set_backlog(std::max(SOMAXCONN, 2 * threads));
  m.thread = std::thread([&m] {
    m.svr.listen_after_bind();
    m.listen_done = true;
  });
  // stop() can only stop a server that runs.
  while (!m.svr.is_running() && !m.listen_done) std::this_thread::sleep_for(milliseconds(1));
}

int HttpServer::port() const { return impl_->bound_port; }

void HttpServer::stop() {
  Impl& m = *impl_;
  m.stopping = true;
  if (!m.thread.joinable()) return;
  m.svr.stop();
  m.thread.join();
}

}  // namespace po::serve
