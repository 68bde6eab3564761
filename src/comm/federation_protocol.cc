// The federation wire protocol (federation_protocol.h). Payload layouts,
// little-endian, in field order:
//   Challenge: nonce[32]
//   Hello:     u32 client_id, client_nonce[32], u64 model_fingerprint, proof[32]
//   Welcome:   u64 round, proof[32]
//   Refuse:    u32 length, reason
//   Model:     u64 round, u64 theta_hash, tensors
//   Update:    u64 round, u64 theta_hash, u32 client_id, u64 num_examples,
//              u64 steps_done, tensors
//   Ack:       u64 round, u32 client_id
//   Done:      u64 round, u64 theta_hash
//   tensors:   u32 count, then per tensor u32 name length, name, u32 dtype,
//              u32 dims, dims × i64, u64 data length, data
// Decoding checks every length against what is left before it reads or
// allocates, so a hostile length costs nothing.
#include "comm/federation_protocol.h"

#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstring>
#include <memory>

#include "core/bf16.h"

namespace po::comm {
namespace {

// Host byte order is the wire's: the engine builds for little-endian hosts only.
static_assert(std::endian::native == std::endian::little, "the federation protocol assumes a little-endian host");

template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}

void put_bytes(std::string& out, const Bytes32& b) { out.append(reinterpret_cast<const char*>(b.data()), b.size()); }

std::string hex64(uint64_t v) {
  char buf[19];
  std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// "GET / HT" shown as text when printable, else as hex bytes.
std::string shown(std::string_view b) {
  const bool text = std::all_of(b.begin(), b.end(), [](char c) { return c >= 0x20 && c < 0x7f; });
  if (text) return "'" + std::string(b) + "'";
  std::string out;
  for (unsigned char c : b) {
    char buf[4];
    std::snprintf(buf, sizeof buf, "%02x", c);
    out += buf;
  }
  return "0x" + out;
}

// Why `shape` has no element count (a negative dim, a product past int64),
// "" when it has one, stored in *numel.
std::string numel_problem(std::span<const int64_t> shape, int64_t* numel) {
  int64_t n = 1;
  bool zero = false;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] < 0) return core::str_cat("dim ", d, " is ", shape[d], " (negative)");
    zero = zero || shape[d] == 0;
  }
  if (zero) {  // empty whatever the other dims are (each checked >= 0 above)
    *numel = 0;
    return "";
  }
  for (int64_t dim : shape)
    if (__builtin_mul_overflow(n, dim, &n)) return "its element count overflows int64";
  *numel = n;
  return "";
}

// Why `t` cannot be sent, "" when it can; the same rules decode_frame holds
// a received tensor to.
std::string tensor_problem(const NamedTensor& t) {
  if (t.name.size() > kMaxTensorNameBytes)
    return core::str_cat("name is ", t.name.size(), " bytes (at most ", kMaxTensorNameBytes, ")");
  if (t.shape.size() > kMaxTensorDims)
    return core::str_cat("shape has ", t.shape.size(), " dims (at most ", kMaxTensorDims, ")");
  const size_t elem = wire_dtype_bytes(t.dtype);
  if (elem == 0) return core::str_cat("dtype code ", static_cast<uint32_t>(t.dtype), " is unknown");
  int64_t numel = 0;
  if (std::string p = numel_problem(t.shape, &numel); !p.empty()) return "shape: " + p;
  if (static_cast<uint64_t>(numel) > kMaxPayloadBytes / elem)
    return core::str_cat("shape holds ", numel, " elements, more than a payload may");
  if (t.data.size() != static_cast<uint64_t>(numel) * elem)
    return core::str_cat("data is ", t.data.size(), " bytes, not numel ", numel, " × ", elem, " (",
                         wire_dtype_name(t.dtype), ") = ", static_cast<uint64_t>(numel) * elem);
  return "";
}

