// TLS 1.3 over TCP (see tls_stream.h). Sockets stay non-blocking for their
// whole life: every SSL call that wants the socket is answered by a poll()
// against the caller's deadline and retried with the same arguments, so a
// limit is never overrun inside OpenSSL. OpenSSL reaches the socket through
// a small BIO of our own, because its socket BIO writes with write(2), which
// raises SIGPIPE on a vanished peer; ours sends with MSG_NOSIGNAL.
#include "comm/tls_stream.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "core/error.h"

namespace po::comm {
namespace {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

constexpr size_t kWriteChunk = size_t{1} << 20;
constexpr size_t kReadChunk = size_t{64} << 10;
// A frame's buffer is reserved whole up to this, so it is not copied as it
// grows, while a header alone (unauthenticated) cannot claim more.
constexpr uint64_t kMaxReserve = uint64_t{64} << 20;
constexpr int kStopPollMs = 100;
constexpr char kBindingLabel[] = "EXPORTER-Channel-Binding";

template <auto kFree>
struct Free {
  void operator()(auto* p) const { kFree(p); }
};
template <typename T, auto kFree>
using Owned = std::unique_ptr<T, Free<kFree>>;

Deadline deadline_in(int ms) { return ms < 0 ? Deadline::max() : Clock::now() + std::chrono::milliseconds(ms); }

// Milliseconds left for poll(): -1 for no deadline, else >= 0.
int ms_left(Deadline d) {
  if (d == Deadline::max()) return -1;
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(d - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, 1 << 30));
}

// Every error OpenSSL has queued on this thread, emptying the queue.
std::string openssl_errors() {
  std::string out;
  char buf[256];
  while (const unsigned long e = ERR_get_error()) {
    ERR_error_string_n(e, buf, sizeof buf);
    out += (out.empty() ? "" : "; ") + std::string(buf);
  }
  return out.empty() ? "no OpenSSL error queued" : out;
}

// Why an SSL call returning `ret` failed, and whether that is the peer
// going away (a clean close_notify, EOF without one, or a reset).
struct Failure {
  bool closed = false;
  std::string why;
};
Failure ssl_failure(ssl_st* ssl, int ret, int err_no) {
  const int e = SSL_get_error(ssl, ret);
  if (e == SSL_ERROR_ZERO_RETURN) return {true, "close_notify"};
  if (e == SSL_ERROR_SYSCALL && (err_no == 0 || err_no == ECONNRESET || err_no == EPIPE)) {
    ERR_clear_error();
    return {true, err_no ? std::strerror(err_no) : "EOF"};
  }
  if (e == SSL_ERROR_SYSCALL) return {false, std::strerror(err_no) + std::string(" (") + openssl_errors() + ")"};
  if (ERR_GET_REASON(ERR_peek_last_error()) == SSL_R_UNEXPECTED_EOF_WHILE_READING) {
    ERR_clear_error();
    return {true, "EOF without close_notify"};
  }
  return {false, openssl_errors()};
}

// Waits until the socket can do what SSL_get_error said it wants, or the
// deadline; false on timeout. Errors and hang-ups count as ready: the next
// SSL call reports them.
bool wait_socket(int fd, int ssl_error, int ms) {
  pollfd p{fd, static_cast<short>(ssl_error == SSL_ERROR_WANT_WRITE ? POLLOUT : POLLIN), 0};
  for (;;) {
    const int r = ::poll(&p, 1, ms);
    if (r >= 0) return r > 0;
    if (errno != EINTR) PO_THROW(core::CommError, "poll: ", std::strerror(errno));
  }
}

bool wants_socket(ssl_st* ssl, int ret, int* ssl_error) {
  *ssl_error = SSL_get_error(ssl, ret);
  return *ssl_error == SSL_ERROR_WANT_READ || *ssl_error == SSL_ERROR_WANT_WRITE;
}

// ---- the socket BIO ----------------------------------------------------------

int fd_of(BIO* b) { return static_cast<int>(reinterpret_cast<intptr_t>(BIO_get_data(b))); }  // the fd is the BIO's data

int bio_write(BIO* b, const char* data, int n) {
  BIO_clear_retry_flags(b);
  ssize_t w;
  do w = ::send(fd_of(b), data, static_cast<size_t>(n), MSG_NOSIGNAL);
  while (w < 0 && errno == EINTR);
  if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) BIO_set_retry_write(b);
  return static_cast<int>(w);
}

