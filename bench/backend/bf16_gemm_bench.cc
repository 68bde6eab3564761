// bf16 GEMM vs f32 GEMM on this CPU, over the GEMMs of one bench-small training
// step (issue 4: "use bf16 GEMM where the BLAS supports it; measure it against
// converting to f32; keep the faster"). Four paths, one process, same inputs:
//   f32      dnnl_sgemm on f32 operands (what backend::cpu::gemm does today)
//   bf16gemm dnnl_gemm_bf16bf16f32: bf16 A and B, f32 accumulate and C. Exported
//            by libdnnl 2.6 but not declared in its public dnnl.h, so it is
//            declared in backend/cpu/dnnl_bf16.h.
//   bf16mm   oneDNN matmul primitive: bf16 src/weights, f32 dst (strides give the
//            transposes; dW's "+=" is a sum post-op). Created once per shape,
//            outside the timing, as an engine would cache it.
//   cvt+f32  bf16 storage, both operands widened to f32 scratch, then dnnl_sgemm;
//            the conversion is inside the timed region.
// Ops as matmul_forward/backward call gemm(), weights stored [OC,C]:
//   fwd = gemm(N,T, BT,OC,C)  dx = gemm(N,N, BT,C,OC)  dW += gemm(T,N, OC,C,BT).
// Before timing, every path is checked on small shapes against an f64 reference
// computed from the f32 (not rounded) inputs, so the bf16 error includes input
// rounding, which is what a bf16 training mode would see.
// Usage: bf16_gemm_bench [threads=2] [min_reps=5]
//   ONEDNN_VERBOSE=1 prints the implementation oneDNN dispatches per call.
#include "../bench_util.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "core/bf16.h"

#if defined(PO_BLAS_DNNL)
#include "backend/cpu/dnnl_bf16.h"

namespace cpu = po::backend::cpu;
using po::core::bf16;

