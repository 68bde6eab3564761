// Device kernels of the NCCL backend's 16-bit reductions: widen bf16/f16 to an
// f32 scratch buffer, and round the f32 result back once (dividing by the
// group size first for avg), plus the in-place f32 divide of f32 avg. They
// keep the Communicator contract on the GPU: 16-bit sums accumulate in f32 and
// are rounded once, with round-to-nearest-even like core/bf16.h and core/f16.h.
//
// Every function only enqueues on `stream` and returns the launch status
// (cudaGetLastError); n == 0 enqueues nothing. Pointers are device memory.
// This header is plain C++ (no project headers) so that convert.cu compiles
// with nvcc alone.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace po::comm::nccl::kernels {

enum class Half { kBF16, kF16 };

// dst[i] = float(src[i]) for i < n.
cudaError_t widen(const void* src, Half type, float* dst, size_t n, cudaStream_t stream);
// dst[i] = round_to_half(src[i] / divisor) for i < n.
cudaError_t narrow(const float* src, Half type, void* dst, size_t n, float divisor,
                   cudaStream_t stream);
// x[i] /= divisor for i < n.
cudaError_t divide(float* x, size_t n, float divisor, cudaStream_t stream);

}  // namespace po::comm::nccl::kernels
