// The wire protocol of federation across separately launched jobs
// (`pagedoptim federate serve` is the coordinator, `pagedoptim federate join
// HOST:PORT` a client that dials out to it; docs/diloco.md,
// ../shared/research/federated.md §5 B). Messages, their bytes and the
// authentication helpers only: no sockets here.
//
// A frame, little-endian: "POFED001" (the magic, its last three digits the
// protocol version), u32 message type, u64 payload length, the payload, then
// the XXH3-64 of everything before it. decode_frame takes exactly one frame
// and refuses anything else with a core::IoError naming the caller's `what`
// and the field that was wrong, and what it held against what was expected.
// Every accepted frame re-encodes to the same bytes (the fuzzer holds it to
// that): there is one encoding of each message.
//
// A session: on connect the coordinator sends a Challenge; the client
// answers with a Hello signed with its client key; the coordinator answers
// with a Welcome (signed over the client's nonce, so the client knows the
// coordinator holds the job secret) or a Refuse; then each round a Model
// goes out and an Update comes back (Ack'd or Refused), until Done.
//
// Keys: every client has its own key, HMAC-SHA256(job secret,
// "pagedoptim-federate-client" | client id), so a site can be given its key
// without the job's secret, and one site's key does not sign for another.
// The secret and the keys are never sent. Proofs are compared in constant
// time. Payloads travel unencrypted (TLS is the transport's business).
//
// Tensors travel whole and named, in the dtype of the payload (f32 or
// bf16), their bytes as stored: data.size() is always numel × element size.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "core/error.h"

