// Secure aggregation: known-answer tests of the primitives (RFC 8439, 7748,
// 5869), Shamir thresholds, AES-GCM tampering, fixed-point bounds, and the
// four-round protocol: the masked sum equals the plain sum bit for bit, with
// and without dropouts, and one masked update is uniform over the ring.
//
// Keys and masks come from RAND_bytes, so the uniformity tests are
// statistical: each chi-square test runs at significance 1e-6.
#include "privacy/secagg.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <string>

#include "core/error.h"
#include "core/rng.h"

namespace po::privacy {
namespace {

using po::core::InvalidArgument;

Bytes from_hex(std::string_view hex) {
  Bytes out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2)
    out.push_back(static_cast<uint8_t>(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
  return out;
}
Key32 key_from_hex(std::string_view hex) {
  Bytes b = from_hex(hex);
  Key32 k{};
  std::copy(b.begin(), b.end(), k.begin());
  return k;
}
std::string to_hex(std::span<const uint8_t> b) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (uint8_t c : b) s += {d[c >> 4], d[c & 15]};
  return s;
}

// "" when equal, else the first differing index, both values and the count.
template <typename T>
std::string first_difference(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size()) return "sizes " + std::to_string(got.size()) + " vs " + std::to_string(want.size());
  size_t count = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0 && count++ == 0) first = i;
  if (count == 0) return "";
  return std::to_string(count) + " of " + std::to_string(got.size()) + " words differ; first at " +
         std::to_string(first) + ": got " + std::to_string(got[first]) + ", want " + std::to_string(want[first]);
}

std::vector<std::vector<uint32_t>> random_inputs(uint32_t n, uint64_t size, uint64_t seed) {
  std::vector<std::vector<uint32_t>> inputs(n, std::vector<uint32_t>(size));
  for (uint32_t u = 0; u < n; ++u) {
    po::core::Philox rng(seed, u);
    for (uint64_t i = 0; i < size; ++i) inputs[u][i] = rng.block(i)[0];
  }
  return inputs;
}

std::vector<uint32_t> plain_sum(const std::vector<std::vector<uint32_t>>& inputs, const std::vector<uint32_t>& who) {
  std::vector<uint32_t> sum(inputs.at(0).size(), 0);
  for (uint32_t u : who) ring_add(sum, inputs[u]);
  return sum;
}

std::vector<uint32_t> all_ids(uint32_t n) {
  std::vector<uint32_t> ids(n);
  for (uint32_t u = 0; u < n; ++u) ids[u] = u;
  return ids;
}

std::vector<uint32_t> except(uint32_t n, std::initializer_list<uint32_t> gone) {
  std::vector<uint32_t> ids;
  for (uint32_t u = 0; u < n; ++u)
    if (std::find(gone.begin(), gone.end(), u) == gone.end()) ids.push_back(u);
  return ids;
}

SecAggConfig config_for(uint32_t n, uint64_t size) { return SecAggConfig{n, n / 2 + 1, size, 42}; }

// Runs `fn` and returns the message of the `E` it must throw.
template <typename E, typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception, none was thrown";
  return "";
}

// ---- primitives --------------------------------------------------------------

TEST(SecAggPrimitives, PrgIsChaCha20KeystreamRfc8439) {
  // RFC 8439 A.1 vectors #1 and #2: zero key, zero nonce, blocks 0 and 1.
  const Key32 zero{};
  std::vector<uint32_t> words(32);
  prg_words(zero, 0, words);
  Bytes bytes(128);
  for (size_t i = 0; i < words.size(); ++i)
    for (int k = 0; k < 4; ++k) bytes[4 * i + k] = static_cast<uint8_t>(words[i] >> (8 * k));
  EXPECT_EQ(to_hex(std::span(bytes).first(64)),
            "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
            "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586");
  EXPECT_EQ(to_hex(std::span(bytes).subspan(64)),
            "9f07e7be5551387a98ba977c732d080dcb0f29a048e3656912c6533e32ee7aed"
            "29b721769ce64e43d57133b074d839d531ed1f28510afb45ace10a1f4b794d6f");
}

