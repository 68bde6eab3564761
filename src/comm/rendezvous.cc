// TCP rendezvous (see rendezvous.h). All sockets are non-blocking and every
// wait is a poll() against a deadline, so no call blocks past its timeout.
// Wire format: frames of a 16-byte header (magic, kind, sequence number,
// payload bytes; little-endian u32 each) and the payload.
#include "comm/rendezvous.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <thread>
#include <utility>

#include "core/error.h"
#include "core/log.h"

namespace po::comm {
namespace {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

constexpr uint32_t kMagic = 0x56524f50;  // "PORV"
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 16;
constexpr size_t kMaxFrameBytes = size_t{1} << 30;

enum Kind : uint32_t { kHello = 1, kWelcome, kReject, kGather, kGatherResult, kBroadcast };

const char* kind_name(uint32_t k) {
  switch (k) {
    case kHello: return "hello";
    case kWelcome: return "welcome";
    case kReject: return "reject";
    case kGather: return "all_gather";
    case kGatherResult: return "all_gather result";
    case kBroadcast: return "broadcast";
  }
  return "unknown";
}

// ---- small helpers -----------------------------------------------------------

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~Fd() { reset(); }
  int get() const { return fd_; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

Deadline deadline_after(Duration d) {
  const auto now = Clock::now();
  if (d >= std::chrono::duration_cast<Duration>(Deadline::max() - now)) return Deadline::max();
  return now + d;
}

// Milliseconds left for poll(): -1 (forever) for Deadline::max(), >= 0 otherwise.
int poll_ms(Deadline deadline) {
  if (deadline == Deadline::max()) return -1;
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, 1 << 30));
}

std::string format_duration(Duration d) {
  if (d == kNoTimeout) return "forever";
  const long long ms = d.count();
  if (ms < 1000) return core::str_cat(ms, " ms");
  if (ms % 1000 == 0) return core::str_cat(ms / 1000, " s");
  return core::str_cat(static_cast<double>(ms) / 1000.0, " s");
}

std::string errno_text(int err) { return std::strerror(err); }

// "1.2.3.4:5678" or "[::1]:5678"; IPv4-mapped IPv6 addresses print as IPv4.
std::string address_text(const sockaddr* sa, socklen_t len) {
  char host[NI_MAXHOST] = {}, serv[NI_MAXSERV] = {};
  if (getnameinfo(sa, len, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return "?";
  std::string h = host;
  if (h.rfind("::ffff:", 0) == 0 && h.find('.') != std::string::npos) h = h.substr(7);
  if (h.find(':') != std::string::npos) h = "[" + h + "]";
  return h + ":" + serv;
}

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // latency only; failure is harmless
}

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

std::string encode_list(const std::vector<std::string>& items) {
  std::string out;
  put_u32(out, static_cast<uint32_t>(items.size()));
  for (const auto& s : items) {
    put_u32(out, static_cast<uint32_t>(s.size()));
    out += s;
  }
  return out;
}

// nullopt-like: false when `in` is not a well-formed list of `expect` items.
bool decode_list(const std::string& in, size_t expect, std::vector<std::string>* out) {
  if (in.size() < 4 || get_u32(in.data()) != expect) return false;
  size_t pos = 4;
  out->clear();
  for (size_t i = 0; i < expect; ++i) {
    if (in.size() - pos < 4) return false;
    const size_t n = get_u32(in.data() + pos);
    pos += 4;
    if (in.size() - pos < n) return false;
    out->emplace_back(in, pos, n);
    pos += n;
  }
  return pos == in.size();
}

// ---- frames ------------------------------------------------------------------

// A failed frame transfer, turned into a message with context by the caller.
struct WireError {
  enum What { kTimeout, kClosed, kSystem, kBadFrame } what;
  std::string detail;
};

struct Frame {
  uint32_t kind = 0;
  uint32_t seq = 0;
  std::string payload;
};

void send_bytes(int fd, const char* p, size_t n, Deadline deadline) {
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w > 0) {
      p += w;
      n -= static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
      if (errno == EPIPE || errno == ECONNRESET) throw WireError{WireError::kClosed, errno_text(errno)};
      throw WireError{WireError::kSystem, "send: " + errno_text(errno)};
    }
    pollfd pfd{fd, POLLOUT, 0};
    const int rc = ::poll(&pfd, 1, poll_ms(deadline));
    if (rc == 0) throw WireError{WireError::kTimeout, "send timed out"};
    if (rc < 0 && errno != EINTR) throw WireError{WireError::kSystem, "poll: " + errno_text(errno)};
  }
}

