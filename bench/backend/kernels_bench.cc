// The memory-bound kernels of a training step, f32 and bf16, against the
// memory bandwidth measured in the same run (a STREAM triad over arrays much
// larger than the last-level cache). Each kernel's GB/s counts the bytes it
// must move at least: its inputs read once and its outputs written once.
// Shapes: bench-small's (B·T = 2048 rows, C = 384, F = 1536, V = 50257; the
// loss over one head chunk of 256 rows); AdamW over 8M parameters.
//   kernels_bench [THREADS=2]
// Prints a table and one JSON line per kernel.
#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "../bench_util.h"

namespace ops = po::backend::cpu;

namespace {

std::vector<float> random_floats(size_t n, float scale) {
  std::vector<float> v(n);
  uint64_t s = 0x9E3779B97F4A7C15ull;
  for (float& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = scale * (static_cast<float>(s >> 40) / static_cast<float>(1 << 24) - 0.5f);
  }
  return v;
}

struct Row {
  std::string kernel;
  double bytes, seconds;
};

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  ops::set_num_threads(threads);
  const double bw = po::bench::triad_gbs();
  const int64_t BT = 2048, C = 384, F = 1536, V = 50257, chunk = 256;
  std::vector<Row> rows;
  auto time = [&](const std::string& name, double bytes, const std::function<void()>& op) {
    rows.push_back({name, bytes, po::bench::best_time(op, 3, 50)});
  };