TEST(SecAggPrimitives, PrgSeeksToAnyWordOffset) {
  const Key32 key = hkdf_sha256(from_hex("0102"), {}, "seek");
  std::vector<uint32_t> whole(5000), part(3000);
  prg_words(key, 0, whole);
  prg_words(key, 1237, part);  // mid-block start, several 4096-word chunks
  std::vector<uint32_t> want(whole.begin() + 1237, whole.begin() + 4237);
  EXPECT_EQ(first_difference(part, want), "");
  // Across 2^32 blocks the counter carries into the next IV word: reading
  // blocks 2^32−1 and 2^32 in one go equals seeking to each.
  const uint64_t edge = (uint64_t{1} << 32) * 16;
  std::vector<uint32_t> span2(32), before(16), after(16);
  prg_words(key, edge - 16, span2);
  prg_words(key, edge - 16, before);
  prg_words(key, edge, after);
  std::vector<uint32_t> joined(before);
  joined.insert(joined.end(), after.begin(), after.end());
  EXPECT_EQ(first_difference(span2, joined), "");
  // prg_accumulate adds and subtracts the same words.
  std::vector<uint32_t> acc(part.size(), 7);
  prg_accumulate(key, +1, 1237, acc);
  prg_accumulate(key, -1, 1237, acc);
  EXPECT_EQ(first_difference(acc, std::vector<uint32_t>(part.size(), 7)), "");
}

TEST(SecAggPrimitives, X25519MatchesRfc7748) {
  const Key32 a = key_from_hex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a");
  const Key32 b = key_from_hex("5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb");
  const Key32 a_pub = x25519_public_key(a), b_pub = x25519_public_key(b);
  EXPECT_EQ(to_hex(a_pub), "8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a");
  EXPECT_EQ(to_hex(b_pub), "de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f");
  EXPECT_EQ(to_hex(x25519_agree(a, b_pub)), "4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742");
  EXPECT_EQ(to_hex(x25519_agree(b, a_pub)), "4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742");

  const X25519KeyPair u = x25519_generate(), v = x25519_generate();
  EXPECT_EQ(x25519_public_key(u.secret_key), u.public_key);
  EXPECT_EQ(x25519_agree(u.secret_key, v.public_key), x25519_agree(v.secret_key, u.public_key));
  EXPECT_NE(u.secret_key, v.secret_key);
  // The all-zero point has order 1: the shared secret would be zero.
  std::string msg = error_of<InvalidArgument>([&] { x25519_agree(u.secret_key, Key32{}); });
  EXPECT_NE(msg.find("low order"), std::string::npos) << msg;
}

TEST(SecAggPrimitives, HkdfMatchesRfc5869) {
  // RFC 5869 A.1, first 32 of the 42 output bytes.
  const Key32 okm = hkdf_sha256(Bytes(22, 0x0b), from_hex("000102030405060708090a0b0c"),
                                std::string_view("\xf0\xf1\xf2\xf3\xf4\xf5\xf6\xf7\xf8\xf9", 10));
  EXPECT_EQ(to_hex(okm), "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf");
}

TEST(SecAggPrimitives, AesGcmDetectsEveryTamper) {
  const Key32 key = hkdf_sha256(from_hex("aa"), {}, "k1"), other = hkdf_sha256(from_hex("aa"), {}, "k2");
  const Bytes pt = from_hex("00112233445566778899aabbccddeeff0102"), aad = from_hex("abcdef");
  const Bytes sealed = aead_seal(key, pt, aad);
  ASSERT_EQ(sealed.size(), 12 + pt.size() + 16);
  EXPECT_EQ(aead_open(key, sealed, aad), pt);
  EXPECT_NE(aead_seal(key, pt, aad), sealed) << "two seals of one message must use different nonces";
  // A flipped bit anywhere: nonce (0), ciphertext (12, 20), tag (last byte).
  for (size_t at : {size_t{0}, size_t{12}, size_t{20}, sealed.size() - 1}) {
    Bytes bad = sealed;
    bad[at] ^= 0x01;
    std::string msg = error_of<AuthenticationError>([&] { aead_open(key, bad, aad); });
    EXPECT_NE(msg.find("authentication failed"), std::string::npos) << "byte " << at << ": " << msg;
  }
  error_of<AuthenticationError>([&] { aead_open(other, sealed, aad); });
  error_of<AuthenticationError>([&] { aead_open(key, sealed, from_hex("abcdee")); });
  error_of<AuthenticationError>([&] { aead_open(key, std::span(sealed).first(27), aad); });
  error_of<po::core::CommError>([&] { aead_open(key, std::span(sealed).first(sealed.size() - 1), aad); });
}

