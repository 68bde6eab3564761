// The federation wire protocol (comm/federation_protocol.h): every message
// round-trips to equal structs and the same bytes; every malformed frame is
// an IoError naming the caller's `what` and the field; encode refuses what
// the peer would; the HMAC challenge holds against a wrong secret, another
// client's key and a replay, and its derivations match Python's hmac; the
// fingerprint and θ hash ignore order and see every change; the streaming
// size helper waits for whole frames.
#include "comm/federation_protocol.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/error.h"

namespace po::comm {
namespace {

const std::string kWhat = "peer 10.0.0.7:4711";

// The message of the core::IoError `fn` throws; a test failure if it throws
// anything else or nothing.
std::string io_error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const core::IoError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something other than an IoError: " << e.what();
    return "";
  }
  ADD_FAILURE() << "threw nothing";
  return "";
}

std::string invalid_argument_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const core::InvalidArgument& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something other than an InvalidArgument: " << e.what();
    return "";
  }
  ADD_FAILURE() << "threw nothing";
  return "";
}

// Expects decode_frame(frame) to be refused naming kWhat and every one of `parts`.
void expect_refused(const std::string& frame, std::initializer_list<std::string> parts) {
  const std::string msg = io_error_of([&] { decode_frame(frame, kWhat); });
  EXPECT_NE(msg.find(kWhat), std::string::npos) << "the error does not name what was read: " << msg;
  for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' missing from: " << msg;
}

template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}

// A frame around `payload` with a correct length and checksum.
std::string frame(uint32_t type, const std::string& payload) {
  std::string out("POFED001", 8);
  put<uint32_t>(out, type);
  put<uint64_t>(out, payload.size());
  out += payload;
  put<uint64_t>(out, XXH3_64bits(out.data(), out.size()));
  return out;
}

// `f` with its checksum recomputed after an edit.
std::string resealed(std::string f) {
  const uint64_t sum = XXH3_64bits(f.data(), f.size() - 8);
  std::memcpy(f.data() + f.size() - 8, &sum, 8);
  return f;
}

// One tensor's wire bytes (the tensors layout of federation_protocol.cc).
std::string tensor_bytes(const std::string& name, uint32_t dtype, const std::vector<int64_t>& shape, uint64_t data_len,
                         size_t data_actual) {
  std::string out;
  put<uint32_t>(out, static_cast<uint32_t>(name.size()));
  out += name;
  put<uint32_t>(out, dtype);
  put<uint32_t>(out, static_cast<uint32_t>(shape.size()));
  for (int64_t d : shape) put<int64_t>(out, d);
  put<uint64_t>(out, data_len);
  out += std::string(data_actual, '\x5a');
  return out;
}

// A Model frame (round 1, hash 2) of the given tensor bytes, `count` claimed.
std::string model_frame(uint32_t count, const std::string& tensors) {
  std::string payload;
  put<uint64_t>(payload, 1);
  put<uint64_t>(payload, 2);
  put<uint32_t>(payload, count);
  return frame(static_cast<uint32_t>(MessageType::kModel), payload + tensors);
}

Nonce32 bytes_from(uint8_t first) {
  Nonce32 n;
  for (size_t i = 0; i < n.size(); ++i) n[i] = static_cast<uint8_t>(first + i);
  return n;
}

std::string hex(const Bytes32& b) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (uint8_t c : b) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

std::vector<NamedTensor> sample_tensors() {
  const std::vector<float> w = {1.5f, -2.25f, 3.0f, 0.0f, -0.0f, 1e-30f};
  const std::vector<float> b = {0.1f, 0.2f, 0.3f};
  return {f32_tensor("h.0.attn.w", {2, 3}, w), bf16_tensor("h.0.attn.b", {3}, b),
          f32_tensor("empty", {0, 5}, {}), f32_tensor("scalar", {}, std::vector<float>{42.0f}),
          NamedTensor{"bf16.raw", {2}, WireDtype::kBf16, std::string("\x80\x3f\xc0\x7f", 4)}};
}