void recv_bytes(int fd, char* p, size_t n, Deadline deadline) {
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
      continue;
    }
    if (r == 0) throw WireError{WireError::kClosed, "connection closed"};
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      if (errno == ECONNRESET) throw WireError{WireError::kClosed, errno_text(errno)};
      throw WireError{WireError::kSystem, "recv: " + errno_text(errno)};
    }
    pollfd pfd{fd, POLLIN, 0};
    const int rc = ::poll(&pfd, 1, poll_ms(deadline));
    if (rc == 0) throw WireError{WireError::kTimeout, "no data"};
    if (rc < 0 && errno != EINTR) throw WireError{WireError::kSystem, "poll: " + errno_text(errno)};
  }
}

void send_frame(int fd, uint32_t kind, uint32_t seq, const std::string& payload, Deadline deadline) {
  std::string buf;
  buf.reserve(kHeaderBytes + payload.size());
  put_u32(buf, kMagic);
  put_u32(buf, kind);
  put_u32(buf, seq);
  put_u32(buf, static_cast<uint32_t>(payload.size()));
  buf += payload;
  send_bytes(fd, buf.data(), buf.size(), deadline);
}

Frame recv_frame(int fd, Deadline deadline) {
  char h[kHeaderBytes];
  recv_bytes(fd, h, sizeof h, deadline);
  if (get_u32(h) != kMagic) throw WireError{WireError::kBadFrame, "bad magic number"};
  Frame f;
  f.kind = get_u32(h + 4);
  f.seq = get_u32(h + 8);
  const size_t n = get_u32(h + 12);
  if (n > kMaxFrameBytes) throw WireError{WireError::kBadFrame, core::str_cat("frame of ", n, " bytes")};
  f.payload.resize(n);
  recv_bytes(fd, f.payload.data(), n, deadline);
  return f;
}

// ---- connection set-up -------------------------------------------------------

// Listens on every interface at `port`: IPv6 dual-stack where available (so
// IPv4 and IPv6 peers both reach it), IPv4 otherwise.
Fd open_listener(const std::string& host, int port) {
  Fd fd(::socket(AF_INET6, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  bool v6 = fd.get() >= 0;
  if (v6) {
    int zero = 0;
    v6 = setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero) == 0;
  }
  if (!v6) fd = Fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (fd.get() < 0)
    PO_THROW(core::CommError, "rendezvous: rank 0 cannot create a socket: ", errno_text(errno));
  int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_storage ss{};
  socklen_t len;
  if (v6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    a->sin6_family = AF_INET6;
    a->sin6_addr = in6addr_any;
    a->sin6_port = htons(static_cast<uint16_t>(port));
    len = sizeof *a;
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    a->sin_family = AF_INET;
    a->sin_addr.s_addr = htonl(INADDR_ANY);
    a->sin_port = htons(static_cast<uint16_t>(port));
    len = sizeof *a;
  }
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&ss), len) != 0) {
    const int err = errno;
    if (err == EADDRINUSE) {
      PO_THROW(core::CommError, "rendezvous: MASTER_PORT ", port, " on ", host,
               " is already in use (bind: ", errno_text(err),
               "; another run, or a second process with RANK=0?); choose a free MASTER_PORT");
    }
    PO_THROW(core::CommError, "rendezvous: rank 0 cannot listen on MASTER_PORT ", port, " (MASTER_ADDR ",
             host, "): bind: ", errno_text(err));
  }
  if (::listen(fd.get(), SOMAXCONN) != 0)
    PO_THROW(core::CommError, "rendezvous: rank 0 cannot listen on MASTER_PORT ", port, ": ",
             errno_text(errno));
  return fd;
}

