#include "parallel/unit_blocks.h"

#include "backend/ops.h"
#include "core/bf16.h"

namespace po::parallel {
namespace ops = po::backend::cpu;
using tensor::DType;

void add_block(void* dst, DType dst_dtype, const void* block, DType block_dtype, int64_t n) {
  const bool block_bf16 = block_dtype == DType::kBF16;
  if (dst_dtype == DType::kF32) {
    float* d = static_cast<float*>(dst);
    if (block_bf16) {
      const auto* b = static_cast<const uint16_t*>(block);
      for (int64_t i = 0; i < n; ++i) d[i] += core::bf16_to_f32(core::bf16{b[i]});
    } else {
      const auto* b = static_cast<const float*>(block);
      for (int64_t i = 0; i < n; ++i) d[i] += b[i];
    }
    return;
  }
  auto* d = static_cast<uint16_t*>(dst);
  if (block_bf16)
    ops::bf16_add_bf16(d, static_cast<const uint16_t*>(block), n);
  else
    ops::bf16_add_f32(d, static_cast<const float*>(block), n);
}

void widen_unit(const model::Layout& layout, int u, const uint16_t* src, float* dst, bool lean) {
  if (!lean) {
    ops::bf16_to_f32(dst, src, layout.unit_numel(u));
    return;
  }
  for (const auto& [b, e] : layout.f32_read_ranges(u)) ops::bf16_to_f32(dst + b, src + b, e - b);
}

}  // namespace po::parallel
