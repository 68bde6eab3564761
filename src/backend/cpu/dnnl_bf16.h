// oneDNN's bf16 GEMM (bf16 A and B, f32 accumulation and C). libdnnl 2.x
// exports it but its public dnnl.h does not declare it; declared here once,
// as oneDNN's own tests declare it, for the backend and its benchmarks.
#pragma once

#include <dnnl.h>

#include <cstdint>

extern "C" dnnl_status_t dnnl_gemm_bf16bf16f32(char transa, char transb, dnnl_dim_t M,
                                               dnnl_dim_t N, dnnl_dim_t K, float alpha,
                                               const uint16_t* A, dnnl_dim_t lda,
                                               const uint16_t* B, dnnl_dim_t ldb, float beta,
                                               float* C, dnnl_dim_t ldc);