int bio_read(BIO* b, char* data, int n) {
  BIO_clear_retry_flags(b);
  ssize_t r;
  do r = ::recv(fd_of(b), data, static_cast<size_t>(n), 0);
  while (r < 0 && errno == EINTR);
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) BIO_set_retry_read(b);
  return static_cast<int>(r);
}

long bio_ctrl(BIO*, int cmd, long, void*) { return cmd == BIO_CTRL_FLUSH ? 1 : 0; }  // send() buffers nothing

// A BIO over `fd` (not owning it), for SSL_set_bio.
BIO* socket_bio(int fd) {
  static const Owned<BIO_METHOD, BIO_meth_free> method = [] {
    BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "pagedoptim socket");
    if (m == nullptr || !BIO_meth_set_write(m, bio_write) || !BIO_meth_set_read(m, bio_read) ||
        !BIO_meth_set_ctrl(m, bio_ctrl))
      PO_THROW(core::CommError, "BIO_meth_new: ", openssl_errors());
    return Owned<BIO_METHOD, BIO_meth_free>(m);
  }();
  BIO* b = BIO_new(method.get());
  if (b == nullptr) PO_THROW(core::CommError, "BIO_new: ", openssl_errors());
  BIO_set_data(b, reinterpret_cast<void*>(static_cast<intptr_t>(fd)));
  BIO_set_init(b, 1);
  return b;
}

// ---- sockets and contexts ------------------------------------------------------

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // latency only; failure is harmless
}

// getaddrinfo for TCP; a CommError "<doing> <HOST:PORT>: <why>" if it fails.
Owned<addrinfo, freeaddrinfo> resolve(const std::string& host, int port, bool passive, const std::string& doing) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  const int gai = getaddrinfo(host.empty() ? nullptr : host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (gai != 0) PO_THROW(core::CommError, doing, join_host_port(host, port), ": ", gai_strerror(gai));
  return Owned<addrinfo, freeaddrinfo>(res);
}

