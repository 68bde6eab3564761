// Secure aggregation (Bonawitz et al., "Practical Secure Aggregation for
// Privacy-Preserving Machine Learning", ePrint 2017/281), honest-but-curious
// version, without transport: the four rounds exchange the message structs
// below, and a network layer only has to carry them.
//
// Invariants the code keeps:
// - Inputs live in the ring Z_{2^32} (uint32 words, wrap-around addition).
//   Floats reach the ring through fixed_point_encode, whose bound
//   n·2·ceil(clip·2^frac_bits) < 2^32 keeps a sum of n encodings exact.
// - y_u = x_u + PRG(b_u) + Σ_{v>u} PRG(s_uv) − Σ_{v<u} PRG(s_uv)  (mod 2^32),
//   v over U2 (the clients whose shares were relayed). Pairwise masks cancel
//   in the sum; the server removes the self masks PRG(b_u) of the survivors
//   U3 and the left-over pairwise masks of the clients in U2 \ U3.
// - A client reveals, for each peer, either its share of the peer's mask key
//   s^SK (peer dropped before masking) or its share of b (peer's masked input
//   arrived), never both: it keeps a ledger and refuses a conflicting request.
// - Every sum is taken in client-id order, so results are deterministic.
// - The threshold t satisfies n/2 < t ≤ n: two disjoint sets of t clients do
//   not exist, so a server cannot get s^SK from one set and b from another.
//
// Key material: each client has two X25519 pairs, as in the paper: c (the
// channel: AES-256-GCM keys for the shares) and s (the pairwise masks). Only
// s^SK is Shamir-shared, so revealing it never opens the channel of a client.
// Randomness for keys, seeds, Shamir coefficients and nonces comes from
// OpenSSL's RAND_bytes; only the stochastic rounding of fixed_point_encode is
// a reproducible Philox stream.
//
// Not covered: the paper's consistency-check round and signatures (active
// adversaries), and SecAgg+ neighbourhoods (Bell 2020); every client masks
// with every other, O(n²) key agreements and O(n·vector_size) PRG words each.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <set>
#include <span>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace po::privacy {

using Key32 = std::array<uint8_t, 32>;
using Bytes = std::vector<uint8_t>;

// A ciphertext that failed authentication (tampered, wrong key, wrong
// associated data, truncated). Derives from CommError: it reports a message
// that arrived damaged or forged, not a bad argument of the caller.
class AuthenticationError : public po::core::CommError {
 public:
  using po::core::CommError::CommError;
};

// ---------------------------------------------------------------------------
// Fixed-point encoding into Z_{2^32}.
//
// encode(x) = round_stochastic(clamp(x, -clip, clip) · 2^frac_bits) as a
// two's-complement int32 stored in a uint32. With M = ceil(clip·2^frac_bits),
// one encoding lies in [-M, M] and a sum of n lies in [-nM, nM]; it decodes
// exactly iff those 2nM+1 values fit the ring, i.e. n·2·M < 2^32.
// Rounding: floor(q) + [u < q − floor(q)] with u = Philox(seed, kStream)
// word 0 of block (offset + i) / 2^32, so E[encode] = q to within 2^-32 of a
// quantum, and encoding a slice at `offset` equals the same slice of the
// whole vector.
struct FixedPoint {
  double clip = 1.0;  // |x| is clipped to clip before scaling
  int frac_bits = 16; // quantum = 2^-frac_bits, 0 ≤ frac_bits ≤ 30
};

// Throws InvalidArgument, naming clip, frac_bits and num_clients, unless
// num_clients·2·ceil(clip·2^frac_bits) < 2^32.
void fixed_point_check(const FixedPoint& fp, uint64_t num_clients);

// out[i] = encode(x[i]); x and out have the same length (elements). NaN is
// refused (InvalidArgument naming the index); ±inf clips.
void fixed_point_encode(const FixedPoint& fp, std::span<const float> x, uint64_t seed, uint64_t offset,
                        std::span<uint32_t> out);

// out[i] = float(int32(sum[i]) · 2^-frac_bits) for a ring sum of num_clients
// encodings. Runs fixed_point_check first, and throws InvalidArgument if a
// word lies outside [-nM, nM] (not a sum of n encodings: a wrong mask or an
// overflow).
void fixed_point_decode_sum(const FixedPoint& fp, std::span<const uint32_t> sum, uint64_t num_clients,
                            std::span<float> out);

// acc[i] += x[i] (mod 2^32); same length.
void ring_add(std::span<uint32_t> acc, std::span<const uint32_t> x);

// ---------------------------------------------------------------------------
// Primitives (OpenSSL 3 EVP).

struct X25519KeyPair {
  Key32 secret_key;
  Key32 public_key;
};

// A fresh key pair (EVP_PKEY_keygen).
X25519KeyPair x25519_generate();
// The public key of a raw secret key.
Key32 x25519_public_key(const Key32& secret_key);
// The raw X25519 shared secret (EVP_PKEY_derive); throws InvalidArgument for
// a low-order peer key (all-zero secret).
Key32 x25519_agree(const Key32& secret_key, const Key32& peer_public_key);

