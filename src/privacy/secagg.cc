// Secure aggregation: primitives on OpenSSL 3's EVP interfaces, Shamir over
// GF(2^61 − 1), and the four-round client/server state machines (secagg.h).
//
// Rules the code relies on:
// - Every key the protocol uses comes out of HKDF with an info string naming
//   the protocol version, the purpose, the round id and the client(s), so no
//   two purposes, rounds or pairs ever share a ChaCha20 or AES key.
// - Pairwise keys name the pair as (min, max): u and v derive the same key.
// - Ring arithmetic is uint32 arithmetic: unsigned wrap-around is mod 2^32.
// - Secret bytes (key pairs, seeds, held shares) are wiped with
//   OPENSSL_cleanse when their owner is destroyed.
#include "privacy/secagg.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <openssl/params.h>
#include <openssl/rand.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#include "core/rng.h"

namespace po::privacy {
namespace {

using po::core::InvalidArgument;
using po::core::str_cat;

// ---- OpenSSL boundary -------------------------------------------------------

[[noreturn]] void throw_ssl(const char* call) {
  char buf[256] = "no error queued";
  if (unsigned long e = ERR_get_error()) ERR_error_string_n(e, buf, sizeof buf);
  ERR_clear_error();
  PO_THROW(po::core::Internal, "secagg: OpenSSL ", call, " failed: ", buf);
}

// OpenSSL calls return 1 on success, ≤ 0 on failure; pointers are null on failure.
#define PO_SSL_CHECK(call)              \
  do {                                  \
    if ((call) <= 0) throw_ssl(#call);  \
  } while (0)

template <typename T>
T* ssl_ptr(T* p, const char* call) {
  if (p == nullptr) throw_ssl(call);
  return p;
}

struct PkeyFree { void operator()(EVP_PKEY* p) const { EVP_PKEY_free(p); } };
struct PkeyCtxFree { void operator()(EVP_PKEY_CTX* p) const { EVP_PKEY_CTX_free(p); } };
struct CipherCtxFree { void operator()(EVP_CIPHER_CTX* p) const { EVP_CIPHER_CTX_free(p); } };
struct KdfFree { void operator()(EVP_KDF* p) const { EVP_KDF_free(p); } };
struct KdfCtxFree { void operator()(EVP_KDF_CTX* p) const { EVP_KDF_CTX_free(p); } };
using Pkey = std::unique_ptr<EVP_PKEY, PkeyFree>;
using PkeyCtx = std::unique_ptr<EVP_PKEY_CTX, PkeyCtxFree>;
using CipherCtx = std::unique_ptr<EVP_CIPHER_CTX, CipherCtxFree>;

void random_bytes(uint8_t* out, size_t n) { PO_SSL_CHECK(RAND_bytes(out, static_cast<int>(n))); }

template <typename T>
void wipe(T& secret) {
  OPENSSL_cleanse(&secret, sizeof secret);
}

void store_le32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void store_le64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t load_le32(const uint8_t* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}
uint64_t load_le64(const uint8_t* p) { return uint64_t{load_le32(p)} | uint64_t{load_le32(p + 4)} << 32; }

// ---- GF(2^61 − 1) -------------------------------------------------------------

constexpr uint64_t kP = kShamirPrime;

uint64_t gf_reduce(unsigned __int128 v) {  // v < 2^122
  uint64_t r = static_cast<uint64_t>(v & kP) + static_cast<uint64_t>(v >> 61);
  r = (r & kP) + (r >> 61);
  return r >= kP ? r - kP : r;
}
uint64_t gf_add(uint64_t a, uint64_t b) { return a + b >= kP ? a + b - kP : a + b; }
uint64_t gf_sub(uint64_t a, uint64_t b) { return a >= b ? a - b : a + kP - b; }
uint64_t gf_mul(uint64_t a, uint64_t b) { return gf_reduce(static_cast<unsigned __int128>(a) * b); }
uint64_t gf_inv(uint64_t a) {  // Fermat: a^(p−2), a ≠ 0
  uint64_t r = 1, e = kP - 2;
  for (; e != 0; e >>= 1, a = gf_mul(a, a))
    if (e & 1) r = gf_mul(r, a);
  return r;
}
// Uniform in [0, p): 61 random bits, rejecting the single value p.
uint64_t gf_random() {
  for (;;) {
    uint8_t b[8];
    random_bytes(b, sizeof b);
    uint64_t v = load_le64(b) & kP;
    wipe(b);
    if (v != kP) return v;
  }
}

void check_distinct_points(std::span<const ShamirShare> shares, const char* who) {
  std::set<uint32_t> seen;
  for (const ShamirShare& s : shares) {
    PO_CHECK(s.x != 0, who, ": a share has x = 0, the secret itself");
    PO_CHECK(seen.insert(s.x).second, who, ": two shares have x = ", s.x);
  }
}

// ---- protocol key schedule and payloads ---------------------------------------

constexpr std::string_view kProtocol = "po.secagg.v1";
constexpr size_t kSharePayloadBytes = 4 + 4 + 2 * (4 + 8 * kShamirLimbs);

std::string pair_info(std::string_view purpose, uint64_t round_id, uint32_t a, uint32_t b) {
  return str_cat(kProtocol, " ", purpose, " round=", round_id, " pair=", std::min(a, b), ",", std::max(a, b));
}
// AES-256-GCM key of the channel between u and v: HKDF of X25519(c_u, c_v).
Key32 channel_key(const SecAggConfig& c, const Key32& agreement, uint32_t u, uint32_t v) {
  return hkdf_sha256(agreement, {}, pair_info("channel", c.round_id, u, v));
}
// ChaCha20 key of PRG(s_uv): HKDF of X25519(s_u, s_v).
Key32 mask_pair_key(const SecAggConfig& c, const Key32& agreement, uint32_t u, uint32_t v) {
  return hkdf_sha256(agreement, {}, pair_info("mask", c.round_id, u, v));
}
// ChaCha20 key of PRG(b_u).
Key32 self_mask_key(const SecAggConfig& c, const Key32& seed, uint32_t u) {
  return hkdf_sha256(seed, {}, str_cat(kProtocol, " self-mask round=", c.round_id, " client=", u));
}
// Associated data of a share ciphertext: binds version, round and direction.
Bytes share_aad(const SecAggConfig& c, uint32_t from, uint32_t to) {
  Bytes aad(kProtocol.begin(), kProtocol.end());
  aad.resize(kProtocol.size() + 16);
  store_le64(aad.data() + kProtocol.size(), c.round_id);
  store_le32(aad.data() + kProtocol.size() + 8, from);
  store_le32(aad.data() + kProtocol.size() + 12, to);
  return aad;
}

uint8_t* put_share(uint8_t* p, const ShamirShare& s) {
  store_le32(p, s.x);
  for (int k = 0; k < kShamirLimbs; ++k) store_le64(p + 4 + 8 * k, s.y[k]);
  return p + 4 + 8 * kShamirLimbs;
}
const uint8_t* get_share(const uint8_t* p, ShamirShare& s) {
  s.x = load_le32(p);
  for (int k = 0; k < kShamirLimbs; ++k) s.y[k] = load_le64(p + 4 + 8 * k);
  return p + 4 + 8 * kShamirLimbs;
}

void require_quorum(size_t got, size_t of, uint32_t threshold, const char* round) {
  PO_CHECK(got >= threshold, "secagg ", round, ": ", got, " of ", of,
           " clients responded, fewer than the threshold t = ", threshold, "; the aggregation is abandoned");
}

}  // namespace

// ---- fixed point ----------------------------------------------------------------

namespace {
constexpr uint64_t kRoundingStream = 0x5345434147ull;  // "SECAG": Philox stream of the rounding

// M = ceil(clip·2^frac_bits) after fixed_point_check has passed.
uint64_t fixed_point_max(const FixedPoint& fp) {
  return static_cast<uint64_t>(std::ceil(std::ldexp(fp.clip, fp.frac_bits)));
}
}  // namespace

void fixed_point_check(const FixedPoint& fp, uint64_t num_clients) {
  PO_CHECK(fp.frac_bits >= 0 && fp.frac_bits <= 30, "secagg fixed point: frac_bits = ", fp.frac_bits,
           " must lie in [0, 30]");
  PO_CHECK(std::isfinite(fp.clip) && fp.clip > 0, "secagg fixed point: clip = ", fp.clip, " must be finite and > 0");
  PO_CHECK(num_clients >= 1, "secagg fixed point: num_clients = 0");
  const double m = std::ceil(std::ldexp(fp.clip, fp.frac_bits));
  constexpr uint64_t kRingMax = std::numeric_limits<uint32_t>::max();  // 2^32 − 1
  // n·2·M < 2^32  ⟺  n·2·M ≤ 2^32 − 1  ⟺  n ≤ ⌊(2^32 − 1) / 2M⌋, with no overflow.
  PO_CHECK(m < 2147483648.0 && num_clients <= kRingMax / (2 * static_cast<uint64_t>(m)),
           "secagg fixed point: the modulus 2^32 must exceed num_clients·2·ceil(clip·2^frac_bits) = ", num_clients,
           "·2·", m, " = ", static_cast<double>(num_clients) * 2 * m, " (num_clients = ", num_clients,
           ", clip = ", fp.clip, ", frac_bits = ", fp.frac_bits,
           "); lower frac_bits or clip, or aggregate fewer clients");
}

void fixed_point_encode(const FixedPoint& fp, std::span<const float> x, uint64_t seed, uint64_t offset,
                        std::span<uint32_t> out) {
  fixed_point_check(fp, 1);
  PO_CHECK(x.size() == out.size(), "fixed_point_encode: ", x.size(), " inputs but ", out.size(), " outputs");
  const double scale = std::ldexp(1.0, fp.frac_bits);
  const po::core::Philox rng(seed, kRoundingStream);
  for (size_t i = 0; i < x.size(); ++i) {
    PO_CHECK(!std::isnan(x[i]), "fixed_point_encode: x[", offset + i, "] is NaN");
    const double q = std::clamp(static_cast<double>(x[i]), -fp.clip, fp.clip) * scale;  // exact
    const double lo = std::floor(q);
    const double u = rng.block(offset + i)[0] * 0x1p-32;  // uniform in [0, 1), 32 bits
    const int64_t r = static_cast<int64_t>(lo) + (u < q - lo ? 1 : 0);
    out[i] = static_cast<uint32_t>(r);  // two's complement: conversion to unsigned is mod 2^32
  }
}

void fixed_point_decode_sum(const FixedPoint& fp, std::span<const uint32_t> sum, uint64_t num_clients,
                            std::span<float> out) {
  fixed_point_check(fp, num_clients);
  PO_CHECK(sum.size() == out.size(), "fixed_point_decode_sum: ", sum.size(), " words but ", out.size(), " outputs");
  const int64_t bound = static_cast<int64_t>(num_clients * fixed_point_max(fp));  // < 2^31 by the check
  for (size_t i = 0; i < sum.size(); ++i) {
    const int64_t s = static_cast<int32_t>(sum[i]);  // mod 2^32 to [−2^31, 2^31)
    PO_CHECK(s >= -bound && s <= bound, "fixed_point_decode_sum: word ", i, " = ", s,
             " lies outside ±num_clients·M = ±", bound, ": not a sum of ", num_clients,
             " encodings (wrong mask or overflow)");
    out[i] = static_cast<float>(std::ldexp(static_cast<double>(s), -fp.frac_bits));
  }
}

void ring_add(std::span<uint32_t> acc, std::span<const uint32_t> x) {
  PO_CHECK(acc.size() == x.size(), "ring_add: ", acc.size(), " words += ", x.size(), " words");
  for (size_t i = 0; i < acc.size(); ++i) acc[i] += x[i];
}

// ---- X25519, HKDF, ChaCha20, AES-GCM -------------------------------------------

X25519KeyPair x25519_generate() {
  PkeyCtx ctx(ssl_ptr(EVP_PKEY_CTX_new_id(EVP_PKEY_X25519, nullptr), "EVP_PKEY_CTX_new_id(X25519)"));
  PO_SSL_CHECK(EVP_PKEY_keygen_init(ctx.get()));
  EVP_PKEY* raw = nullptr;
  PO_SSL_CHECK(EVP_PKEY_keygen(ctx.get(), &raw));
  Pkey key(raw);
  X25519KeyPair kp;
  size_t sk_len = kp.secret_key.size(), pk_len = kp.public_key.size();
  PO_SSL_CHECK(EVP_PKEY_get_raw_private_key(key.get(), kp.secret_key.data(), &sk_len));
  PO_SSL_CHECK(EVP_PKEY_get_raw_public_key(key.get(), kp.public_key.data(), &pk_len));
  PO_ASSERT(sk_len == 32 && pk_len == 32, "X25519 keys are 32 bytes, got ", sk_len, " and ", pk_len);
  return kp;
}

Key32 x25519_public_key(const Key32& secret_key) {
  Pkey key(ssl_ptr(EVP_PKEY_new_raw_private_key(EVP_PKEY_X25519, nullptr, secret_key.data(), secret_key.size()),
                   "EVP_PKEY_new_raw_private_key(X25519)"));
  Key32 pk;
  size_t len = pk.size();
  PO_SSL_CHECK(EVP_PKEY_get_raw_public_key(key.get(), pk.data(), &len));
  return pk;
}

Key32 x25519_agree(const Key32& secret_key, const Key32& peer_public_key) {
  Pkey mine(ssl_ptr(EVP_PKEY_new_raw_private_key(EVP_PKEY_X25519, nullptr, secret_key.data(), secret_key.size()),
                    "EVP_PKEY_new_raw_private_key(X25519)"));
  Pkey peer(ssl_ptr(
      EVP_PKEY_new_raw_public_key(EVP_PKEY_X25519, nullptr, peer_public_key.data(), peer_public_key.size()),
      "EVP_PKEY_new_raw_public_key(X25519)"));
  PkeyCtx ctx(ssl_ptr(EVP_PKEY_CTX_new(mine.get(), nullptr), "EVP_PKEY_CTX_new"));
  PO_SSL_CHECK(EVP_PKEY_derive_init(ctx.get()));
  Key32 shared;
  size_t len = shared.size();
  // OpenSSL refuses a low-order peer key (the shared secret would be all zero).
  if (EVP_PKEY_derive_set_peer(ctx.get(), peer.get()) <= 0 || EVP_PKEY_derive(ctx.get(), shared.data(), &len) <= 0) {
    ERR_clear_error();
    PO_THROW(InvalidArgument, "x25519_agree: key agreement failed: the peer public key is invalid or of low order");
  }
  PO_ASSERT(len == 32, "X25519 shared secret of ", len, " bytes");
  return shared;
}

Key32 hkdf_sha256(std::span<const uint8_t> ikm, std::span<const uint8_t> salt, std::string_view info) {
  std::unique_ptr<EVP_KDF, KdfFree> kdf(ssl_ptr(EVP_KDF_fetch(nullptr, "HKDF", nullptr), "EVP_KDF_fetch(HKDF)"));
  std::unique_ptr<EVP_KDF_CTX, KdfCtxFree> ctx(ssl_ptr(EVP_KDF_CTX_new(kdf.get()), "EVP_KDF_CTX_new"));
  char digest[] = "SHA256";
  OSSL_PARAM params[5];
  OSSL_PARAM* p = params;
  *p++ = OSSL_PARAM_construct_utf8_string(OSSL_KDF_PARAM_DIGEST, digest, 0);
  *p++ = OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_KEY, const_cast<uint8_t*>(ikm.data()), ikm.size());
  if (!salt.empty())
    *p++ = OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_SALT, const_cast<uint8_t*>(salt.data()), salt.size());
  if (!info.empty())
    *p++ = OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_INFO, const_cast<char*>(info.data()), info.size());
  *p = OSSL_PARAM_construct_end();
  Key32 out;
  PO_SSL_CHECK(EVP_KDF_derive(ctx.get(), out.data(), out.size(), params));
  return out;
}