// ---- Shamir ------------------------------------------------------------------

constexpr uint64_t kP = kShamirPrime;
uint64_t gf_mul(uint64_t a, uint64_t b) { return static_cast<uint64_t>((static_cast<unsigned __int128>(a) * b) % kP); }
uint64_t gf_sub(uint64_t a, uint64_t b) { return (a + kP - b) % kP; }
uint64_t gf_inv(uint64_t a) {
  uint64_t r = 1;
  for (uint64_t e = kP - 2; e; e >>= 1, a = gf_mul(a, a))
    if (e & 1) r = gf_mul(r, a);
  return r;
}

// Limb k of a secret: bytes 4k .. 4k+3, little-endian (secagg.h).
uint64_t limb(const Key32& s, int k) {
  return uint64_t{s[4 * k]} | uint64_t{s[4 * k + 1]} << 8 | uint64_t{s[4 * k + 2]} << 16 | uint64_t{s[4 * k + 3]} << 24;
}

Key32 test_secret() {
  Key32 s;
  for (int i = 0; i < 32; ++i) s[i] = static_cast<uint8_t>(0xf0 + 7 * i);
  return s;
}

TEST(SecAggShamir, EveryThresholdSubsetReconstructs) {
  const Key32 secret = test_secret();
  const std::vector<uint32_t> xs = {1, 2, 3, 4, 5};
  const uint32_t t = 3;
  const std::vector<ShamirShare> shares = shamir_split(secret, t, xs);
  for (const ShamirShare& s : shares)
    for (uint64_t y : s.y) ASSERT_LT(y, kP) << "share x = " << s.x;
  int tried = 0;
  for (unsigned mask = 0; mask < 32; ++mask) {
    if (std::popcount(mask) < static_cast<int>(t)) continue;
    std::vector<ShamirShare> subset;
    for (int i = 4; i >= 0; --i)  // descending x: order must not matter
      if (mask >> i & 1) subset.push_back(shares[i]);
    EXPECT_EQ(to_hex(shamir_reconstruct(subset, t)), to_hex(secret)) << "subset mask " << mask;
    ++tried;
  }
  EXPECT_EQ(tried, 16);  // C(5,3) + C(5,4) + C(5,5)
}

TEST(SecAggShamir, FewerThanThresholdRevealNothing) {
  const Key32 secret = test_secret();
  const uint32_t t = 3;
  const std::vector<uint32_t> xs = {1, 2, 3, 4, 5};
  const std::vector<ShamirShare> shares = shamir_split(secret, t, xs);
  const std::vector<ShamirShare> few = {shares[1], shares[3]};  // t − 1 = 2 shares

  // Loud failure when the threshold is known.
  std::string msg = error_of<InvalidArgument>([&] { shamir_reconstruct(few, t); });
  EXPECT_NE(msg.find("2 shares given, threshold is 3"), std::string::npos) << msg;
  // Interpolating them anyway gives a wrong value.
  const auto limbs = shamir_interpolate_at_zero(few);
  int equal = 0;
  for (int k = 0; k < kShamirLimbs; ++k) equal += limbs[k] == limb(secret, k);
  EXPECT_EQ(equal, 0) << "t−1 shares interpolated to the secret in " << equal << " of 8 limbs";

  // Any other secret is just as consistent with the t−1 shares: forge a t-th
  // share at x = 5 on the polynomial through (0, fake) and the two real ones;
  // the three then reconstruct `fake`.
  Key32 fake;
  for (int i = 0; i < 32; ++i) fake[i] = static_cast<uint8_t>(i * 13 + 1);
  ShamirShare forged;
  forged.x = 5;
  const uint64_t px[3] = {0, few[0].x, few[1].x};
  for (int k = 0; k < kShamirLimbs; ++k) {
    const uint64_t py[3] = {limb(fake, k), few[0].y[k], few[1].y[k]};
    uint64_t y = 0;
    for (int i = 0; i < 3; ++i) {  // Lagrange at x = 5
      uint64_t num = 1, den = 1;
      for (int j = 0; j < 3; ++j)
        if (j != i) num = gf_mul(num, gf_sub(5, px[j])), den = gf_mul(den, gf_sub(px[i], px[j]));
      y = (y + gf_mul(py[i], gf_mul(num, gf_inv(den)))) % kP;
    }
    forged.y[k] = y;
  }
  const std::vector<ShamirShare> with_forged = {few[0], few[1], forged};
  EXPECT_EQ(to_hex(shamir_reconstruct(with_forged, t)), to_hex(fake));
  EXPECT_NE(to_hex(fake), to_hex(secret));
}