namespace po::comm {

using Bytes32 = std::array<uint8_t, 32>;
using Key32 = Bytes32;    // a client key
using Nonce32 = Bytes32;  // a fresh random challenge or client nonce
using Mac32 = Bytes32;    // an HMAC-SHA256 proof

// ---- limits (bytes unless said otherwise) ------------------------------------

inline constexpr char kFederationMagic[8] = {'P', 'O', 'F', 'E', 'D', '0', '0', '1'};
inline constexpr size_t kFrameHeaderBytes = 8 + 4 + 8;  // magic, type, payload length
inline constexpr size_t kFrameTrailerBytes = 8;         // XXH3-64
inline constexpr uint64_t kMaxPayloadBytes = uint64_t{16} << 30;
inline constexpr uint32_t kMaxTensors = uint32_t{1} << 20;  // tensors per message
inline constexpr uint32_t kMaxTensorNameBytes = 1024;
inline constexpr uint32_t kMaxTensorDims = 8;
inline constexpr uint32_t kMaxReasonBytes = 64 << 10;  // a Refuse's reason

// ---- tensors -------------------------------------------------------------------

// Wire codes; new codes are appended, never renumbered.
enum class WireDtype : uint32_t { kF32 = 1, kBf16 = 2 };

// Bytes per element of `dtype`; 0 for a code this build does not know.
size_t wire_dtype_bytes(WireDtype dtype);
const char* wire_dtype_name(WireDtype dtype);  // "f32", "bf16", "unknown"

struct NamedTensor {
  std::string name;            // UTF-8, at most kMaxTensorNameBytes, unique in a message
  std::vector<int64_t> shape;  // at most kMaxTensorDims dims, each >= 0; {} is a scalar
  WireDtype dtype = WireDtype::kF32;
  std::string data;            // numel × wire_dtype_bytes(dtype) bytes, little-endian
  bool operator==(const NamedTensor&) const = default;
};

// Elements of `shape` (1 for a scalar); an InvalidArgument for a negative
// dim or a product past int64.
int64_t shape_numel(std::span<const int64_t> shape);

// An f32 tensor holding `values` (values.size() must be the shape's numel).
NamedTensor f32_tensor(std::string name, std::vector<int64_t> shape, std::span<const float> values);
// A bf16 tensor holding `values` rounded to nearest even.
NamedTensor bf16_tensor(std::string name, std::vector<int64_t> shape, std::span<const float> values);
// The tensor's elements as f32 (bf16 widened exactly).
std::vector<float> tensor_f32(const NamedTensor& t);

// XXH3-64 over the tensors' names, dtypes and shapes in name order (not
// their data, which may be left empty): equal for the same model whatever
// order its tensors are listed in, different after any name, shape or dtype
// change. The client sends it in its Hello; the coordinator refuses another
// model. An InvalidArgument for a repeated name.
uint64_t model_fingerprint(const std::vector<NamedTensor>& tensors);

// XXH3-64 over the tensors' names, dtypes, shapes and data in name order:
// the identity of a global model θ. A Model carries it, and an Update names
// the θ it started from, so an update against another θ is refused.
uint64_t theta_hash(const std::vector<NamedTensor>& tensors);

// ---- messages ----------------------------------------------------------------

// Wire codes; new codes are appended, never renumbered.
enum class MessageType : uint32_t {
  kChallenge = 1,
  kHello = 2,
  kWelcome = 3,
  kRefuse = 4,
  kModel = 5,
  kUpdate = 6,
  kAck = 7,
  kDone = 8,
};
const char* message_type_name(MessageType type);  // "Challenge", ..., "unknown"

// Coordinator → client, first thing on every connection.
struct Challenge {
  static constexpr MessageType kType = MessageType::kChallenge;
  Nonce32 nonce{};
  bool operator==(const Challenge&) const = default;
};

// Client → coordinator: who it is and which model it trains. proof =
// hello_proof(client_key(secret, client_id), challenge, client_nonce,
// client_id, model_fingerprint).
struct Hello {
  static constexpr MessageType kType = MessageType::kHello;
  uint32_t client_id = 0;
  Nonce32 client_nonce{};
  uint64_t model_fingerprint = 0;
  Mac32 proof{};
  bool operator==(const Hello&) const = default;
};

// Coordinator → client: accepted; the round it joins. proof =
// welcome_proof(the client's key, challenge, client_nonce, client_id, round).
struct Welcome {
  static constexpr MessageType kType = MessageType::kWelcome;
  uint64_t round = 0;
  Mac32 proof{};
  bool operator==(const Welcome&) const = default;
};

// Either way: why a Hello or an Update is refused (wrong secret, another
// model, a stale round, a client id already connected, ...), for people.
struct Refuse {
  static constexpr MessageType kType = MessageType::kRefuse;
  std::string reason;  // at most kMaxReasonBytes
  bool operator==(const Refuse&) const = default;
};

// Coordinator → client: the global model θ of `round`.
struct Model {
  static constexpr MessageType kType = MessageType::kModel;
  uint64_t round = 0;
  uint64_t theta_hash = 0;  // theta_hash(tensors)
  std::vector<NamedTensor> tensors;
  bool operator==(const Model&) const = default;
};

// Client → coordinator: its pseudo-gradient Δ = θ − θ_k for `round`, whole
// named tensors; theta_hash names the θ it started from.
struct Update {
  static constexpr MessageType kType = MessageType::kUpdate;
  uint64_t round = 0;
  uint64_t theta_hash = 0;
  uint32_t client_id = 0;
  uint64_t num_examples = 0;  // sequences trained on this round (FedAvg's weight)
  uint64_t steps_done = 0;    // inner steps taken (partial work counts by them)
  std::vector<NamedTensor> tensors;
  bool operator==(const Update&) const = default;
};

// Coordinator → client: the client's update for `round` is counted.
struct Ack {
  static constexpr MessageType kType = MessageType::kAck;
  uint64_t round = 0;
  uint32_t client_id = 0;
  bool operator==(const Ack&) const = default;
};

// Coordinator → client: the federation is over after `round` rounds; its
// final θ has theta_hash.
struct Done {
  static constexpr MessageType kType = MessageType::kDone;
  uint64_t round = 0;
  uint64_t theta_hash = 0;
  bool operator==(const Done&) const = default;
};

using Message = std::variant<Challenge, Hello, Welcome, Refuse, Model, Update, Ack, Done>;

MessageType message_type(const Message& m);

// One whole frame. An InvalidArgument (naming the field) for a message the
// peer would refuse: a name too long, a data size that is not numel ×
// element size, a repeated name, a payload past kMaxPayloadBytes.
std::string encode(const Message& m);

// The message of exactly one frame; a core::IoError naming `what` and the
// field for anything else (see the file comment).
Message decode_frame(std::string_view bytes, const std::string& what);

// For a socket reader. frame_size(header): the whole frame's size in bytes
// once the header is buffered (0 while fewer than kFrameHeaderBytes are),
// after checking its magic (as soon as any bytes are there), type and
// payload length; an IoError naming `what` otherwise.
uint64_t frame_size(std::string_view buffered, const std::string& what);
// frame_size when all of the frame is buffered, 0 while more is needed.
size_t frame_size_if_complete(std::string_view buffered, const std::string& what);

// The message as a T; a core::CommError naming `what` otherwise (with the
// reason when the peer sent a Refuse).
template <typename T>
T expect(Message&& m, const std::string& what) {
  if (T* t = std::get_if<T>(&m)) return std::move(*t);
  std::string detail;
  if (const Refuse* r = std::get_if<Refuse>(&m)) detail = ": " + r->reason;
  PO_THROW(core::CommError, what, ": expected a ", message_type_name(T::kType), ", got a ",
           message_type_name(message_type(m)), detail);
}

// ---- authentication --------------------------------------------------------------

// 32 bytes from OpenSSL's CSPRNG (a CommError if it fails).
Nonce32 random_nonce();

// The challenge the proofs are made over: SHA-256("pagedoptim-federate-bind"
// | the Challenge's nonce | the TLS session's RFC 9266 exporter). Both ends
// compute it, so a proof holds for this TLS session only: a man in the
// middle (two sessions, two exporters) cannot relay it.
Nonce32 bind_challenge(const Nonce32& nonce, const Bytes32& channel_binding);

// HMAC-SHA256(job_secret, "pagedoptim-federate-client" | client_id as u32
// LE). An InvalidArgument for an empty secret.
Key32 client_key(std::string_view job_secret, uint32_t client_id);

// HMAC-SHA256(key, "pagedoptim-federate-hello" | challenge | client_nonce |
// client_id | fingerprint), integers as LE u32 / u64.
Mac32 hello_proof(const Key32& key, const Nonce32& challenge, const Nonce32& client_nonce,
                  uint32_t client_id, uint64_t fingerprint);
// A Hello signed with `key` against `challenge`, with a fresh nonce.
Hello make_hello(const Key32& key, const Nonce32& challenge, uint32_t client_id, uint64_t fingerprint);
// Coordinator: whether `hello` was signed by the key of the client id it
// claims, against this connection's `challenge` (so a replayed Hello fails).
bool verify_hello(std::string_view job_secret, const Nonce32& challenge, const Hello& hello);

// HMAC-SHA256(key, "pagedoptim-federate-welcome" | challenge | client_nonce
// | client_id | round).
Mac32 welcome_proof(const Key32& key, const Nonce32& challenge, const Nonce32& client_nonce,
                    uint32_t client_id, uint64_t round);
// Coordinator: the Welcome answering `hello` on the connection challenged
// with `challenge`.
Welcome make_welcome(std::string_view job_secret, const Nonce32& challenge, const Hello& hello,
                     uint64_t round);
// Client: whether `welcome` answers its own `hello` (so the coordinator
// holds the secret).
bool verify_welcome(const Key32& key, const Nonce32& challenge, const Hello& hello, const Welcome& welcome);

// Constant-time equality of two proofs.
bool same_mac(const Mac32& a, const Mac32& b);

}  // namespace po::comm
