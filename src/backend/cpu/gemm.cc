// GEMM through the BLAS chosen at configure time (cmake/blas.cmake, docs/blas.md),
// plus thread control. All three candidate BLAS libraries are linked in their
// OpenMP builds, so setting the OpenMP thread count sizes the one shared pool.
#include <omp.h>

#include "backend/ops.h"
#include "core/error.h"

#if defined(PO_BLAS_OPENBLAS)
#include <cblas.h>
#elif defined(PO_BLAS_BLIS)
#include <blis.h>
#elif defined(PO_BLAS_DNNL)
#include <dnnl.h>
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

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
          const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
          int64_t ldc) {
  if (M == 0 || N == 0) return;
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

}  // namespace po::backend::cpu
