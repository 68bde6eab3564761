// NF4 with double quantization (backend/nf4.h). Every float32 operation is
// the one bitsandbytes' reference performs, in its order: 1 / absmax, the
// product, the clamp, |s - value| for the argmin (Codebook::nearest), and on
// decode a product then a sum (volatile between them: never an FMA, which
// -march=x86-64-v3 would otherwise contract them into).
#include "backend/nf4.h"

#include <algorithm>
#include <cmath>

#include "backend/codebook.h"
#include "core/error.h"
#include "backend/quant_map.h"

namespace po::backend {

namespace {

using backend::Codebook;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// c[i] = the code of x[i] of a block x[len] on `cb`; returns the block's
// absmax. bitsandbytes' rule: s = clamp(x * (1 / absmax), -1, 1), the first
// nearest value; a zero absmax makes every s NaN, code 0.
float block_codes(const Codebook& cb, const float* x, int64_t len, uint8_t* c) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < len; ++i) absmax = std::max(absmax, std::fabs(x[i]));
  const float rcp = 1.0f / absmax;
  for (int64_t i = 0; i < len; ++i) {
    float s = x[i] * rcp;
    s = s < -1.0f ? -1.0f : (s > 1.0f ? 1.0f : s);  // NaN stays NaN (torch.clamp)
    c[i] = cb.nearest(s);
  }
  return absmax;
}

void check_tensor(const Nf4Tensor& t, const char* who) {
  PO_CHECK(t.numel > 0, who, ": the NF4 tensor holds ", t.numel, " elements");
  const int64_t blocks = t.blocks();
  PO_CHECK(static_cast<int64_t>(t.codes.size()) == ceil_div(t.numel, 2), who, ": ",
           t.codes.size(), " bytes of codes for ", t.numel, " elements (want ", ceil_div(t.numel, 2), ")");
  PO_CHECK(static_cast<int64_t>(t.absmax_codes.size()) == blocks, who, ": ",
           t.absmax_codes.size(), " absmax codes for ", blocks, " blocks of ", kNf4Block);
  PO_CHECK(static_cast<int64_t>(t.nested_absmax.size()) == ceil_div(blocks, kNf4NestedBlock), who,
           ": ", t.nested_absmax.size(), " nested absmaxes for ", blocks, " blocks (want ",
           ceil_div(blocks, kNf4NestedBlock), ", one per ", kNf4NestedBlock, ")");
}

float absmax_of(const Codebook& dynamic, const Nf4Tensor& t, int64_t block) {
  volatile float scaled = dynamic.value[t.absmax_codes[static_cast<size_t>(block)]] *
                          t.nested_absmax[static_cast<size_t>(block / kNf4NestedBlock)];
  return scaled + t.offset;
}

// Elements [first, first + count) of a checked tensor.
void decode(const Nf4Tensor& t, int64_t first, int64_t count, float* out) {
  const Codebook& nf4 = codebook(QuantMap::kNf4);
  const Codebook& dynamic = codebook(QuantMap::kSigned8);
  const uint8_t* codes = t.codes.data();
  const int64_t end = first + count;
  for (int64_t e = first; e < end;) {
    const int64_t block = e / kNf4Block;
    const int64_t stop = std::min(end, (block + 1) * kNf4Block);
    const float absmax = absmax_of(dynamic, t, block);
    for (; e < stop; ++e)
      out[e - first] = nf4.value[static_cast<size_t>(backend::code_at(codes, e, 4))] * absmax;
  }
}

}  // namespace

Nf4Tensor quantize_nf4(const float* w, int64_t n) {
  PO_CHECK(n > 0, "quantize_nf4: ", n, " elements; NF4 needs at least one");
  PO_CHECK(w != nullptr, "quantize_nf4: the weights are null");
  const Codebook& nf4 = codebook(QuantMap::kNf4);
  const Codebook& dynamic = codebook(QuantMap::kSigned8);
  Nf4Tensor t;
  t.numel = n;
  const int64_t blocks = t.blocks();
  t.codes.assign(static_cast<size_t>(ceil_div(n, 2)), 0);
  std::vector<float> absmax(static_cast<size_t>(blocks));

  // Level 1: NF4 codes and float32 absmax per block of 64 (the first
  // non-finite element found, if any, ends the call after the loop).
  int64_t bad = n;
  const uint8_t pad = nf4.code(0.0f);  // bitsandbytes pads the scaled values with 0.0
#pragma omp parallel for schedule(static) reduction(min : bad)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kNf4Block, len = std::min(kNf4Block, n - lo);
    for (int64_t i = 0; i < len; ++i)
      if (!std::isfinite(w[lo + i])) {
        bad = std::min(bad, lo + i);
        break;
      }
    uint8_t c[kNf4Block];
    absmax[static_cast<size_t>(b)] = block_codes(nf4, w + lo, len, c);
    uint8_t* out = t.codes.data() + lo / 2;  // lo is even
    for (int64_t i = 0; i + 1 < len; i += 2) out[i / 2] = static_cast<uint8_t>(c[i] << 4 | c[i + 1]);
    if (len & 1) out[len / 2] = static_cast<uint8_t>(c[len - 1] << 4 | pad);
  }
  PO_CHECK(bad == n, "quantize_nf4: element ", bad, " is ", bad < n ? w[bad] : 0.0f,
           "; NF4 quantizes finite weights only");

  // Level 2: offset = mean absmax; absmax - offset on the signed dynamic map
  // in blocks of 256, one float32 absmax each.
  double sum = 0.0;
  for (float a : absmax) sum += a;
  t.offset = static_cast<float>(sum / static_cast<double>(blocks));
  for (float& a : absmax) a -= t.offset;
  const int64_t nested = ceil_div(blocks, kNf4NestedBlock);
  t.absmax_codes.assign(static_cast<size_t>(blocks), 0);
  t.nested_absmax.assign(static_cast<size_t>(nested), 0.0f);
  for (int64_t k = 0; k < nested; ++k) {
    const int64_t lo = k * kNf4NestedBlock;
    t.nested_absmax[static_cast<size_t>(k)] =
        block_codes(dynamic, absmax.data() + lo, std::min(kNf4NestedBlock, blocks - lo),
                    t.absmax_codes.data() + lo);
  }
  return t;
}

float nf4_absmax(const Nf4Tensor& t, int64_t block) {
  check_tensor(t, "nf4_absmax");
  PO_CHECK(block >= 0 && block < t.blocks(), "nf4_absmax: block ", block, " of a tensor of ",
           t.blocks(), " blocks");
  return absmax_of(codebook(QuantMap::kSigned8), t, block);
}

void dequantize_nf4(const Nf4Tensor& t, float* out) {
  check_tensor(t, "dequantize_nf4");
  const int64_t blocks = t.blocks();
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kNf4Block;
    decode(t, lo, std::min(kNf4Block, t.numel - lo), out + lo);
  }
}

void dequantize_nf4_rows(const Nf4Tensor& t, int64_t first, int64_t count, float* out) {
  check_tensor(t, "dequantize_nf4_rows");
  PO_CHECK(first >= 0 && count >= 0 && first <= t.numel - count, "dequantize_nf4_rows: elements [",
           first, ", ", first + count, ") are not inside the tensor's ", t.numel);
  decode(t, first, count, out);
}

}  // namespace po::backend