namespace {
constexpr size_t kPrgChunkWords = 4096;

// Calls fn(words, position) on consecutive chunks of PRG(key)[offset, offset+count).
// The ChaCha20 IV is the 64-bit little-endian block counter then a zero
// nonce; OpenSSL carries the counter across 2^32 blocks (the test checks it).
template <typename Fn>
void prg_for_each_chunk(const Key32& key, uint64_t offset, size_t count, Fn&& fn) {
  static const std::array<uint8_t, 4 * kPrgChunkWords> kZeros{};
  CipherCtx ctx(ssl_ptr(EVP_CIPHER_CTX_new(), "EVP_CIPHER_CTX_new"));
  uint8_t iv[16] = {};
  store_le64(iv, offset / 16);
  PO_SSL_CHECK(EVP_EncryptInit_ex(ctx.get(), EVP_chacha20(), nullptr, key.data(), iv));
  std::array<uint8_t, 4 * kPrgChunkWords> bytes;
  std::array<uint32_t, kPrgChunkWords> words;
  int len = 0;
  if (const size_t skip = offset % 16; skip != 0)
    PO_SSL_CHECK(EVP_EncryptUpdate(ctx.get(), bytes.data(), &len, kZeros.data(), static_cast<int>(4 * skip)));
  for (size_t done = 0; done < count;) {
    const size_t n = std::min(kPrgChunkWords, count - done);
    PO_SSL_CHECK(EVP_EncryptUpdate(ctx.get(), bytes.data(), &len, kZeros.data(), static_cast<int>(4 * n)));
    for (size_t k = 0; k < n; ++k) words[k] = load_le32(bytes.data() + 4 * k);
    fn(std::span<const uint32_t>(words.data(), n), done);
    done += n;
  }
  wipe(bytes);
  wipe(words);
}
}  // namespace