TEST(SecAggShamir, RejectsBadArguments) {
  const Key32 secret = test_secret();
  const std::vector<uint32_t> dup = {1, 2, 2}, zero = {0, 1, 2}, ok = {1, 2, 3};
  EXPECT_NE(error_of<InvalidArgument>([&] { shamir_split(secret, 2, dup); }).find("two shares have x = 2"),
            std::string::npos);
  EXPECT_NE(error_of<InvalidArgument>([&] { shamir_split(secret, 2, zero); }).find("x = 0"), std::string::npos);
  EXPECT_NE(error_of<InvalidArgument>([&] { shamir_split(secret, 4, ok); }).find("threshold = 4"), std::string::npos);
  // A share replaced by unrelated field elements shifts each limb by a
  // pseudo-random field element: it leaves the 32-bit range (loud) except
  // with probability 2^-29 per limb. (A small error, such as +1, stays
  // silent: the public-key check of the server catches those for s^SK.)
  std::vector<ShamirShare> shares = shamir_split(secret, 2, ok);
  for (uint64_t& y : shares[0].y) y = gf_mul(y ^ 0x5a5a5a5a5a5aull, 0x123456789abull);
  EXPECT_NE(error_of<InvalidArgument>([&] { shamir_reconstruct(shares, 2); }).find("inconsistent"), std::string::npos);
}

// ---- fixed point -------------------------------------------------------------

std::vector<float> float_inputs(uint64_t size, uint64_t seed, float sd) {
  po::core::Philox rng(seed, 7);
  std::vector<float> x(size);
  for (uint64_t i = 0; i < size; ++i) x[i] = sd * rng.normal(i);
  return x;
}

std::vector<uint32_t> encode(const FixedPoint& fp, const std::vector<float>& x, uint64_t seed) {
  std::vector<uint32_t> out(x.size());
  fixed_point_encode(fp, x, seed, 0, out);
  return out;
}

TEST(SecAggFixedPoint, RoundTripWithinOneQuantumPerClient) {
  const FixedPoint fp{1.0, 16};
  const uint32_t n = 5;
  const uint64_t size = 4097;
  std::vector<uint32_t> sum(size, 0);
  std::vector<double> want(size, 0.0);
  for (uint32_t u = 0; u < n; ++u) {
    std::vector<float> x = float_inputs(size, u, 0.7f);  // ~15% beyond the clip
    x[u] = -INFINITY;                                      // clips to −1
    ring_add(sum, encode(fp, x, 100 + u));
    for (uint64_t i = 0; i < size; ++i) want[i] += std::clamp(static_cast<double>(x[i]), -1.0, 1.0);
  }
  std::vector<float> got(size);
  fixed_point_decode_sum(fp, sum, n, got);
  double worst = 0;
  uint64_t worst_at = 0;
  for (uint64_t i = 0; i < size; ++i) {
    const double excess = std::abs(got[i] - want[i]) - std::abs(want[i]) * 0x1p-24;  // less decode rounding
    if (excess > worst) worst = excess, worst_at = i;
  }
  EXPECT_LE(worst, n * 0x1p-16) << "round-trip error " << worst / 0x1p-16 << " quanta at " << worst_at
                                << " exceeds 1 quantum per client (" << n << ")";
}