// decode(encode(m)) == m, and it encodes to the same bytes again.
void expect_round_trip(const Message& m) {
  const std::string bytes = encode(m);
  const Message back = decode_frame(bytes, kWhat);
  EXPECT_EQ(message_type(back), message_type(m));
  EXPECT_TRUE(back == m) << message_type_name(message_type(m)) << " changed in a round trip";
  EXPECT_EQ(encode(back), bytes) << message_type_name(message_type(m)) << " re-encodes to other bytes";
  EXPECT_EQ(frame_size_if_complete(bytes, kWhat), bytes.size());
}

// ---- round trips --------------------------------------------------------------------

TEST(FederationProtocol, EveryMessageRoundTrips) {
  expect_round_trip(Challenge{bytes_from(1)});
  expect_round_trip(Hello{7, bytes_from(9), 0xfedcba9876543210ull, bytes_from(200)});
  expect_round_trip(Welcome{123456789012ull, bytes_from(77)});
  expect_round_trip(Refuse{"client 3 is already connected (from 10.0.0.8:5000)"});
  expect_round_trip(Refuse{""});
  expect_round_trip(Model{4, 0x1234, {}});
  expect_round_trip(Model{5, theta_hash(sample_tensors()), sample_tensors()});
  expect_round_trip(Update{5, 0xabc, 3, 4096, 500, {}});
  expect_round_trip(Update{~0ull, ~0ull, ~0u, ~0ull, ~0ull, sample_tensors()});
  expect_round_trip(Ack{9, 2});
  expect_round_trip(Done{10, 0x77});
}

TEST(FederationProtocol, FrameLayoutIsMagicTypeLengthPayloadChecksum) {
  const std::string f = encode(Ack{0x0102030405060708ull, 0x0a0b0c0du});
  ASSERT_EQ(f.size(), 20u + 12u + 8u);
  EXPECT_EQ(f.substr(0, 8), "POFED001");
  uint32_t type;
  uint64_t len, round, sum;
  uint32_t id;
  std::memcpy(&type, f.data() + 8, 4);
  std::memcpy(&len, f.data() + 12, 8);
  std::memcpy(&round, f.data() + 20, 8);
  std::memcpy(&id, f.data() + 28, 4);
  std::memcpy(&sum, f.data() + 32, 8);
  EXPECT_EQ(type, 7u);
  EXPECT_EQ(len, 12u);
  EXPECT_EQ(round, 0x0102030405060708ull);
  EXPECT_EQ(id, 0x0a0b0c0du);
  EXPECT_EQ(sum, XXH3_64bits(f.data(), 32));
  // A hand-built tensor frame reads as the tensor it describes.
  const Model m = expect<Model>(decode_frame(model_frame(1, tensor_bytes("w", 2, {3}, 6, 6)), kWhat), kWhat);
  ASSERT_EQ(m.tensors.size(), 1u);
  EXPECT_EQ(m.tensors[0], (NamedTensor{"w", {3}, WireDtype::kBf16, std::string(6, '\x5a')}));
}

TEST(FederationProtocol, TensorsConvertToF32) {
  const std::vector<float> v = {1.0f, -3.5f, 1.0f / 3.0f};
  EXPECT_EQ(tensor_f32(f32_tensor("a", {3}, v)), v);
  const std::vector<float> b = tensor_f32(bf16_tensor("b", {1, 3}, v));
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0], 1.0f);
  EXPECT_EQ(b[1], -3.5f);
  EXPECT_EQ(b[2], 0.333984375f) << "1/3 rounds to nearest even in bf16";
  const std::string msg = invalid_argument_of([&] { f32_tensor("c", {2, 2}, v); });
  EXPECT_NE(msg.find("3 values for a shape of 4 elements"), std::string::npos) << msg;
}

// ---- malformed frames -----------------------------------------------------------------

