// A frozen base's linear weights stored quantized (model.quant, QLoRA), and
// the GEMMs that read them: dequantization runs one panel of weight rows at a
// time into a scratch buffer of at most kQuantPanelBytes that the GEMM then
// reads, so no f32 or bf16 copy of a whole matrix is ever made.
//
// Formats, each tensor (one Hugging Face module's weight, [rows, cols] as the
// Linear holds it, W [out, in]) quantized on its own, as bitsandbytes
// quantizes each module:
//  - kNf4: bitsandbytes' NF4 with double quantization (backend/nf4.h), blocks
//    of 64 over the row-major elements: 4.127 bits a weight.
//  - kInt8: LLM.int8()'s vector-wise format (bitsandbytes'
//    int8_vectorwise_quant, threshold 0: no outlier columns): per row
//    absmax a = max |w| (float32), code = w · (127 / a) rounded to the
//    nearest integer, ties to even (CUDA's __float2int_rn, torch.round);
//    decoded as (code · a) · (1 / 127 in float32), two float32 roundings. A
//    zero row codes 0 and decodes to 0. 8 bits + 32 / cols a weight.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "model/config.h"
#include "backend/nf4.h"

namespace po::model {

inline constexpr size_t kQuantPanelBytes = size_t{4} << 20;

const char* weight_quant_name(WeightQuant q);  // "none" | "nf4" | "int8"

struct QuantTensor {
  WeightQuant format = WeightQuant::kNone;
  int64_t rows = 0, cols = 0;
  backend::Nf4Tensor nf4;          // kNf4
  std::vector<int8_t> int8;      // kInt8: rows · cols codes
  std::vector<float> row_absmax; // kInt8: one per row

  // bytes() of a [rows, cols] tensor in `format`, before it is quantized.
  static size_t predicted_bytes(WeightQuant format, int64_t rows, int64_t cols);
  // out[n · cols] = rows [row0, row0 + n) decoded.
  void decode(int64_t row0, int64_t n, float* out) const;
  size_t bytes() const;  // what the codes and scales hold
};

// w [rows, cols], every element finite; `name` (the tensor) is named in errors.
QuantTensor quantize_weight(WeightQuant format, const float* w, int64_t rows, int64_t cols,
                            const std::string& name);

// A Linear's weight as the quantized tensors it is made of, stacked by rows
// (q | k | v, gate | up: one tensor each, as their modules are).
struct QuantWeight {
  std::vector<const QuantTensor*> parts;
  int64_t rows() const;
  // out[n · cols] = rows [row0, row0 + n) of the stack, decoded in parallel.
  void decode(int64_t row0, int64_t n, float* out) const;
};

// Rows of W per panel for `in` columns (a multiple of 16, at least 16).
int64_t quant_panel_rows(int64_t in, int64_t out);

// y[rows, out] = x · Wᵀ + bias (bias may be null), W read panel by panel.
void quant_matmul_forward(float* y, backend::cpu::Operand x, const QuantWeight& w, const float* bias,
                          int64_t rows, int64_t in, int64_t out);
// The same for rows [row0, row0 + n) of W only: y[rows, n] (row stride ldy)
// = x · W[row0 : row0 + n]ᵀ, no bias (a LoRA piece's or a DoRA row's base).
void quant_matmul_rows(float* y, int64_t ldy, backend::cpu::Operand x, const QuantWeight& w, int64_t row0,
                       int64_t n, int64_t rows, int64_t in);
// dx[rows, in] = dy · W (written), W read panel by panel; the panels' sums
// add in row order.
void quant_matmul_backward_input(float* dx, backend::cpu::Operand dy, const QuantWeight& w,
                                 int64_t rows, int64_t in, int64_t out);

}  // namespace po::model
