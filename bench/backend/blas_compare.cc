// Compares the candidate BLAS libraries on the engine's training GEMM shapes in
// one process: each library is dlopen()ed RTLD_LOCAL and its sgemm resolved, so
// they run side by side under the same load. OPENBLAS_CORETYPE is read when
// OpenBLAS loads, so run this once per environment setting (docs/blas.md).
// Usage: blas_compare [threads=2] [quick|full] [pthread] — a table on stdout,
// JSON lines on stderr. Two figures per cell: wall-clock GFLOP/s (best run)
// and CPU-normalised GFLOP/s = flop / (process CPU seconds / threads), which
// stays meaningful when other processes share the cores (spinning is charged).
#include "../bench_util.h"
#include <dlfcn.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

namespace {

using CblasSgemm = void (*)(int, int, int, int, int, int, float, const float*, int,
                            const float*, int, float, float*, int);
using DnnlSgemm = int (*)(char, char, int64_t, int64_t, int64_t, float, const float*, int64_t,
                          const float*, int64_t, float, float*, int64_t);
using SetThreads = void (*)(int);
using SetThreadsL = void (*)(long);

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

struct Lib {
  std::string name;
  CblasSgemm cblas = nullptr;
  DnnlSgemm dnnl = nullptr;
  void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A,
            const float* B, float* C) const {
    const int64_t lda = ta ? M : K, ldb = tb ? K : N;
    if (dnnl)
      dnnl(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, N);
    else
      cblas(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, M, N, K, 1.0f, A, lda,
            B, ldb, 0.0f, C, N);
  }
};

bool load(const char* name, const char* path, int threads, Lib& out) {
  void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    std::fprintf(stderr, "skip %s: %s\n", name, dlerror());
    return false;
  }
  out.name = name;
  if (std::strcmp(name, "dnnl") == 0) {
    out.dnnl = reinterpret_cast<DnnlSgemm>(dlsym(h, "dnnl_sgemm"));
  } else {
    out.cblas = reinterpret_cast<CblasSgemm>(dlsym(h, "cblas_sgemm"));
  }
  if (auto f = reinterpret_cast<SetThreads>(dlsym(h, "openblas_set_num_threads"))) f(threads);
  if (auto f = reinterpret_cast<SetThreadsL>(dlsym(h, "bli_thread_set_num_threads"))) f(threads);
  return out.cblas || out.dnnl;
}

double cpu_now() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

double now() { return po::bench::now_seconds(); }