TEST(FederationProtocol, RefusesBadFramesNamingTheField) {
  const std::string good = encode(Ack{1, 2});
  std::string f = good;
  f[3] = 'X';
  expect_refused(f, {"the magic", "'POFXD001'", "not 'POFED001'"});
  expect_refused("GET / HTTP/1.1\r\nHost: x\r\n\r\n", {"the magic", "'GET / HT'"});
  expect_refused(good.substr(0, 5), {"the header", "cut short"});
  expect_refused(good.substr(0, 24), {"the header", "cut short", "24 bytes"});

  f = good;
  f[8] = 42;
  expect_refused(resealed(f), {"the message type", "42 is unknown"});
  f = good;
  f[8] = 0;
  expect_refused(resealed(f), {"the message type", "0 is unknown"});

  // The header's length against the frame's.
  expect_refused(good + "x", {"the payload length", "header says 12", "holds 13"});
  expect_refused(good.substr(0, good.size() - 1), {"the payload length", "header says 12", "holds 11"});
  f = good;
  const uint64_t huge = kMaxPayloadBytes + 1;
  std::memcpy(f.data() + 12, &huge, 8);
  expect_refused(f, {"the payload length", "17179869185 bytes (at most 17179869184)"});

  f = good;
  f[25] ^= 1;
  expect_refused(f, {"the checksum", "stored 0x", "computed 0x"});
  f = good;
  f.back() ^= 1;
  expect_refused(f, {"the checksum"});
}

TEST(FederationProtocol, RefusesTruncatedAndTrailingPayloads) {
  const auto ack = static_cast<uint32_t>(MessageType::kAck);
  expect_refused(frame(ack, std::string(10, '\0')), {"the Ack's client id", "cut short (needs 4 bytes, 2 left)"});
  expect_refused(frame(ack, std::string(13, '\0')), {"the end of the Ack", "1 bytes left over"});
  expect_refused(frame(static_cast<uint32_t>(MessageType::kChallenge), std::string(31, '\0')),
                 {"the Challenge's nonce", "cut short"});
  expect_refused(frame(static_cast<uint32_t>(MessageType::kHello), std::string(4 + 32 + 8 + 31, '\0')),
                 {"the Hello's proof", "cut short (needs 32 bytes, 31 left)"});
  expect_refused(frame(static_cast<uint32_t>(MessageType::kWelcome), std::string(7, '\0')),
                 {"the Welcome's round", "cut short"});
  expect_refused(frame(static_cast<uint32_t>(MessageType::kDone), std::string(17, '\0')),
                 {"the end of the Done", "1 bytes left over"});
  std::string update(8 + 8 + 4 + 8 + 5, '\0');
  expect_refused(frame(static_cast<uint32_t>(MessageType::kUpdate), update), {"the Update's step count", "cut short"});

  std::string refuse;
  put<uint32_t>(refuse, 10);
  refuse += "too short";
  expect_refused(frame(static_cast<uint32_t>(MessageType::kRefuse), refuse),
                 {"the Refuse's reason", "cut short (needs 10 bytes, 9 left)"});
  refuse.clear();
  put<uint32_t>(refuse, kMaxReasonBytes + 1);
  expect_refused(frame(static_cast<uint32_t>(MessageType::kRefuse), refuse),
                 {"the Refuse's reason length", "65537 bytes (at most 65536)"});

  // Every proper prefix of a valid Update's payload is cut short somewhere.
  const std::string u = encode(Update{1, 2, 3, 4, 5, sample_tensors()});
  const std::string payload = u.substr(20, u.size() - 28);
  for (size_t n = 0; n < payload.size(); ++n)
    expect_refused(frame(static_cast<uint32_t>(MessageType::kUpdate), payload.substr(0, n)), {"cut short"});
  expect_refused(frame(static_cast<uint32_t>(MessageType::kUpdate), payload + "\x01"),
                 {"the end of the Update", "1 bytes left over"});
}

