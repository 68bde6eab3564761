// Flash attention forward + backward at the gpt2-124M training shape
// (B=4, T=256, C=768, NH=12) and the bench-small shape (B=8, T=256, C=384,
// NH=6), next to the LM-head matmul forward (gpt2-124M shape) measured in the
// same run. Validates a small case against a materialised softmax first.
// Usage: attention_bench [threads=2] [B T C NH] [nolm]
// Each shape runs on f32 tiles and at bf16 (bf16 tiles where the CPU has
// AVX512-BF16), each against its precision's GEMM peak measured in the run.
//   (a given shape replaces the two defaults; "nolm" skips the LM-head matmul)
// GFLOP/s count the causal useful work only, with pairs = B*NH*T*(T+1)/2
// (query, key) pairs: forward 2 matmuls (QK^T, PV) = 4*pairs*hs FLOPs,
// backward 5 (QK^T recompute, dO V^T, dV, dK, dQ) = 10*pairs*hs = 2.5x forward.
// Skipped masked work and softmax/exp arithmetic are not counted.
#include "../bench_util.h"
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/ops.h"

namespace cpu = po::backend::cpu;

namespace {

template <typename F>
double best_time(F op) {
  return po::bench::best_time(op, 5, 200);
}

bool validate() {
  const int64_t T = 37, C = 64, NH = 1, hs = 64;
  std::vector<float> qkv(T * 3 * C), out(T * C), lse(T);
  for (size_t i = 0; i < qkv.size(); i++) qkv[i] = std::sin(0.37 * i);
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), 1, T, NH, NH, C / NH);
  for (int64_t i = 0; i < T; i++) {
    std::vector<double> p(i + 1);
    double mx = -1e300, sum = 0;
    for (int64_t j = 0; j <= i; j++) {
      double s = 0;
      for (int64_t d = 0; d < hs; d++) s += qkv[i * 3 * C + d] * qkv[j * 3 * C + C + d];
      p[j] = s / 8.0;
      mx = std::max(mx, p[j]);
    }
    for (int64_t j = 0; j <= i; j++) sum += (p[j] = std::exp(p[j] - mx));
    for (int64_t d = 0; d < hs; d++) {
      double o = 0;
      for (int64_t j = 0; j <= i; j++) o += p[j] / sum * qkv[j * 3 * C + 2 * C + d];
      if (std::fabs(o - out[i * C + d]) > 1e-4) {
        std::fprintf(stderr, "attention wrong at (%ld,%ld): %g vs %g\n", static_cast<long>(i),
                     static_cast<long>(d), out[i * C + d], o);
        return false;
      }
    }
  }
  return true;
}

void bench_shape(int threads, int64_t B, int64_t T, int64_t C, int64_t NH,
                 cpu::GemmPrecision precision, double peak) {
  cpu::set_gemm_precision(precision);
  const bool bf16 = precision == cpu::GemmPrecision::kBF16;
  const char* tiles = !bf16 ? "f32 tiles" : cpu::bf16_attention_tiles() ? "bf16 tiles" : "f32 tiles (no AVX512-BF16)";
  const int64_t hs = C / NH;
  std::vector<float> qkv(B * T * 3 * C), out(B * T * C), lse(B * NH * T), dout(B * T * C),
      dqkv(B * T * 3 * C);
  for (size_t i = 0; i < qkv.size(); i++) qkv[i] = std::sin(0.001 * i);
  for (size_t i = 0; i < dout.size(); i++) dout[i] = std::cos(0.003 * i);
  const double t_f =
      best_time([&] { cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, NH, hs); });
  const double t_b = best_time([&] {
    cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, NH,
                            NH, hs);
  });
  cpu::set_gemm_precision(cpu::GemmPrecision::kF32);
  const double pairs = static_cast<double>(B) * NH * T * (T + 1) / 2.0;
  const double f_fl = 2.0 * 2 * pairs * hs, b_fl = 5.0 * 2 * pairs * hs;
  const double all = (f_fl + b_fl) / (t_f + t_b) * 1e-9;
  std::printf("attention B=%ld T=%ld C=%ld NH=%ld threads=%d, %s (%s GEMM peak %.0f GFLOP/s)\n",
              static_cast<long>(B), static_cast<long>(T), static_cast<long>(C),
              static_cast<long>(NH), threads, tiles, bf16 ? "bf16" : "f32", peak);
  std::printf("  forward  %8.2f ms %7.1f GFLOP/s\n", t_f * 1e3, f_fl / t_f * 1e-9);
  std::printf("  backward %8.2f ms %7.1f GFLOP/s\n", t_b * 1e3, b_fl / t_b * 1e-9);
  std::printf("  fwd+bwd  %8.2f ms %7.1f GFLOP/s = %.0f%% of the peak\n", (t_f + t_b) * 1e3, all,
              100.0 * all / peak);
  std::printf(
      "{\"bench\":\"attention\",\"precision\":\"%s\",\"tiles\":\"%s\",\"B\":%ld,\"T\":%ld,"
      "\"C\":%ld,\"NH\":%ld,\"threads\":%d,\"fwd_ms\":%.3f,\"bwd_ms\":%.3f,\"fwd_gflops\":%.1f,"
      "\"bwd_gflops\":%.1f,\"peak_gflops\":%.1f}\n",
      bf16 ? "bf16" : "fp32", tiles, static_cast<long>(B), static_cast<long>(T),
      static_cast<long>(C), static_cast<long>(NH), threads, t_f * 1e3, t_b * 1e3,
      f_fl / t_f * 1e-9, b_fl / t_b * 1e-9, peak);
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const bool shape_given = argc > 5;
  const bool lm =
      !(argc > (shape_given ? 6 : 2) && std::string(argv[shape_given ? 6 : 2]) == "nolm");
  cpu::set_num_threads(threads);
  if (!validate()) return 1;
  // Each precision against its own GEMM peak, measured in this run.
  for (const cpu::GemmPrecision prec : {cpu::GemmPrecision::kF32, cpu::GemmPrecision::kBF16}) {
    const double peak = cpu::measure_gemm_peak_gflops(prec);
    if (shape_given) {
      bench_shape(threads, std::atol(argv[2]), std::atol(argv[3]), std::atol(argv[4]),
                  std::atol(argv[5]), prec, peak);
    } else {
      bench_shape(threads, 4, 256, 768, 12, prec, peak);
      bench_shape(threads, 8, 256, 384, 6, prec, peak);
      bench_shape(threads, 4, 1024, 768, 12, prec, peak);
    }
  }
  if (!lm) return 0;
  const int64_t BT = 4 * 256, C = 768, V = 50257;
  std::vector<float> inp(BT * C, 0.01f), w(V * C, 0.02f), logits(BT * V);
  const double t_lm = best_time(
      [&] { cpu::matmul_forward(logits.data(), inp.data(), w.data(), nullptr, BT, C, V); });
  std::printf("lm_head matmul_forward [%ldx%ld]x[%ldx%ld] %8.2f ms %7.1f GFLOP/s (%s)\n",
              static_cast<long>(BT), static_cast<long>(C), static_cast<long>(C),
              static_cast<long>(V), t_lm * 1e3, 2.0 * BT * C * V / t_lm * 1e-9, cpu::blas_name());
  std::printf("{\"bench\":\"lm_head\",\"threads\":%d,\"lm_head_fwd_ms\":%.3f}\n", threads,
              t_lm * 1e3);
  return 0;
}
