// GEMM through the BLAS chosen at configure time (cmake/blas.cmake, docs/blas.md),
// plus thread control. All three candidate BLAS libraries are linked in their
// OpenMP builds, so setting the OpenMP thread count sizes the one shared pool.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "backend/isa.h"
#include "backend/ops.h"
#include "core/error.h"
#include "core/signal_stack.h"
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

#if defined(PO_BLAS_DNNL)
// oneDNN's GEMM kernels may run with the stack pointer on the heap
// (core/signal_stack.h): the calling thread and every thread of its OpenMP
// team get an alternate signal stack before oneDNN runs on them (once per
// team size; a GEMM called inside a parallel region covers its own thread).
void give_team_signal_stacks() {
  thread_local int covered = 0;
  const int n = omp_get_max_threads();
  if (n <= covered) return;
  core::give_thread_signal_stack();
  if (omp_in_parallel()) return;
  if (n > 1) {
#pragma omp parallel num_threads(n)
    core::give_thread_signal_stack();
  }
  covered = n;
}
#endif

void gemm_f32(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
              const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
              int64_t ldc) {
#if defined(PO_BLAS_DNNL)
  active_isa();  // fixed (and oneDNN capped to PO_ISA) before oneDNN's first call
  give_team_signal_stacks();
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

// Elements an operand of `rows` rows of stride ld spans, the last row only as
// long as needed.
int64_t extent(int64_t rows, int64_t cols, int64_t ld) { return (rows - 1) * ld + cols; }

// The operand's bf16 bits: its own, or its f32 values rounded into `scratch`.
const uint16_t* bf16_of(const Operand& x, int64_t n, std::vector<uint16_t>& scratch) {
  if (x.bf16 != nullptr) return x.bf16;
  scratch.resize(static_cast<size_t>(n));
  f32_to_bf16(scratch.data(), x.f32, n);
  return scratch.data();
}

// The operand's f32 values: its own, or its bf16 bits widened into `scratch`.
const float* f32_of(const Operand& x, int64_t n, std::vector<float>& scratch) {
  if (x.f32 != nullptr) return x.f32;
  scratch.resize(static_cast<size_t>(n));
  bf16_to_f32(scratch.data(), x.bf16, n);
  return scratch.data();
}

bool g_native_allowed = true;

}  // namespace

void set_gemm_precision(GemmPrecision p) { g_precision = p; }
GemmPrecision gemm_precision() { return g_precision; }

void allow_native_bf16_gemm(bool allowed) { g_native_allowed = allowed; }

bool native_bf16_gemm() {
#if defined(PO_BLAS_DNNL)
  // active_isa() first: it caps oneDNN to PO_ISA's path before oneDNN's first use.
  return g_native_allowed && active_isa() >= Isa::kAvx512Bf16 &&
         dnnl_get_effective_cpu_isa() >= dnnl_cpu_isa_avx512_core_bf16;
#else
  return false;
#endif
}

void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta,
               float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
#if defined(PO_BLAS_DNNL)
  if (native_bf16_gemm() && K > 0) {
    give_team_signal_stacks();
    const dnnl_status_t st = dnnl_gemm_bf16bf16f32(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M,
                                                   N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    PO_ASSERT(st == dnnl_success, "dnnl_gemm_bf16bf16f32 failed with status ",
              static_cast<int>(st));
    return;
  }
#endif
  thread_local std::vector<float> af, bf;
  const int64_t na = K > 0 ? extent(trans_a ? K : M, trans_a ? M : K, lda) : 0;
  const int64_t nb = K > 0 ? extent(trans_b ? N : K, trans_b ? K : N, ldb) : 0;
  gemm_f32(trans_a, trans_b, M, N, K, alpha, f32_of(Operand(A), na, af), lda,
           f32_of(Operand(B), nb, bf), ldb, beta, C, ldc);
}

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, Operand A,
          int64_t lda, Operand B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  const int64_t na = K > 0 ? extent(trans_a ? K : M, trans_a ? M : K, lda) : 0;
  const int64_t nb = K > 0 ? extent(trans_b ? N : K, trans_b ? K : N, ldb) : 0;
  if (g_precision == GemmPrecision::kF32 || K == 0) {
    thread_local std::vector<float> af, bf;
    gemm_f32(trans_a, trans_b, M, N, K, alpha, f32_of(A, na, af), lda, f32_of(B, nb, bf), ldb,
             beta, C, ldc);
    return;
  }
  thread_local std::vector<uint16_t> a16, b16;
  gemm_bf16(trans_a, trans_b, M, N, K, alpha, bf16_of(A, na, a16), lda, bf16_of(B, nb, b16), ldb,
            beta, C, ldc);
}

// One warm-up (oneDNN JIT-compiles its kernel on first use), then best of 3.
// At kBF16 the operands are bf16 already (rounded before the clock starts), as
// a bf16 step's parameters and saved activations are: the peak is the bf16
// GEMM's own. Both precisions touch the same three n x n f32 buffers (the
// bf16 operands live in the third, the product goes to the first), so the
// probe's resident size, which the planner counts, is the same.
double measure_gemm_peak_gflops(GemmPrecision precision) {
  const int64_t n = 2048;
  tensor::Storage a(n * n * 4), b(n * n * 4), c(n * n * 4);
  for (int64_t i = 0; i < n * n; ++i) a.f32()[i] = b.f32()[i] = 1e-3f * static_cast<float>(i % 97);
  auto* a16 = static_cast<uint16_t*>(c.data());
  uint16_t* b16 = a16 + n * n;
  if (precision == GemmPrecision::kBF16) {
    f32_to_bf16(a16, a.f32(), n * n);
    f32_to_bf16(b16, b.f32(), n * n);
  }
  // One warm-up (the JIT), then the best of three. More runs read the peak
  // more steadily (a training run's start-up probe reads 10-50% low on this
  // 2-core VM) but each GEMM call can grow the heap (the planner counts the
  // probe's resident size as every process's fixed overhead, and more calls
  // raised it by 3-14 MiB, past plan_vs_engine's 10%): kept at four.
  double best = 1e30;
  for (int rep = 0; rep < 4; ++rep) {
    core::Timer t;
    if (precision == GemmPrecision::kBF16)
      gemm_bf16(false, true, n, n, n, 1.0f, a16, n, b16, n, 0.0f, a.f32(), n);
    else
      gemm_f32(false, true, n, n, n, 1.0f, a.f32(), n, b.f32(), n, 0.0f, c.f32(), n);
    if (rep > 0) best = std::min(best, t.seconds());
  }
  return 2.0 * n * n * n / best / 1e9;
}

}  // namespace po::backend::cpu