TEST(FederationProtocol, RefusesMalformedTensors) {
  expect_refused(model_frame(1, tensor_bytes(std::string(1025, 'n'), 1, {1}, 4, 4)),
                 {"tensor 0's name length", "1025 bytes (at most 1024)"});
  expect_refused(model_frame(1, tensor_bytes("w", 3, {1}, 4, 4)), {"tensor 0 ('w')'s dtype", "code 3 is unknown"});
  expect_refused(model_frame(1, tensor_bytes("w", 1, std::vector<int64_t>(9, 1), 4, 4)),
                 {"tensor 0 ('w')'s dim count", "9 dims (at most 8)"});
  expect_refused(model_frame(1, tensor_bytes("w", 1, {2, -3}, 0, 0)),
                 {"tensor 0 ('w')'s shape", "dim 1 is -3 (negative)"});
  expect_refused(model_frame(1, tensor_bytes("w", 1, {int64_t{1} << 32, int64_t{1} << 32}, 0, 0)),
                 {"tensor 0 ('w')'s shape", "overflows int64"});
  expect_refused(model_frame(1, tensor_bytes("w", 1, {int64_t{1} << 40}, 0, 0)),
                 {"tensor 0 ('w')'s shape", "more than a payload may hold"});
  expect_refused(model_frame(1, tensor_bytes("w", 2, {3}, 4, 4)),
                 {"tensor 0 ('w')'s data length", "4 bytes, not numel 3 × 2 (bf16) = 6"});
  expect_refused(model_frame(1, tensor_bytes("w", 1, {3}, 12, 11)), {"tensor 0 ('w')'s data", "cut short"});
  expect_refused(model_frame(2, tensor_bytes("a", 1, {1}, 4, 4) + tensor_bytes("b", 1, {1}, 4, 4) + "x"),
                 {"the end of the Model", "1 bytes left over"});
  expect_refused(model_frame(3, tensor_bytes("a", 1, {1}, 4, 4) + tensor_bytes("b", 1, {}, 4, 4) +
                                    tensor_bytes("a", 2, {2}, 4, 4)),
                 {"tensor 2's name", "'a' repeats tensor 0's"});
  expect_refused(model_frame(kMaxTensors + 1, ""), {"the tensor count", "1048577 (at most 1048576)"});
  expect_refused(model_frame(5, tensor_bytes("a", 1, {1}, 4, 4)),
                 {"the tensor count", "5 tensors cannot fit in the 33 bytes left"});
  // A zero in the shape makes it empty whatever the other dims.
  const Model m = expect<Model>(decode_frame(model_frame(1, tensor_bytes("z", 1, {0, int64_t{1} << 62}, 0, 0)), kWhat),
                                kWhat);
  EXPECT_EQ(m.tensors.at(0).shape, (std::vector<int64_t>{0, int64_t{1} << 62}));
}

TEST(FederationProtocol, EncodeRefusesWhatThePeerWouldRefuse) {
  auto refused = [](NamedTensor t, const std::string& part) {
    const std::string msg = invalid_argument_of([&] { encode(Model{1, 2, {std::move(t)}}); });
    EXPECT_NE(msg.find(part), std::string::npos) << "'" << part << "' missing from: " << msg;
  };
  refused(NamedTensor{"w", {2}, WireDtype::kF32, std::string(4, '\0')}, "data is 4 bytes, not numel 2 × 4 (f32) = 8");
  refused(NamedTensor{std::string(1025, 'n'), {}, WireDtype::kF32, std::string(4, '\0')}, "name is 1025 bytes");
  refused(NamedTensor{"w", std::vector<int64_t>(9, 1), WireDtype::kF32, std::string(4, '\0')}, "shape has 9 dims");
  refused(NamedTensor{"w", {-1}, WireDtype::kF32, ""}, "dim 0 is -1 (negative)");
  refused(NamedTensor{"w", {1}, static_cast<WireDtype>(9), ""}, "dtype code 9 is unknown");
  const std::string dup = invalid_argument_of([] {
    const std::vector<float> one = {1.0f};
    encode(Update{1, 2, 3, 4, 5, {f32_tensor("w", {}, one), f32_tensor("w", {}, one)}});
  });
  EXPECT_NE(dup.find("tensors 0 and 1 are both named 'w'"), std::string::npos) << dup;
  const std::string reason = invalid_argument_of([] { encode(Refuse{std::string(kMaxReasonBytes + 1, 'r')}); });
  EXPECT_NE(reason.find("65537 bytes (at most 65536)"), std::string::npos) << reason;
}

// ---- streaming ---------------------------------------------------------------------

