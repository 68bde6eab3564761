// TLS transport of the federation protocol (comm/tls_stream.h), over real
// sockets on 127.0.0.1: every message kind and a 40 MB model cross both
// ways; the channel binding is one session's own; reads time out and stop
// when asked; a closed peer, a stalled frame and bytes that are no frame are
// errors naming the peer; a handshake and a refused dial fail within their
// limits; a CA file admits its own certificate for the right host name and
// refuses another; HOST:PORT parsing.
#include "comm/tls_stream.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"

namespace po::comm {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr int kLimitMs = 5000;

long long ms_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}

struct Pair {
  TlsStream client, server;
};

// A client dialled to `listener` and the server's end of it.
Pair connect_pair(TlsListener& listener, const std::string& host = "127.0.0.1", const TlsClientConfig& cfg = {}) {
  // std::async's future joins on destruction, so a failed dial cannot leave the accept running.
  auto server = std::async(std::launch::async, [&] { return listener.accept(kLimitMs, kLimitMs); });
  TlsStream client = tls_connect(host, listener.port(), cfg, kLimitMs);
  std::optional<TlsStream> s = server.get();
  if (!s) throw std::runtime_error("the listener accepted nothing");
  return {std::move(client), std::move(*s)};
}

// The message of the E that `fn` throws; a test failure naming what it
// threw instead otherwise.
template <typename E>
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw another exception type: " << e.what();
    return "";
  }
  ADD_FAILURE() << "threw nothing";
  return "";
}

NamedTensor ramp(const std::string& name, std::vector<int64_t> shape, float scale) {
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = scale * static_cast<float>(i % 977) - 3.0f;
  return f32_tensor(name, std::move(shape), v);
}

std::vector<Message> one_of_each() {
  Model model{7, 0, {ramp("blocks.0.w", {32, 48}, 0.5f), bf16_tensor("norm", {1000}, std::vector<float>(1000, 1.5f))}};
  model.theta_hash = theta_hash(model.tensors);
  Update update{7, model.theta_hash, 3, 512, 40, {ramp("blocks.0.w", {32, 48}, -0.25f)}};
  return {Challenge{random_nonce()}, model, update, Done{9, model.theta_hash}};
}

TEST(TlsStream, EveryKindCrossesBothWays) {
  TlsListener listener("127.0.0.1", 0, {});
  Pair p = connect_pair(listener);
  for (const Message& m : one_of_each()) {
    p.client.write_message(m);
    std::optional<Message> got = p.server.read_message(kLimitMs);
    ASSERT_TRUE(got) << message_type_name(message_type(m)) << " did not reach the server";
    EXPECT_TRUE(*got == m) << message_type_name(message_type(m)) << " changed client → server";
    p.server.write_message(m);
    got = p.client.read_message(kLimitMs);
    ASSERT_TRUE(got) << message_type_name(message_type(m)) << " did not reach the client";
    EXPECT_TRUE(*got == m) << message_type_name(message_type(m)) << " changed server → client";
  }
}

TEST(TlsStream, FortyMegabyteModelArrivesWhole) {
  TlsListener listener("127.0.0.1", 0, {});
  Pair p = connect_pair(listener);
  // 10 Mi f32 elements written as raw bytes, cheaper than converting floats; moved, never copied.
  Model model{1, 0, {}};
  model.tensors.push_back({"big", {10 << 20}, WireDtype::kF32, std::string(size_t{40} << 20, '\0')});
  std::string& data = model.tensors[0].data;
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>((i * 131 + i / 4099) & 0xff);
  model.theta_hash = theta_hash(model.tensors);
  const std::string frame = encode(model);
  ASSERT_GT(frame.size(), size_t{40} << 20);
  std::thread writer([&] { p.server.write(frame); });  // more than the socket buffers: needs a reader
  std::optional<Message> got = p.client.read_message(kLimitMs);
  writer.join();
  ASSERT_TRUE(got) << "no frame of " << frame.size() << " bytes arrived";
  const Model* m = std::get_if<Model>(&*got);
  ASSERT_NE(m, nullptr) << "a " << message_type_name(message_type(*got)) << " arrived instead of a Model";
  EXPECT_EQ(m->theta_hash, model.theta_hash) << "the model's θ hash changed on the way";
  EXPECT_TRUE(*m == model) << "the 40 MB model changed on the way";
}