struct Shape {
  const char* model;
  const char* what;
  bool ta, tb;
  int64_t M, N, K;
};

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const bool quick = argc > 2 && std::strcmp(argv[2], "quick") == 0;
  const bool with_pthread = argc > 3 && std::strcmp(argv[3], "pthread") == 0;
  omp_set_num_threads(threads);
  const char* dir = "/usr/lib/x86_64-linux-gnu";
  const std::string ob_omp = std::string(dir) + "/openblas-openmp/libopenblas.so.0";
  const std::string ob_pth = std::string(dir) + "/openblas-pthread/libopenblas.so.0";
  const std::string blis = std::string(dir) + "/blis-openmp/libblis.so.4";
  std::vector<Lib> libs;
  Lib l;
  if (load("openblas-omp", ob_omp.c_str(), threads, l)) libs.push_back(l);
  if (load("blis-omp", blis.c_str(), threads, l)) libs.push_back(l);
  if (load("dnnl", "libdnnl.so.2", threads, l)) libs.push_back(l);
  if (with_pthread && load("openblas-pthread", ob_pth.c_str(), threads, l)) libs.push_back(l);

  const char* env_core = std::getenv("OPENBLAS_CORETYPE");
  const char* env_l2 = std::getenv("OPENBLAS_L2_SIZE");
  std::printf("# threads=%d OPENBLAS_CORETYPE=%s OPENBLAS_L2_SIZE=%s\n", threads,
              env_core ? env_core : "(unset)", env_l2 ? env_l2 : "(unset)");

  // Training shapes: matmul_forward = gemm(N,T, BT,OC,C); dinp = gemm(N,N, BT,C,OC);
  // dweight = gemm(T,N, OC,C,BT).
  std::vector<Shape> shapes;
  auto add_model = [&](const char* model, int64_t BT, int64_t C, int64_t V) {
    const int64_t oc[][2] = {{3 * C, C}, {C, C}, {4 * C, C}, {C, 4 * C}, {V, C}};
    const char* names[] = {"qkv", "attproj", "fc", "fcproj", "lm_head"};
    for (int i = 0; i < 5; i++) {
      const int64_t OC = oc[i][0], IC = oc[i][1];
      if (quick && i != 0 && i != 4) continue;
      shapes.push_back({model, names[i], false, true, BT, OC, IC});
      shapes.push_back({model, names[i], false, false, BT, IC, OC});
      shapes.push_back({model, names[i], true, false, OC, IC, BT});
    }
  };
  shapes.push_back({"square", "peak", false, false, 3072, 3072, 3072});
  add_model("gpt2-124M", 1024, 768, 50257);
  add_model("bench-small", 2048, 384, 50257);

  size_t maxA = 0, maxB = 0, maxC = 0;
  for (auto& s : shapes) {
    maxA = std::max<size_t>(maxA, s.M * s.K);
    maxB = std::max<size_t>(maxB, s.K * s.N);
    maxC = std::max<size_t>(maxC, s.M * s.N);
  }
  std::vector<float> A(maxA), B(maxB), C(maxC), R(maxC);
  for (size_t i = 0; i < maxA; i++) A[i] = static_cast<float>((i * 7 + 3) % 17) * 0.01f - 0.08f;
  for (size_t i = 0; i < maxB; i++) B[i] = static_cast<float>((i * 5 + 1) % 13) * 0.01f - 0.06f;

  // Validate every library against the first on a small awkward case per transpose.
  for (int t = 0; t < 4; t++) {
    const bool ta = t & 1, tb = t & 2;
    const int64_t M = 45, N = 37, K = 29;
    libs[0].gemm(ta, tb, M, N, K, A.data(), B.data(), R.data());
    for (auto& lib : libs) {
      lib.gemm(ta, tb, M, N, K, A.data(), B.data(), C.data());
      for (int64_t i = 0; i < M * N; i++)
        if (std::fabs(C[i] - R[i]) > 1e-4f) {
          std::fprintf(stderr, "%s disagrees at %ld (ta=%d tb=%d): %g vs %g\n",
                       lib.name.c_str(), static_cast<long>(i), ta, tb, C[i], R[i]);
          return 1;
        }
    }
  }

  std::printf("%-12s %-8s %-3s %6s %6s %6s", "model", "gemm", "op", "M", "N", "K");
  for (auto& lib : libs) std::printf(" %18s", lib.name.c_str());
  std::printf("   (GFLOP/s wall / CPU-normalised, best of runs)\n");
  std::vector<double> totals(libs.size(), 0.0);
  for (auto& s : shapes) {
    const double flop = 2.0 * s.M * s.N * s.K;
    const char* op = !s.ta && s.tb ? "fwd" : (!s.ta ? "dx" : "dW");
    std::printf("%-12s %-8s %-3s %6ld %6ld %6ld", s.model, s.what, op, static_cast<long>(s.M),
                static_cast<long>(s.N), static_cast<long>(s.K));
    for (size_t li = 0; li < libs.size(); li++) {
      libs[li].gemm(s.ta, s.tb, s.M, s.N, s.K, A.data(), B.data(), C.data());  // warm-up
      double best = 1e30, best_cpu = 1e30, spent = 0.0;
      int reps = 0;
      while (reps < 2 || (spent < 0.3 && reps < 50)) {
        const double t0 = now(), c0 = cpu_now();
        libs[li].gemm(s.ta, s.tb, s.M, s.N, s.K, A.data(), B.data(), C.data());
        const double dt = now() - t0, dc = (cpu_now() - c0) / threads;
        best = std::min(best, dt);
        best_cpu = std::min(best_cpu, dc);
        spent += dt;
        reps++;
      }
      const double gf = flop / best * 1e-9, gf_cpu = flop / best_cpu * 1e-9;
      if (std::strcmp(s.model, "square") != 0) totals[li] += best_cpu;
      std::printf(" %8.1f / %7.1f", gf, gf_cpu);
      std::fflush(stdout);
      std::fprintf(stderr,
                   "{\"bench\":\"blas_compare\",\"lib\":\"%s\",\"model\":\"%s\",\"gemm\":\"%s\","
                   "\"op\":\"%s\",\"M\":%ld,\"N\":%ld,\"K\":%ld,\"threads\":%d,\"coretype\":\"%s\","
                   "\"gflops\":%.1f,\"gflops_cpu_normalised\":%.1f}\n",
                   libs[li].name.c_str(), s.model, s.what, op, static_cast<long>(s.M),
                   static_cast<long>(s.N), static_cast<long>(s.K), threads,
                   env_core ? env_core : "", gf, gf_cpu);
    }
    std::printf("\n");
  }
  std::printf("%-43s", "sum of CPU-normalised times, training shapes (ms)");
  for (double t : totals) std::printf(" %18.1f", t * 1e3);
  std::printf("\n");
  return 0;
}
