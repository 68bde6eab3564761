// Quantized frozen weights and their panel GEMMs (model/quant_weight.h).
#include "model/quant_weight.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include <omp.h>

#include "core/error.h"

namespace po::model {
namespace ops = backend::cpu;

const char* weight_quant_name(WeightQuant q) {
  switch (q) {
    case WeightQuant::kNf4: return "nf4";
    case WeightQuant::kInt8: return "int8";
    default: return "none";
  }
}

namespace {

constexpr float kInv127 = 7.874015718698502e-3f;  // 1 / 127 in float32 (bitsandbytes' constant)

// Names the first weight that is not finite (a one-line error); called only
// once a quantizer has seen one, so good weights are read once.
[[noreturn]] void refuse_nonfinite(WeightQuant format, const float* w, int64_t n, int64_t cols,
                                   const std::string& name) {
  int64_t e = 0;
  while (e < n - 1 && std::isfinite(w[e])) ++e;
  PO_CHECK(false, name, ": element ", e, " (row ", e / cols, ", column ", e % cols, ") is ", w[e],
           "; model.quant = ", weight_quant_name(format), " needs finite weights");
  std::abort();  // (PO_CHECK(false) throws)
}

// Returns false when a weight is not finite (the codes are then not used).
bool quantize_int8_rows(QuantTensor& t, const float* w) {
  t.int8.resize(static_cast<size_t>(t.rows * t.cols));
  t.row_absmax.resize(static_cast<size_t>(t.rows));
  bool finite = true;
#pragma omp parallel for schedule(static) reduction(&& : finite)
  for (int64_t j = 0; j < t.rows; ++j) {
    const float* row = w + j * t.cols;
    float a = 0.0f;
    bool ok = true;
    for (int64_t i = 0; i < t.cols; ++i) {
      a = std::max(a, std::fabs(row[i]));
      ok = ok && std::isfinite(row[i]);
    }
    finite = finite && ok;
    t.row_absmax[static_cast<size_t>(j)] = a;
    int8_t* c = t.int8.data() + j * t.cols;
    if (a == 0.0f) {
      std::fill(c, c + t.cols, int8_t{0});
      continue;
    }
    const float k = 127.0f / a;
    // nearbyint under the default rounding mode: to nearest, ties to even.
    for (int64_t i = 0; i < t.cols; ++i) c[i] = static_cast<int8_t>(std::nearbyint(row[i] * k));
  }
  return finite;
}

}  // namespace

QuantTensor quantize_weight(WeightQuant format, const float* w, int64_t rows, int64_t cols,
                            const std::string& name) {
  PO_CHECK(format != WeightQuant::kNone, "quantize_weight: no format for ", name);
  PO_CHECK(rows > 0 && cols > 0, "quantize_weight: ", name, " is [", rows, ", ", cols, "]");
  const int64_t n = rows * cols;
  QuantTensor t;
  t.format = format;
  t.rows = rows;
  t.cols = cols;
  if (format == WeightQuant::kInt8) {
    if (!quantize_int8_rows(t, w)) refuse_nonfinite(format, w, n, cols, name);
    return t;
  }
  try {  // quantize_nf4 checks every weight as it reads it
    t.nf4 = backend::quantize_nf4(w, n);
  } catch (const core::Error&) {
    refuse_nonfinite(format, w, n, cols, name);
  }
  return t;
}

void QuantTensor::decode(int64_t row0, int64_t n, float* out) const {
  PO_ASSERT(row0 >= 0 && n >= 0 && row0 + n <= rows, "QuantTensor::decode: rows [", row0, ", ",
            row0 + n, ") of ", rows);
  if (format == WeightQuant::kNf4) return backend::dequantize_nf4_rows(nf4, row0 * cols, n * cols, out);
  for (int64_t j = 0; j < n; ++j) {
    const float a = row_absmax[static_cast<size_t>(row0 + j)];
    const int8_t* c = int8.data() + (row0 + j) * cols;
    float* o = out + j * cols;
    for (int64_t i = 0; i < cols; ++i) {
      volatile float ca = static_cast<float>(c[i]) * a;  // two roundings, never fused
      o[i] = ca * kInv127;
    }
  }
}

size_t QuantTensor::predicted_bytes(WeightQuant format, int64_t rows, int64_t cols) {
  const auto n = static_cast<size_t>(rows * cols);
  if (format == WeightQuant::kNf4) {
    const auto block = static_cast<size_t>(backend::kNf4Block), nested = static_cast<size_t>(backend::kNf4NestedBlock);
    const size_t blocks = (n + block - 1) / block;
    return (n + 1) / 2 + blocks + (blocks + nested - 1) / nested * sizeof(float) + sizeof(float);
  }
  return n + static_cast<size_t>(rows) * sizeof(float);
}

size_t QuantTensor::bytes() const {
  if (format == WeightQuant::kNf4)
    return nf4.codes.size() + nf4.absmax_codes.size() + nf4.nested_absmax.size() * sizeof(float) +
           sizeof(float);
  return int8.size() + row_absmax.size() * sizeof(float);
}

int64_t QuantWeight::rows() const {
  int64_t r = 0;
  for (const QuantTensor* t : parts) r += t->rows;
  return r;
}

void QuantWeight::decode(int64_t row0, int64_t n, float* out) const {
  PO_ASSERT(!parts.empty(), "QuantWeight::decode: no tensors");
  const int64_t cols = parts[0]->cols;
  // Each thread decodes its own rows: [row0 + n·t/T, row0 + n·(t+1)/T).
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    int64_t r = row0 + n * id / nt;
    const int64_t end = row0 + n * (id + 1) / nt;
    int64_t first = 0;  // the stack's first row of part p
    for (const QuantTensor* t : parts) {
      const int64_t lo = std::max(r, first), hi = std::min(end, first + t->rows);
      if (lo < hi) t->decode(lo - first, hi - lo, out + (lo - row0) * cols);
      first += t->rows;
    }
  }
}