std::string address_text(const sockaddr* sa, socklen_t len) {
  char host[NI_MAXHOST] = {}, serv[NI_MAXSERV] = {};
  if (getnameinfo(sa, len, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return "?";
  return join_host_port(host, std::atoi(serv));
}

using CtxPtr = Owned<SSL_CTX, SSL_CTX_free>;

CtxPtr new_context(const SSL_METHOD* method) {
  CtxPtr ctx(SSL_CTX_new(method));
  if (!ctx || !SSL_CTX_set_min_proto_version(ctx.get(), TLS1_3_VERSION))
    PO_THROW(core::CommError, "SSL_CTX_new: ", openssl_errors());
  return ctx;
}

// The ephemeral identity: an Ed25519 key and a self-signed v3 certificate.
void use_ephemeral_certificate(SSL_CTX* ctx) {
  Owned<EVP_PKEY, EVP_PKEY_free> key(EVP_PKEY_Q_keygen(nullptr, nullptr, "ED25519"));
  Owned<X509, X509_free> cert(X509_new());
  int64_t serial = 0;  // random and positive, as RFC 5280 asks
  std::memcpy(&serial, random_nonce().data(), sizeof serial);
  serial = (serial & INT64_MAX) | 1;
  bool ok = key && cert && X509_set_version(cert.get(), 2) &&
            ASN1_INTEGER_set_int64(X509_get_serialNumber(cert.get()), serial) &&
            X509_gmtime_adj(X509_getm_notBefore(cert.get()), -86400L) &&
            X509_gmtime_adj(X509_getm_notAfter(cert.get()), 10L * 366 * 86400);
  X509_NAME* name = ok ? X509_get_subject_name(cert.get()) : nullptr;
  ok = ok && name &&
       X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                                  reinterpret_cast<const unsigned char*>("pagedoptim-federation"), -1, -1, 0) &&
       X509_set_issuer_name(cert.get(), name) && X509_set_pubkey(cert.get(), key.get()) &&
       X509_sign(cert.get(), key.get(), nullptr) > 0 &&  // Ed25519 takes no digest
       SSL_CTX_use_certificate(ctx, cert.get()) && SSL_CTX_use_PrivateKey(ctx, key.get());
  if (!ok) PO_THROW(core::CommError, "making an ephemeral TLS certificate: ", openssl_errors());
}

// A connected non-blocking socket to one of `host`'s addresses by `deadline`.
int dial(const std::string& host, int port, Deadline deadline, int limit_ms, const std::string& peer) {
  const auto res = resolve(host, port, false, "cannot resolve ");
  std::string why = "no address";
  int fd = -1;
  for (addrinfo* a = res.get(); a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    int err = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      if (!wait_socket(fd, SSL_ERROR_WANT_WRITE, ms_left(deadline))) {
        err = ETIMEDOUT;
      } else {
        socklen_t len = sizeof err;
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      }
    }
    if (err != 0) {
      why = err == ETIMEDOUT ? core::str_cat("timed out after ", limit_ms, " ms") : std::strerror(err);
      ::close(fd);
      fd = -1;
    }
  }
  if (fd < 0) PO_THROW(core::CommError, "cannot connect to ", peer, ": ", why);
  set_nodelay(fd);
  return fd;
}

}  // namespace

// ---- TlsStream -----------------------------------------------------------------

void TlsStream::handshake(bool server, int wait_ms, int limit_ms) {
  SSL* ssl = ssl_;
  BIO* bio = socket_bio(fd_);
  SSL_set_bio(ssl, bio, bio);  // one reference for both directions
  server ? SSL_set_accept_state(ssl) : SSL_set_connect_state(ssl);
  const Deadline deadline = deadline_in(wait_ms);
  for (;;) {
    ERR_clear_error();
    errno = 0;
    const int ret = SSL_do_handshake(ssl);
    const int err_no = errno;
    if (ret == 1) {
      broken_ = false;
      return;
    }
    int e = 0;
    if (wants_socket(ssl, ret, &e)) {
      if (!wait_socket(fd_, e, ms_left(deadline)))
        PO_THROW(core::CommError, peer_, ": TLS handshake timed out after ", limit_ms, " ms");
      continue;
    }
    // Without SSL_VERIFY_PEER the result is computed but means nothing.
    const long verify = (SSL_get_verify_mode(ssl) & SSL_VERIFY_PEER) ? SSL_get_verify_result(ssl) : X509_V_OK;
    const std::string cert =
        verify == X509_V_OK ? ""
                            : core::str_cat("certificate verification failed (",
                                            X509_verify_cert_error_string(verify), "): ");
    const Failure f = ssl_failure(ssl, ret, err_no);
    PO_THROW(core::CommError, peer_, ": TLS handshake failed: ", cert,
             f.closed ? "the peer closed the connection (" + f.why + ")" : f.why);
  }
}

TlsStream::TlsStream(TlsStream&& o) noexcept
    : ssl_(std::exchange(o.ssl_, nullptr)), fd_(std::exchange(o.fd_, -1)), peer_(std::move(o.peer_)),
      broken_(o.broken_) {}

