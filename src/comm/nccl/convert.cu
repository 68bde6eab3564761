// Widen/narrow kernels for the NCCL backend's 16-bit reductions (convert.h).
// Grid-stride loops over size_t indices, so any n works with a bounded grid.
// Division is IEEE-exact (no fast-math), so narrow(x, d) matches the host's
// round(x / d) bit for bit; the conversions are the CUDA round-to-nearest-even
// intrinsics.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "comm/nccl/convert.h"

namespace po::comm::nccl::kernels {
namespace {

constexpr unsigned kThreads = 256;
constexpr size_t kMaxBlocks = 4096;  // enough to fill any current GPU

unsigned blocks_for(size_t n) {
  return static_cast<unsigned>(std::min(kMaxBlocks, (n + kThreads - 1) / kThreads));
}

__device__ size_t first_index() { return size_t{blockIdx.x} * blockDim.x + threadIdx.x; }
__device__ size_t grid_stride() { return size_t{gridDim.x} * blockDim.x; }

__global__ void widen_bf16(const __nv_bfloat16* src, float* dst, size_t n) {
  for (size_t i = first_index(); i < n; i += grid_stride()) dst[i] = __bfloat162float(src[i]);
}

__global__ void widen_f16(const __half* src, float* dst, size_t n) {
  for (size_t i = first_index(); i < n; i += grid_stride()) dst[i] = __half2float(src[i]);
}

__global__ void narrow_bf16(const float* src, __nv_bfloat16* dst, size_t n, float divisor) {
  for (size_t i = first_index(); i < n; i += grid_stride()) {
    dst[i] = __float2bfloat16_rn(src[i] / divisor);
  }
}

__global__ void narrow_f16(const float* src, __half* dst, size_t n, float divisor) {
  for (size_t i = first_index(); i < n; i += grid_stride())
    dst[i] = __float2half_rn(src[i] / divisor);
}

__global__ void divide_f32(float* x, size_t n, float divisor) {
  for (size_t i = first_index(); i < n; i += grid_stride()) x[i] /= divisor;
}

}  // namespace

cudaError_t widen(const void* src, Half type, float* dst, size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (type == Half::kBF16) {
    widen_bf16<<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(src), dst,
                                                       n);
  } else {
    widen_f16<<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const __half*>(src), dst, n);
  }
  return cudaGetLastError();
}

cudaError_t narrow(const float* src, Half type, void* dst, size_t n, float divisor,
                   cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (type == Half::kBF16) {
    narrow_bf16<<<blocks_for(n), kThreads, 0, stream>>>(src, static_cast<__nv_bfloat16*>(dst), n,
                                                        divisor);
  } else {
    narrow_f16<<<blocks_for(n), kThreads, 0, stream>>>(src, static_cast<__half*>(dst), n, divisor);
  }
  return cudaGetLastError();
}

cudaError_t divide(float* x, size_t n, float divisor, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  divide_f32<<<blocks_for(n), kThreads, 0, stream>>>(x, n, divisor);
  return cudaGetLastError();
}

}  // namespace po::comm::nccl::kernels