// Tensors in name order. *first < *second are the indices of two tensors of
// one name, both tensors.size() when every name is unique.
std::vector<const NamedTensor*> by_name(const std::vector<NamedTensor>& tensors, size_t* first, size_t* second) {
  std::vector<const NamedTensor*> order;
  order.reserve(tensors.size());
  for (const NamedTensor& t : tensors) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const NamedTensor* a, const NamedTensor* b) { return a->name < b->name; });
  *first = *second = tensors.size();
  for (size_t i = 1; i < order.size(); ++i)
    if (order[i - 1]->name == order[i]->name) {
      *first = static_cast<size_t>(order[i - 1] - tensors.data());
      *second = static_cast<size_t>(order[i] - tensors.data());
      if (*first > *second) std::swap(*first, *second);
      break;
    }
  return order;
}

// ---- hashing ---------------------------------------------------------------------

using XxhState = std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)>;

uint64_t hash_tensors(const std::vector<NamedTensor>& tensors, bool with_data, const char* fn) {
  size_t first, second;
  const std::vector<const NamedTensor*> order = by_name(tensors, &first, &second);
  PO_CHECK(first == tensors.size(), fn, ": tensors ", first, " and ", second, " are both named '",
           tensors[first].name, "'");
  XxhState st(XXH3_createState(), &XXH3_freeState);
  PO_CHECK(st != nullptr && XXH3_64bits_reset(st.get()) == XXH_OK, fn, ": cannot start an XXH3 state");
  std::string meta;
  for (const NamedTensor* t : order) {
    meta.clear();
    put<uint32_t>(meta, static_cast<uint32_t>(t->name.size()));
    meta += t->name;
    put<uint32_t>(meta, static_cast<uint32_t>(t->dtype));
    put<uint32_t>(meta, static_cast<uint32_t>(t->shape.size()));
    for (int64_t d : t->shape) put<int64_t>(meta, d);
    if (with_data) put<uint64_t>(meta, t->data.size());
    XXH3_64bits_update(st.get(), meta.data(), meta.size());
    if (with_data && !t->data.empty()) XXH3_64bits_update(st.get(), t->data.data(), t->data.size());
  }
  return XXH3_64bits_digest(st.get());
}

// ---- encoding --------------------------------------------------------------------

void put_tensors(std::string& out, const std::vector<NamedTensor>& tensors) {
  PO_CHECK(tensors.size() <= kMaxTensors, "federation: ", tensors.size(), " tensors in one message (at most ",
           kMaxTensors, ")");
  size_t first, second;
  by_name(tensors, &first, &second);
  PO_CHECK(first == tensors.size(), "federation: tensors ", first, " and ", second, " are both named '",
           tensors[first].name, "'");
  put<uint32_t>(out, static_cast<uint32_t>(tensors.size()));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const NamedTensor& t = tensors[i];
    const std::string problem = tensor_problem(t);
    PO_CHECK(problem.empty(), "federation: tensor ", i, " ('", t.name.substr(0, 64), "'): ", problem);
    put<uint32_t>(out, static_cast<uint32_t>(t.name.size()));
    out += t.name;
    put<uint32_t>(out, static_cast<uint32_t>(t.dtype));
    put<uint32_t>(out, static_cast<uint32_t>(t.shape.size()));
    for (int64_t d : t.shape) put<int64_t>(out, d);
    put<uint64_t>(out, t.data.size());
    out += t.data;
  }
}

size_t tensors_bytes(const std::vector<NamedTensor>& tensors) {
  size_t n = 4;
  for (const NamedTensor& t : tensors) n += 4 + t.name.size() + 8 + 8 * t.shape.size() + 8 + t.data.size();
  return n;
}