// True when a connection came back to its own socket: a connect to a free
// port in the ephemeral range on this host can pick that port as its source
// (TCP simultaneous open). It must count as "nobody listening".
bool connected_to_itself(int fd) {
  sockaddr_storage self{}, peer{};
  socklen_t ls = sizeof self, lp = sizeof peer;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&self), &ls) != 0 ||
      getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &lp) != 0)
    return false;
  return address_text(reinterpret_cast<sockaddr*>(&self), ls) ==
         address_text(reinterpret_cast<sockaddr*>(&peer), lp);
}

// One connection attempt to any address of host:port, each waiting at most
// until `deadline`; an empty Fd and `error` set on failure.
Fd try_connect(const std::string& host, int port, Deadline deadline, std::string* error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0) {
    *error = core::str_cat("cannot resolve '", host, "': ",
                           rc == EAI_SYSTEM ? errno_text(errno) : gai_strerror(rc));
    return Fd();
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> guard(res, freeaddrinfo);
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    Fd fd(::socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (fd.get() < 0) {
      *error = "socket: " + errno_text(errno);
      continue;
    }
    const int rc_connect = ::connect(fd.get(), ai->ai_addr, ai->ai_addrlen);
    if (rc_connect != 0 && errno != EINPROGRESS) {
      *error = core::str_cat("connect to ", address_text(ai->ai_addr, ai->ai_addrlen), ": ",
                             errno_text(errno));
      continue;
    }
    int err = 0;
    if (rc_connect != 0) {
      pollfd pfd{fd.get(), POLLOUT, 0};
      int prc;
      do prc = ::poll(&pfd, 1, poll_ms(deadline));
      while (prc < 0 && errno == EINTR);
      if (prc == 0) {
        *error = core::str_cat("connect to ", address_text(ai->ai_addr, ai->ai_addrlen),
                               ": no answer (host down or packets dropped)");
        continue;
      }
      socklen_t len = sizeof err;
      getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    }
    if (err == 0 && connected_to_itself(fd.get())) err = ECONNREFUSED;
    if (err == 0) return fd;
    *error = core::str_cat("connect to ", address_text(ai->ai_addr, ai->ai_addrlen), ": ",
                           errno_text(err));
  }
  return Fd();
}

}  // namespace

// ---- Rendezvous ----------------------------------------------------------------

struct Rendezvous::Peer {
  Fd fd;
  std::string address;  // the peer's ip:port, for messages
};

RendezvousOptions rendezvous_options(const LaunchEnv& env, Duration timeout) {
  PO_CHECK(!env.master_addr.empty(), "RANK=", env.rank, " and WORLD_SIZE=", env.world_size,
           " are set but MASTER_ADDR is not: processes started without mpirun find rank 0 at "
           "MASTER_ADDR:MASTER_PORT");
  PO_CHECK(env.master_port > 0, "RANK=", env.rank, " and WORLD_SIZE=", env.world_size,
           " are set but MASTER_PORT is not: processes started without mpirun find rank 0 at "
           "MASTER_ADDR:MASTER_PORT");
  RendezvousOptions o;
  o.master_addr = env.master_addr;
  o.master_port = env.master_port;
  o.rank = env.rank;
  o.world_size = env.world_size;
  o.timeout = timeout;
  return o;
}

Rendezvous::Rendezvous(const RendezvousOptions& options)
    : rank_(options.rank),
      world_size_(options.world_size),
      endpoint_(core::str_cat(options.master_addr, ":", options.master_port)),
      timeout_(options.timeout) {
  PO_CHECK(options.world_size >= 1 && options.rank >= 0 && options.rank < options.world_size,
           "rendezvous: rank ", options.rank, " is not in [0, world size ", options.world_size, ")");
  PO_CHECK(options.master_port > 0 && options.master_port < 65536, "rendezvous: MASTER_PORT ",
           options.master_port, " is not a port number (1..65535)");
  PO_CHECK(!options.master_addr.empty(), "rendezvous: MASTER_ADDR is empty");
  PO_CHECK(options.hello.size() <= kMaxBlobBytes, "rendezvous: hello of ", options.hello.size(),
           " bytes exceeds ", kMaxBlobBytes);
  if (rank_ == 0) {
    join_as_root(options);
  } else {
    join_as_peer(options);
  }
}