int64_t quant_panel_rows(int64_t in, int64_t out) {
  const int64_t fit = static_cast<int64_t>(kQuantPanelBytes / sizeof(float)) / std::max<int64_t>(in, 1);
  return std::min(out, std::max<int64_t>(16, fit / 16 * 16));
}

namespace {

// fn(r, k, panel[k, in]) for each panel of rows [row0 + r, row0 + r + k) of
// W in order, r from 0 to n, decoded into this thread's scratch.
template <typename Fn>
void for_each_panel(const QuantWeight& w, int64_t row0, int64_t n, int64_t in, Fn&& fn) {
  const int64_t P = quant_panel_rows(in, n);
  thread_local std::vector<float> panel;
  panel.resize(static_cast<size_t>(P * in));
  for (int64_t r = 0; r < n; r += P) {
    const int64_t k = std::min(P, n - r);
    w.decode(row0 + r, k, panel.data());
    fn(r, k, panel.data());
  }
}

}  // namespace

void quant_matmul_rows(float* y, int64_t ldy, ops::Operand x, const QuantWeight& w, int64_t row0, int64_t n,
                       int64_t rows, int64_t in) {
  PO_ASSERT(row0 >= 0 && row0 + n <= w.rows() && w.parts[0]->cols == in, "quant_matmul_rows: rows [", row0,
            ", ", row0 + n, ") of a [", w.rows(), ", ", w.parts[0]->cols, "] weight for in ", in);
  for_each_panel(w, row0, n, in, [&](int64_t r, int64_t k, const float* panel) {
    ops::gemm(false, true, rows, k, in, 1.0f, x, in, panel, in, 0.0f, y + r, ldy);
  });
}

void quant_matmul_forward(float* y, ops::Operand x, const QuantWeight& w, const float* bias,
                          int64_t rows, int64_t in, int64_t out) {
  PO_ASSERT(w.rows() == out, "quant_matmul_forward: a [", w.rows(), ", ", w.parts[0]->cols, "] weight for out ",
            out);
  quant_matmul_rows(y, out, x, w, 0, out, rows, in);
  if (bias == nullptr) return;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < out; ++j) y[i * out + j] += bias[j];
}

void quant_matmul_backward_input(float* dx, ops::Operand dy, const QuantWeight& w, int64_t rows,
                                 int64_t in, int64_t out) {
  PO_ASSERT(w.rows() == out && w.parts[0]->cols == in, "quant_matmul_backward_input: a [", w.rows(),
            ", ", w.parts[0]->cols, "] weight for in ", in, ", out ", out);
  for_each_panel(w, 0, out, in, [&](int64_t r0, int64_t n, const float* panel) {
    const ops::Operand d(dy.f32 != nullptr ? dy.f32 + r0 : nullptr,
                         dy.bf16 != nullptr ? dy.bf16 + r0 : nullptr);
    ops::gemm(false, false, rows, in, n, 1.0f, d, out, panel, in, r0 == 0 ? 0.0f : 1.0f, dx, in);
  });
}

}  // namespace po::model