namespace {

#define BENCH_DNNL_CHECK(call)                                                       \
  do {                                                                               \
    const dnnl_status_t st_ = (call);                                                \
    if (st_ != dnnl_success) {                                                       \
      std::fprintf(stderr, "%s failed: status %d\n", #call, static_cast<int>(st_)); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

// One GEMM C[M,N] = op(A)[M,K] op(B)[K,N] + beta C, row-major, packed strides:
// A is stored [K,M] when ta, B is stored [N,K] when tb.
struct Shape {
  const char* gemm;
  const char* op;
  bool ta, tb;
  int64_t M, N, K;
  float beta;
  int64_t lda() const { return ta ? M : K; }
  int64_t ldb() const { return tb ? K : N; }
  double flop() const { return 2.0 * M * N * K; }
};

// fwd / dx / dW of one linear layer inp[BT,C] -> out[BT,OC].
void add_linear(std::vector<Shape>& v, const char* name, int64_t BT, int64_t C, int64_t OC) {
  v.push_back({name, "fwd", false, true, BT, OC, C, 0.0f});
  v.push_back({name, "dx", false, false, BT, C, OC, 0.0f});
  v.push_back({name, "dW", true, false, OC, C, BT, 1.0f});
}

void bf16_round(std::vector<bf16>& out, const std::vector<float>& in) {
  out.resize(in.size());
  const int64_t n = static_cast<int64_t>(in.size());
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) out[i] = po::core::f32_to_bf16(in[i]);
}

// The conversion path (c) pays for: a shift per element, vectorised by the compiler.
void bf16_widen(float* out, const bf16* in, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const uint32_t u = uint32_t{in[i].bits} << 16;
    std::memcpy(&out[i], &u, 4);
  }
}

// The matmul primitive for one shape, bf16 x bf16 -> f32, built once.
struct Bf16Matmul {
  dnnl_primitive_t prim = nullptr;
  dnnl_memory_t a = nullptr, b = nullptr, c = nullptr;
  std::string impl;

  Bf16Matmul(dnnl_engine_t eng, const Shape& s) {
    const dnnl_dims_t a_dims = {s.M, s.K}, b_dims = {s.K, s.N}, c_dims = {s.M, s.N};
    const dnnl_dims_t a_str = {s.ta ? 1 : s.lda(), s.ta ? s.lda() : 1};
    const dnnl_dims_t b_str = {s.tb ? 1 : s.ldb(), s.tb ? s.ldb() : 1};
    const dnnl_dims_t c_str = {s.N, 1};
    dnnl_memory_desc_t a_md, b_md, c_md;
    BENCH_DNNL_CHECK(dnnl_memory_desc_init_by_strides(&a_md, 2, a_dims, dnnl_bf16, a_str));
    BENCH_DNNL_CHECK(dnnl_memory_desc_init_by_strides(&b_md, 2, b_dims, dnnl_bf16, b_str));
    BENCH_DNNL_CHECK(dnnl_memory_desc_init_by_strides(&c_md, 2, c_dims, dnnl_f32, c_str));
    dnnl_matmul_desc_t desc;
    BENCH_DNNL_CHECK(dnnl_matmul_desc_init(&desc, &a_md, &b_md, nullptr, &c_md));
    dnnl_primitive_attr_t attr;
    BENCH_DNNL_CHECK(dnnl_primitive_attr_create(&attr));
    if (s.beta != 0.0f) {
      dnnl_post_ops_t po;
      BENCH_DNNL_CHECK(dnnl_post_ops_create(&po));
      BENCH_DNNL_CHECK(dnnl_post_ops_append_sum(po, s.beta));
      BENCH_DNNL_CHECK(dnnl_primitive_attr_set_post_ops(attr, po));
      dnnl_post_ops_destroy(po);
    }
    dnnl_primitive_desc_t pd;
    BENCH_DNNL_CHECK(dnnl_primitive_desc_create(&pd, &desc, attr, eng, nullptr));
    const char* name = nullptr;
    BENCH_DNNL_CHECK(dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &name));
    impl = name ? name : "?";
    BENCH_DNNL_CHECK(dnnl_primitive_create(&prim, pd));
    dnnl_primitive_desc_destroy(pd);
    dnnl_primitive_attr_destroy(attr);
    BENCH_DNNL_CHECK(dnnl_memory_create(&a, &a_md, eng, DNNL_MEMORY_NONE));
    BENCH_DNNL_CHECK(dnnl_memory_create(&b, &b_md, eng, DNNL_MEMORY_NONE));
    BENCH_DNNL_CHECK(dnnl_memory_create(&c, &c_md, eng, DNNL_MEMORY_NONE));
  }
  ~Bf16Matmul() {
    dnnl_memory_destroy(a);
    dnnl_memory_destroy(b);
    dnnl_memory_destroy(c);
    dnnl_primitive_destroy(prim);
  }
  Bf16Matmul(const Bf16Matmul&) = delete;
  Bf16Matmul& operator=(const Bf16Matmul&) = delete;

  void run(dnnl_stream_t stream, const bf16* A, const bf16* B, float* C) {
    BENCH_DNNL_CHECK(dnnl_memory_set_data_handle(a, const_cast<bf16*>(A)));
    BENCH_DNNL_CHECK(dnnl_memory_set_data_handle(b, const_cast<bf16*>(B)));
    BENCH_DNNL_CHECK(dnnl_memory_set_data_handle(c, C));
    const dnnl_exec_arg_t args[] = {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}};
    BENCH_DNNL_CHECK(dnnl_primitive_execute(prim, stream, 3, args));
    BENCH_DNNL_CHECK(dnnl_stream_wait(stream));
  }
};

// Operands of one shape in every storage the paths need.
struct Operands {
  std::vector<float> a, b, c, a_scratch, b_scratch;
  std::vector<bf16> a16, b16;
  Operands(const Shape& s, uint32_t seed) {
    a.resize(s.M * s.K);
    b.resize(s.K * s.N);
    c.assign(s.M * s.N, 0.0f);
    a_scratch.resize(a.size());
    b_scratch.resize(b.size());
    // Deterministic LCG values in [-1,1).
    uint32_t x = seed;
    auto next = [&x] {
      x = x * 1664525u + 1013904223u;
      return static_cast<float>(x >> 8) / 8388608.0f - 1.0f;
    };
    for (float& v : a) v = next();
    for (float& v : b) v = next();
    bf16_round(a16, a);
    bf16_round(b16, b);
  }
};