TEST(SecAggFixedPoint, StochasticRoundingIsUnbiased) {
  const FixedPoint fp{1.0, 16};
  const uint64_t size = 100000;
  for (float v : {1000.3f * 0x1p-16f, -7.75f * 0x1p-16f, 0.123456f}) {
    const double q = static_cast<double>(v) * 0x1p16;
    const double frac = q - std::floor(q);
    std::vector<uint32_t> out = encode(fp, std::vector<float>(size, v), 9);
    double mean = 0;
    for (uint32_t w : out) {
      const int64_t s = static_cast<int32_t>(w);
      ASSERT_TRUE(s == std::floor(q) || s == std::floor(q) + 1) << "value " << v << " encoded to " << s;
      mean += static_cast<double>(s) / size;
    }
    const double sigma = std::sqrt(frac * (1 - frac) / size);
    EXPECT_LE(std::abs(mean - q), 5 * sigma) << "value " << v << ": mean of encodings " << mean << " vs " << q
                                             << " quanta; bias of " << (mean - q) / sigma << " sigma";
  }
}

TEST(SecAggFixedPoint, EncodingIsReproducibleAndSliceable) {
  const FixedPoint fp{2.0, 20};
  const std::vector<float> x = float_inputs(3000, 1, 1.0f);
  const std::vector<uint32_t> whole = encode(fp, x, 5);
  EXPECT_EQ(first_difference(encode(fp, x, 5), whole), "");
  std::vector<uint32_t> pieces(x.size());
  fixed_point_encode(fp, std::span(x).first(1000), 5, 0, std::span(pieces).first(1000));
  fixed_point_encode(fp, std::span(x).subspan(1000), 5, 1000, std::span(pieces).subspan(1000));
  EXPECT_EQ(first_difference(pieces, whole), "");
  EXPECT_NE(first_difference(encode(fp, x, 6), whole), "") << "another seed must round some coordinate differently";
  std::vector<float> nan_x = {0.5f, NAN};
  std::vector<uint32_t> out(2);
  EXPECT_NE(error_of<InvalidArgument>([&] { fixed_point_encode(fp, nan_x, 1, 40, out); }).find("x[41] is NaN"),
            std::string::npos);
}

TEST(SecAggFixedPoint, ModulusCheckFires) {
  const FixedPoint fp{1.0, 16};  // M = 2^16: n·2^17 < 2^32 ⟺ n ≤ 32767
  fixed_point_check(fp, 32767);
  std::string msg = error_of<InvalidArgument>([&] { fixed_point_check(fp, 32768); });
  for (const char* name : {"num_clients = 32768", "frac_bits = 16", "clip = 1", "modulus 2^32"})
    EXPECT_NE(msg.find(name), std::string::npos) << "missing '" << name << "' in: " << msg;
  std::vector<uint32_t> sum(4, 0);
  std::vector<float> out(4);
  EXPECT_THROW(fixed_point_decode_sum(fp, sum, 32768, out), InvalidArgument);
  EXPECT_THROW(fixed_point_check(FixedPoint{1.0, 31}, 1), InvalidArgument);
  EXPECT_THROW(fixed_point_check(FixedPoint{0.0, 8}, 1), InvalidArgument);
  // A word no sum of n encodings can produce (a wrong mask) is refused.
  sum[2] = 0x40000000u;
  msg = error_of<InvalidArgument>([&] { fixed_point_decode_sum(fp, sum, 3, out); });
  EXPECT_NE(msg.find("word 2"), std::string::npos) << msg;
}

// ---- protocol ----------------------------------------------------------------

TEST(SecAggProtocol, MaskedSumEqualsPlainSum) {
  for (uint32_t n : {2u, 3u, 5u})
    for (uint64_t size : {uint64_t{1000}, uint64_t{4097}}) {
      const auto inputs = random_inputs(n, size, 10 * n + size);
      const SecAggResult r = secagg_run_in_memory(config_for(n, size), inputs);
      EXPECT_EQ(r.survivors, all_ids(n));
      EXPECT_EQ(first_difference(r.sum, plain_sum(inputs, all_ids(n))), "") << "n = " << n << ", size = " << size;
    }
}