struct PayloadWriter {
  std::string& out;
  void operator()(const Challenge& m) const { put_bytes(out, m.nonce); }
  void operator()(const Hello& m) const {
    put<uint32_t>(out, m.client_id);
    put_bytes(out, m.client_nonce);
    put<uint64_t>(out, m.model_fingerprint);
    put_bytes(out, m.proof);
  }
  void operator()(const Welcome& m) const {
    put<uint64_t>(out, m.round);
    put_bytes(out, m.proof);
  }
  void operator()(const Refuse& m) const {
    PO_CHECK(m.reason.size() <= kMaxReasonBytes, "federation: a Refuse's reason is ", m.reason.size(),
             " bytes (at most ", kMaxReasonBytes, ")");
    put<uint32_t>(out, static_cast<uint32_t>(m.reason.size()));
    out += m.reason;
  }
  void operator()(const Model& m) const {
    put<uint64_t>(out, m.round);
    put<uint64_t>(out, m.theta_hash);
    put_tensors(out, m.tensors);
  }
  void operator()(const Update& m) const {
    put<uint64_t>(out, m.round);
    put<uint64_t>(out, m.theta_hash);
    put<uint32_t>(out, m.client_id);
    put<uint64_t>(out, m.num_examples);
    put<uint64_t>(out, m.steps_done);
    put_tensors(out, m.tensors);
  }
  void operator()(const Ack& m) const {
    put<uint64_t>(out, m.round);
    put<uint32_t>(out, m.client_id);
  }
  void operator()(const Done& m) const {
    put<uint64_t>(out, m.round);
    put<uint64_t>(out, m.theta_hash);
  }
};

// ---- decoding --------------------------------------------------------------------

// Reads a payload front to back; every read is bounds-checked and every
// failure names `what` and the field.
class Reader {
 public:
  Reader(std::string_view b, const std::string& what) : b_(b), what_(what) {}

  template <typename... Args>
  [[noreturn]] void fail(const std::string& field, const Args&... detail) const {
    PO_THROW(core::IoError, what_, ": bad federation frame: ", field, ": ", detail...);
  }
  size_t left() const { return b_.size() - at_; }
  const char* take(uint64_t n, const std::string& field) {
    if (n > left()) fail(field, "cut short (needs ", n, " bytes, ", left(), " left)");
    const char* p = b_.data() + at_;
    at_ += static_cast<size_t>(n);
    return p;
  }
  template <typename T>
  T get(const std::string& field) {
    T v;
    std::memcpy(&v, take(sizeof v, field), sizeof v);
    return v;
  }
  Bytes32 get_bytes(const std::string& field) {
    Bytes32 v;
    std::memcpy(v.data(), take(v.size(), field), v.size());
    return v;
  }
  void expect_end(const char* message) const {
    if (left() != 0) fail(core::str_cat("the end of the ", message), left(), " bytes left over");
  }

 private:
  std::string_view b_;
  size_t at_ = 0;
  const std::string& what_;
};

NamedTensor get_tensor(Reader& r, uint32_t i) {
  const std::string f = core::str_cat("tensor ", i, "'s ");
  NamedTensor t;
  const uint32_t name_len = r.get<uint32_t>(f + "name length");
  if (name_len > kMaxTensorNameBytes)
    r.fail(f + "name length", name_len, " bytes (at most ", kMaxTensorNameBytes, ")");
  t.name.assign(r.take(name_len, f + "name"), name_len);
  const std::string g = core::str_cat("tensor ", i, " ('", t.name.substr(0, 64), "')'s ");
  const uint32_t dtype = r.get<uint32_t>(g + "dtype");
  t.dtype = static_cast<WireDtype>(dtype);
  const size_t elem = wire_dtype_bytes(t.dtype);
  if (elem == 0) r.fail(g + "dtype", "code ", dtype, " is unknown (1 f32, 2 bf16)");
  const uint32_t dims = r.get<uint32_t>(g + "dim count");
  if (dims > kMaxTensorDims) r.fail(g + "dim count", dims, " dims (at most ", kMaxTensorDims, ")");
  for (uint32_t d = 0; d < dims; ++d) t.shape.push_back(r.get<int64_t>(g + "shape"));
  int64_t numel = 0;
  if (std::string p = numel_problem(t.shape, &numel); !p.empty()) r.fail(g + "shape", p);
  if (static_cast<uint64_t>(numel) > kMaxPayloadBytes / elem)
    r.fail(g + "shape", numel, " elements, more than a payload may hold");
  const uint64_t want = static_cast<uint64_t>(numel) * elem;
  const uint64_t len = r.get<uint64_t>(g + "data length");
  if (len != want)
    r.fail(g + "data length", len, " bytes, not numel ", numel, " × ", elem, " (", wire_dtype_name(t.dtype),
           ") = ", want);
  t.data.assign(r.take(len, g + "data"), static_cast<size_t>(len));
  return t;
}