TlsStream& TlsStream::operator=(TlsStream&& o) noexcept {
  if (this != &o) {
    close();
    ssl_ = std::exchange(o.ssl_, nullptr);
    fd_ = std::exchange(o.fd_, -1);
    peer_ = std::move(o.peer_);
    broken_ = o.broken_;
  }
  return *this;
}

TlsStream::~TlsStream() { close(); }

void TlsStream::close() {
  if (ssl_ != nullptr) {
    // One try at close_notify, without waiting for the peer's: the frames
    // are self-delimiting, so nothing depends on it arriving.
    if (!broken_) SSL_shutdown(ssl_);
    SSL_free(ssl_);
    ERR_clear_error();
    ssl_ = nullptr;
  }
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void TlsStream::fail(const std::string& doing, int ret, int err_no) {
  const Failure f = ssl_failure(ssl_, ret, err_no);
  broken_ = true;
  if (f.closed) PO_THROW(core::CommError, peer_, " closed the connection", doing, " (", f.why, ")");
  PO_THROW(core::CommError, peer_, doing, ": ", f.why);
}

void TlsStream::write(std::string_view bytes) {
  if (ssl_ == nullptr) PO_THROW(core::CommError, peer_, ": write after the connection was closed here");
  for (size_t done = 0; done < bytes.size();) {
    const size_t n = std::min(kWriteChunk, bytes.size() - done);
    size_t wrote = 0;
    ERR_clear_error();
    errno = 0;
    const int ret = SSL_write_ex(ssl_, bytes.data() + done, n, &wrote);
    const int err_no = errno;
    if (ret == 1) {
      done += wrote;
      continue;
    }
    int e = 0;
    if (wants_socket(ssl_, ret, &e)) {
      wait_socket(fd_, e, -1);  // retried with the same arguments, as OpenSSL requires
      continue;
    }
    fail(core::str_cat(" while ", done, " of ", bytes.size(), " bytes were written"), ret, err_no);
  }
}

void TlsStream::write_message(const Message& m) { write(encode(m)); }

std::optional<Message> TlsStream::read_message(int wait_ms, const std::function<bool()>& stop, int frame_ms,
                                              uint64_t max_frame) {
  if (ssl_ == nullptr) PO_THROW(core::CommError, peer_, ": read after the connection was closed here");
  const Deadline first = deadline_in(wait_ms);
  Deadline rest{};
  std::string frame;
  uint64_t total = 0;  // the frame's size once its header is in
  const auto progress = [&] {
    return total ? core::str_cat(frame.size(), " of the frame's ", total, " bytes")
                 : core::str_cat(frame.size(), " of the ", kFrameHeaderBytes, "-byte frame header");
  };
  char chunk[kReadChunk];
  for (;;) {
    // Never more than the frame needs: what follows stays in OpenSSL for the next call.
    const size_t want =
        total ? std::min<uint64_t>(total - frame.size(), sizeof chunk) : kFrameHeaderBytes - frame.size();
    size_t got = 0;
    ERR_clear_error();
    errno = 0;
    const int ret = SSL_read_ex(ssl_, chunk, want, &got);
    const int err_no = errno;
    if (ret == 1) {
      if (frame.empty()) rest = deadline_in(frame_ms);
      frame.append(chunk, got);
      if (!total) {
        total = frame_size(frame, peer_);  // checks the magic from the first byte
        if (total > max_frame)
          PO_THROW(core::CommError, peer_, ": a frame of ", total, " bytes where at most ", max_frame,
                   " are taken (a Hello or a Welcome is a few hundred)");
        if (total) frame.reserve(std::min<uint64_t>(total, kMaxReserve));
      }
      if (total && frame.size() == total) return decode_frame(frame, peer_);
      continue;
    }
    int e = 0;
    if (!wants_socket(ssl_, ret, &e))
      fail(frame.empty() ? "" : " in the middle of a frame, after " + progress(), ret, err_no);
    if (!frame.empty()) {
      if (!wait_socket(fd_, e, ms_left(rest)))
        PO_THROW(core::CommError, peer_, ": a frame did not arrive within ", frame_ms, " ms: ", progress(),
                 " came");
      continue;
    }
    // No byte yet (a readable socket may hold only part of a TLS record).
    const int left = ms_left(first);
    if (left == 0) return std::nullopt;
    const int slice = stop ? (left < 0 ? kStopPollMs : std::min(left, kStopPollMs)) : left;
    if (!wait_socket(fd_, e, slice) && stop && stop()) return std::nullopt;
  }
}

Bytes32 TlsStream::channel_binding() const {
  Bytes32 out{};
  ERR_clear_error();
  if (ssl_ == nullptr ||
      SSL_export_keying_material(ssl_, out.data(), out.size(), kBindingLabel, sizeof kBindingLabel - 1, nullptr, 0,
                                 0) != 1)
    PO_THROW(core::CommError, peer_, ": TLS channel binding: ", openssl_errors());
  return out;
}

// ---- PendingSocket -------------------------------------------------------------

PendingSocket::PendingSocket(PendingSocket&& o) noexcept : fd_(std::exchange(o.fd_, -1)), peer_(std::move(o.peer_)) {}

PendingSocket& PendingSocket::operator=(PendingSocket&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(o.fd_, -1);
    peer_ = std::move(o.peer_);
  }
  return *this;
}