TEST(SecAggProtocol, DropoutsAfterMasking) {
  // Their masked inputs arrived, so their inputs count; the other survivors
  // reveal b shares for them.
  const uint32_t n = 5;
  const auto inputs = random_inputs(n, 4097, 3);
  for (const std::vector<uint32_t>& gone : {std::vector<uint32_t>{1}, std::vector<uint32_t>{1, 3}}) {
    SecAggDropouts d;
    d.before_unmasking = gone;
    const SecAggResult r = secagg_run_in_memory(config_for(n, 4097), inputs, d);
    EXPECT_EQ(r.survivors, all_ids(n));
    EXPECT_EQ(first_difference(r.sum, plain_sum(inputs, all_ids(n))), "") << gone.size() << " dropped after masking";
  }
}

TEST(SecAggProtocol, DropoutsBeforeMasking) {
  // Shares sent, masked input never: the survivors reveal the dropped
  // clients' mask keys and the server removes the left-over pairwise masks.
  const uint32_t n = 5;
  const auto inputs = random_inputs(n, 1000, 4);
  SecAggDropouts one;
  one.before_masked_input = {2};
  SecAggResult r = secagg_run_in_memory(config_for(n, 1000), inputs, one);
  EXPECT_EQ(r.survivors, except(n, {2}));
  EXPECT_EQ(first_difference(r.sum, plain_sum(inputs, except(n, {2}))), "") << "client 2 dropped before masking";
  SecAggDropouts two;
  two.before_masked_input = {0, 4};
  r = secagg_run_in_memory(config_for(n, 1000), inputs, two);
  EXPECT_EQ(first_difference(r.sum, plain_sum(inputs, except(n, {0, 4}))), "") << "clients 0, 4 dropped before masking";
}

TEST(SecAggProtocol, DropoutsInEveryRound) {
  const uint32_t n = 7;  // t = 4
  const auto inputs = random_inputs(n, 4097, 5);
  SecAggDropouts d;
  d.before_share_keys = {6};
  d.before_masked_input = {1};
  d.before_unmasking = {3};  // U3 = {0, 2, 3, 4, 5}, 4 answer
  const SecAggResult r = secagg_run_in_memory(config_for(n, 4097), inputs, d);
  EXPECT_EQ(r.survivors, except(n, {1, 6}));
  EXPECT_EQ(first_difference(r.sum, plain_sum(inputs, except(n, {1, 6}))), "");
}

TEST(SecAggProtocol, TooManyDropoutsAreRefused) {
  const uint32_t n = 5;  // t = 3
  const auto inputs = random_inputs(n, 64, 6);
  struct Case {
    SecAggDropouts d;
    std::string round;
  };
  std::vector<Case> cases(3);
  cases[0].d.before_share_keys = {0, 1, 2};
  cases[0].round = "round 1 (ShareKeys): 2 of 5 clients responded, fewer than the threshold t = 3";
  cases[1].d.before_masked_input = {0, 1, 4};
  cases[1].round = "round 2 (MaskedInput): 2 of 5 clients responded, fewer than the threshold t = 3";
  cases[2].d.before_masked_input = {0};
  cases[2].d.before_unmasking = {1, 2};
  cases[2].round = "round 3 (Unmasking): 2 of 4 clients responded, fewer than the threshold t = 3";
  for (const Case& c : cases) {
    std::string msg = error_of<InvalidArgument>([&] { secagg_run_in_memory(config_for(n, 64), inputs, c.d); });
    EXPECT_NE(msg.find(c.round), std::string::npos) << "want '" << c.round << "' in: " << msg;
  }
}

// Runs rounds 0-2 by hand and returns every client's masked input.
struct Rounds {
  SecAggConfig config;
  std::vector<SecAggClient> clients;
  SecAggServer server;
  std::map<uint32_t, std::vector<EncryptedShare>> inbox;
  explicit Rounds(const SecAggConfig& c) : config(c), server(c) {
    for (uint32_t u = 0; u < c.num_clients; ++u) clients.emplace_back(c, u);
    for (SecAggClient& cl : clients) server.receive(cl.advertise_keys());
    const std::vector<AdvertiseKeys> roster = server.finish_advertise_keys();
    for (SecAggClient& cl : clients) server.receive(cl.share_keys(roster));
    inbox = server.finish_share_keys();
  }
};