void prg_words(const Key32& key, uint64_t offset, std::span<uint32_t> out) {
  prg_for_each_chunk(key, offset, out.size(), [&](std::span<const uint32_t> w, size_t pos) {
    std::copy(w.begin(), w.end(), out.begin() + pos);
  });
}

void prg_accumulate(const Key32& key, int sign, uint64_t offset, std::span<uint32_t> acc) {
  PO_CHECK(sign == 1 || sign == -1, "prg_accumulate: sign = ", sign, " must be +1 or -1");
  prg_for_each_chunk(key, offset, acc.size(), [&](std::span<const uint32_t> w, size_t pos) {
    uint32_t* a = acc.data() + pos;
    if (sign > 0)
      for (size_t k = 0; k < w.size(); ++k) a[k] += w[k];
    else
      for (size_t k = 0; k < w.size(); ++k) a[k] -= w[k];
  });
}

namespace {
constexpr size_t kGcmNonceBytes = 12, kGcmTagBytes = 16;
}

Bytes aead_seal(const Key32& key, std::span<const uint8_t> plaintext, std::span<const uint8_t> aad) {
  PO_CHECK(plaintext.size() < (size_t{1} << 30) && aad.size() < (size_t{1} << 30),
           "aead_seal: messages are limited to 1 GiB, got ", plaintext.size(), " bytes");
  Bytes out(kGcmNonceBytes + plaintext.size() + kGcmTagBytes);
  random_bytes(out.data(), kGcmNonceBytes);
  CipherCtx ctx(ssl_ptr(EVP_CIPHER_CTX_new(), "EVP_CIPHER_CTX_new"));
  PO_SSL_CHECK(EVP_EncryptInit_ex(ctx.get(), EVP_aes_256_gcm(), nullptr, key.data(), out.data()));
  int len = 0;
  if (!aad.empty()) PO_SSL_CHECK(EVP_EncryptUpdate(ctx.get(), nullptr, &len, aad.data(), static_cast<int>(aad.size())));
  uint8_t* ct = out.data() + kGcmNonceBytes;
  if (!plaintext.empty())
    PO_SSL_CHECK(EVP_EncryptUpdate(ctx.get(), ct, &len, plaintext.data(), static_cast<int>(plaintext.size())));
  PO_SSL_CHECK(EVP_EncryptFinal_ex(ctx.get(), ct + plaintext.size(), &len));  // GCM: no bytes
  PO_SSL_CHECK(EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_GET_TAG, kGcmTagBytes, ct + plaintext.size()));
  return out;
}

