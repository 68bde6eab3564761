// The HTTP front of `pagedoptim serve`: TGI's routes and OpenAI's over one
// Engine, on cpp-httplib (Debian's libcpp-httplib-dev: the one HTTP server
// library Debian packages for C++ that needs no event loop of our own; SSE is
// a chunked response written from the handler's thread).
//
//   POST /generate, /generate_stream (SSE), / (stream or an array), /tokenize
//   GET  /info, /health, /ping, /metrics                         (TGI)
//   POST /v1/completions, /v1/chat/completions (stream or not)
//   GET  /v1/models                                              (OpenAI)
//
// Rules it keeps:
//   - every 4xx and 5xx has a JSON body in the shape of the route's family:
//     TGI's {"error", "error_type"}, OpenAI's {"error": {message, type,
//     param, code}} under /v1 (unknown paths too); validation is 422 on
//     TGI's routes and 400 on OpenAI's, an engine at --max-concurrent-requests
//     429 at once, a body over max_body_bytes 413, a wrong method 405, a
//     missing or wrong API key 401 (every route but /health and /ping);
//   - a bad request ends that request only: the server keeps serving;
//   - a request whose client goes away is cancelled (streaming: when a write
//     fails or the socket closed; otherwise polled every 50 ms), so the
//     engine frees its blocks at its next step;
//   - each streaming request holds one handler thread for its life: there
//     are max_concurrent_requests + 8 of them by default.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace po::serve {

class Engine;

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;               // 0: a free port, port() says which
  std::string api_key;           // empty: no authentication
  std::string model_id = "pagedoptim";
  std::string chat_template = "plain";  // serve/api.h: llama2, chatml, plain
  size_t max_body_bytes = 1 << 20;
  std::chrono::milliseconds read_timeout{5000};      // the longest wait for a request's next bytes
  std::chrono::milliseconds request_timeout{10000};  // a whole request (line, headers, body): slow-loris
  std::chrono::milliseconds write_timeout{10000};    // a client that stops reading
  int64_t max_stop_sequences = 4;
  int64_t max_best_of = 2;
  int64_t max_n = 16;
  int threads = 0;  // handler threads; 0: the engine's max_concurrent_requests + 8
};

class HttpServer {
 public:
  // Without an engine: /health answers 503 ("loading") until attach().
  explicit HttpServer(HttpServerOptions options);
  HttpServer(Engine& engine, HttpServerOptions options);
  ~HttpServer();  // stop()
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // The model is loaded: serve with `engine` (which must outlive the server).
  void attach(Engine& engine);
  // Shutting down: /health answers 503 so that balancers stop sending.
  void set_draining();
  // Binds and listens on a thread of its own; throws IoError naming
  // host:port when it cannot bind.
  void start();
  // The bound port (after start()).
  int port() const;
  // Stops listening and waits for the handlers (streams end when their
  // client is written to next; drain the engine first to finish them).
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace po::serve