  // Cross-entropy over one head chunk: logits read (several passes in cache
  // per row), the gradient written in place (f32) or as bf16.
  {
    const std::vector<float> src = random_floats(static_cast<size_t>(chunk * V), 8.0f);
    std::vector<float> logits(src.size()), losses(static_cast<size_t>(chunk));
    std::vector<uint16_t> grad16(src.size());
    std::vector<int32_t> targets(static_cast<size_t>(chunk));
    for (int64_t r = 0; r < chunk; ++r) targets[static_cast<size_t>(r)] = static_cast<int32_t>(r * 97 % V);
    const double n = static_cast<double>(chunk * V);
    time("crossentropy f32 (grad in place)", n * 8, [&] {
      logits = src;
      ops::crossentropy_forward(losses.data(), logits.data(), targets.data(), chunk, V, 1e-3f);
    });
    time("crossentropy, grad to bf16", n * 6, [&] {
      logits = src;
      ops::crossentropy_forward_bf16(losses.data(), logits.data(), grad16.data(), targets.data(),
                                     chunk, V, 1e-3f);
    });
    // The copy of src into logits is in both; measured alone so it can be taken out.
    time("(copy of the logits, subtracted)", n * 8, [&] { logits = src; });
  }
  // Norms and activations over [BT, C] and [BT, F].
  {
    const std::vector<float> x = random_floats(static_cast<size_t>(BT * F), 4.0f);
    std::vector<float> out(x.size()), mean(static_cast<size_t>(BT)), rstd(static_cast<size_t>(BT));
    const std::vector<float> w = random_floats(static_cast<size_t>(C), 1.0f);
    std::vector<uint16_t> out16(x.size());
    const double nc = static_cast<double>(BT * C), nf = static_cast<double>(BT * F);
    time("layernorm forward f32", nc * 8, [&] {
      ops::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), w.data(), BT, C);
    });
    time("rmsnorm forward f32", nc * 8, [&] {
      ops::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), BT, C, 1e-5);
    });
    time("gelu forward f32", nf * 8, [&] { ops::gelu_forward(out.data(), x.data(), BT * F); });
    time("gelu backward f32", nf * 12,
         [&] { ops::gelu_backward(out.data(), x.data(), x.data(), BT * F); });
    // The backwards from a saved bf16 input: read as it is, against widening
    // it into f32 first (the model's path before 2026-12-04).
    std::vector<uint16_t> x16(x.size());
    ops::f32_to_bf16(x16.data(), x.data(), BT * F);
    std::vector<float> xw(x.size()), dx(x.size()), dw(static_cast<size_t>(2 * C));
    time("gelu backward, bf16 input", nf * 10,
         [&] { ops::gelu_backward(out.data(), x16.data(), x.data(), BT * F); });
    time("gelu backward, widened first", nf * 18, [&] {
      ops::bf16_to_f32(xw.data(), x16.data(), BT * F);
      ops::gelu_backward(out.data(), xw.data(), x.data(), BT * F);
    });
    ops::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), w.data(), BT, C);
    time("layernorm backward f32", nc * 16, [&] {
      ops::layernorm_backward(dx.data(), dw.data(), dw.data() + C, x.data(), x.data(), w.data(),
                              mean.data(), rstd.data(), BT, C);
    });
    time("layernorm backward, bf16 input", nc * 14, [&] {
      ops::layernorm_backward(dx.data(), dw.data(), dw.data() + C, x.data(), x16.data(), w.data(),
                              mean.data(), rstd.data(), BT, C);
    });
    time("layernorm backward, widened first", nc * 22, [&] {
      ops::bf16_to_f32(xw.data(), x16.data(), BT * C);
      ops::layernorm_backward(dx.data(), dw.data(), dw.data() + C, x.data(), xw.data(), w.data(),
                              mean.data(), rstd.data(), BT, C);
    });
    time("f32 -> bf16", nf * 6, [&] { ops::f32_to_bf16(out16.data(), x.data(), BT * F); });
    time("bf16 -> f32", nf * 6, [&] { ops::bf16_to_f32(out.data(), out16.data(), BT * F); });
  }

  // AdamW over 8M parameters: f32 (param, grad, m, v read; param, m, v
  // written) and mixed (bf16 grad; f32 master, m, v; bf16 parameters written).
  {
    const int64_t n = 8 << 20;
    std::vector<float> p = random_floats(static_cast<size_t>(n), 0.1f), g = p, m(p.size(), 0.0f),
                       v(p.size(), 0.0f);
    std::vector<uint16_t> g16(p.size()), p16(p.size());
    ops::f32_to_bf16(g16.data(), g.data(), n);
    const double dn = static_cast<double>(n);
    int64_t t = 0;
    time("adamw f32", dn * 28, [&] {
      ops::adamw_update(p.data(), g.data(), m.data(), v.data(), n, 1e-3f, 0.9f, 0.95f, 1e-8f,
                        0.1f, 1.0f, ++t);
    });
    t = 0;
    time("adamw mixed (bf16 grad and params)", dn * 28, [&] {
      ops::adamw_update_mixed(p.data(), g16.data(), m.data(), v.data(), p16.data(), n, 1e-3f,
                              0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, ++t);
    });
  }

  std::printf("kernels_bench: %d threads, memory bandwidth (triad) %.1f GB/s\n", threads, bw);
  std::printf("%-36s %10s %9s %12s\n", "kernel", "ms", "GB/s", "of triad");
  double copy_s = 0;
  for (const Row& r : rows)
    if (r.kernel.rfind("(copy", 0) == 0) copy_s = r.seconds;
  for (const Row& r : rows) {
    // The cross-entropy rows include a copy of the logits into place.
    const bool ce = r.kernel.rfind("crossentropy", 0) == 0;
    const double s = ce ? r.seconds - copy_s : r.seconds;
    const double gbs = r.bytes / s / 1e9;
    std::printf("%-36s %10.3f %9.1f %11.0f%%\n", r.kernel.c_str(), s * 1e3, gbs, 100.0 * gbs / bw);
    std::printf("{\"bench\":\"kernels\",\"kernel\":\"%s\",\"ms\":%.4f,\"gbs\":%.2f,\"triad_gbs\":%.2f}\n",
                r.kernel.c_str(), s * 1e3, gbs, bw);
  }
  return 0;
}