Bytes aead_open(const Key32& key, std::span<const uint8_t> sealed, std::span<const uint8_t> aad) {
  if (sealed.size() < kGcmNonceBytes + kGcmTagBytes)
    PO_THROW(AuthenticationError, "aead_open: ciphertext of ", sealed.size(),
             " bytes is shorter than nonce and tag (", kGcmNonceBytes + kGcmTagBytes, " bytes)");
  PO_CHECK(sealed.size() < (size_t{1} << 30) && aad.size() < (size_t{1} << 30),
           "aead_open: messages are limited to 1 GiB, got ", sealed.size(), " bytes");
  const size_t n = sealed.size() - kGcmNonceBytes - kGcmTagBytes;
  Bytes out(n);
  CipherCtx ctx(ssl_ptr(EVP_CIPHER_CTX_new(), "EVP_CIPHER_CTX_new"));
  PO_SSL_CHECK(EVP_DecryptInit_ex(ctx.get(), EVP_aes_256_gcm(), nullptr, key.data(), sealed.data()));
  int len = 0;
  if (!aad.empty()) PO_SSL_CHECK(EVP_DecryptUpdate(ctx.get(), nullptr, &len, aad.data(), static_cast<int>(aad.size())));
  if (n != 0)
    PO_SSL_CHECK(EVP_DecryptUpdate(ctx.get(), out.data(), &len, sealed.data() + kGcmNonceBytes, static_cast<int>(n)));
  uint8_t tag[kGcmTagBytes];
  std::memcpy(tag, sealed.data() + kGcmNonceBytes + n, kGcmTagBytes);
  PO_SSL_CHECK(EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_SET_TAG, kGcmTagBytes, tag));
  uint8_t final_block[16];
  if (EVP_DecryptFinal_ex(ctx.get(), final_block, &len) <= 0) {
    ERR_clear_error();
    OPENSSL_cleanse(out.data(), out.size());
    PO_THROW(AuthenticationError, "aead_open: AES-256-GCM authentication failed for a ciphertext of ", sealed.size(),
             " bytes (tampered, truncated, wrong key or wrong associated data)");
  }
  return out;
}

// ---- Shamir ----------------------------------------------------------------------