// Pearson chi-square of 256 bins against uniform; the critical value at
// significance 1e-6 for 255 degrees of freedom (Wilson–Hilferty, z = 4.7534).
double chi_square_256(const std::vector<uint32_t>& words, int shift) {
  std::vector<double> bins(256, 0);
  for (uint32_t w : words) bins[(w >> shift) & 255] += 1;
  const double expect = static_cast<double>(words.size()) / 256;
  double chi = 0;
  for (double b : bins) chi += (b - expect) * (b - expect) / expect;
  return chi;
}
double chi_square_critical_255() {
  const double k = 255, z = 4.753424, h = 2 / (9 * k);
  return k * std::pow(1 - h + z * std::sqrt(h), 3);
}

TEST(SecAggProtocol, MaskedInputIsUniformOverTheRing) {
  const uint64_t size = 100000;
  const double crit = chi_square_critical_255();
  std::vector<uint32_t> ramp(size);
  for (uint64_t i = 0; i < size; ++i) ramp[i] = static_cast<uint32_t>(i % 17);
  ASSERT_GT(chi_square_256(ramp, 0), crit) << "the test must reject a structured vector";
  for (const std::vector<uint32_t>& input : {std::vector<uint32_t>(size, 0), ramp}) {
    Rounds rounds(config_for(3, size));
    for (uint32_t u = 0; u < 3; ++u) {  // u = 0: only + masks; 1: both; 2: only −
      const MaskedInput m = rounds.clients[u].masked_input(rounds.inbox.at(u), input);
      size_t same = 0;
      for (uint64_t i = 0; i < size; ++i) same += m.masked[i] == input[i];
      EXPECT_LE(same, 3u) << "client " << u << ": " << same << " of " << size << " masked words equal the input";
      const double top = chi_square_256(m.masked, 24), low = chi_square_256(m.masked, 0);
      EXPECT_LT(top, crit) << "client " << u << ": top 8 bits chi-square " << top << " >= " << crit;
      EXPECT_LT(low, crit) << "client " << u << ": low 8 bits chi-square " << low << " >= " << crit;
    }
  }
}

TEST(SecAggProtocol, ClientNeverRevealsBothShares) {
  const SecAggConfig c = config_for(5, 16);
  Rounds rounds(c);
  const auto inputs = random_inputs(5, 16, 8);
  for (uint32_t u = 0; u < 5; ++u) rounds.clients[u].masked_input(rounds.inbox.at(u), inputs[u]);
  const std::vector<uint32_t> everyone = all_ids(5), without4 = except(5, {4});
  const Unmasking first = rounds.clients[0].unmask(everyone);
  EXPECT_EQ(first.self_mask_shares.size(), 5u);
  EXPECT_TRUE(first.mask_key_shares.empty());
  // The same request again is a retransmission: same answer.
  const Unmasking again = rounds.clients[0].unmask(everyone);
  EXPECT_EQ(again.self_mask_shares.size(), 5u);
  EXPECT_EQ(again.self_mask_shares[4].share.y, first.self_mask_shares[4].share.y);
  // A server claiming afterwards that client 4 dropped asks for s_4^SK.
  std::string msg = error_of<InvalidArgument>([&] { rounds.clients[0].unmask(without4); });
  EXPECT_NE(msg.find("refuses"), std::string::npos) << msg;
  EXPECT_NE(msg.find("client 4's self-mask seed b"), std::string::npos) << msg;
  // And the other way round, on a client that first saw client 4 dropped.
  rounds.clients[1].unmask(without4);
  msg = error_of<InvalidArgument>([&] { rounds.clients[1].unmask(everyone); });
  EXPECT_NE(msg.find("client 4's mask key s^SK"), std::string::npos) << msg;
}