enum Path { kF32, kBf16Gemm, kBf16Matmul, kCvtF32, kNumPaths };
const char* const kPathName[kNumPaths] = {"f32", "bf16gemm", "bf16mm", "cvt+f32"};

void run_path(Path p, const Shape& s, Operands& o, Bf16Matmul& mm, dnnl_stream_t stream) {
  const char ta = s.ta ? 'T' : 'N', tb = s.tb ? 'T' : 'N';
  switch (p) {
    case kF32:
      cpu::gemm(s.ta, s.tb, s.M, s.N, s.K, 1.0f, o.a.data(), s.lda(), o.b.data(), s.ldb(),
                s.beta, o.c.data(), s.N);
      break;
    case kBf16Gemm:
      BENCH_DNNL_CHECK(dnnl_gemm_bf16bf16f32(
          ta, tb, s.M, s.N, s.K, 1.0f, reinterpret_cast<const uint16_t*>(o.a16.data()), s.lda(),
          reinterpret_cast<const uint16_t*>(o.b16.data()), s.ldb(), s.beta, o.c.data(), s.N));
      break;
    case kBf16Matmul:
      mm.run(stream, o.a16.data(), o.b16.data(), o.c.data());
      break;
    case kCvtF32:
      bf16_widen(o.a_scratch.data(), o.a16.data(), static_cast<int64_t>(o.a16.size()));
      bf16_widen(o.b_scratch.data(), o.b16.data(), static_cast<int64_t>(o.b16.size()));
      cpu::gemm(s.ta, s.tb, s.M, s.N, s.K, 1.0f, o.a_scratch.data(), s.lda(),
                o.b_scratch.data(), s.ldb(), s.beta, o.c.data(), s.N);
      break;
    default:
      break;
  }
}

double cpu_now() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// Best wall time and best CPU-normalised time (process CPU seconds / threads) of
// each path. Paths are interleaved rep by rep, so load from other processes on a
// shared machine hits all of them alike; at least min_reps rounds, then more
// until ~2 s were spent (at most 200 rounds).
struct PathTimes {
  double wall[kNumPaths], cpu[kNumPaths];
};
template <typename F>
PathTimes time_paths(F run, int min_reps, int threads) {
  PathTimes t;
  for (int p = 0; p < kNumPaths; p++) {
    run(p);  // warm-up: page faults, primitive JIT, caches
    t.wall[p] = t.cpu[p] = 1e30;
  }
  double spent = 0.0;
  for (int r = 0; r < min_reps || (spent < 2.0 && r < 200); r++)
    for (int p = 0; p < kNumPaths; p++) {
      const double w0 = po::bench::now_seconds(), c0 = cpu_now();
      run(p);
      const double dw = po::bench::now_seconds() - w0, dc = (cpu_now() - c0) / threads;
      t.wall[p] = std::min(t.wall[p], dw);
      t.cpu[p] = std::min(t.cpu[p], dc);
      spent += dw;
    }
  return t;
}

