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
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>
#include <utility>

#include "core/error.h"
#include "core/log.h"

namespace po::comm {
namespace {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

constexpr uint32_t kMagic = 0x56524f50;  // "PORV"
constexpr uint32_t kVersion = 2;  // 2: challenge, HMAC-signed hello and welcome
constexpr size_t kNonceBytes = 32, kMacBytes = 32;
constexpr size_t kHeaderBytes = 16;
constexpr size_t kMaxFrameBytes = size_t{1} << 30;

enum Kind : uint32_t { kHello = 1, kWelcome, kReject, kGather, kGatherResult, kBroadcast, kChallenge };

const char* kind_name(uint32_t k) {
  switch (k) {
    case kHello: return "hello";
    case kWelcome: return "welcome";
    case kReject: return "reject";
    case kChallenge: return "challenge";
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

// ---- authentication ------------------------------------------------------------

std::string random_bytes(size_t n) {
  std::string out(n, '\0');
  for (size_t got = 0; got < n;) {
    const ssize_t r = getrandom(out.data() + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    PO_CHECK(r > 0, "rendezvous: getrandom: ", errno_text(errno));
    got += static_cast<size_t>(r);
  }
  return out;
}

// HMAC-SHA256(secret, label | parts...), each part length-prefixed so that
// no two different messages sign alike.
std::string mac(const std::string& secret, const char* label, std::initializer_list<std::string_view> parts) {
  std::string msg = label;
  for (std::string_view part : parts) {
    put_u32(msg, static_cast<uint32_t>(part.size()));
    msg.append(part);
  }
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  PO_CHECK(HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
                reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), out, &len) != nullptr &&
               len == kMacBytes,
           "rendezvous: HMAC-SHA256 failed");
  return std::string(reinterpret_cast<const char*>(out), len);
}

bool same_mac(std::string_view a, std::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

// Whether every address `host` resolves to is a loopback one.
bool is_loopback(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) return false;
  bool all = true;
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    if (ai->ai_family == AF_INET) {
      all = all && (ntohl(reinterpret_cast<sockaddr_in*>(ai->ai_addr)->sin_addr.s_addr) >> 24) == 127;
    } else if (ai->ai_family == AF_INET6) {
      const in6_addr& a = reinterpret_cast<sockaddr_in6*>(ai->ai_addr)->sin6_addr;
      all = all && (IN6_IS_ADDR_LOOPBACK(&a) ||
                    (IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127));
    } else {
      all = false;
    }
  }
  freeaddrinfo(res);
  return all;
}

// ---- connection set-up -------------------------------------------------------

// Listens at `port` on the address `host` names, and nowhere else (the first
// of its addresses this host has).
Fd open_listener(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int gai = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (gai != 0 || res == nullptr)
    PO_THROW(core::CommError, "rendezvous: rank 0 cannot resolve MASTER_ADDR ", host, ": ", gai_strerror(gai));
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> guard(res, freeaddrinfo);
  std::string tried;
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    Fd fd(::socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (fd.get() < 0) continue;
    int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    const std::string addr = address_text(ai->ai_addr, ai->ai_addrlen);
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
      const int err = errno;
      if (err == EADDRINUSE) {
        PO_THROW(core::CommError, "rendezvous: MASTER_PORT ", port, " on ", host,
                 " is already in use (bind: ", errno_text(err),
                 "; another run, or a second process with RANK=0?); choose a free MASTER_PORT");
      }
      tried += core::str_cat(tried.empty() ? "" : "; ", addr, ": ", errno_text(err));
      continue;
    }
    if (::listen(fd.get(), SOMAXCONN) != 0)
      PO_THROW(core::CommError, "rendezvous: rank 0 cannot listen on MASTER_PORT ", port, ": ",
               errno_text(errno));
    return fd;
  }
  PO_THROW(core::CommError, "rendezvous: rank 0 cannot listen on MASTER_ADDR ", host, " port ", port,
           " (", tried.empty() ? std::string("no usable address") : tried,
           "); MASTER_ADDR must name an address of rank 0's host");
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
  std::string nonce;    // rank 0: the peer's hello nonce, which the welcome signs
};

std::string rendezvous_secret() {
  if (const char* v = std::getenv("PAGEDOPTIM_RDZV_SECRET"); v != nullptr && *v != '\0') return v;
  const char* file = std::getenv("PAGEDOPTIM_RDZV_KEY_FILE");
  if (file == nullptr || *file == '\0') return "";
  struct stat st {};
  PO_CHECK(::stat(file, &st) == 0, "PAGEDOPTIM_RDZV_KEY_FILE=", file, ": ", errno_text(errno));
  PO_CHECK((st.st_mode & 077) == 0, "PAGEDOPTIM_RDZV_KEY_FILE=", file,
           ": others may read it (permissions ", (st.st_mode >> 6) & 7, (st.st_mode >> 3) & 7, st.st_mode & 7,
           "); `chmod 600` it");
  std::ifstream f(file, std::ios::binary);
  const std::string key((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  PO_CHECK(f.good() || f.eof(), "PAGEDOPTIM_RDZV_KEY_FILE=", file, ": cannot read it");
  PO_CHECK(key.size() >= 16, "PAGEDOPTIM_RDZV_KEY_FILE=", file, ": ", key.size(),
           " bytes; a key needs at least 16 (e.g. `head -c 32 /dev/urandom > FILE`)");
  std::string job;
  for (const char* var : {"SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "PAGEDOPTIM_JOB_ID"})
    if (const char* v = std::getenv(var); v != nullptr && *v != '\0') {
      job = core::str_cat(var, "=", v);
      break;
    }
  PO_CHECK(!job.empty(), "PAGEDOPTIM_RDZV_KEY_FILE is set but no job id is: set SLURM_JOB_ID, "
           "TORCHELASTIC_RUN_ID or PAGEDOPTIM_JOB_ID (the same on every rank)");
  return mac(key, "po-rdzv-job", {job});
}

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
  o.secret = rendezvous_secret();
  return o;
}

Rendezvous::Rendezvous(const RendezvousOptions& options)
    : rank_(options.rank),
      world_size_(options.world_size),
      endpoint_(core::str_cat(options.master_addr, ":", options.master_port)),
      secret_(options.secret),
      timeout_(options.timeout) {
  PO_CHECK(options.world_size >= 1 && options.rank >= 0 && options.rank < options.world_size,
           "rendezvous: rank ", options.rank, " is not in [0, world size ", options.world_size, ")");
  PO_CHECK(options.master_port > 0 && options.master_port < 65536, "rendezvous: MASTER_PORT ",
           options.master_port, " is not a port number (1..65535)");
  PO_CHECK(!options.master_addr.empty(), "rendezvous: MASTER_ADDR is empty");
  PO_CHECK(options.hello.size() <= kMaxBlobBytes, "rendezvous: hello of ", options.hello.size(),
           " bytes exceeds ", kMaxBlobBytes);
  // Without a secret anyone who reaches the port could join: only on loopback.
  PO_CHECK(rank_ != 0 || !secret_.empty() || is_loopback(options.master_addr),
           "rendezvous: MASTER_ADDR ", options.master_addr,
           " is reachable from other hosts and the job has no secret: set PAGEDOPTIM_RDZV_SECRET "
           "(the same on every rank), or PAGEDOPTIM_RDZV_KEY_FILE with SLURM_JOB_ID or "
           "PAGEDOPTIM_JOB_ID");
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

std::string Rendezvous::hello_problem(int r, int w, const std::string& address) const {
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
    const std::string challenge = random_bytes(kNonceBytes);
    Frame hello;
    try {
      // A real peer sends its hello right after the challenge; a stray
      // connection must not hold up the others for long.
      const Deadline soon = std::min(deadline, deadline_after(std::chrono::seconds(5)));
      send_frame(c, kChallenge, 0, challenge, soon);
      hello = recv_frame(c, soon);
    } catch (const WireError& e) {
      PO_LOG_WARN("rendezvous: ignored a connection from ", peer->address, " (", e.detail,
                  "): not a PagedOptim rank");
      continue;
    }
    constexpr size_t kFixed = 12 + kNonceBytes + kMacBytes;
    if (hello.kind != kHello || hello.payload.size() < 12) {
      PO_LOG_WARN("rendezvous: ignored a connection from ", peer->address, " that sent a ",
                  kind_name(hello.kind), " frame instead of a hello");
      continue;
    }
    // Refused one by one (the others go on joining): a hello of another
    // protocol version, or one not signed with this job's secret for this
    // challenge (a stranger, a replayed hello, a rank with another secret).
    auto refuse = [&](const std::string& why) {
      PO_LOG_WARN("rendezvous: refused a connection from ", peer->address, ": ", why);
      try {
        send_frame(c, kReject, 0, core::str_cat("rank 0 refused this connection: ", why),
                   deadline_after(std::chrono::seconds(1)));
      } catch (const WireError&) {
      }
    };
    const uint32_t version = get_u32(hello.payload.data());
    const int r = static_cast<int>(get_u32(hello.payload.data() + 4));
    const int w = static_cast<int>(get_u32(hello.payload.data() + 8));
    if (version != kVersion || hello.payload.size() < kFixed) {
      refuse(core::str_cat("it speaks rendezvous protocol version ", version, ", rank 0 version ", kVersion,
                           " (a different PagedOptim build?)"));
      continue;
    }
    const std::string_view nonce(hello.payload.data() + 12, kNonceBytes);
    const std::string_view signature(hello.payload.data() + 12 + kNonceBytes, kMacBytes);
    const std::string_view blob(hello.payload.data() + kFixed, hello.payload.size() - kFixed);
    if (!same_mac(signature, mac(secret_, "po-rdzv-hello",
                                 {challenge, nonce, hello.payload.substr(0, 12), blob}))) {
      refuse(core::str_cat("its hello (as rank ", r,
                           ") is not signed with this job's secret for this connection's challenge "
                           "(a stranger, a replayed hello, or another PAGEDOPTIM_RDZV_SECRET)"));
      continue;
    }
    peer->nonce.assign(nonce);
    const std::string reason = hello_problem(r, w, peer->address);
    if (!reason.empty()) {
      peers_.push_back(std::move(peer));  // so that it hears the reason too
      fail(reason);
    }
    hellos_[static_cast<size_t>(r)] = std::string(blob);
    peers_[static_cast<size_t>(r)] = std::move(peer);
    ++arrived;
  }
  const std::string welcome = encode_list(hellos_);
  const Deadline send_deadline = deadline_after(timeout_);
  for (int r = 1; r < world_size_; ++r) {
    try {
      const Peer& p = *peers_[static_cast<size_t>(r)];
      send_frame(p.fd.get(), kWelcome, 0, mac(secret_, "po-rdzv-welcome", {p.nonce, welcome}) + welcome,
                 send_deadline);
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
  // Rank 0 was listening when we connected, so it gives up at most timeout_
  // from now: waiting that long (and a little) always hears its verdict.
  const Duration grace = std::chrono::seconds(2);
  const Deadline answer_deadline = deadline_after(timeout_ >= kNoTimeout - grace ? kNoTimeout : timeout_ + grace);
  const std::string nonce = random_bytes(kNonceBytes);
  Frame answer;
  try {
    const Frame challenge = recv_frame(fd.get(), answer_deadline);
    if (challenge.kind != kChallenge || challenge.payload.size() != kNonceBytes)
      throw WireError{WireError::kBadFrame, core::str_cat("a ", kind_name(challenge.kind), " frame first, not a challenge")};
    std::string fixed;
    put_u32(fixed, kVersion);
    put_u32(fixed, static_cast<uint32_t>(rank_));
    put_u32(fixed, static_cast<uint32_t>(world_size_));
    const std::string hello = fixed + nonce +
                              mac(secret_, "po-rdzv-hello", {challenge.payload, nonce, fixed, options.hello}) +
                              options.hello;
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
  if (answer.kind == kWelcome &&
      (answer.payload.size() < kMacBytes ||
       !same_mac(std::string_view(answer.payload).substr(0, kMacBytes),
                 mac(secret_, "po-rdzv-welcome", {nonce, std::string_view(answer.payload).substr(kMacBytes)})))) {
    PO_THROW(core::CommError, "rendezvous: ", endpoint_,
             " answered with a welcome not signed with this job's secret (another job's rank 0, or "
             "another PAGEDOPTIM_RDZV_SECRET)");
  }
  if (answer.kind == kWelcome) answer.payload.erase(0, kMacBytes);
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