PendingSocket::~PendingSocket() {
  if (fd_ >= 0) ::close(fd_);
}

// ---- TlsListener ---------------------------------------------------------------

TlsListener::TlsListener(const std::string& host, int port, const TlsServerConfig& cfg)
    : address_(join_host_port(host, port)) {
  PO_CHECK(cfg.cert_file.empty() == cfg.key_file.empty(),
           "TLS: a certificate file needs its key file and the other way round (cert_file \"", cfg.cert_file,
           "\", key_file \"", cfg.key_file, "\")");
  CtxPtr ctx = new_context(TLS_server_method());
  SSL_CTX_set_num_tickets(ctx.get(), 0);  // no resumption: every session is bound afresh
  SSL_CTX_set_session_cache_mode(ctx.get(), SSL_SESS_CACHE_OFF);
  if (cfg.cert_file.empty()) {
    use_ephemeral_certificate(ctx.get());
  } else if (SSL_CTX_use_certificate_chain_file(ctx.get(), cfg.cert_file.c_str()) != 1 ||
             SSL_CTX_use_PrivateKey_file(ctx.get(), cfg.key_file.c_str(), SSL_FILETYPE_PEM) != 1 ||
             SSL_CTX_check_private_key(ctx.get()) != 1) {
    PO_THROW(core::IoError, "TLS certificate \"", cfg.cert_file, "\" with key \"", cfg.key_file,
             "\": ", openssl_errors());
  }

  const auto res = resolve(host, port, true, "cannot listen on ");
  std::string why = "no address";
  for (addrinfo* a = res.get(); a != nullptr && fd_ < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    int one = 1;
    if (fd >= 0 && setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0 &&
        ::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 64) == 0) {
      fd_ = fd;
      break;
    }
    why = std::strerror(errno);
    if (fd >= 0) ::close(fd);
  }
  if (fd_ < 0) PO_THROW(core::CommError, "cannot listen on ", address_, ": ", why);
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  getsockname(fd_, reinterpret_cast<sockaddr*>(&ss), &len);
  port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                         : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  ctx_ = ctx.release();
}

TlsListener::~TlsListener() {
  SSL_CTX_free(ctx_);  // streams made from it hold their own reference
  if (fd_ >= 0) ::close(fd_);
}