TEST(TlsStream, ChannelBindingIsOneSessionsOwn) {
  TlsListener listener("127.0.0.1", 0, {});
  Pair a = connect_pair(listener), b = connect_pair(listener);
  EXPECT_EQ(a.client.channel_binding(), a.server.channel_binding()) << "the two ends of one session differ";
  EXPECT_EQ(b.client.channel_binding(), b.server.channel_binding()) << "the two ends of one session differ";
  EXPECT_NE(a.client.channel_binding(), b.client.channel_binding()) << "two sessions share a binding";
  EXPECT_NE(a.client.channel_binding(), Bytes32{}) << "the binding is all zero";
}

TEST(TlsStream, ReadTimesOutAndStopsWhenAsked) {
  TlsListener listener("127.0.0.1", 0, {});
  Pair p = connect_pair(listener);
  auto t0 = Clock::now();
  EXPECT_FALSE(p.server.read_message(150)) << "a message came from a silent client";
  EXPECT_GE(ms_since(t0), 140) << "returned before wait_ms";
  EXPECT_LT(ms_since(t0), 600) << "overran wait_ms = 150 by far";

  t0 = Clock::now();
  int asked = 0;
  EXPECT_FALSE(p.server.read_message(-1, [&] { return ++asked == 3; })) << "a message came from a silent client";
  EXPECT_EQ(asked, 3) << "stop was not asked until it said true";
  EXPECT_GE(ms_since(t0), 250) << "stop asked faster than every 100 ms";
  EXPECT_LT(ms_since(t0), 600) << "did not return once stop said true";

  // The stream is still good after both.
  p.client.write_message(Done{1, 2});
  std::optional<Message> got = p.server.read_message(kLimitMs);
  EXPECT_TRUE(got && *got == Message(Done{1, 2})) << "the Done after the timeouts did not arrive intact";
}

TEST(TlsStream, PeerClosingIsACommError) {
  TlsListener listener("127.0.0.1", 0, {});
  Pair p = connect_pair(listener);
  p.client.close();
  EXPECT_FALSE(p.client.is_open());
  const std::string msg = error_of<core::CommError>([&] { p.server.read_message(kLimitMs); });
  EXPECT_NE(msg.find(p.server.peer() + " closed the connection"), std::string::npos) << msg;

  Pair q = connect_pair(listener);
  const std::string frame = encode(Done{1, 2});
  q.client.write(std::string_view(frame).substr(0, 25));
  q.client.close();
  const std::string mid = error_of<core::CommError>([&] { q.server.read_message(kLimitMs); });
  EXPECT_NE(mid.find("closed the connection in the middle of a frame, after 25 of the frame's " +
                     std::to_string(frame.size()) + " bytes"),
            std::string::npos)
      << mid;
  // Writing to the closed peer is an error, not a SIGPIPE.
  const std::string w = error_of<core::CommError>([&] {
    for (int i = 0; i < 100; ++i) q.server.write(std::string(1 << 16, 'x'));
  });
  EXPECT_NE(w.find(q.server.peer()), std::string::npos) << w;
}

TEST(TlsStream, StalledFrameSaysHowMuchCame) {
  TlsListener listener("127.0.0.1", 0, {});
  Pair p = connect_pair(listener);
  p.client.write(encode(Done{1, 2}).substr(0, kFrameHeaderBytes));
  const auto t0 = Clock::now();
  const std::string msg = error_of<core::CommError>([&] { p.server.read_message(kLimitMs, {}, 150); });
  EXPECT_LT(ms_since(t0), 600) << "frame_ms = 150 overrun";
  EXPECT_NE(msg.find(p.server.peer() + ": a frame did not arrive within 150 ms: 20 of the frame's 44 bytes"),
            std::string::npos)
      << msg;
}

TEST(TlsStream, GarbageIsAnIoErrorNamingThePeer) {
  TlsListener listener("127.0.0.1", 0, {});
  Pair p = connect_pair(listener);
  std::string frame = encode(Done{1, 2});
  frame[0] = 'X';
  p.client.write(frame);
  const std::string msg = error_of<core::IoError>([&] { p.server.read_message(kLimitMs); });
  EXPECT_NE(msg.find(p.server.peer()), std::string::npos) << msg;
  EXPECT_NE(msg.find("magic"), std::string::npos) << msg;
}

