// GEMM through the BLAS chosen at configure time (cmake/blas.cmake, docs/blas.md),
// plus thread control. All three candidate BLAS libraries are linked in their
// OpenMP builds, so setting the OpenMP thread count sizes the one shared pool.
#include <omp.h>

#include <algorithm>

#include <vector>

#include "backend/ops.h"
#include "core/bf16.h"
#include "core/error.h"
#include "core/timer.h"
#include "tensor/tensor.h"

#if defined(PO_BLAS_OPENBLAS)
#include <cblas.h>
#elif defined(PO_BLAS_BLIS)
#include <blis.h>
#elif defined(PO_BLAS_DNNL)
#include "backend/cpu/dnnl_bf16.h"
#else
#error "one of PO_BLAS_OPENBLAS / PO_BLAS_BLIS / PO_BLAS_DNNL must be defined"
#endif

namespace po::backend::cpu {

void set_num_threads(int n) {
  PO_CHECK(n >= 1, "set_num_threads: need n >= 1, got ", n);
  omp_set_num_threads(n);
#if defined(PO_BLAS_OPENBLAS)
  openblas_set_num_threads(n);
#elif defined(PO_BLAS_BLIS)
  bli_thread_set_num_threads(n);
#endif
  // oneDNN's OpenMP runtime follows omp_get_max_threads().
}

int num_threads() { return omp_get_max_threads(); }

const char* blas_name() {
#if defined(PO_BLAS_OPENBLAS)
  return "openblas";
#elif defined(PO_BLAS_BLIS)
  return "blis";
#else
  return "dnnl";
#endif
}

namespace {

GemmPrecision g_precision = GemmPrecision::kF32;

// Rows x ld floats rounded to bf16 bits into `out` (resized), in parallel.
void round_to_bf16(const float* x, int64_t n, std::vector<uint16_t>& out) {
  out.resize(static_cast<size_t>(n));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = core::f32_to_bf16(x[i]).bits;
}

// The same values as f32 (for BLAS builds without a bf16 GEMM).
void round_in_f32(const float* x, int64_t n, std::vector<float>& out) {
  out.resize(static_cast<size_t>(n));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i)
    out[static_cast<size_t>(i)] = core::bf16_to_f32(core::f32_to_bf16(x[i]));
}

void gemm_f32(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
              const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
              int64_t ldc);

}  // namespace

void set_gemm_precision(GemmPrecision p) { g_precision = p; }
GemmPrecision gemm_precision() { return g_precision; }

bool native_bf16_gemm() {
#if defined(PO_BLAS_DNNL)
  return dnnl_get_effective_cpu_isa() >= dnnl_cpu_isa_avx512_core_bf16;
#else
  return false;
#endif
}

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
          const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
          int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (g_precision == GemmPrecision::kF32 || K == 0) {
    gemm_f32(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  // Operand extents in memory: rows of stride ld, the last one only as long as needed.
  const int64_t a_elems = ((trans_a ? K : M) - 1) * lda + (trans_a ? M : K);
  const int64_t b_elems = ((trans_b ? N : K) - 1) * ldb + (trans_b ? K : N);
#if defined(PO_BLAS_DNNL)
  if (native_bf16_gemm()) {
    thread_local std::vector<uint16_t> a16, b16;
    round_to_bf16(A, a_elems, a16);
    round_to_bf16(B, b_elems, b16);
    const dnnl_status_t st = dnnl_gemm_bf16bf16f32(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M,
                                                   N, K, alpha, a16.data(), lda, b16.data(), ldb,
                                                   beta, C, ldc);
    PO_ASSERT(st == dnnl_success, "dnnl_gemm_bf16bf16f32 failed with status ",
              static_cast<int>(st));
    return;
  }
#endif
  thread_local std::vector<float> ar, br;
  round_in_f32(A, a_elems, ar);
  round_in_f32(B, b_elems, br);
  gemm_f32(trans_a, trans_b, M, N, K, alpha, ar.data(), lda, br.data(), ldb, beta, C, ldc);
}

namespace {

void gemm_f32(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
              const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
              int64_t ldc) {
#if defined(PO_BLAS_DNNL)
  const dnnl_status_t st =
      dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb,
                 beta, C, ldc);
  PO_ASSERT(st == dnnl_success, "dnnl_sgemm failed with status ", static_cast<int>(st));
#else
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(M), static_cast<int>(N),
              static_cast<int>(K), alpha, A, static_cast<int>(lda), B, static_cast<int>(ldb),
              beta, C, static_cast<int>(ldc));
#endif
}

}  // namespace

// One warm-up (oneDNN JIT-compiles its kernel on first use), then best of 3.
double measure_gemm_peak_gflops(GemmPrecision precision) {
  const GemmPrecision before = gemm_precision();
  set_gemm_precision(precision);
  const int64_t n = 2048;
  tensor::Storage a(n * n * 4), b(n * n * 4), c(n * n * 4);
  for (int64_t i = 0; i < n * n; ++i) a.f32()[i] = b.f32()[i] = 1e-3f * static_cast<float>(i % 97);
  double best = 1e30;
  for (int rep = 0; rep < 4; ++rep) {
    core::Timer t;
    gemm(false, true, n, n, n, 1.0f, a.f32(), n, b.f32(), n, 0.0f, c.f32(), n);
    if (rep > 0) best = std::min(best, t.seconds());
  }
  set_gemm_precision(before);
  return 2.0 * n * n * n / best / 1e9;
}

}  // namespace po::backend::cpu