TEST(SecAggProtocol, TamperedShareIsDetectedAndLeavesNoState) {
  const SecAggConfig c = config_for(3, 256);
  Rounds rounds(c);
  const auto inputs = random_inputs(3, 256, 9);
  std::vector<EncryptedShare> bad = rounds.inbox.at(1);
  bad[0].ciphertext[20] ^= 0x80;
  std::string msg = error_of<AuthenticationError>([&] { rounds.clients[1].masked_input(bad, inputs[1]); });
  EXPECT_NE(msg.find("share from client 0 to client 1 failed authentication"), std::string::npos) << msg;
  // A share relabelled for another recipient fails too: the AAD binds (from, to).
  bad = rounds.inbox.at(1);
  bad[0].ciphertext = rounds.inbox.at(2)[0].ciphertext;
  error_of<AuthenticationError>([&] { rounds.clients[1].masked_input(bad, inputs[1]); });
  // The failed calls kept nothing: the genuine inbox still completes.
  for (uint32_t u = 0; u < 3; ++u) rounds.server.receive(rounds.clients[u].masked_input(rounds.inbox.at(u), inputs[u]));
  const std::vector<uint32_t> survivors = rounds.server.finish_masked_input();
  for (uint32_t u : survivors) rounds.server.receive(rounds.clients[u].unmask(survivors));
  EXPECT_EQ(first_difference(rounds.server.finish_unmasking(), plain_sum(inputs, all_ids(3))), "");
}

TEST(SecAggProtocol, ServerRejectsMalformedMessages) {
  const SecAggConfig c = config_for(3, 8);
  SecAggServer server(c);
  SecAggClient a(c, 0);
  const AdvertiseKeys keys = a.advertise_keys();
  server.receive(keys);
  EXPECT_NE(error_of<InvalidArgument>([&] { server.receive(keys); }).find("advertised twice"), std::string::npos);
  EXPECT_NE(error_of<InvalidArgument>([&] { server.receive(MaskedInput{0, {}}); }).find("outside its round"),
            std::string::npos);
  AdvertiseKeys copy = keys;
  copy.client_id = 1;  // same public keys as client 0
  server.receive(copy);
  EXPECT_NE(error_of<InvalidArgument>([&] { server.finish_advertise_keys(); }).find("share a public key"),
            std::string::npos);
  EXPECT_NE(error_of<InvalidArgument>([&] { secagg_config_check(SecAggConfig{4, 2, 8, 0}); }).find("threshold = 2"),
            std::string::npos);
  EXPECT_THROW(SecAggClient(c, 3), InvalidArgument);
  EXPECT_NE(error_of<InvalidArgument>([&] { a.masked_input({}, std::vector<uint32_t>(8)); }).find("round 2"),
            std::string::npos);
}

TEST(SecAggProtocol, DecodedFloatSumMatchesPlainEncodingBitForBit) {
  const FixedPoint fp{1.0, 16};
  const uint32_t n = 5;
  const uint64_t size = 4097;
  std::vector<std::vector<uint32_t>> encoded;
  for (uint32_t u = 0; u < n; ++u) encoded.push_back(encode(fp, float_inputs(size, 20 + u, 0.5f), 1000 + u));
  SecAggDropouts d;
  d.before_masked_input = {3};
  for (const SecAggDropouts& drop : {SecAggDropouts{}, d}) {
    const SecAggResult r = secagg_run_in_memory(config_for(n, size), encoded, drop);
    std::vector<float> secure(size), plain(size);
    fixed_point_decode_sum(fp, r.sum, r.survivors.size(), secure);
    fixed_point_decode_sum(fp, plain_sum(encoded, r.survivors), r.survivors.size(), plain);
    std::vector<uint32_t> secure_bits(size), plain_bits(size);
    for (uint64_t i = 0; i < size; ++i) {
      secure_bits[i] = std::bit_cast<uint32_t>(secure[i]);
      plain_bits[i] = std::bit_cast<uint32_t>(plain[i]);
    }
    EXPECT_EQ(first_difference(secure_bits, plain_bits), "") << r.survivors.size() << " survivors (float bits)";
  }
}

}  // namespace
}  // namespace po::privacy