std::vector<ShamirShare> shamir_split(const Key32& secret, uint32_t threshold, std::span<const uint32_t> xs) {
  PO_CHECK(threshold >= 1 && threshold <= xs.size(), "shamir_split: threshold = ", threshold, " must lie in [1, ",
           xs.size(), "] (the number of shares)");
  std::vector<ShamirShare> shares(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) shares[i].x = xs[i];
  check_distinct_points(shares, "shamir_split");
  std::vector<uint64_t> coeffs(threshold);
  for (int k = 0; k < kShamirLimbs; ++k) {
    coeffs[0] = load_le32(secret.data() + 4 * k);
    for (uint32_t j = 1; j < threshold; ++j) coeffs[j] = gf_random();
    for (ShamirShare& s : shares) {  // Horner
      uint64_t y = 0;
      for (uint32_t j = threshold; j-- > 0;) y = gf_add(gf_mul(y, s.x), coeffs[j]);
      s.y[k] = y;
    }
  }
  OPENSSL_cleanse(coeffs.data(), coeffs.size() * sizeof(uint64_t));
  return shares;
}

std::array<uint64_t, kShamirLimbs> shamir_interpolate_at_zero(std::span<const ShamirShare> shares) {
  PO_CHECK(!shares.empty(), "shamir_interpolate_at_zero: no shares");
  check_distinct_points(shares, "shamir_interpolate_at_zero");
  std::array<uint64_t, kShamirLimbs> secret{};
  for (size_t i = 0; i < shares.size(); ++i) {
    // Lagrange basis at 0: Π_{j≠i} x_j / (x_j − x_i).
    uint64_t num = 1, den = 1;
    for (size_t j = 0; j < shares.size(); ++j) {
      if (j == i) continue;
      num = gf_mul(num, shares[j].x);
      den = gf_mul(den, gf_sub(shares[j].x, shares[i].x));
    }
    const uint64_t li = gf_mul(num, gf_inv(den));
    for (int k = 0; k < kShamirLimbs; ++k) {
      PO_CHECK(shares[i].y[k] < kP, "shamir_interpolate_at_zero: share x = ", shares[i].x, " limb ", k,
               " is not a field element");
      secret[k] = gf_add(secret[k], gf_mul(shares[i].y[k], li));
    }
  }
  return secret;
}

Key32 shamir_reconstruct(std::span<const ShamirShare> shares, uint32_t threshold) {
  PO_CHECK(threshold >= 1, "shamir_reconstruct: threshold = 0");
  PO_CHECK(shares.size() >= threshold, "shamir_reconstruct: ", shares.size(), " shares given, threshold is ",
           threshold, ": fewer than t shares say nothing about the secret");
  std::array<uint64_t, kShamirLimbs> limbs = shamir_interpolate_at_zero(shares.first(threshold));
  Key32 secret;
  for (int k = 0; k < kShamirLimbs; ++k) {
    PO_CHECK(limbs[k] <= std::numeric_limits<uint32_t>::max(), "shamir_reconstruct: limb ", k, " = ", limbs[k],
             " is not a 32-bit value: the shares are inconsistent");
    store_le32(secret.data() + 4 * k, static_cast<uint32_t>(limbs[k]));
  }
  wipe(limbs);
  return secret;
}

// ---- protocol ----------------------------------------------------------------------

void secagg_config_check(const SecAggConfig& c) {
  PO_CHECK(c.num_clients >= 2 && c.num_clients < std::numeric_limits<uint32_t>::max(),
           "secagg: num_clients = ", c.num_clients, " must be at least 2");
  PO_CHECK(c.threshold >= 2 && c.threshold <= c.num_clients && 2 * uint64_t{c.threshold} > c.num_clients,
           "secagg: threshold = ", c.threshold,
           " must satisfy num_clients/2 < threshold <= num_clients (num_clients = ", c.num_clients,
           ") and be at least 2");
  PO_CHECK(c.vector_size >= 1, "secagg: vector_size = 0");
}

SecAggClient::SecAggClient(const SecAggConfig& config, uint32_t client_id) : config_(config), id_(client_id) {
  secagg_config_check(config_);
  PO_CHECK(id_ < config_.num_clients, "SecAggClient: client_id = ", id_, " must be < num_clients = ",
           config_.num_clients);
}

SecAggClient::~SecAggClient() {
  wipe(cipher_keys_);
  wipe(mask_keys_);
  wipe(self_mask_seed_);
  for (auto& [v, s] : held_mask_key_) wipe(s);
  for (auto& [v, s] : held_self_mask_) wipe(s);
}

AdvertiseKeys SecAggClient::advertise_keys() {
  PO_CHECK(stage_ == Stage::kAdvertise, "SecAggClient ", id_, ": round 0 (AdvertiseKeys) was already run");
  cipher_keys_ = x25519_generate();
  mask_keys_ = x25519_generate();
  stage_ = Stage::kShareKeys;
  return AdvertiseKeys{id_, cipher_keys_.public_key, mask_keys_.public_key};
}

