// A unit's stored values, widened or added into: the one arithmetic of
// bf16 parameters read as f32 and of a ZeRO 2-3 gradient shard's
// accumulation, wherever the reduce-scatter ran.
#pragma once

#include <cstdint>

#include "model/layout.h"
#include "tensor/tensor.h"

namespace po::parallel {

// A reduced gradient block (n elements, f32 or bf16 on the wire) added into
// a gradient stored as f32 or bf16.
void add_block(void* dst, tensor::DType dst_dtype, const void* block, tensor::DType block_dtype,
               int64_t n);

// Unit u's stored bf16 parameters `src` widened into `dst` (unit_numel(u)
// floats): every value, or (lean) only `layout`'s f32_read_ranges(u), the
// rest left as they were.
void widen_unit(const model::Layout& layout, int u, const uint16_t* src, float* dst, bool lean);

}  // namespace po::parallel