std::vector<NamedTensor> get_tensors(Reader& r) {
  const uint32_t n = r.get<uint32_t>("the tensor count");
  if (n > kMaxTensors) r.fail("the tensor count", n, " (at most ", kMaxTensors, ")");
  constexpr size_t kMinTensorBytes = 4 + 4 + 4 + 8;  // an empty name, a scalar header, no data
  if (n > r.left() / kMinTensorBytes)
    r.fail("the tensor count", "cut short (", n, " tensors cannot fit in the ", r.left(), " bytes left)");
  std::vector<NamedTensor> tensors;
  tensors.reserve(n);
  for (uint32_t i = 0; i < n; ++i) tensors.push_back(get_tensor(r, i));
  size_t first, second;
  by_name(tensors, &first, &second);
  if (first != tensors.size())
    r.fail(core::str_cat("tensor ", second, "'s name"), "'", tensors[second].name.substr(0, 64),
           "' repeats tensor ", first, "'s");
  return tensors;
}

Message decode_payload(MessageType type, Reader& r) {
  switch (type) {
    case MessageType::kChallenge:
      return Challenge{r.get_bytes("the Challenge's nonce")};
    case MessageType::kHello: {
      Hello m;
      m.client_id = r.get<uint32_t>("the Hello's client id");
      m.client_nonce = r.get_bytes("the Hello's client nonce");
      m.model_fingerprint = r.get<uint64_t>("the Hello's model fingerprint");
      m.proof = r.get_bytes("the Hello's proof");
      return m;
    }
    case MessageType::kWelcome: {
      Welcome m;
      m.round = r.get<uint64_t>("the Welcome's round");
      m.proof = r.get_bytes("the Welcome's proof");
      return m;
    }
    case MessageType::kRefuse: {
      const uint32_t len = r.get<uint32_t>("the Refuse's reason length");
      if (len > kMaxReasonBytes) r.fail("the Refuse's reason length", len, " bytes (at most ", kMaxReasonBytes, ")");
      return Refuse{std::string(r.take(len, "the Refuse's reason"), len)};
    }
    case MessageType::kModel: {
      Model m;
      m.round = r.get<uint64_t>("the Model's round");
      m.theta_hash = r.get<uint64_t>("the Model's theta hash");
      m.tensors = get_tensors(r);
      return m;
    }
    case MessageType::kUpdate: {
      Update m;
      m.round = r.get<uint64_t>("the Update's round");
      m.theta_hash = r.get<uint64_t>("the Update's theta hash");
      m.client_id = r.get<uint32_t>("the Update's client id");
      m.num_examples = r.get<uint64_t>("the Update's example count");
      m.steps_done = r.get<uint64_t>("the Update's step count");
      m.tensors = get_tensors(r);
      return m;
    }
    case MessageType::kAck: {
      Ack m;
      m.round = r.get<uint64_t>("the Ack's round");
      m.client_id = r.get<uint32_t>("the Ack's client id");
      return m;
    }
    case MessageType::kDone: {
      Done m;
      m.round = r.get<uint64_t>("the Done's round");
      m.theta_hash = r.get<uint64_t>("the Done's theta hash");
      return m;
    }
  }
  r.fail("the message type", static_cast<uint32_t>(type), " is unknown");
}

bool known_type(uint32_t t) { return t >= 1 && t <= static_cast<uint32_t>(MessageType::kDone); }