// max |C - ref| / max |ref| over the matrix, ref in f64 from the f32 inputs.
double max_rel_error(Path p, const Shape& s, dnnl_engine_t eng, dnnl_stream_t stream) {
  Operands o(s, 12345u);
  Bf16Matmul mm(eng, s);
  std::vector<double> ref(s.M * s.N);
  for (int64_t i = 0; i < s.M; i++)
    for (int64_t j = 0; j < s.N; j++) {
      double acc = 0.0;
      for (int64_t k = 0; k < s.K; k++) {
        const double av = s.ta ? o.a[k * s.lda() + i] : o.a[i * s.lda() + k];
        const double bv = s.tb ? o.b[j * s.ldb() + k] : o.b[k * s.ldb() + j];
        acc += av * bv;
      }
      ref[i * s.N + j] = acc;
    }
  // beta != 0: start from a known C so the "+=" is checked too.
  for (int64_t i = 0; i < s.M * s.N; i++) {
    o.c[i] = 0.25f * static_cast<float>(i % 7);
    ref[i] += s.beta * o.c[i];
  }
  run_path(p, s, o, mm, stream);
  double err = 0.0, scale = 0.0;
  for (int64_t i = 0; i < s.M * s.N; i++) {
    err = std::max(err, std::fabs(o.c[i] - ref[i]));
    scale = std::max(scale, std::fabs(ref[i]));
  }
  return err / scale;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const int min_reps = argc > 2 ? std::atoi(argv[2]) : 5;
  cpu::set_num_threads(threads);
  dnnl_engine_t eng;
  dnnl_stream_t stream;
  BENCH_DNNL_CHECK(dnnl_engine_create(&eng, dnnl_cpu, 0));
  BENCH_DNNL_CHECK(dnnl_stream_create(&stream, eng, dnnl_stream_default_flags));
  const dnnl_version_t* ver = dnnl_version();
  std::printf("# oneDNN %d.%d.%d threads=%d min_reps=%d\n", ver->major, ver->minor,
              ver->patch, threads, min_reps);

  // Accuracy on small shapes (K=384 as the model's C), all three transpose cases.
  std::vector<Shape> small;
  add_linear(small, "small", 64, 384, 96);
  double err[kNumPaths] = {};
  for (const Shape& s : small)
    for (int p = 0; p < kNumPaths; p++) {
      const double e = max_rel_error(static_cast<Path>(p), s, eng, stream);
      err[p] = std::max(err[p], e);
      // f32 path must be f32-accurate; bf16 inputs carry ~2^-9 relative rounding each.
      const double tol = p == kF32 ? 1e-5 : 2e-2;
      if (!(e < tol)) {
        std::fprintf(stderr, "%s wrong on %s %s: max rel err %g\n", kPathName[p], s.gemm, s.op,
                     e);
        return 1;
      }
    }
  std::printf("# max |C-ref|/max|ref| vs f64 (BT=64 C=384 OC=96, fwd/dx/dW):"
              " f32 %.2e  bf16gemm %.2e  bf16mm %.2e  cvt+f32 %.2e\n",
              err[kF32], err[kBf16Gemm], err[kBf16Matmul], err[kCvtF32]);

  // bench-small: B=4, T=256 (BT=1024), C=384; the LM head runs in 256-row chunks.
  const int64_t BT = 1024, C = 384, V = 50257, kLmRows = 256;
  std::vector<Shape> shapes;
  add_linear(shapes, "qkv", BT, C, 3 * C);
  add_linear(shapes, "attproj", BT, C, C);
  add_linear(shapes, "fc", BT, C, 4 * C);
  add_linear(shapes, "fcproj", BT, 4 * C, C);
  add_linear(shapes, "lm_head", kLmRows, C, V);

  // Ratios use wall time: the paths are interleaved, so load hits them alike. The
  // CPU-normalised figure (JSON only) is informational: in this VM process CPU time
  // undercounts multi-threaded work (it reads ~1x wall with both threads busy).
  std::printf("# wall GFLOP/s, best of interleaved reps\n");
  std::printf("%-8s %-4s %6s %6s %6s  %8s %8s %8s %8s  %8s %8s %8s  %s\n", "gemm", "op",
              "M", "N", "K", "f32", "bf16gemm", "bf16mm", "cvt+f32", "gemm/f32", "mm/f32",
              "cvt/f32", "bf16mm impl");
  double total_ms[kNumPaths] = {}, total_cpu_ms[kNumPaths] = {};
  std::string json = "{\"bench\":\"bf16_gemm\",\"threads\":" + std::to_string(threads) +
                     ",\"shapes\":[";
  for (size_t si = 0; si < shapes.size(); si++) {
    const Shape& s = shapes[si];
    Operands o(s, 777u + static_cast<uint32_t>(si));
    Bf16Matmul mm(eng, s);
    // beta=1 grows C each rep; harmless for timing (no overflow at these sizes).
    const PathTimes t = time_paths(
        [&](int p) { run_path(static_cast<Path>(p), s, o, mm, stream); }, min_reps, threads);
    double gf[kNumPaths], gf_cpu[kNumPaths];
    for (int p = 0; p < kNumPaths; p++) {
      gf[p] = s.flop() / t.wall[p] * 1e-9;
      gf_cpu[p] = s.flop() / t.cpu[p] * 1e-9;
      total_ms[p] += t.wall[p] * 1e3;
      total_cpu_ms[p] += t.cpu[p] * 1e3;
    }
    std::printf("%-8s %-4s %6ld %6ld %6ld ", s.gemm, s.op, static_cast<long>(s.M),
                static_cast<long>(s.N), static_cast<long>(s.K));
    for (int p = 0; p < kNumPaths; p++) std::printf(" %8.1f", gf[p]);
    std::printf("  %8.2f %8.2f %8.2f  %s\n", gf[kBf16Gemm] / gf[kF32],
                gf[kBf16Matmul] / gf[kF32], gf[kCvtF32] / gf[kF32],
                mm.impl.c_str());
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "%s{\"gemm\":\"%s\",\"op\":\"%s\",\"M\":%ld,\"N\":%ld,\"K\":%ld,"
                  "\"gflops\":{\"f32\":%.1f,\"bf16gemm\":%.1f,\"bf16mm\":%.1f,\"cvt_f32\":%.1f},"
                  "\"gflops_cpu\":{\"f32\":%.1f,\"bf16gemm\":%.1f,\"bf16mm\":%.1f,\"cvt_f32\":%.1f}}",
                  si ? "," : "", s.gemm, s.op, static_cast<long>(s.M), static_cast<long>(s.N),
                  static_cast<long>(s.K), gf[kF32], gf[kBf16Gemm], gf[kBf16Matmul],
                  gf[kCvtF32], gf_cpu[kF32], gf_cpu[kBf16Gemm], gf_cpu[kBf16Matmul],
                  gf_cpu[kCvtF32]);
    json += buf;
  }
  std::printf("%-35s", "total wall ms (sum of best)");
  for (int p = 0; p < kNumPaths; p++) std::printf(" %8.1f", total_ms[p]);
  std::printf("  %8.2f %8.2f %8.2f  (speed-up vs f32)\n", total_ms[kF32] / total_ms[kBf16Gemm],
              total_ms[kF32] / total_ms[kBf16Matmul], total_ms[kF32] / total_ms[kCvtF32]);
  char tail[600];
  std::snprintf(tail, sizeof tail,
                "],\"total_ms\":{\"f32\":%.2f,\"bf16gemm\":%.2f,\"bf16mm\":%.2f,\"cvt_f32\":%.2f},"
                "\"total_cpu_ms\":{\"f32\":%.2f,\"bf16gemm\":%.2f,\"bf16mm\":%.2f,\"cvt_f32\":%.2f},"
                "\"max_rel_err\":{\"f32\":%.2e,\"bf16gemm\":%.2e,\"bf16mm\":%.2e,\"cvt_f32\":%.2e}}",
                total_ms[kF32], total_ms[kBf16Gemm], total_ms[kBf16Matmul], total_ms[kCvtF32],
                total_cpu_ms[kF32], total_cpu_ms[kBf16Gemm], total_cpu_ms[kBf16Matmul],
                total_cpu_ms[kCvtF32], err[kF32], err[kBf16Gemm], err[kBf16Matmul], err[kCvtF32]);
  json += tail;
  std::printf("%s\n", json.c_str());
  dnnl_stream_destroy(stream);
  dnnl_engine_destroy(eng);
  return 0;
}

#else  // !PO_BLAS_DNNL

int main() {
  std::printf("bf16_gemm_bench: needs the oneDNN build (-DPO_BLAS=dnnl); skipped\n");
  return 0;
}

#endif