Rendezvous::~Rendezvous() = default;

void Rendezvous::reject_all(const std::string& reason) {
  const Deadline soon = deadline_after(std::chrono::seconds(1));
  for (auto& p : peers_) {
    if (!p) continue;
    try {
      send_frame(p->fd.get(), kReject, 0, reason, soon);
    } catch (const WireError&) {
      // That peer is gone already; the others still get the reason.
    }
  }
}

std::string Rendezvous::missing_ranks() const {
  std::string missing;
  int n = 0;
  for (int r = 1; r < world_size_; ++r) {
    if (peers_[static_cast<size_t>(r)]) continue;
    if (++n <= 16) missing += core::str_cat(n > 1 ? ", " : "", r);
  }
  if (n > 16) missing += core::str_cat(" and ", n - 16, " more");
  return core::str_cat(n == 1 ? "rank " : "ranks ", missing, " of WORLD_SIZE=", world_size_,
                       " never arrived at rank 0 (MASTER_ADDR:MASTER_PORT ", endpoint_, ") within ",
                       format_duration(timeout_));
}

std::string Rendezvous::hello_problem(uint32_t version, int r, int w, const std::string& address) const {
  if (version != kVersion) {
    return core::str_cat("rank ", r, " (", address, ") speaks rendezvous protocol version ", version,
                         ", rank 0 version ", kVersion, " (different PagedOptim builds?)");
  }
  if (w != world_size_) {
    return core::str_cat("rank ", r, " (", address, ") has WORLD_SIZE=", w, " but rank 0 has WORLD_SIZE=",
                         world_size_, "; every process of a run needs the same WORLD_SIZE");
  }
  if (r <= 0 || r >= world_size_) {
    return core::str_cat("a process at ", address, " has RANK=", r, ", not in [1, WORLD_SIZE=", world_size_,
                         ") as a peer of rank 0 must be");
  }
  if (const auto& first = peers_[static_cast<size_t>(r)]) {
    return core::str_cat("two processes have RANK=", r, " (", first->address, " and ", address,
                         "); every process needs its own RANK in [0, ", world_size_, ")");
  }
  return "";
}