// HKDF-SHA256 (RFC 5869), 32 bytes of output.
Key32 hkdf_sha256(std::span<const uint8_t> ikm, std::span<const uint8_t> salt, std::string_view info);

// The mask stream PRG(key): ChaCha20 keystream (zero nonce, block counter
// from 0) read as little-endian uint32 words. Words [offset, offset+size).
void prg_words(const Key32& key, uint64_t offset, std::span<uint32_t> out);
// acc[i] += PRG(key)[offset+i] (sign +1) or −= (sign −1), mod 2^32.
void prg_accumulate(const Key32& key, int sign, uint64_t offset, std::span<uint32_t> acc);

// AES-256-GCM with a random 96-bit nonce: returns nonce(12) ‖ ciphertext ‖
// tag(16). `aad` is authenticated, not encrypted.
Bytes aead_seal(const Key32& key, std::span<const uint8_t> plaintext, std::span<const uint8_t> aad);
// Inverse of aead_seal; throws AuthenticationError on any mismatch.
Bytes aead_open(const Key32& key, std::span<const uint8_t> sealed, std::span<const uint8_t> aad);

// ---------------------------------------------------------------------------
// Shamir t-of-n sharing over GF(p), p = 2^61 − 1.
//
// A 32-byte secret is 8 little-endian 32-bit limbs, each shared with its own
// random polynomial of degree t−1 (coefficients uniform in [0, p) from
// RAND_bytes). 32-bit limbs keep every limb far below p, so a reconstructed
// limb ≥ 2^32 reveals inconsistent shares.
// Fewer than t shares: shamir_reconstruct throws (it knows t);
// shamir_interpolate_at_zero gives the value of the lower-degree polynomial
// through them, unrelated to the secret: t−1 shares are consistent with
// every secret (the test forges a t-th share for an arbitrary one).
inline constexpr uint64_t kShamirPrime = (uint64_t{1} << 61) - 1;
inline constexpr int kShamirLimbs = 8;

struct ShamirShare {
  uint32_t x = 0;                            // evaluation point, ≠ 0
  std::array<uint64_t, kShamirLimbs> y{};    // f_k(x) for each limb k
};

// One share per x in xs (distinct, nonzero); 1 ≤ threshold ≤ xs.size().
std::vector<ShamirShare> shamir_split(const Key32& secret, uint32_t threshold, std::span<const uint32_t> xs);
// The secret from the first `threshold` shares; throws InvalidArgument when
// there are fewer, when x repeats, or when a limb is out of range.
Key32 shamir_reconstruct(std::span<const ShamirShare> shares, uint32_t threshold);
// Lagrange interpolation at 0 of all the shares given, limb by limb.
std::array<uint64_t, kShamirLimbs> shamir_interpolate_at_zero(std::span<const ShamirShare> shares);

// ---------------------------------------------------------------------------
// Protocol.

struct SecAggConfig {
  uint32_t num_clients = 0;  // n: client ids are 0 .. n−1
  uint32_t threshold = 0;    // t: n/2 < t ≤ n, and t ≥ 2
  uint64_t vector_size = 0;  // elements (uint32 ring words) of every input
  uint64_t round_id = 0;     // binds keys, masks and ciphertexts to one aggregation
};

// Throws InvalidArgument naming the field that is out of range.
void secagg_config_check(const SecAggConfig& config);

// Round 0, client → server; the server's roster of these goes back to all.
struct AdvertiseKeys {
  uint32_t client_id = 0;
  Key32 cipher_public_key{};  // c_u^PK: channel for the shares
  Key32 mask_public_key{};    // s_u^PK: pairwise masks
};

// One AES-256-GCM ciphertext of (from, to, share of s_from^SK, share of
// b_from), relayed by the server but readable only by `to`.
struct EncryptedShare {
  uint32_t from = 0;
  uint32_t to = 0;
  Bytes ciphertext;
};

// Round 1, client → server: one EncryptedShare for every other roster member,
// ascending `to`. The server forwards each to its recipient.
struct ShareKeys {
  uint32_t client_id = 0;
  std::vector<EncryptedShare> shares;
};

// Round 2, client → server: y_u, vector_size words.
struct MaskedInput {
  uint32_t client_id = 0;
  std::vector<uint32_t> masked;
};

// A share of `owner`'s secret that the revealing client holds.
struct RevealedShare {
  uint32_t owner = 0;
  ShamirShare share;
};

// Round 3, client → server, answering the survivor list U3: shares of s_v^SK
// for each v in U2 \ U3, shares of b_v for each v in U3 (itself included),
// both ascending `owner`.
struct Unmasking {
  uint32_t client_id = 0;
  std::vector<RevealedShare> mask_key_shares;
  std::vector<RevealedShare> self_mask_shares;
};