ShareKeys SecAggClient::share_keys(std::span<const AdvertiseKeys> roster) {
  PO_CHECK(stage_ == Stage::kShareKeys, "SecAggClient ", id_,
           ": round 1 (ShareKeys) must follow round 0 (AdvertiseKeys) and run once");
  std::map<uint32_t, AdvertiseKeys> members;
  std::set<Key32> keys;
  for (const AdvertiseKeys& a : roster) {
    PO_CHECK(a.client_id < config_.num_clients, "secagg round 1 (ShareKeys): roster names client ", a.client_id,
             ", num_clients = ", config_.num_clients);
    PO_CHECK(members.emplace(a.client_id, a).second, "secagg round 1 (ShareKeys): roster names client ",
             a.client_id, " twice");
    PO_CHECK(keys.insert(a.cipher_public_key).second && keys.insert(a.mask_public_key).second,
             "secagg round 1 (ShareKeys): client ", a.client_id, " repeats a public key of the roster");
  }
  auto me = members.find(id_);
  PO_CHECK(me != members.end() && me->second.cipher_public_key == cipher_keys_.public_key &&
               me->second.mask_public_key == mask_keys_.public_key,
           "secagg round 1 (ShareKeys): the roster does not carry client ", id_, "'s own public keys");
  require_quorum(members.size(), config_.num_clients, config_.threshold, "round 1 (ShareKeys), roster");
  roster_ = std::move(members);

  random_bytes(self_mask_seed_.data(), self_mask_seed_.size());
  std::vector<uint32_t> xs;
  for (const auto& [v, a] : roster_) xs.push_back(v + 1);
  std::vector<ShamirShare> sk_shares = shamir_split(mask_keys_.secret_key, config_.threshold, xs);
  std::vector<ShamirShare> b_shares = shamir_split(self_mask_seed_, config_.threshold, xs);

  ShareKeys msg{id_, {}};
  size_t i = 0;
  for (const auto& [v, a] : roster_) {
    if (v == id_) {
      held_self_mask_[id_] = b_shares[i];
    } else {
      std::array<uint8_t, kSharePayloadBytes> payload;
      store_le32(payload.data(), id_);
      store_le32(payload.data() + 4, v);
      put_share(put_share(payload.data() + 8, sk_shares[i]), b_shares[i]);
      Key32 key = channel_key(config_, x25519_agree(cipher_keys_.secret_key, a.cipher_public_key), id_, v);
      msg.shares.push_back(EncryptedShare{id_, v, aead_seal(key, payload, share_aad(config_, id_, v))});
      wipe(payload);
      wipe(key);
    }
    wipe(sk_shares[i]);
    wipe(b_shares[i]);
    ++i;
  }
  stage_ = Stage::kMaskedInput;
  return msg;
}

MaskedInput SecAggClient::masked_input(std::span<const EncryptedShare> inbox, std::span<const uint32_t> input) {
  PO_CHECK(stage_ == Stage::kMaskedInput, "SecAggClient ", id_,
           ": round 2 (MaskedInput) must follow round 1 (ShareKeys) and run once");
  PO_CHECK(input.size() == config_.vector_size, "secagg round 2 (MaskedInput): client ", id_, " input has ",
           input.size(), " words, vector_size = ", config_.vector_size);
  // Decrypt everything before keeping anything: a bad share leaves no state.
  std::set<uint32_t> shared = {id_};
  std::map<uint32_t, ShamirShare> mask_key_shares, self_mask_shares;
  for (const EncryptedShare& e : inbox) {
    PO_CHECK(e.to == id_, "secagg round 2 (MaskedInput): client ", id_, " got a share addressed to ", e.to);
    auto from = roster_.find(e.from);
    PO_CHECK(from != roster_.end() && e.from != id_, "secagg round 2 (MaskedInput): client ", id_,
             " got a share from client ", e.from, ", not another roster member");
    PO_CHECK(shared.insert(e.from).second, "secagg round 2 (MaskedInput): client ", id_,
             " got two shares from client ", e.from);
    const Key32 agreement = x25519_agree(cipher_keys_.secret_key, from->second.cipher_public_key);
    Key32 key = channel_key(config_, agreement, e.from, id_);
    Bytes payload;
    try {
      payload = aead_open(key, e.ciphertext, share_aad(config_, e.from, id_));
    } catch (const AuthenticationError& err) {
      PO_THROW(AuthenticationError, "secagg round 2 (MaskedInput): the share from client ", e.from, " to client ", id_,
               " failed authentication: ", err.what());
    }
    wipe(key);
    PO_CHECK(payload.size() == kSharePayloadBytes && load_le32(payload.data()) == e.from &&
                 load_le32(payload.data() + 4) == id_,
             "secagg round 2 (MaskedInput): the share from client ", e.from, " to client ", id_,
             " is malformed (", payload.size(), " bytes, or it names other clients)");
    ShamirShare sk, b;
    get_share(get_share(payload.data() + 8, sk), b);
    OPENSSL_cleanse(payload.data(), payload.size());
    PO_CHECK(sk.x == id_ + 1 && b.x == id_ + 1, "secagg round 2 (MaskedInput): the share from client ", e.from,
             " to client ", id_, " has x = ", sk.x, " and ", b.x, ", expected ", id_ + 1);
    mask_key_shares[e.from] = sk;
    self_mask_shares[e.from] = b;
  }
  require_quorum(shared.size(), roster_.size(), config_.threshold, "round 2 (MaskedInput), shares received");
  shared_ = std::move(shared);
  held_mask_key_.merge(mask_key_shares);
  held_self_mask_.merge(self_mask_shares);

  // y_u = x_u + PRG(b_u) + Σ_{v>u} PRG(s_uv) − Σ_{v<u} PRG(s_uv), v ∈ U2, in id order.
  MaskedInput msg{id_, std::vector<uint32_t>(input.begin(), input.end())};
  Key32 key = self_mask_key(config_, self_mask_seed_, id_);
  prg_accumulate(key, +1, 0, msg.masked);
  for (uint32_t v : shared_) {
    if (v == id_) continue;
    key = mask_pair_key(config_, x25519_agree(mask_keys_.secret_key, roster_.at(v).mask_public_key), id_, v);
    prg_accumulate(key, v > id_ ? +1 : -1, 0, msg.masked);
  }
  wipe(key);
  stage_ = Stage::kUnmask;
  return msg;
}