TEST(TlsStream, AFrameLargerThanTheReaderTakesIsRefusedFromItsHeader) {
  TlsListener listener("127.0.0.1", 0, {});
  Pair p = connect_pair(listener);
  // Only the header of a frame announcing a 1 GiB Model: refused before any payload.
  std::string header = encode(Done{1, 2}).substr(0, kFrameHeaderBytes);
  const uint32_t model = static_cast<uint32_t>(MessageType::kModel);
  const uint64_t payload = uint64_t{1} << 30;
  std::memcpy(header.data() + 8, &model, 4);
  std::memcpy(header.data() + 12, &payload, 8);
  p.client.write(header);
  const std::string msg = error_of<core::CommError>([&] { p.server.read_message(kLimitMs, {}, kLimitMs, 4096); });
  EXPECT_NE(msg.find(p.server.peer()), std::string::npos) << msg;
  EXPECT_NE(msg.find("at most 4096"), std::string::npos) << msg;
}

// A plain TCP connection to 127.0.0.1:port (no TLS), closed on destruction.
struct RawClient {
  explicit RawClient(int port) : fd(::socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0) << "raw connect to port " << port;
  }
  ~RawClient() { ::close(fd); }
  int fd;
};

TEST(TlsStream, HandshakeFailsWithinItsLimitNamingThePeer) {
  TlsListener listener("127.0.0.1", 0, {});
  {
    RawClient silent(listener.port());  // connects, never speaks TLS
    std::optional<PendingSocket> s = listener.accept_socket(kLimitMs);
    ASSERT_TRUE(s) << "no connection accepted";
    const std::string peer = s->peer();
    const auto t0 = Clock::now();
    const std::string msg = error_of<core::CommError>([&] { listener.handshake(std::move(*s), 150); });
    EXPECT_LT(ms_since(t0), 600) << "handshake_ms = 150 overrun";
    EXPECT_NE(msg.find(peer + ": TLS handshake timed out after 150 ms"), std::string::npos) << msg;
  }
  {
    RawClient gone(listener.port());
    ::shutdown(gone.fd, SHUT_WR);
    const std::string msg = error_of<core::CommError>([&] { listener.accept(kLimitMs, kLimitMs); });
    EXPECT_NE(msg.find("TLS handshake failed: the peer closed the connection"), std::string::npos) << msg;
  }
  EXPECT_FALSE(listener.accept_socket(50)) << "a connection appeared from nowhere";
}

TEST(TlsStream, RefusedDialFailsWithinItsLimit) {
  int port = 0;
  {  // a port that was free a moment ago and has no listener now
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    port = ntohs(a.sin_port);
    ::close(fd);
  }
  const auto t0 = Clock::now();
  const std::string msg = error_of<core::CommError>([&] { tls_connect("127.0.0.1", port, {}, 1000); });
  EXPECT_LT(ms_since(t0), 1000) << "the dial outlived its 1000 ms";
  EXPECT_NE(msg.find("127.0.0.1:" + std::to_string(port)), std::string::npos) << msg;
  EXPECT_NE(msg.find("refused"), std::string::npos) << msg;
}

// ---- certificates from files -----------------------------------------------------

// A self-signed P-256 certificate for DNS name `host`, written as PEM to
// DIR/NAME.crt and DIR/NAME.key.
void write_self_signed(const fs::path& dir, const std::string& name, const std::string& host) {
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(EVP_PKEY_Q_keygen(nullptr, nullptr, "EC", "P-256"),
                                                          EVP_PKEY_free);
  std::unique_ptr<X509, decltype(&X509_free)> cert(X509_new(), X509_free);
  ASSERT_TRUE(key && cert);
  X509_set_version(cert.get(), 2);
  ASN1_INTEGER_set(X509_get_serialNumber(cert.get()), 1);
  X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600);
  X509_gmtime_adj(X509_getm_notAfter(cert.get()), 3600);
  X509_NAME* subject = X509_get_subject_name(cert.get());
  X509_NAME_add_entry_by_txt(subject, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>(host.c_str()), -1,
                             -1, 0);
  X509_set_issuer_name(cert.get(), subject);
  X509_set_pubkey(cert.get(), key.get());
  X509_EXTENSION* san = X509V3_EXT_conf_nid(nullptr, nullptr, NID_subject_alt_name, ("DNS:" + host).c_str());
  ASSERT_NE(san, nullptr);
  X509_add_ext(cert.get(), san, -1);
  X509_EXTENSION_free(san);
  ASSERT_GT(X509_sign(cert.get(), key.get(), EVP_sha256()), 0);
  FILE* c = std::fopen((dir / (name + ".crt")).c_str(), "w");
  FILE* k = std::fopen((dir / (name + ".key")).c_str(), "w");
  ASSERT_TRUE(c && k);
  EXPECT_EQ(PEM_write_X509(c, cert.get()), 1);
  EXPECT_EQ(PEM_write_PrivateKey(k, key.get(), nullptr, nullptr, 0, nullptr, nullptr), 1);
  std::fclose(c);
  std::fclose(k);
}

