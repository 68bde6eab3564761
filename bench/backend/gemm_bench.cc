// sgemm peak through the engine's own gemm() (the BLAS the build links), plus
// the gpt2-124M LM-head shape. The JSON line {"bench":"sgemm_peak",...} is the
// peak the training benchmark divides by for MFU. Validates before timing.
// Usage: gemm_bench [threads=2]
#include "../bench_util.h"
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "backend/ops.h"

namespace cpu = po::backend::cpu;

namespace {

template <typename F>
double best_time(F op) {
  return po::bench::best_time(op, 3, 100);
}

bool validate() {
  const int64_t M = 33, N = 29, K = 41;
  std::vector<float> A(M * K), B(K * N), C(M * N);
  for (size_t i = 0; i < A.size(); i++) A[i] = std::sin(0.1 * i);
  for (size_t i = 0; i < B.size(); i++) B[i] = std::cos(0.07 * i);
  cpu::gemm(false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, C.data(), N);
  for (int64_t i = 0; i < M; i++)
    for (int64_t j = 0; j < N; j++) {
      double s = 0;
      for (int64_t k = 0; k < K; k++) s += static_cast<double>(A[i * K + k]) * B[k * N + j];
      if (std::fabs(s - C[i * N + j]) > 1e-4 * (1 + std::fabs(s))) {
        std::fprintf(stderr, "gemm wrong at (%ld,%ld): %g vs %g\n", static_cast<long>(i),
                     static_cast<long>(j), C[i * N + j], s);
        return false;
      }
    }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  cpu::set_num_threads(threads);
  if (!validate()) return 1;
  const char* core = std::getenv("OPENBLAS_CORETYPE");
  std::printf("# blas=%s threads=%d OPENBLAS_CORETYPE=%s\n", cpu::blas_name(), threads,
              core ? core : "(unset)");

  const int64_t n = 3072;
  std::vector<float> A(n * n, 0.01f), B(n * n, 0.02f), C(n * n);
  const double t_sq = best_time([&] {
    cpu::gemm(false, false, n, n, n, 1.0f, A.data(), n, B.data(), n, 0.0f, C.data(), n);
  });
  const double peak = 2.0 * n * n * n / t_sq * 1e-9;
  std::printf("%-36s %10.2f ms %8.1f GFLOP/s\n", "sgemm 3072^3", t_sq * 1e3, peak);

  // The bf16 GEMM on bf16 operands (rounded before the clock), f32 accumulation:
  // the peak of a bf16 step's products (the f32 GEMM where the CPU or BLAS has
  // no native bf16 one).
  std::vector<uint16_t> A16(n * n), B16(n * n);
  cpu::f32_to_bf16(A16.data(), A.data(), n * n);
  cpu::f32_to_bf16(B16.data(), B.data(), n * n);
  const double t_bf = best_time([&] {
    cpu::gemm_bf16(false, false, n, n, n, 1.0f, A16.data(), n, B16.data(), n, 0.0f, C.data(), n);
  });
  const double peak_bf16 = 2.0 * n * n * n / t_bf * 1e-9;
  std::printf("%-36s %10.2f ms %8.1f GFLOP/s (%s)\n", "bf16 gemm 3072^3", t_bf * 1e3, peak_bf16,
              cpu::native_bf16_gemm() ? "native" : "no native bf16 GEMM: through f32");

  const int64_t BT = 1024, Cc = 768, V = 50257;
  std::vector<float> inp(BT * Cc, 0.01f), w(V * Cc, 0.02f), out(BT * V);
  const double t_lm = best_time(
      [&] { cpu::matmul_forward(out.data(), inp.data(), w.data(), nullptr, BT, Cc, V); });
  std::printf("%-36s %10.2f ms %8.1f GFLOP/s\n", "lm_head fwd 1024x768 . 768x50257",
              t_lm * 1e3, 2.0 * BT * Cc * V / t_lm * 1e-9);

  std::printf("{\"bench\":\"sgemm_peak\",\"threads\":%d,\"gflops\":%.1f,\"blas\":\"%s\"}\n",
              threads, peak, cpu::blas_name());
  std::printf("{\"bench\":\"bf16_peak\",\"threads\":%d,\"gflops\":%.1f,\"native\":%s}\n",
              threads, peak_bf16, cpu::native_bf16_gemm() ? "true" : "false");
  std::printf("{\"bench\":\"lm_head_fwd\",\"threads\":%d,\"ms\":%.2f,\"gflops\":%.1f}\n",
              threads, t_lm * 1e3, 2.0 * BT * Cc * V / t_lm * 1e-9);
  return 0;
}