// ---- authentication -----------------------------------------------------------------

// HMAC-SHA256(key, label | body); the bodies are fixed-size fields, so no
// two different messages sign alike.
Mac32 mac(const void* key, size_t key_len, std::string_view label, const std::string& body) {
  std::string msg(label);
  msg += body;
  Mac32 out{};
  unsigned int len = 0;
  PO_CHECK(HMAC(EVP_sha256(), key, static_cast<int>(key_len),
                reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), out.data(), &len) != nullptr &&
               len == out.size(),
           "federation: HMAC-SHA256 failed");
  return out;
}

std::string auth_body(const Nonce32& challenge, const Nonce32& client_nonce, uint32_t client_id, uint64_t tail) {
  std::string body;
  put_bytes(body, challenge);
  put_bytes(body, client_nonce);
  put<uint32_t>(body, client_id);
  put<uint64_t>(body, tail);
  return body;
}

}  // namespace

// ---- tensors -----------------------------------------------------------------------

size_t wire_dtype_bytes(WireDtype dtype) {
  switch (dtype) {
    case WireDtype::kF32: return 4;
    case WireDtype::kBf16: return 2;
  }
  return 0;
}

const char* wire_dtype_name(WireDtype dtype) {
  switch (dtype) {
    case WireDtype::kF32: return "f32";
    case WireDtype::kBf16: return "bf16";
  }
  return "unknown";
}

int64_t shape_numel(std::span<const int64_t> shape) {
  int64_t numel = 0;
  const std::string p = numel_problem(shape, &numel);
  PO_CHECK(p.empty(), "federation: shape: ", p);
  return numel;
}

NamedTensor f32_tensor(std::string name, std::vector<int64_t> shape, std::span<const float> values) {
  const int64_t numel = shape_numel(shape);
  PO_CHECK(static_cast<uint64_t>(numel) == values.size(), "federation: tensor '", name, "': ", values.size(),
           " values for a shape of ", numel, " elements");
  NamedTensor t{std::move(name), std::move(shape), WireDtype::kF32, std::string(values.size() * 4, '\0')};
  if (!values.empty()) std::memcpy(t.data.data(), values.data(), t.data.size());
  return t;
}

NamedTensor bf16_tensor(std::string name, std::vector<int64_t> shape, std::span<const float> values) {
  const int64_t numel = shape_numel(shape);
  PO_CHECK(static_cast<uint64_t>(numel) == values.size(), "federation: tensor '", name, "': ", values.size(),
           " values for a shape of ", numel, " elements");
  NamedTensor t{std::move(name), std::move(shape), WireDtype::kBf16, std::string(values.size() * 2, '\0')};
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t bits = core::f32_to_bf16(values[i]).bits;
    std::memcpy(t.data.data() + 2 * i, &bits, 2);
  }
  return t;
}

std::vector<float> tensor_f32(const NamedTensor& t) {
  const std::string problem = tensor_problem(t);
  PO_CHECK(problem.empty(), "federation: tensor '", t.name.substr(0, 64), "': ", problem);
  std::vector<float> out(t.data.size() / wire_dtype_bytes(t.dtype));
  if (t.dtype == WireDtype::kF32) {
    if (!out.empty()) std::memcpy(out.data(), t.data.data(), t.data.size());
  } else {
    for (size_t i = 0; i < out.size(); ++i) {
      core::bf16 h;
      std::memcpy(&h.bits, t.data.data() + 2 * i, 2);
      out[i] = core::bf16_to_f32(h);
    }
  }
  return out;
}

uint64_t model_fingerprint(const std::vector<NamedTensor>& tensors) {
  return hash_tensors(tensors, false, "model_fingerprint");
}

uint64_t theta_hash(const std::vector<NamedTensor>& tensors) { return hash_tensors(tensors, true, "theta_hash"); }

// ---- messages ----------------------------------------------------------------------