TEST(TlsStream, CaFileAdmitsItsCertificateAndRefusesAnother) {
  const fs::path dir = fs::temp_directory_path() / ("tls_stream_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  write_self_signed(dir, "server", "localhost");
  write_self_signed(dir, "other", "localhost");
  const std::string crt = (dir / "server.crt").string();
  TlsListener listener("127.0.0.1", 0, {crt, (dir / "server.key").string()});

  Pair p = connect_pair(listener, "localhost", {crt});
  p.client.write_message(Done{3, 4});
  std::optional<Message> got = p.server.read_message(kLimitMs);
  EXPECT_TRUE(got && *got == Message(Done{3, 4})) << "no Done through a verified session";
  EXPECT_EQ(p.client.peer(), "localhost:" + std::to_string(listener.port()));

  const std::string other = error_of<core::CommError>(
      [&] { connect_pair(listener, "localhost", {(dir / "other.crt").string()}); });
  EXPECT_NE(other.find("localhost:" + std::to_string(listener.port())), std::string::npos) << other;
  EXPECT_NE(other.find("certificate verification failed"), std::string::npos) << other;

  // The right CA, but the certificate does not name 127.0.0.1.
  const std::string ip = error_of<core::CommError>([&] { connect_pair(listener, "127.0.0.1", {crt}); });
  EXPECT_NE(ip.find("certificate verification failed"), std::string::npos) << ip;

  EXPECT_NE(error_of<core::InvalidArgument>([&] { TlsListener("127.0.0.1", 0, {crt, ""}); }).find("key file"),
            std::string::npos);
  EXPECT_NE(error_of<core::IoError>([&] { TlsListener("127.0.0.1", 0, {crt, (dir / "other.key").string()}); })
                .find("other.key"),
            std::string::npos);
  fs::remove_all(dir);
}

TEST(TlsStream, ListenerNamesAnAddressItCannotBind) {
  TlsListener first("127.0.0.1", 0, {});
  const std::string msg =
      error_of<core::CommError>([&] { TlsListener("127.0.0.1", first.port(), {}); });
  EXPECT_NE(msg.find("127.0.0.1:" + std::to_string(first.port())), std::string::npos) << msg;
}

TEST(ParseHostPort, AcceptsHostsAndBracketedIpv6) {
  EXPECT_EQ(parse_host_port("127.0.0.1:4000", "x"), std::make_pair(std::string("127.0.0.1"), 4000));
  EXPECT_EQ(parse_host_port("[::1]:4000", "x"), std::make_pair(std::string("::1"), 4000));
  EXPECT_EQ(parse_host_port("host.example:1", "x"), std::make_pair(std::string("host.example"), 1));
  EXPECT_EQ(parse_host_port("h:65535", "x").second, 65535);
  EXPECT_EQ(parse_host_port("h:0", "x", true).second, 0);
  EXPECT_EQ(join_host_port("::1", 7), "[::1]:7");
}

TEST(ParseHostPort, RefusesAnythingElseNamingWhat) {
  for (const std::string bad : {"nohost", "h:0", "h:70000", "h:x", ":80", "::1:80", "h:", "[::1]", "h:-1"}) {
    const std::string msg = error_of<core::InvalidArgument>([&] { parse_host_port(bad, "federated.listen"); });
    EXPECT_NE(msg.find("federated.listen"), std::string::npos) << "for \"" << bad << "\": " << msg;
    EXPECT_NE(msg.find("\"" + bad + "\""), std::string::npos) << "for \"" << bad << "\": " << msg;
  }
}

}  // namespace
}  // namespace po::comm