Unmasking SecAggClient::unmask(std::span<const uint32_t> survivors) {
  PO_CHECK(stage_ == Stage::kUnmask, "SecAggClient ", id_, ": round 3 (Unmasking) must follow round 2 (MaskedInput)");
  for (size_t i = 0; i < survivors.size(); ++i) {
    PO_CHECK(i == 0 || survivors[i] > survivors[i - 1], "secagg round 3 (Unmasking): the survivor list must be "
             "strictly ascending; entry ", i, " = ", survivors[i]);
    PO_CHECK(shared_.count(survivors[i]), "secagg round 3 (Unmasking): survivor ", survivors[i],
             " did not take part in round 1 (ShareKeys) as client ", id_, " saw it");
  }
  PO_CHECK(std::binary_search(survivors.begin(), survivors.end(), id_), "secagg round 3 (Unmasking): client ", id_,
           " is not in the survivor list it was sent");
  require_quorum(survivors.size(), shared_.size(), config_.threshold, "round 3 (Unmasking), survivor list");

  // Check every peer before revealing anything: all or nothing.
  for (uint32_t v : shared_) {
    const Revealed want = std::binary_search(survivors.begin(), survivors.end(), v) ? Revealed::kSelfMask
                                                                                    : Revealed::kMaskKey;
    const Revealed had = revealed_.count(v) ? revealed_.at(v) : Revealed::kNone;
    PO_CHECK(had == Revealed::kNone || had == want, "secagg round 3 (Unmasking): client ", id_,
             " refuses: it already revealed its share of client ", v, "'s ",
             had == Revealed::kMaskKey ? "mask key s^SK" : "self-mask seed b", " and is now asked for its share of ",
             want == Revealed::kMaskKey ? "s^SK" : "b", "; both would unmask client ", v, "'s input");
  }
  Unmasking msg{id_, {}, {}};
  for (uint32_t v : shared_) {
    if (std::binary_search(survivors.begin(), survivors.end(), v)) {
      revealed_[v] = Revealed::kSelfMask;
      msg.self_mask_shares.push_back(RevealedShare{v, held_self_mask_.at(v)});
    } else {
      revealed_[v] = Revealed::kMaskKey;
      msg.mask_key_shares.push_back(RevealedShare{v, held_mask_key_.at(v)});
    }
  }
  return msg;
}

SecAggServer::SecAggServer(const SecAggConfig& config) : config_(config) { secagg_config_check(config_); }

void SecAggServer::expect_stage(Stage stage, const char* round) const {
  PO_CHECK(stage_ == stage, "SecAggServer: a ", round, " message or call arrived outside its round");
}

void SecAggServer::receive(const AdvertiseKeys& msg) {
  expect_stage(Stage::kAdvertise, "round 0 (AdvertiseKeys)");
  PO_CHECK(msg.client_id < config_.num_clients, "secagg round 0 (AdvertiseKeys): client ", msg.client_id,
           " is not below num_clients = ", config_.num_clients);
  PO_CHECK(roster_.emplace(msg.client_id, msg).second, "secagg round 0 (AdvertiseKeys): client ", msg.client_id,
           " advertised twice");
}

std::vector<AdvertiseKeys> SecAggServer::finish_advertise_keys() {
  expect_stage(Stage::kAdvertise, "round 0 (AdvertiseKeys)");
  require_quorum(roster_.size(), config_.num_clients, config_.threshold, "round 0 (AdvertiseKeys)");
  std::map<Key32, uint32_t> owner;
  std::vector<AdvertiseKeys> out;
  for (const auto& [u, a] : roster_) {
    for (const Key32* k : {&a.cipher_public_key, &a.mask_public_key}) {
      auto [it, fresh] = owner.emplace(*k, u);
      PO_CHECK(fresh, "secagg round 0 (AdvertiseKeys): clients ", it->second, " and ", u, " share a public key");
    }
    out.push_back(a);
  }
  stage_ = Stage::kShareKeys;
  return out;
}

void SecAggServer::receive(const ShareKeys& msg) {
  expect_stage(Stage::kShareKeys, "round 1 (ShareKeys)");
  const uint32_t u = msg.client_id;
  PO_CHECK(roster_.count(u), "secagg round 1 (ShareKeys): client ", u, " is not in the roster");
  PO_CHECK(!share_keys_.count(u), "secagg round 1 (ShareKeys): client ", u, " sent its shares twice");
  PO_CHECK(msg.shares.size() + 1 == roster_.size(), "secagg round 1 (ShareKeys): client ", u, " sent ",
           msg.shares.size(), " shares for a roster of ", roster_.size());
  std::set<uint32_t> to;
  for (const EncryptedShare& e : msg.shares)
    PO_CHECK(e.from == u && e.to != u && roster_.count(e.to) && to.insert(e.to).second,
             "secagg round 1 (ShareKeys): client ", u, " sent a share labelled ", e.from, " -> ", e.to,
             ", not one for each other roster member");
  share_keys_.emplace(u, msg);
}

std::map<uint32_t, std::vector<EncryptedShare>> SecAggServer::finish_share_keys() {
  expect_stage(Stage::kShareKeys, "round 1 (ShareKeys)");
  require_quorum(share_keys_.size(), roster_.size(), config_.threshold, "round 1 (ShareKeys)");
  std::map<uint32_t, std::vector<EncryptedShare>> inbox;
  for (const auto& [v, unused] : share_keys_) inbox[v];
  for (const auto& [u, msg] : share_keys_)  // ascending sender, so each inbox is ascending `from`
    for (const EncryptedShare& e : msg.shares)
      if (auto it = inbox.find(e.to); it != inbox.end()) it->second.push_back(e);
  stage_ = Stage::kMaskedInput;
  return inbox;
}

void SecAggServer::receive(const MaskedInput& msg) {
  expect_stage(Stage::kMaskedInput, "round 2 (MaskedInput)");
  const uint32_t u = msg.client_id;
  PO_CHECK(share_keys_.count(u), "secagg round 2 (MaskedInput): client ", u, " did not share its keys in round 1");
  PO_CHECK(msg.masked.size() == config_.vector_size, "secagg round 2 (MaskedInput): client ", u, " sent ",
           msg.masked.size(), " words, vector_size = ", config_.vector_size);
  PO_CHECK(masked_.emplace(u, msg.masked).second, "secagg round 2 (MaskedInput): client ", u, " sent twice");
}

