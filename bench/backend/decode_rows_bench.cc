// Serving's few-row linear layers: the GEMM (matmul_forward, the BLAS the
// build links) against generation's path (matmul_forward_decode: AVX-512
// dot-product tiles up to kDecodeRowsTiled rows) at the row counts a serving
// step has, on gpt2-124M's shapes with the weights hot in cache; then a
// step over all of gpt2-124M's block weights (12 blocks, 340 MB, cold) by
// both, at 1-64 rows: what a decode step pays, and (one row) the weights'
// streaming rate against the memory's read bandwidth, the decode bound.
// One JSON line per measurement.
// Usage: decode_rows_bench [threads=2]
#include "../bench_util.h"

#include <omp.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "backend/ops.h"

namespace cpu = po::backend::cpu;

namespace {

struct Shape {
  const char* name;
  int64_t in, out;
};

std::vector<float> filled(int64_t n, double step) {
  std::vector<float> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); i++) v[i] = static_cast<float>(0.05 * std::sin(step * i));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  omp_set_num_threads(threads);
  const Shape shapes[] = {{"c_attn", 768, 2304},
                          {"attn_proj", 768, 768},
                          {"c_fc", 768, 3072},
                          {"mlp_proj", 3072, 768},
                          {"lm_head", 768, 50257}};
  for (const Shape& s : shapes) {
    const auto w = filled(s.in * s.out, 0.013);
    for (int64_t rows : {1, 2, 4, 8, 12, 16, 32, 64, 128}) {
      const auto x = filled(rows * s.in, 0.1);
      std::vector<float> out(static_cast<size_t>(rows * s.out));
      const double flops = 2.0 * static_cast<double>(rows * s.in * s.out);
      const double gemm = po::bench::best_time(
          [&] { cpu::matmul_forward(out.data(), x.data(), w.data(), nullptr, rows, s.in, s.out); },
          3, 50);
      const double decode = po::bench::best_time(
          [&] {
            cpu::matmul_forward_decode(out.data(), x.data(), w.data(), nullptr, rows, s.in, s.out);
          },
          3, 50);
      std::printf("{\"bench\":\"decode_rows\",\"shape\":\"%s\",\"in\":%ld,\"out\":%ld,\"rows\":%ld,"
                  "\"gemm_gflops\":%.1f,\"decode_gflops\":%.1f,\"threads\":%d}\n",
                  s.name, static_cast<long>(s.in), static_cast<long>(s.out),
                  static_cast<long>(rows), flops / gemm / 1e9, flops / decode / 1e9, threads);
    }
  }
  // A step over every block weight of gpt2-124M once, far past the last-level cache.
  std::vector<Shape> step;
  for (int l = 0; l < 12; ++l)
    for (int k = 0; k < 4; ++k) step.push_back(shapes[k]);
  std::vector<std::vector<float>> weights;
  double bytes = 0;
  for (const Shape& s : step) {
    weights.push_back(filled(s.in * s.out, 0.007));
    bytes += 4.0 * static_cast<double>(s.in * s.out);
  }
  const auto x = filled(64 * 3072, 0.1);
  std::vector<float> out(static_cast<size_t>(64 * 3072));
  for (int64_t rows : {1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64}) {
    auto time = [&](bool decode) {
      return po::bench::best_time(
          [&] {
            for (size_t i = 0; i < step.size(); ++i) {
              if (decode)
                cpu::matmul_forward_decode(out.data(), x.data(), weights[i].data(), nullptr, rows,
                                           step[i].in, step[i].out);
              else
                cpu::matmul_forward(out.data(), x.data(), weights[i].data(), nullptr, rows,
                                    step[i].in, step[i].out);
            }
          },
          3, 10);
    };
    const double gemm = time(false), decode = time(true);
    std::printf("{\"bench\":\"decode_blocks_step\",\"rows\":%ld,\"gemm_ms\":%.2f,"
                "\"decode_ms\":%.2f,\"decode_weight_gbs\":%.1f,\"weight_mb\":%.0f,"
                "\"threads\":%d}\n",
                static_cast<long>(rows), gemm * 1e3, decode * 1e3, bytes / decode / 1e9,
                bytes / 1e6, threads);
  }
  return 0;
}