std::optional<PendingSocket> TlsListener::accept_socket(int wait_ms) {
  if (!wait_socket(fd_, SSL_ERROR_WANT_READ, wait_ms)) return std::nullopt;
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  const int fd = ::accept4(fd_, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (fd < 0) {
    // Gone before we took it, or taken by another thread: nothing to report.
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNABORTED || errno == EINTR || errno == EPROTO)
      return std::nullopt;
    PO_THROW(core::CommError, "accepting on ", address_, ": ", std::strerror(errno));
  }
  set_nodelay(fd);
  return PendingSocket(fd, address_text(reinterpret_cast<sockaddr*>(&ss), len));
}

TlsStream TlsListener::handshake(PendingSocket socket, int handshake_ms) const {
  SSL* ssl = SSL_new(ctx_);
  if (ssl == nullptr) PO_THROW(core::CommError, socket.peer_, ": SSL_new: ", openssl_errors());
  TlsStream stream(ssl, std::exchange(socket.fd_, -1), std::move(socket.peer_));
  stream.handshake(true, handshake_ms, handshake_ms);
  return stream;
}

std::optional<TlsStream> TlsListener::accept(int wait_ms, int handshake_ms) {
  std::optional<PendingSocket> s = accept_socket(wait_ms);
  if (!s) return std::nullopt;
  return handshake(std::move(*s), handshake_ms);
}

// ---- the client ----------------------------------------------------------------

TlsStream tls_connect(const std::string& host, int port, const TlsClientConfig& cfg, int timeout_ms) {
  const std::string peer = join_host_port(host, port);
  const Deadline deadline = deadline_in(timeout_ms);
  CtxPtr ctx = new_context(TLS_client_method());
  if (!cfg.ca_file.empty()) {
    if (SSL_CTX_load_verify_locations(ctx.get(), cfg.ca_file.c_str(), nullptr) != 1)
      PO_THROW(core::IoError, "TLS CA file \"", cfg.ca_file, "\": ", openssl_errors());
    SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, nullptr);
  }
  Owned<SSL, SSL_free> ssl(SSL_new(ctx.get()));  // holds its own reference to ctx
  if (!ssl) PO_THROW(core::CommError, peer, ": SSL_new: ", openssl_errors());
  // The certificate must name the host as dialled: an IP literal as an IP
  // address (SSL_set1_host matches DNS names only), a name as a DNS name.
  const bool is_ip = X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl.get()), host.c_str()) == 1;
  ERR_clear_error();
  if (!is_ip && (!SSL_set1_host(ssl.get(), host.c_str()) || !SSL_set_tlsext_host_name(ssl.get(), host.c_str())))
    PO_THROW(core::CommError, peer, ": setting the TLS host name: ", openssl_errors());
  const int fd = dial(host, port, deadline, timeout_ms, peer);
  TlsStream stream(ssl.release(), fd, peer);
  stream.handshake(false, ms_left(deadline), timeout_ms);
  return stream;
}

// ---- addresses -----------------------------------------------------------------

std::string join_host_port(const std::string& host, int port) {
  return host.find(':') != std::string::npos ? core::str_cat("[", host, "]:", port) : core::str_cat(host, ":", port);
}

std::pair<std::string, int> parse_host_port(const std::string& text, const std::string& what, bool allow_zero) {
  const auto bad = [&](const char* why) {
    PO_THROW(core::InvalidArgument, what, ": expected HOST:PORT or [IPv6]:PORT, got \"", text, "\" (", why, ")");
  };
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos) bad("no port");
  std::string host = text.substr(0, colon);
  const std::string port_text = text.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  } else if (host.find_first_of("[]:") != std::string::npos) {
    bad("an IPv6 address needs brackets");
  }
  if (host.empty()) bad("no host");
  if (port_text.empty() || port_text.size() > 5 || port_text.find_first_not_of("0123456789") != std::string::npos)
    bad("the port is not a number");
  const int port = std::stoi(port_text);
  if (port > 65535 || (port == 0 && !allow_zero)) bad(allow_zero ? "port past 65535" : "port outside 1..65535");
  return {host, port};
}

}  // namespace po::comm