void Rendezvous::join_as_root(const RendezvousOptions& options) {
  const Deadline deadline = deadline_after(timeout_);
  Fd listener = open_listener(options.master_addr, options.master_port);
  hellos_.assign(static_cast<size_t>(world_size_), std::string());
  hellos_[0] = options.hello;
  peers_.resize(static_cast<size_t>(world_size_));
  auto fail = [&](const std::string& reason) {
    reject_all(reason);
    PO_THROW(core::CommError, "rendezvous: ", reason);
  };
  for (int arrived = 1; arrived < world_size_;) {
    pollfd pfd{listener.get(), POLLIN, 0};
    const int rc = ::poll(&pfd, 1, poll_ms(deadline));
    if (rc < 0 && errno == EINTR) continue;
    if (rc == 0) fail(missing_ranks());
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    const int c = ::accept4(listener.get(), reinterpret_cast<sockaddr*>(&ss), &len,
                            SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (c < 0) continue;  // EINTR, EAGAIN, ECONNABORTED: the next poll tells
    auto peer = std::make_unique<Peer>();
    peer->fd = Fd(c);
    peer->address = address_text(reinterpret_cast<sockaddr*>(&ss), len);
    set_nodelay(c);
    Frame hello;
    try {
      // A real peer sends its hello right after connecting; a stray
      // connection must not hold up the others for long.
      hello = recv_frame(c, std::min(deadline, deadline_after(std::chrono::seconds(5))));
    } catch (const WireError& e) {
      PO_LOG_WARN("rendezvous: ignored a connection from ", peer->address, " (", e.detail,
                  "): not a PagedOptim rank");
      continue;
    }
    if (hello.kind != kHello || hello.payload.size() < 12) {
      PO_LOG_WARN("rendezvous: ignored a connection from ", peer->address, " that sent a ",
                  kind_name(hello.kind), " frame instead of a hello");
      continue;
    }
    const int r = static_cast<int>(get_u32(hello.payload.data() + 4));
    const std::string reason = hello_problem(get_u32(hello.payload.data()), r,
                                             static_cast<int>(get_u32(hello.payload.data() + 8)),
                                             peer->address);
    if (!reason.empty()) {
      peers_.push_back(std::move(peer));  // so that it hears the reason too
      fail(reason);
    }
    hellos_[static_cast<size_t>(r)] = hello.payload.substr(12);
    peers_[static_cast<size_t>(r)] = std::move(peer);
    ++arrived;
  }
  const std::string welcome = encode_list(hellos_);
  const Deadline send_deadline = deadline_after(timeout_);
  for (int r = 1; r < world_size_; ++r) {
    try {
      send_frame(peers_[static_cast<size_t>(r)]->fd.get(), kWelcome, 0, welcome, send_deadline);
    } catch (const WireError& e) {
      fail(core::str_cat("rank ", r, " (", peers_[static_cast<size_t>(r)]->address,
                         ") went away before the group was complete (", e.detail, ")"));
    }
  }
}

void Rendezvous::join_as_peer(const RendezvousOptions& options) {
  const Deadline connect_deadline = deadline_after(timeout_);
  const auto start = Clock::now();
  std::string error;
  Fd fd;
  int attempts = 0;
  auto backoff = std::chrono::milliseconds(10);
  for (;;) {
    ++attempts;
    // One attempt may not take all the time: a host that drops packets for a
    // while (still booting, say) gets asked again.
    const Deadline attempt_deadline =
        std::min(connect_deadline, deadline_after(std::chrono::seconds(5)));
    fd = try_connect(options.master_addr, options.master_port, attempt_deadline, &error);
    if (fd.get() >= 0) break;
    if (Clock::now() >= connect_deadline) {
      PO_THROW(core::CommError, "rendezvous: rank ", rank_, " could not reach rank 0 at MASTER_ADDR:MASTER_PORT ",
               endpoint_, " within ", format_duration(timeout_), " (", attempts, " attempts; last: ",
               error, ")");
    }
    const auto left = connect_deadline - Clock::now();
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, left));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
  set_nodelay(fd.get());
  std::string hello;
  put_u32(hello, kVersion);
  put_u32(hello, static_cast<uint32_t>(rank_));
  put_u32(hello, static_cast<uint32_t>(world_size_));
  hello += options.hello;
  // Rank 0 was listening when we connected, so it gives up at most timeout_
  // from now: waiting that long (and a little) always hears its verdict.
  const Duration grace = std::chrono::seconds(2);
  const Deadline answer_deadline = deadline_after(timeout_ >= kNoTimeout - grace ? kNoTimeout : timeout_ + grace);
  Frame answer;
  try {
    send_frame(fd.get(), kHello, 0, hello, answer_deadline);
    answer = recv_frame(fd.get(), answer_deadline);
  } catch (const WireError& e) {
    const auto waited = std::chrono::duration_cast<Duration>(Clock::now() - start);
    switch (e.what) {
      case WireError::kTimeout:
        PO_THROW(core::CommError, "rendezvous: rank ", rank_, " reached rank 0 at ", endpoint_,
                 " but rank 0 did not answer within ", format_duration(waited));
      case WireError::kBadFrame:
        PO_THROW(core::CommError, "rendezvous: ", endpoint_,
                 " answered, but not as a PagedOptim rendezvous (", e.detail,
                 "); is another service using MASTER_PORT?");
      default:
        PO_THROW(core::CommError, "rendezvous: rank 0 at ", endpoint_,
                 " closed the connection before the group was complete (", e.detail,
                 "); see rank 0's log");
    }
  }
  if (answer.kind == kReject) {
    PO_THROW(core::CommError, "rendezvous: rank 0 at ", endpoint_, " gave up: ", answer.payload);
  }
  if (answer.kind != kWelcome || !decode_list(answer.payload, static_cast<size_t>(world_size_), &hellos_)) {
    PO_THROW(core::CommError, "rendezvous: ", endpoint_, " answered a ", kind_name(answer.kind),
             " frame that is not a welcome for ", world_size_, " ranks");
  }
  peers_.push_back(std::make_unique<Peer>());
  peers_[0]->fd = std::move(fd);
  peers_[0]->address = endpoint_;
}