const char* message_type_name(MessageType type) {
  switch (type) {
    case MessageType::kChallenge: return "Challenge";
    case MessageType::kHello: return "Hello";
    case MessageType::kWelcome: return "Welcome";
    case MessageType::kRefuse: return "Refuse";
    case MessageType::kModel: return "Model";
    case MessageType::kUpdate: return "Update";
    case MessageType::kAck: return "Ack";
    case MessageType::kDone: return "Done";
  }
  return "unknown";
}

MessageType message_type(const Message& m) {
  return std::visit([](const auto& v) { return std::decay_t<decltype(v)>::kType; }, m);
}

std::string encode(const Message& m) {
  size_t reserve = kFrameHeaderBytes + 128 + kFrameTrailerBytes;
  if (const Model* model = std::get_if<Model>(&m)) reserve += tensors_bytes(model->tensors);
  if (const Update* update = std::get_if<Update>(&m)) reserve += tensors_bytes(update->tensors);
  if (const Refuse* refuse = std::get_if<Refuse>(&m)) reserve += refuse->reason.size();
  std::string out;
  out.reserve(reserve);
  out.append(kFederationMagic, sizeof kFederationMagic);
  put<uint32_t>(out, static_cast<uint32_t>(message_type(m)));
  put<uint64_t>(out, 0);  // the payload length, patched below
  std::visit(PayloadWriter{out}, m);
  const uint64_t payload = out.size() - kFrameHeaderBytes;
  PO_CHECK(payload <= kMaxPayloadBytes, "federation: a ", message_type_name(message_type(m)), " of ", payload,
           " bytes (a payload holds at most ", kMaxPayloadBytes, ")");
  std::memcpy(out.data() + 12, &payload, 8);
  put<uint64_t>(out, XXH3_64bits(out.data(), out.size()));
  return out;
}

uint64_t frame_size(std::string_view buffered, const std::string& what) {
  const size_t magic_seen = std::min(buffered.size(), sizeof kFederationMagic);
  if (magic_seen > 0 && std::memcmp(buffered.data(), kFederationMagic, magic_seen) != 0)
    PO_THROW(core::IoError, what, ": bad federation frame: the magic: ", shown(buffered.substr(0, magic_seen)),
             ", not 'POFED001' (not a federation peer, or another protocol version)");
  if (buffered.size() < kFrameHeaderBytes) return 0;
  uint32_t type;
  uint64_t payload;
  std::memcpy(&type, buffered.data() + 8, 4);
  std::memcpy(&payload, buffered.data() + 12, 8);
  if (!known_type(type))
    PO_THROW(core::IoError, what, ": bad federation frame: the message type: ", type, " is unknown");
  if (payload > kMaxPayloadBytes)
    PO_THROW(core::IoError, what, ": bad federation frame: the payload length: ", payload, " bytes (at most ",
             kMaxPayloadBytes, ")");
  return kFrameHeaderBytes + payload + kFrameTrailerBytes;
}

size_t frame_size_if_complete(std::string_view buffered, const std::string& what) {
  const uint64_t size = frame_size(buffered, what);
  return size != 0 && buffered.size() >= size ? static_cast<size_t>(size) : 0;
}

Message decode_frame(std::string_view bytes, const std::string& what) {
  const uint64_t size = frame_size(bytes, what);
  if (size == 0 || bytes.size() < kFrameHeaderBytes + kFrameTrailerBytes)
    PO_THROW(core::IoError, what, ": bad federation frame: the header: cut short (", bytes.size(),
             " bytes, a frame has at least ", kFrameHeaderBytes + kFrameTrailerBytes, ")");
  if (bytes.size() != size)
    PO_THROW(core::IoError, what, ": bad federation frame: the payload length: the header says ",
             size - kFrameHeaderBytes - kFrameTrailerBytes, " bytes, the frame holds ",
             bytes.size() - kFrameHeaderBytes - kFrameTrailerBytes);
  uint64_t stored;
  std::memcpy(&stored, bytes.data() + bytes.size() - 8, 8);
  const uint64_t computed = XXH3_64bits(bytes.data(), bytes.size() - 8);
  if (stored != computed)
    PO_THROW(core::IoError, what, ": bad federation frame: the checksum: stored ", hex64(stored), ", computed ",
             hex64(computed), " (damaged in transit?)");
  uint32_t type;
  std::memcpy(&type, bytes.data() + 8, 4);
  Reader r(bytes.substr(kFrameHeaderBytes, bytes.size() - kFrameHeaderBytes - kFrameTrailerBytes), what);
  Message m = decode_payload(static_cast<MessageType>(type), r);
  r.expect_end(message_type_name(static_cast<MessageType>(type)));
  return m;
}

