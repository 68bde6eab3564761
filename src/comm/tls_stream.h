// TLS 1.3 over TCP for the federation protocol (comm/federation_protocol.h):
// a coordinator listens, clients dial out. The transport only encrypts and
// frames; who a peer is stays the protocol's business: its HMAC handshake is
// bound to the TLS session through channel_binding() (RFC 9266), so without a
// CA file the coordinator's certificate can be an ephemeral self-signed one
// and a man in the middle still fails the proof.
//
// Invariants: no call blocks past its limit (every socket is non-blocking
// and every wait is a poll() against a deadline, so a timeout never hangs in
// SSL_read); writing to a vanished peer is a CommError, never a SIGPIPE (the
// socket BIO sends with MSG_NOSIGNAL); every OpenSSL failure carries
// OpenSSL's queued error text and the peer's "HOST:PORT".
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "comm/federation_protocol.h"

struct ssl_st;      // OpenSSL's SSL
struct ssl_ctx_st;  // OpenSSL's SSL_CTX

namespace po::comm {

// Coordinator side. Both empty: an ephemeral Ed25519 key and a self-signed
// certificate (CN "pagedoptim-federation", valid from a day ago to ten years
// ahead) made in memory, so a federation needs no certificate files. Both
// set: PEM files, the certificate file may hold a chain. One without the
// other is an InvalidArgument.
struct TlsServerConfig {
  std::string cert_file, key_file;
};

// Client side. ca_file empty: the server's certificate is not verified (the
// caller's authentication is bound to the session instead). ca_file set: the
// chain is verified against it, and the certificate must name the host given
// to tls_connect (a DNS name, or an IP address for an IP literal).
struct TlsClientConfig {
  std::string ca_file;
};

// One TLS connection; move-only, the destructor closes it. One thread uses
// it at a time. After any exception from write or read_message the stream's
// bytes are out of step (part of a frame went or came): close it.
class TlsStream {
 public:
  TlsStream(TlsStream&& o) noexcept;
  TlsStream& operator=(TlsStream&& o) noexcept;
  ~TlsStream();

  // Writes every byte (SSL_write in chunks of at most 1 MiB), waiting as long
  // as the peer takes to read them; a core::CommError "<peer> ..." when it
  // closed or reset the connection.
  void write(std::string_view bytes);
  void write_message(const Message& m);  // write(encode(m))

  // Exactly one frame, decoded (decode_frame with what = peer()). Waits at
  // most wait_ms (negative: no limit) for the frame's first byte and gives
  // nullopt if none came; `stop` (may be empty) is asked every 100 ms of that
  // wait and a true answer gives nullopt as well. The rest of the frame must
  // then arrive within frame_ms, or a CommError says how many of its bytes
  // did. EOF: a CommError "<peer> closed the connection" (saying so when it
  // was mid-frame). Bytes that are no frame: decode_frame's core::IoError.
  // A frame whose header says more than max_frame bytes: a CommError before
  // any of its payload is read (an unauthenticated peer is held to a few
  // KiB: it cannot make the reader buffer a 16 GiB "Model").
  std::optional<Message> read_message(int wait_ms, const std::function<bool()>& stop = {},
                                      int frame_ms = 60000, uint64_t max_frame = UINT64_MAX);

  // RFC 9266 tls-exporter: 32 bytes exported with the label
  // "EXPORTER-Channel-Binding" and no context; equal at both ends of one
  // session, different for any other session.
  Bytes32 channel_binding() const;

  const std::string& peer() const { return peer_; }  // "HOST:PORT" of the other end
  void close();  // best-effort close_notify, then close(2); idempotent
  bool is_open() const { return ssl_ != nullptr; }

 private:
  friend class TlsListener;
  friend TlsStream tls_connect(const std::string&, int, const TlsClientConfig&, int);
  // Takes both; broken_ until handshake() succeeds.
  TlsStream(ssl_st* ssl, int fd, std::string peer) : ssl_(ssl), fd_(fd), peer_(std::move(peer)) {}
  void handshake(bool server, int wait_ms, int limit_ms);
  [[noreturn]] void fail(const std::string& doing, int ret, int err_no);

  ssl_st* ssl_ = nullptr;
  int fd_ = -1;
  std::string peer_;
  bool broken_ = true;  // no handshake yet, or a fatal TLS error since: no close_notify then
};

// A TCP connection accepted but not yet through its TLS handshake; closes
// the socket unless handed to TlsListener::handshake. Move-only.
class PendingSocket {
 public:
  PendingSocket(PendingSocket&& o) noexcept;
  PendingSocket& operator=(PendingSocket&& o) noexcept;
  ~PendingSocket();
  const std::string& peer() const { return peer_; }

 private:
  friend class TlsListener;
  PendingSocket(int fd, std::string peer) : fd_(fd), peer_(std::move(peer)) {}
  int fd_ = -1;
  std::string peer_;
};

// The coordinator's listening socket and TLS context. One thread may accept
// while others run handshakes and use the streams already made.
class TlsListener {
 public:
  // Listens on HOST:PORT (an IPv4 or IPv6 literal or a name; "" is every
  // interface; port 0 picks a free one; SO_REUSEADDR). A core::CommError
  // naming the address if it cannot bind; an InvalidArgument or IoError for
  // a bad certificate configuration.
  TlsListener(const std::string& host, int port, const TlsServerConfig& cfg);
  TlsListener(const TlsListener&) = delete;
  TlsListener& operator=(const TlsListener&) = delete;
  ~TlsListener();

  int port() const { return port_; }  // the bound port

  // Waits up to wait_ms (negative: no limit) for a TCP connection; nullopt
  // when none came (or it vanished before accept).
  std::optional<PendingSocket> accept_socket(int wait_ms);
  // The TLS server handshake within handshake_ms; a core::CommError naming
  // the peer when it fails or times out. Thread-safe: run it on the
  // connection's own thread so a slow client holds up nobody else.
  TlsStream handshake(PendingSocket socket, int handshake_ms) const;
  // accept_socket then handshake.
  std::optional<TlsStream> accept(int wait_ms, int handshake_ms);

 private:
  ssl_ctx_st* ctx_ = nullptr;
  int fd_ = -1;
  int port_ = 0;
  std::string address_;  // "HOST:PORT" as asked, for messages
};

// Dials HOST:PORT (every address getaddrinfo gives, in order) and completes
// the TLS client handshake, all within timeout_ms; a core::CommError naming
// HOST:PORT and why (refused, timed out, certificate verification failed
// with OpenSSL's reason).
TlsStream tls_connect(const std::string& host, int port, const TlsClientConfig& cfg, int timeout_ms);

// "HOST:PORT" or "[IPv6]:PORT" split into the host (without brackets) and
// the port; an InvalidArgument naming `what` for anything else: no host, no
// port, a port outside 1..65535 (0 allowed when allow_zero), an IPv6 address
// without brackets.
std::pair<std::string, int> parse_host_port(const std::string& text, const std::string& what,
                                            bool allow_zero = false);

// "HOST:PORT", or "[HOST]:PORT" when the host holds a ':' (IPv6).
std::string join_host_port(const std::string& host, int port);

}  // namespace po::comm