// One participant. Calls go advertise_keys → share_keys → masked_input →
// unmask, each once (unmask may be repeated with the same survivors); a call
// out of order throws InvalidArgument naming the round.
class SecAggClient {
 public:
  SecAggClient(const SecAggConfig& config, uint32_t client_id);
  ~SecAggClient();
  SecAggClient(const SecAggClient&) = delete;
  SecAggClient& operator=(const SecAggClient&) = delete;
  SecAggClient(SecAggClient&&) = default;
  SecAggClient& operator=(SecAggClient&&) = default;

  uint32_t client_id() const { return id_; }

  // Round 0: fresh key pairs c_u, s_u.
  AdvertiseKeys advertise_keys();
  // Round 1: checks the roster (U1; ≥ t members, itself included with its own
  // keys, no repeated key), draws b_u, shares s_u^SK and b_u among U1.
  ShareKeys share_keys(std::span<const AdvertiseKeys> roster);
  // Round 2: decrypts the shares addressed to it (AuthenticationError if one
  // was tampered with); U2 = their senders ∪ {u}, ≥ t; returns y_u for the
  // ring vector `input` (vector_size words).
  MaskedInput masked_input(std::span<const EncryptedShare> inbox, std::span<const uint32_t> input);
  // Round 3: survivors is U3, ascending, ⊆ U2, ≥ t, containing u. Refuses
  // (InvalidArgument) to reveal b_v and s_v^SK shares for the same v, across
  // all calls.
  Unmasking unmask(std::span<const uint32_t> survivors);

 private:
  enum class Stage { kAdvertise, kShareKeys, kMaskedInput, kUnmask };
  enum class Revealed : uint8_t { kNone, kMaskKey, kSelfMask };

  SecAggConfig config_;
  uint32_t id_;
  Stage stage_ = Stage::kAdvertise;
  X25519KeyPair cipher_keys_{};
  X25519KeyPair mask_keys_{};
  Key32 self_mask_seed_{};                       // b_u
  std::map<uint32_t, AdvertiseKeys> roster_;     // U1
  std::set<uint32_t> shared_;                    // U2
  std::map<uint32_t, ShamirShare> held_mask_key_;   // v → my share of s_v^SK
  std::map<uint32_t, ShamirShare> held_self_mask_;  // v → my share of b_v
  std::map<uint32_t, Revealed> revealed_;
};

// The aggregator. It sees public keys, ciphertexts, masked inputs and the
// revealed shares, and outputs Σ_{u∈U3} x_u. Each round: receive() every
// message that arrives, then finish_*(), which throws InvalidArgument naming
// the round and the counts when fewer than t clients took part.
class SecAggServer {
 public:
  explicit SecAggServer(const SecAggConfig& config);

  // Round 0.
  void receive(const AdvertiseKeys& msg);
  std::vector<AdvertiseKeys> finish_advertise_keys();  // the roster U1, ascending id
  // Round 1.
  void receive(const ShareKeys& msg);
  // Recipient → the EncryptedShares addressed to it, ascending `from`; one
  // entry per member of U2.
  std::map<uint32_t, std::vector<EncryptedShare>> finish_share_keys();
  // Round 2.
  void receive(const MaskedInput& msg);
  std::vector<uint32_t> finish_masked_input();  // U3, ascending
  // Round 3.
  void receive(const Unmasking& msg);
  // Σ_{u∈U3} x_u (mod 2^32), vector_size words.
  std::vector<uint32_t> finish_unmasking();

  const std::vector<uint32_t>& survivors() const { return survivors_; }

 private:
  enum class Stage { kAdvertise, kShareKeys, kMaskedInput, kUnmask, kDone };

  void expect_stage(Stage stage, const char* round) const;

  SecAggConfig config_;
  Stage stage_ = Stage::kAdvertise;
  std::map<uint32_t, AdvertiseKeys> roster_;                // U1
  std::map<uint32_t, ShareKeys> share_keys_;                // U2
  std::map<uint32_t, std::vector<uint32_t>> masked_;        // U3
  std::vector<uint32_t> survivors_;                         // U3, ascending
  std::map<uint32_t, Unmasking> unmasking_;                 // U5
};

// The whole protocol in memory, for tests and as the reference of the message
// flow. A client listed in a dropout set goes silent from that round on.
struct SecAggDropouts {
  std::vector<uint32_t> before_share_keys;    // advertised, then silent: U1 \ U2
  std::vector<uint32_t> before_masked_input;  // shared, then silent: U2 \ U3
  std::vector<uint32_t> before_unmasking;     // masked input sent, then silent: U3 \ U5
};

struct SecAggResult {
  std::vector<uint32_t> sum;        // Σ_{u∈U3} inputs[u] (mod 2^32)
  std::vector<uint32_t> survivors;  // U3, ascending
};

// inputs[u] is client u's ring vector (num_clients vectors of vector_size).
SecAggResult secagg_run_in_memory(const SecAggConfig& config, const std::vector<std::vector<uint32_t>>& inputs,
                                  const SecAggDropouts& dropouts = {});

}  // namespace po::privacy