namespace {

// Throws the error for a failed transfer with `peer_rank` during operation `op` #seq.
[[noreturn]] void throw_op_error(const WireError& e, const char* op, uint32_t seq, int rank, int peer_rank,
                                 Duration timeout) {
  const std::string where = core::str_cat("rendezvous: ", op, " #", seq, " on rank ", rank, ": ");
  switch (e.what) {
    case WireError::kTimeout:
      PO_THROW(core::Timeout, where, "rank ", peer_rank, " did not take part within ",
               format_duration(timeout));
    case WireError::kClosed:
      PO_THROW(core::CommError, where, "rank ", peer_rank, " closed the connection (", e.detail,
               "); see its log");
    default:
      PO_THROW(core::CommError, where, "exchange with rank ", peer_rank, " failed: ", e.detail);
  }
}

void check_frame(const Frame& f, uint32_t kind, uint32_t seq, const char* op, int rank, int peer_rank) {
  if (f.kind == kind && f.seq == seq) return;
  PO_THROW(core::CommError, "rendezvous: ranks disagree on the order of operations: rank ", rank,
           " runs ", op, " #", seq, " but rank ", peer_rank, " sent ", kind_name(f.kind), " #", f.seq);
}

}  // namespace

std::vector<std::string> Rendezvous::all_gather(const std::string& blob) {
  PO_CHECK(blob.size() <= kMaxBlobBytes, "rendezvous: all_gather of ", blob.size(), " bytes exceeds ",
           kMaxBlobBytes);
  const uint32_t seq = ++seq_;
  const Deadline deadline = deadline_after(timeout_);
  std::vector<std::string> out(static_cast<size_t>(world_size_));
  if (rank_ != 0) {
    Frame f;
    try {
      send_frame(peers_[0]->fd.get(), kGather, seq, blob, deadline);
      f = recv_frame(peers_[0]->fd.get(), deadline);
    } catch (const WireError& e) {
      throw_op_error(e, "all_gather", seq, rank_, 0, timeout_);
    }
    check_frame(f, kGatherResult, seq, "all_gather", rank_, 0);
    if (!decode_list(f.payload, out.size(), &out))
      PO_THROW(core::CommError, "rendezvous: all_gather #", seq, ": malformed result from rank 0");
    return out;
  }
  out[0] = blob;
  for (int r = 1; r < world_size_; ++r) {
    Frame f;
    try {
      f = recv_frame(peers_[static_cast<size_t>(r)]->fd.get(), deadline);
    } catch (const WireError& e) {
      throw_op_error(e, "all_gather", seq, rank_, r, timeout_);
    }
    check_frame(f, kGather, seq, "all_gather", rank_, r);
    out[static_cast<size_t>(r)] = std::move(f.payload);
  }
  const std::string result = encode_list(out);
  for (int r = 1; r < world_size_; ++r) {
    try {
      send_frame(peers_[static_cast<size_t>(r)]->fd.get(), kGatherResult, seq, result, deadline);
    } catch (const WireError& e) {
      throw_op_error(e, "all_gather", seq, rank_, r, timeout_);
    }
  }
  return out;
}

std::string Rendezvous::broadcast(const std::string& blob) {
  const uint32_t seq = ++seq_;
  const Deadline deadline = deadline_after(timeout_);
  if (rank_ == 0) {
    PO_CHECK(blob.size() <= kMaxBlobBytes, "rendezvous: broadcast of ", blob.size(), " bytes exceeds ",
             kMaxBlobBytes);
    for (int r = 1; r < world_size_; ++r) {
      try {
        send_frame(peers_[static_cast<size_t>(r)]->fd.get(), kBroadcast, seq, blob, deadline);
      } catch (const WireError& e) {
        throw_op_error(e, "broadcast", seq, rank_, r, timeout_);
      }
    }
    return blob;
  }
  Frame f;
  try {
    f = recv_frame(peers_[0]->fd.get(), deadline);
  } catch (const WireError& e) {
    throw_op_error(e, "broadcast", seq, rank_, 0, timeout_);
  }
  check_frame(f, kBroadcast, seq, "broadcast", rank_, 0);
  return std::move(f.payload);
}

}  // namespace po::comm