TEST(FederationProtocol, FrameSizeWaitsForWholeFrames) {
  const std::string a = encode(Model{3, 4, sample_tensors()});
  const std::string b = encode(Ack{3, 1});
  for (size_t n = 0; n < a.size(); ++n) {
    ASSERT_EQ(frame_size_if_complete(std::string_view(a).substr(0, n), kWhat), 0u) << "at " << n << " of " << a.size();
    ASSERT_EQ(frame_size(std::string_view(a).substr(0, n), kWhat), n < kFrameHeaderBytes ? 0u : a.size()) << n;
  }
  EXPECT_EQ(frame_size_if_complete(a, kWhat), a.size());
  const std::string both = a + b;
  EXPECT_EQ(frame_size_if_complete(both, kWhat), a.size()) << "two frames buffered: the first one's size";
  EXPECT_EQ(frame_size_if_complete(std::string_view(both).substr(a.size()), kWhat), b.size());

  // A bad header is refused as soon as the bytes that show it arrive.
  std::string msg = io_error_of([] { frame_size_if_complete("POX", kWhat); });
  EXPECT_NE(msg.find(kWhat), std::string::npos) << msg;
  EXPECT_NE(msg.find("the magic: 'POX'"), std::string::npos) << msg;
  std::string f = b.substr(0, kFrameHeaderBytes);
  f[8] = 99;
  msg = io_error_of([&] { frame_size_if_complete(f, kWhat); });
  EXPECT_NE(msg.find("the message type: 99 is unknown"), std::string::npos) << msg;
  f = b.substr(0, kFrameHeaderBytes);
  const uint64_t huge = ~0ull;
  std::memcpy(f.data() + 12, &huge, 8);
  msg = io_error_of([&] { frame_size_if_complete(f, kWhat); });
  EXPECT_NE(msg.find("the payload length: 18446744073709551615 bytes"), std::string::npos) << msg;
}

TEST(FederationProtocol, ExpectNamesWhatCameInstead) {
  EXPECT_EQ(expect<Ack>(Message{Ack{1, 2}}, kWhat), (Ack{1, 2}));
  try {
    expect<Welcome>(Message{Refuse{"another model (fingerprint 0x12)"}}, kWhat);
    ADD_FAILURE() << "expect<Welcome> took a Refuse";
  } catch (const core::CommError& e) {
    const std::string want = kWhat + ": expected a Welcome, got a Refuse: another model (fingerprint 0x12)";
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }
  try {
    expect<Model>(Message{Done{1, 2}}, kWhat);
    ADD_FAILURE() << "expect<Model> took a Done";
  } catch (const core::CommError& e) {
    EXPECT_NE(std::string(e.what()).find("expected a Model, got a Done"), std::string::npos) << e.what();
  }
}

// ---- authentication -----------------------------------------------------------------

const std::string kSecret = "job-secret-0123456789";

// Reference values from Python's hmac module (hmac.new(key, msg, sha256)):
//   key  = HMAC(b"job-secret-0123456789", b"pagedoptim-federate-client" + pack("<I", 3))
//   hello = HMAC(key, b"pagedoptim-federate-hello" + bytes(range(32)) + bytes(range(32, 64))
//                     + pack("<IQ", 3, 0x0123456789abcdef))
//   welcome = HMAC(key, b"pagedoptim-federate-welcome" + ... + pack("<IQ", 3, 7))
TEST(FederationAuth, DerivationsMatchAnIndependentHmac) {
  const Key32 key = client_key(kSecret, 3);
  EXPECT_EQ(hex(key), "0d13842a4ee3ba3aa703dfd0a59f41cdbaad60fbb12cba7dd25cee9e245e2155");
  EXPECT_EQ(hex(hello_proof(key, bytes_from(0), bytes_from(32), 3, 0x0123456789abcdefull)),
            "d12c06e61166778a89a404fbd0be4c004ae2019e120c593fd138160c7661670e");
  EXPECT_EQ(hex(welcome_proof(key, bytes_from(0), bytes_from(32), 3, 7)),
            "d7b9265ea46ec471f76354bd058a8b4595c123b9d48d506dc0e4563669fd512e");
}

