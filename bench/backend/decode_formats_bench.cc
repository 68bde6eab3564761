// A decode step's linear layers over weights in each storage format: every
// block weight of gpt2-124M (12 blocks, 85M parameters, far past the
// last-level cache) once, at 1 and 8 input rows, as f32
// (matmul_forward_decode, the engine's path today) and as F16, BF16, Q8_0
// Q4_0, Q4_K and Q6_K (matmul_forward_decode_blocks: dequantization in
// registers; the K-quants from synthetic bytes, as the engine does not write them). At
// one row a step is bound by reading the stored bytes: each format's rate is
// printed beside the memory's read bandwidth (a STREAM triad) and the
// fraction of it reached. One JSON line per measurement.
// Usage: decode_formats_bench [threads=2]
#include "../bench_util.h"

#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/block_formats.h"
#include "backend/ops.h"

namespace cpu = po::backend::cpu;
using po::backend::GgmlType;

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  cpu::set_num_threads(threads);
  struct Shape {
    int64_t in, out;
  };
  const Shape block[] = {{768, 2304}, {768, 768}, {768, 3072}, {3072, 768}};
  std::vector<Shape> step;
  for (int l = 0; l < 12; ++l)
    for (const Shape& s : block) step.push_back(s);
  std::vector<std::vector<float>> f32;
  for (const Shape& s : step) {
    std::vector<float> w(static_cast<size_t>(s.in * s.out));
    for (size_t i = 0; i < w.size(); ++i) w[i] = 0.02f * static_cast<float>((i * 2654435761u) % 1000) / 1000.0f - 0.01f;
    f32.push_back(std::move(w));
  }
  const std::vector<float> x(8 * 3072, 0.1f);
  std::vector<float> out(8 * 3072);
  const double triad = po::bench::triad_gbs();
  std::printf("{\"bench\":\"decode_formats\",\"triad_gbs\":%.1f,\"threads\":%d}\n", triad, threads);
  for (const char* name : {"f32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K"}) {
    const bool plain = std::string(name) == "f32";
    const GgmlType t = plain ? GgmlType::kF32 : *po::backend::ggml_type_from_name(name);
    std::vector<std::vector<uint8_t>> stored;
    double bytes = 0;
    for (size_t i = 0; i < step.size(); ++i) {
      const int64_t n = step[i].in * step[i].out;
      stored.emplace_back(static_cast<size_t>(po::backend::ggml_row_bytes(t, step[i].in) * step[i].out));
      if (t == GgmlType::kQ4_K || t == GgmlType::kQ6_K) {  // read-only types: bytes with small finite scales
        auto& w = stored.back();
        for (size_t k = 0; k < w.size(); ++k) w[k] = static_cast<uint8_t>((k * 2654435761u) >> 13);
        const size_t bb = static_cast<size_t>(po::backend::ggml_block_bytes(t));
        for (size_t at = 0; at < w.size(); at += bb) {
          const size_t dpos = t == GgmlType::kQ4_K ? at : at + bb - 2;
          w[dpos] = 0x00;
          w[dpos + 1] = 0x20;
          if (t == GgmlType::kQ4_K) w[at + 2] = 0x00, w[at + 3] = 0x20;
        }
      } else if (!plain) {
        po::backend::ggml_quantize(t, f32[i].data(), stored.back().data(), n);
      }
      bytes += static_cast<double>(plain ? n * 4 : static_cast<int64_t>(stored.back().size()));
    }
    if (plain) stored.clear();
    for (int64_t rows : {1, 8}) {
      const double s = po::bench::best_time(
          [&] {
            for (size_t i = 0; i < step.size(); ++i) {
              if (plain)
                cpu::matmul_forward_decode(out.data(), x.data(), f32[i].data(), nullptr, rows, step[i].in, step[i].out);
              else
                cpu::matmul_forward_decode_blocks(out.data(), x.data(), stored[i].data(), t, nullptr, rows,
                                                  step[i].in, step[i].out);
            }
          },
          3, 10);
      std::printf("{\"bench\":\"decode_formats\",\"format\":\"%s\",\"rows\":%ld,\"weight_mb\":%.1f,\"step_ms\":%.2f,"
                  "\"weight_gbs\":%.1f,\"of_triad\":%.2f,\"bound_ms\":%.2f}\n",
                  name, static_cast<long>(rows), bytes / 1e6, s * 1e3, bytes / s / 1e9, bytes / s / 1e9 / triad,
                  bytes / triad / 1e6);
    }
  }
  return 0;
}
