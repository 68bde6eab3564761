// Connections under a request deadline (see http_transport.h). All socket
// calls retry EINTR; sends use MSG_NOSIGNAL so a vanished client is an error
// return, never SIGPIPE.
#include "serve/http_transport.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace po::serve {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

thread_local Connection* tls_connection = nullptr;

// poll() for `events` up to `timeout` (0: just look); > 0 when ready.
int wait_for(int fd, short events, milliseconds timeout) {
  pollfd p{fd, events, 0};
  int r;
  do {
    r = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(0, timeout.count())));
  } while (r < 0 && errno == EINTR);
  return r;
}

void address_of(int fd, bool peer, std::string& ip, int& port) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  const int r = peer ? ::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len)
                     : ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  if (r != 0) return;
  char text[INET6_ADDRSTRLEN] = {};
  if (a.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&a);
    ::inet_ntop(AF_INET, &v4->sin_addr, text, sizeof text);
    port = ntohs(v4->sin_port);
  } else if (a.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&a);
    ::inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof text);
    port = ntohs(v6->sin6_port);
  }
  ip = text;
}

}  // namespace

Connection* current_connection() { return tls_connection; }

Connection::Connection(int fd, const TransportOptions& o) : fd_(fd), o_(o) {}

bool Connection::wait_readable() const {
  const auto now = Clock::now();
  if (now >= deadline_) {
    timed_out_ = true;
    return false;
  }
  const auto left = std::chrono::duration_cast<milliseconds>(deadline_ - now) + milliseconds(1);
  if (wait_for(fd_, POLLIN, std::min(o_.read_timeout, left)) > 0) return true;
  if (Clock::now() >= deadline_) timed_out_ = true;
  return false;
}

bool Connection::is_readable() const { return buf_off_ < buf_len_ || wait_readable(); }

bool Connection::is_writable() const {
  return wait_for(fd_, POLLOUT, o_.write_timeout) > 0 && !peer_closed();
}

ssize_t Connection::read(char* ptr, size_t size) {
  if (buf_off_ == buf_len_) {
    if (request_bytes_ >= o_.max_request_bytes || !wait_readable()) {
      if (timed_out_) close_after_ = true;  // what is left of it must not read as the next request
      return -1;
    }
    ssize_t n;
    do {
      n = ::recv(fd_, buf_, sizeof buf_, 0);
    } while (n < 0 && errno == EINTR);
    if (n <= 0) return n;
    buf_off_ = 0;
    buf_len_ = static_cast<size_t>(n);
    request_bytes_ += buf_len_;
  }
  const size_t n = std::min(size, buf_len_ - buf_off_);
  std::memcpy(ptr, buf_ + buf_off_, n);
  buf_off_ += n;
  return static_cast<ssize_t>(n);
}

ssize_t Connection::write(const char* ptr, size_t size) {
  if (wait_for(fd_, POLLOUT, o_.write_timeout) <= 0) return -1;
  ssize_t n;
  do {
    n = ::send(fd_, ptr, size, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  return n;
}

void Connection::get_remote_ip_and_port(std::string& ip, int& port) const { address_of(fd_, true, ip, port); }
void Connection::get_local_ip_and_port(std::string& ip, int& port) const { address_of(fd_, false, ip, port); }

bool Connection::wait_for_request(const std::atomic<int>& server_socket) {
  if (buf_off_ < buf_len_) return true;  // a pipelined request is already here
  const auto until = Clock::now() + o_.keep_alive_timeout;
  // In slices, so that stop() does not wait out idle keep-alive connections.
  while (server_socket != -1) {
    const auto now = Clock::now();
    if (now >= until) return false;
    const auto slice = std::min(milliseconds(50), std::chrono::duration_cast<milliseconds>(until - now));
    const int r = wait_for(fd_, POLLIN, slice);
    if (r < 0) return false;
    if (r > 0) return !peer_closed();
  }
  return false;
}

void Connection::begin_request() {
  deadline_ = Clock::now() + o_.request_timeout;
  request_bytes_ = buf_len_ - buf_off_;
  timed_out_ = false;
}

bool Connection::peer_closed() const {
  if (buf_off_ < buf_len_) return false;
  char c;
  ssize_t n;
  do {
    n = ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  if (n > 0) return false;
  if (n == 0) return true;
  return errno != EAGAIN && errno != EWOULDBLOCK;
}

void Connection::linger() {
  ::shutdown(fd_, SHUT_WR);
  const auto until = Clock::now() + std::chrono::seconds(1);
  char drop[16384];
  while (Clock::now() < until &&
         wait_for(fd_, POLLIN, std::chrono::duration_cast<milliseconds>(until - Clock::now())) > 0) {
    ssize_t n;
    do {
      n = ::recv(fd_, drop, sizeof drop, 0);
    } while (n < 0 && errno == EINTR);
    if (n <= 0) break;
  }
}

Transport::Transport(TransportOptions o) : o_(o) {
  set_socket_options([](int sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
}

void Transport::set_backlog(int n) {
  // listen() again on a listening socket only changes its backlog.
  if (svr_sock_ != -1) ::listen(svr_sock_, n);
}

// httplib's own loop (detail::process_server_socket) with our Connection.
bool Transport::process_and_close_socket(int sock) {
  Connection conn(sock, o_);
  tls_connection = &conn;
  bool ret = false;
  for (size_t left = o_.keep_alive_max_count; left > 0; --left) {
    if (svr_sock_ == -1 || !conn.wait_for_request(svr_sock_)) break;
    conn.begin_request();
    bool closed = false;
    ret = process_request(conn, left == 1 || svr_sock_ == -1, closed, nullptr);
    if (!ret || closed || conn.closing()) break;
  }
  if (conn.closing()) conn.linger();
  tls_connection = nullptr;
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
  return ret;
}

}  // namespace po::serve
