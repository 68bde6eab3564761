// cpp-httplib's server with each connection served by our own stream, for
// what httplib 0.11 lacks:
//   - a deadline on a whole request (request line, headers and body), not
//     only on each read: a slow-loris client trickling a byte every few
//     seconds is dropped at the deadline instead of holding a handler thread
//     for ever (an expired request is answered 408 when its line arrived);
//   - a cap on the bytes one request may send (headers included: httplib
//     bounds a header line but not their number);
//   - a look at the client while a handler runs (Connection::peer_closed):
//     a request whose client hung up is cancelled at the engine's next step,
//     streaming or not;
//   - a lingering close after answering without reading the body (413), so
//     that the client reads the answer instead of a reset;
//   - SO_REUSEADDR only: httplib's default also sets SO_REUSEPORT, which lets
//     a second server bind the same port and take half its connections;
//   - a listen backlog for bursts (set_backlog).
// Server::process_and_close_socket is httplib's per-connection entry
// (private virtual, called by its accept loop); process_request, which
// parses and routes one request over any httplib::Stream, is protected.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <string>

#include "core/http_lib.h"

namespace po::serve {

struct TransportOptions {
  std::chrono::milliseconds read_timeout{5000};       // the longest wait for a request's next bytes
  std::chrono::milliseconds request_timeout{10000};   // a request's line, headers and body, in all
  std::chrono::milliseconds write_timeout{10000};     // the longest wait for the client to take bytes
  std::chrono::milliseconds keep_alive_timeout{5000}; // an idle connection between requests
  size_t keep_alive_max_count = 100;                  // requests on one connection
  size_t max_request_bytes = 2 << 20;                 // bytes one request may send, headers included
};

// One client connection: an httplib::Stream over its socket, with a read
// buffer kept across the requests of the connection.
class Connection final : public httplib::Stream {
 public:
  Connection(int fd, const TransportOptions& o);

  bool is_readable() const override;
  bool is_writable() const override;
  ssize_t read(char* ptr, size_t size) override;
  ssize_t write(const char* ptr, size_t size) override;
  void get_remote_ip_and_port(std::string& ip, int& port) const override;
  void get_local_ip_and_port(std::string& ip, int& port) const override;
  int socket() const override { return fd_; }

  // Waits for the first byte of the next request (true), or false when the
  // connection stays idle past the keep-alive timeout, closes, or `stop`.
  bool wait_for_request(const std::atomic<int>& server_socket);
  // The next request starts: its deadline and byte count start now.
  void begin_request();
  // Whether the client closed its end (or reset it): a cheap non-blocking
  // peek, for handlers polling while the engine works.
  bool peer_closed() const;
  // This request's deadline passed while reading it.
  bool timed_out() const { return timed_out_; }
  // Close after this request's response (its body was not read, or it timed out).
  void close_after() { close_after_ = true; }
  bool closing() const { return close_after_; }
  // Half-close, then read and drop what the client still sends (up to a
  // second), so that it reads our answer instead of a reset.
  void linger();

 private:
  // Waits for readable bytes within the per-read timeout and the request's
  // deadline; false (and timed_out_ once the deadline passed) otherwise.
  bool wait_readable() const;

  int fd_;
  TransportOptions o_;
  std::chrono::steady_clock::time_point deadline_;
  size_t request_bytes_ = 0;
  mutable bool timed_out_ = false;
  bool close_after_ = false;
  char buf_[4096];
  size_t buf_off_ = 0, buf_len_ = 0;
};

// The connection the calling handler thread serves (null off the server's threads).
Connection* current_connection();

class Transport : public httplib::Server {
 public:
  explicit Transport(TransportOptions o);
  // After binding: a listen backlog of `n` connections. libcpp-httplib.so
  // listens with a backlog of 5 (CPPHTTPLIB_LISTEN_BACKLOG, fixed when it was
  // compiled): a burst of clients past it has its SYNs dropped and retried a
  // second later, a second added to their time to first token.
  void set_backlog(int n);

 private:
  bool process_and_close_socket(int sock) override;

  TransportOptions o_;
};

}  // namespace po::serve