// Python: hashlib.sha256(b"pagedoptim-federate-bind" + bytes(range(32)) + bytes(range(100, 132))).
TEST(FederationAuth, TheBoundChallengeIsTheSessionsOwn) {
  const Nonce32 nonce = bytes_from(0), binding = bytes_from(100);
  EXPECT_EQ(hex(bind_challenge(nonce, binding)), "0ea91c2f8c7b1596ecaf1ca8a7092520f5e7d3e657e84ecfa5f6357ffde92e9e");
  Nonce32 other = binding;
  other[31] ^= 1;
  EXPECT_NE(bind_challenge(nonce, binding), bind_challenge(nonce, other))
      << "another TLS session's exporter gave the same bound challenge";
  other = nonce;
  other[0] ^= 1;
  EXPECT_NE(bind_challenge(nonce, binding), bind_challenge(other, binding))
      << "another challenge gave the same bound challenge";
  // A Hello made over one session's binding fails over another's (a relay).
  const Hello h = make_hello(client_key(kSecret, 1), bind_challenge(nonce, binding), 1, 0x5eed);
  EXPECT_TRUE(verify_hello(kSecret, bind_challenge(nonce, binding), h));
  EXPECT_FALSE(verify_hello(kSecret, bind_challenge(nonce, bytes_from(200)), h))
      << "a Hello relayed into another TLS session verified";
}

TEST(FederationAuth, ClientKeysDifferByClientAndSecret) {
  EXPECT_NE(client_key(kSecret, 1), client_key(kSecret, 2));
  EXPECT_NE(client_key(kSecret, 1), client_key(kSecret + "x", 1));
  EXPECT_EQ(client_key(kSecret, 1), client_key(kSecret, 1));
  const std::string msg = invalid_argument_of([] { client_key("", 1); });
  EXPECT_NE(msg.find("the job secret is empty"), std::string::npos) << msg;
  EXPECT_NE(random_nonce(), random_nonce()) << "two 32-byte nonces from RAND_bytes are equal";
}

TEST(FederationAuth, HelloVerifiesOnlyWithTheRightKeyAndChallenge) {
  const Nonce32 challenge = random_nonce();
  const uint64_t fp = 0x5eed;
  const Hello good = make_hello(client_key(kSecret, 4), challenge, 4, fp);
  EXPECT_TRUE(verify_hello(kSecret, challenge, good));
  // It survives the wire.
  EXPECT_TRUE(verify_hello(kSecret, challenge, expect<Hello>(decode_frame(encode(good), kWhat), kWhat)));

  EXPECT_FALSE(verify_hello(kSecret, challenge, make_hello(client_key("another job's secret", 4), challenge, 4, fp)))
      << "a Hello signed with another job's secret verified";
  EXPECT_FALSE(verify_hello(kSecret, challenge, make_hello(client_key(kSecret, 5), challenge, 4, fp)))
      << "client 5's key signed a Hello for client 4";
  EXPECT_FALSE(verify_hello(kSecret, random_nonce(), good)) << "a replayed Hello verified against a new challenge";

  Hello h = good;
  h.client_id = 5;
  EXPECT_FALSE(verify_hello(kSecret, challenge, h)) << "a Hello verified after its client id changed";
  h = good;
  h.model_fingerprint ^= 1;
  EXPECT_FALSE(verify_hello(kSecret, challenge, h)) << "a Hello verified after its fingerprint changed";
  h = good;
  h.client_nonce[31] ^= 1;
  EXPECT_FALSE(verify_hello(kSecret, challenge, h)) << "a Hello verified after its nonce changed";
  h = good;
  h.proof[0] ^= 0x80;
  EXPECT_FALSE(verify_hello(kSecret, challenge, h)) << "a Hello verified after its proof changed";
}