std::vector<uint32_t> SecAggServer::finish_masked_input() {
  expect_stage(Stage::kMaskedInput, "round 2 (MaskedInput)");
  require_quorum(masked_.size(), share_keys_.size(), config_.threshold, "round 2 (MaskedInput)");
  survivors_.clear();
  for (const auto& [u, unused] : masked_) survivors_.push_back(u);
  stage_ = Stage::kUnmask;
  return survivors_;
}

void SecAggServer::receive(const Unmasking& msg) {
  expect_stage(Stage::kUnmask, "round 3 (Unmasking)");
  const uint32_t w = msg.client_id;
  PO_CHECK(masked_.count(w), "secagg round 3 (Unmasking): client ", w, " is not a survivor");
  PO_CHECK(!unmasking_.count(w), "secagg round 3 (Unmasking): client ", w, " answered twice");
  auto expect = [&](const std::vector<RevealedShare>& got, bool survivors, const char* what) {
    size_t i = 0;
    for (const auto& [v, unused] : share_keys_) {
      if (masked_.count(v) != static_cast<size_t>(survivors)) continue;
      PO_CHECK(i < got.size() && got[i].owner == v && got[i].share.x == w + 1, "secagg round 3 (Unmasking): client ",
               w, " must reveal its ", what, " share of client ", v, " (ascending), entry ", i, " differs");
      ++i;
    }
    PO_CHECK(i == got.size(), "secagg round 3 (Unmasking): client ", w, " revealed ", got.size(), " ", what,
             " shares, expected ", i);
  };
  expect(msg.mask_key_shares, false, "mask-key");
  expect(msg.self_mask_shares, true, "self-mask");
  unmasking_.emplace(w, msg);
}

std::vector<uint32_t> SecAggServer::finish_unmasking() {
  expect_stage(Stage::kUnmask, "round 3 (Unmasking)");
  require_quorum(unmasking_.size(), survivors_.size(), config_.threshold, "round 3 (Unmasking)");
  // Owner → its shares from the responders, ascending responder id; entry
  // order in each message is ascending owner (checked by receive).
  std::map<uint32_t, std::vector<ShamirShare>> self_shares, key_shares;
  for (const auto& [w, msg] : unmasking_) {
    for (const RevealedShare& r : msg.self_mask_shares) self_shares[r.owner].push_back(r.share);
    for (const RevealedShare& r : msg.mask_key_shares) key_shares[r.owner].push_back(r.share);
  }
  std::vector<uint32_t> sum(config_.vector_size, 0);
  for (const auto& [u, y] : masked_) ring_add(sum, y);
  for (uint32_t u : survivors_) {  // − PRG(b_u)
    Key32 b = shamir_reconstruct(self_shares.at(u), config_.threshold);
    Key32 key = self_mask_key(config_, b, u);
    prg_accumulate(key, -1, 0, sum);
    wipe(b);
    wipe(key);
  }
  for (const auto& [v, shares] : key_shares) {  // left-over pairwise masks of the clients in U2 \ U3
    Key32 sk = shamir_reconstruct(shares, config_.threshold);
    PO_CHECK(x25519_public_key(sk) == roster_.at(v).mask_public_key, "secagg round 3 (Unmasking): the revealed "
             "shares of client ", v, "'s mask key do not match its advertised public key");
    for (uint32_t u : survivors_) {
      // y_u holds +PRG(s_uv) if v > u, −PRG(s_uv) if v < u: take it back out.
      Key32 key = mask_pair_key(config_, x25519_agree(sk, roster_.at(u).mask_public_key), u, v);
      prg_accumulate(key, v > u ? -1 : +1, 0, sum);
      wipe(key);
    }
    wipe(sk);
  }
  stage_ = Stage::kDone;
  return sum;
}

SecAggResult secagg_run_in_memory(const SecAggConfig& config, const std::vector<std::vector<uint32_t>>& inputs,
                                  const SecAggDropouts& dropouts) {
  secagg_config_check(config);
  PO_CHECK(inputs.size() == config.num_clients, "secagg_run_in_memory: ", inputs.size(), " inputs for ",
           config.num_clients, " clients");
  // silent_from[u] = first round in which u sends nothing (4: never).
  std::vector<int> silent_from(config.num_clients, 4);
  for (auto [list, round] : {std::pair{&dropouts.before_share_keys, 1}, std::pair{&dropouts.before_masked_input, 2},
                             std::pair{&dropouts.before_unmasking, 3}})
    for (uint32_t u : *list) {
      PO_CHECK(u < config.num_clients, "secagg_run_in_memory: dropout of client ", u, ", num_clients = ",
               config.num_clients);
      silent_from[u] = std::min(silent_from[u], round);
    }
  std::vector<SecAggClient> clients;
  for (uint32_t u = 0; u < config.num_clients; ++u) clients.emplace_back(config, u);
  SecAggServer server(config);

  for (SecAggClient& c : clients) server.receive(c.advertise_keys());
  const std::vector<AdvertiseKeys> roster = server.finish_advertise_keys();
  for (SecAggClient& c : clients)
    if (silent_from[c.client_id()] > 1) server.receive(c.share_keys(roster));
  std::map<uint32_t, std::vector<EncryptedShare>> inbox = server.finish_share_keys();
  for (SecAggClient& c : clients)
    if (silent_from[c.client_id()] > 2) server.receive(c.masked_input(inbox.at(c.client_id()), inputs[c.client_id()]));
  const std::vector<uint32_t> survivors = server.finish_masked_input();
  for (uint32_t u : survivors)
    if (silent_from[u] > 3) server.receive(clients[u].unmask(survivors));
  return SecAggResult{server.finish_unmasking(), survivors};
}

#undef PO_SSL_CHECK

}  // namespace po::privacy