// ---- authentication -----------------------------------------------------------------

Nonce32 random_nonce() {
  Nonce32 n{};
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1) {
    char buf[256];
    ERR_error_string_n(ERR_get_error(), buf, sizeof buf);
    PO_THROW(core::CommError, "federation: RAND_bytes failed: ", buf);
  }
  return n;
}

Nonce32 bind_challenge(const Nonce32& nonce, const Bytes32& channel_binding) {
  static constexpr char kLabel[] = "pagedoptim-federate-bind";
  std::string in(kLabel, sizeof kLabel - 1);
  in.append(reinterpret_cast<const char*>(nonce.data()), nonce.size());
  in.append(reinterpret_cast<const char*>(channel_binding.data()), channel_binding.size());
  Nonce32 out{};
  unsigned len = 0;
  if (EVP_Digest(in.data(), in.size(), out.data(), &len, EVP_sha256(), nullptr) != 1 || len != out.size())
    PO_THROW(core::CommError, "federation: SHA-256 failed");
  return out;
}

Key32 client_key(std::string_view job_secret, uint32_t client_id) {
  PO_CHECK(!job_secret.empty(), "federation: the job secret is empty");
  std::string body;
  put<uint32_t>(body, client_id);
  return mac(job_secret.data(), job_secret.size(), "pagedoptim-federate-client", body);
}

Mac32 hello_proof(const Key32& key, const Nonce32& challenge, const Nonce32& client_nonce, uint32_t client_id,
                  uint64_t fingerprint) {
  return mac(key.data(), key.size(), "pagedoptim-federate-hello",
             auth_body(challenge, client_nonce, client_id, fingerprint));
}

Hello make_hello(const Key32& key, const Nonce32& challenge, uint32_t client_id, uint64_t fingerprint) {
  Hello h;
  h.client_id = client_id;
  h.client_nonce = random_nonce();
  h.model_fingerprint = fingerprint;
  h.proof = hello_proof(key, challenge, h.client_nonce, client_id, fingerprint);
  return h;
}

bool verify_hello(std::string_view job_secret, const Nonce32& challenge, const Hello& hello) {
  const Key32 key = client_key(job_secret, hello.client_id);
  return same_mac(hello.proof,
                  hello_proof(key, challenge, hello.client_nonce, hello.client_id, hello.model_fingerprint));
}

Mac32 welcome_proof(const Key32& key, const Nonce32& challenge, const Nonce32& client_nonce, uint32_t client_id,
                    uint64_t round) {
  return mac(key.data(), key.size(), "pagedoptim-federate-welcome",
             auth_body(challenge, client_nonce, client_id, round));
}

Welcome make_welcome(std::string_view job_secret, const Nonce32& challenge, const Hello& hello, uint64_t round) {
  const Key32 key = client_key(job_secret, hello.client_id);
  return Welcome{round, welcome_proof(key, challenge, hello.client_nonce, hello.client_id, round)};
}

bool verify_welcome(const Key32& key, const Nonce32& challenge, const Hello& hello, const Welcome& welcome) {
  return same_mac(welcome.proof, welcome_proof(key, challenge, hello.client_nonce, hello.client_id, welcome.round));
}

bool same_mac(const Mac32& a, const Mac32& b) { return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }

}  // namespace po::comm