TEST(FederationAuth, WelcomeProvesTheCoordinatorHoldsTheSecret) {
  const Nonce32 challenge = random_nonce();
  const Key32 key = client_key(kSecret, 2);
  const Hello hello = make_hello(key, challenge, 2, 0x5eed);
  const Welcome w = make_welcome(kSecret, challenge, hello, 17);
  EXPECT_EQ(w.round, 17u);
  EXPECT_TRUE(verify_welcome(key, challenge, hello, w));
  EXPECT_FALSE(verify_welcome(key, challenge, hello, make_welcome("a stranger's secret", challenge, hello, 17)))
      << "a Welcome from a coordinator without the secret verified";
  EXPECT_FALSE(verify_welcome(key, challenge, make_hello(key, challenge, 2, 0x5eed), w))
      << "a Welcome verified for another Hello's nonce";
  Welcome other_round = w;
  other_round.round = 18;
  EXPECT_FALSE(verify_welcome(key, challenge, hello, other_round)) << "a Welcome verified after its round changed";
  EXPECT_NE(hello_proof(key, challenge, hello.client_nonce, 2, 17),
            welcome_proof(key, challenge, hello.client_nonce, 2, 17))
      << "a hello proof doubles as a welcome proof";
}

// ---- fingerprints ------------------------------------------------------------------

TEST(FederationFingerprint, IgnoresOrderAndDataButSeesEveryShapeChange) {
  std::vector<NamedTensor> t = sample_tensors();
  const uint64_t fp = model_fingerprint(t);
  std::vector<NamedTensor> reversed(t.rbegin(), t.rend());
  EXPECT_EQ(model_fingerprint(reversed), fp) << "the fingerprint depends on the tensors' order";
  std::vector<NamedTensor> no_data = t;
  for (NamedTensor& x : no_data) x.data.clear();
  EXPECT_EQ(model_fingerprint(no_data), fp) << "the fingerprint depends on the data";

  auto differs = [&](const std::function<void(std::vector<NamedTensor>&)>& change, const char* what) {
    std::vector<NamedTensor> c = t;
    change(c);
    EXPECT_NE(model_fingerprint(c), fp) << "the fingerprint missed: " << what;
  };
  for (size_t i = 0; i < t.size(); ++i) {
    for (size_t d = 0; d < t[i].shape.size(); ++d)
      differs([&](auto& c) { c[i].shape[d] += 1; }, "a dim grew");
    differs([&](auto& c) { c[i].shape.push_back(1); }, "a trailing dim of 1 added");
    differs([&](auto& c) { c[i].shape.insert(c[i].shape.begin(), 1); }, "a leading dim of 1 added");
    differs([&](auto& c) { c[i].name += "_"; }, "a renamed tensor");
    differs([&](auto& c) {
      c[i].dtype = c[i].dtype == WireDtype::kF32 ? WireDtype::kBf16 : WireDtype::kF32;
    }, "another dtype");
  }
  differs([](auto& c) { c.pop_back(); }, "a tensor dropped");
  differs([](auto& c) { c.push_back(f32_tensor("extra", {}, std::vector<float>{0})); }, "a tensor added");
  // Shapes {2,3} and {6} (same numel), names swapped between shapes.
  differs([](auto& c) { c[0].shape = {6}; }, "a reshape to the same numel");
  differs([](auto& c) { std::swap(c[0].name, c[1].name); }, "two names swapped");
  EXPECT_NE(model_fingerprint({}), fp);

  const std::string msg = invalid_argument_of([&] {
    std::vector<NamedTensor> dup = t;
    dup.push_back(t[2]);
    model_fingerprint(dup);
  });
  EXPECT_NE(msg.find("tensors 2 and 5 are both named 'empty'"), std::string::npos) << msg;
}

TEST(FederationFingerprint, ThetaHashIgnoresOrderButSeesEveryByte) {
  const std::vector<NamedTensor> t = sample_tensors();
  const uint64_t h = theta_hash(t);
  EXPECT_EQ(theta_hash(std::vector<NamedTensor>(t.rbegin(), t.rend())), h);
  for (size_t i = 0; i < t.size(); ++i)
    for (size_t b = 0; b < t[i].data.size(); ++b) {
      std::vector<NamedTensor> c = t;
      c[i].data[b] ^= 1;
      EXPECT_NE(theta_hash(c), h) << "theta_hash missed a flipped bit in byte " << b << " of tensor " << t[i].name;
    }
  std::vector<NamedTensor> c = t;
  c[0].shape = {3, 2};
  EXPECT_NE(theta_hash(c), h) << "theta_hash missed a transposed shape";
  EXPECT_NE(theta_hash(t), model_fingerprint(t));
}

}  // namespace
}  // namespace po::comm
