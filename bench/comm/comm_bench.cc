// The engine's collectives, measured the way bench/comm/ompi_coll.c measures
// OpenMPI's own: allreduce, reduce_scatter and all_gather on f32, sum, through
// po::comm::mpi::MpiCommunicator's blocking calls (the i* call + Work::wait,
// exactly what training uses) on buffers from the engine's allocator
// (tensor::Storage, as training's gradients). Run it under mpirun the way
// `pagedoptim train --nproc N` launches workers, with no environment tuning.
//
// Sizes are the TOTAL buffer in MiB, as in nccl-tests: the allreduce buffer,
// the reduce-scatter send buffer (size() blocks), the all-gather receive
// buffer (size() blocks). Each (op, size): validate once on small-integer
// inputs (exact in f32), then W warm-up iterations (default 2), then timed
// iterations until --min-time seconds (default 1) and at least 5 iterations
// (or exactly K with --iters). One iteration = barrier, then the call; its
// time is the maximum over ranks. We report the median of the timed
// iterations and the best, and busbw from the median: algbw = bytes / time;
// allreduce busbw = algbw * 2(n-1)/n; reduce-scatter and all-gather busbw =
// algbw * (n-1)/n. A second of samples, rather than a fixed count, because
// this machine's memory bandwidth switches between two levels every few seconds.
//
//   mpirun -np N comm_bench [--sizes 1,16,128] [--ops allreduce,reduce_scatter,all_gather]
//                           [--warmup W] [--min-time S] [--iters K]
//
// Rank 0 prints one JSON line per (op, size); keys as in ompi_coll.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "../bench_util.h"
#include "comm/mpi/communicator.h"
#include "tensor/tensor.h"

namespace {

using po::comm::ReduceOp;
using po::tensor::DType;
using po::tensor::Storage;

enum class Op { kAllreduce, kReduceScatter, kAllGather };
constexpr Op kOps[] = {Op::kAllreduce, Op::kReduceScatter, Op::kAllGather};

const char* op_name(Op o) {
  return o == Op::kAllreduce ? "allreduce" : o == Op::kReduceScatter ? "reduce_scatter" : "all_gather";
}

// busbw / algbw (nccl-tests): 2(n-1)/n for allreduce, (n-1)/n otherwise.
double bus_factor(Op o, int n) {
  return (o == Op::kAllreduce ? 2.0 : 1.0) * (n - 1) / n;
}

constexpr int kMinIters = 5, kMaxIters = 2000;

// Small integers, distinct per rank and position, exact in f32 sums.
float input_value(int rank, size_t i) { return static_cast<float>(rank + 1 + static_cast<int>(i % 7)); }

// One blocking collective of op `o` on `count` floats (the total buffer).
void run_op(po::comm::Communicator& c, Op o, const Storage& send, const Storage& recv,
            size_t count) {
  const size_t block = count / static_cast<size_t>(c.size());
  switch (o) {
    case Op::kAllreduce: c.allreduce(recv.data(), count, DType::kF32, ReduceOp::kSum); break;
    case Op::kReduceScatter:
      c.reduce_scatter(send.data(), recv.data(), block, DType::kF32, ReduceOp::kSum);
      break;
    case Op::kAllGather: c.all_gather(send.data(), recv.data(), block, DType::kF32); break;
  }
}

// Fills the inputs of `o`, runs it once and checks every output element;
// returns false (after printing the first difference) if any differs.
bool validate(po::comm::Communicator& c, Op o, const Storage& send, const Storage& recv,
              size_t count) {
  const int rank = c.rank(), n = c.size();
  const size_t block = count / static_cast<size_t>(n);
  float* in = o == Op::kAllreduce ? recv.f32() : send.f32();
  const float* out = recv.f32();
  for (size_t i = 0; i < (o == Op::kAllGather ? block : count); i++) in[i] = input_value(rank, i);
  run_op(c, o, send, recv, count);
  bool ok = true;
  for (size_t i = 0; i < (o == Op::kReduceScatter ? block : count) && ok; i++) {
    float want = 0.0f;
    if (o == Op::kAllGather) {
      want = input_value(static_cast<int>(i / block), i % block);
    } else {
      const size_t j = o == Op::kAllreduce ? i : static_cast<size_t>(rank) * block + i;
      for (int r = 0; r < n; r++) want += input_value(r, j);
    }
    if (out[i] != want) {
      std::fprintf(stderr, "comm_bench: rank %d: %s element %zu is %g, expected %g\n", rank,
                   op_name(o), i, out[i], want);
      ok = false;
    }
  }
  // Zeros from here on: repeated in-place sums must not grow to inf.
  std::memset(send.data(), 0, send.size());
  std::memset(recv.data(), 0, recv.size());
  return ok;
}

int usage() {
  std::fprintf(stderr, "usage: comm_bench [--sizes 1,16,128] [--ops allreduce,...] [--warmup W] [--min-time S] [--iters K]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<double> sizes_mib = {1, 16, 128};
  int warmup = 2, iters_override = 0;
  double min_time = 1.0;
  std::string ops_filter = "allreduce,reduce_scatter,all_gather";
  for (int a = 1; a < argc; a++) {
    const std::string arg = argv[a];
    if (a + 1 >= argc) return usage();
    if (arg == "--sizes") {
      sizes_mib.clear();
      std::stringstream ss(argv[++a]);
      for (std::string tok; std::getline(ss, tok, ',');) sizes_mib.push_back(std::atof(tok.c_str()));
    } else if (arg == "--ops") {
      ops_filter = argv[++a];
    } else if (arg == "--warmup") {
      warmup = std::atoi(argv[++a]);
    } else if (arg == "--min-time") {
      min_time = std::atof(argv[++a]);
    } else if (arg == "--iters") {
      iters_override = std::atoi(argv[++a]);
    } else {
      return usage();
    }
  }

  po::comm::mpi::Session session;
  auto world = po::comm::mpi::MpiCommunicator::create_world();
  po::comm::Communicator& c = *world;
  const int n = c.size();
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  for (double mib : sizes_mib) {
    // Round down to whole blocks of n floats.
    const size_t count = static_cast<size_t>(mib * 1048576.0) / sizeof(float) / n * n;
    if (count == 0) {
      std::fprintf(stderr, "comm_bench: %g MiB is too small for %d ranks\n", mib, n);
      return 2;
    }
    const size_t bytes = count * sizeof(float);
    const Storage send(bytes), recv(bytes);
    for (Op o : kOps) {
      if (ops_filter.find(op_name(o)) == std::string::npos) continue;
      float bad = validate(c, o, send, recv, count) ? 0.0f : 1.0f;
      c.allreduce(&bad, 1, DType::kF32, ReduceOp::kMax);
      if (bad != 0.0f) {
        if (c.rank() == 0) std::fprintf(stderr, "comm_bench: %s validation failed\n", op_name(o));
        return 1;
      }
      std::vector<double> times;
      double spent = 0.0;  // the same on every rank: a sum of maxima
      for (int it = 0;; it++) {
        const int done = static_cast<int>(times.size());
        if (done == kMaxIters || (iters_override > 0 ? done >= iters_override
                                                     : done >= kMinIters && spent >= min_time)) {
          break;
        }
        c.barrier();
        const double t0 = po::bench::now_seconds();
        run_op(c, o, send, recv, count);
        // Milliseconds in f32 (the engine reduces floats): ample precision.
        float dt_ms = static_cast<float>((po::bench::now_seconds() - t0) * 1e3);
        c.allreduce(&dt_ms, 1, DType::kF32, ReduceOp::kMax);
        if (it >= warmup) {
          times.push_back(dt_ms / 1e3);
          spent += dt_ms / 1e3;
        }
      }
      const int iters = static_cast<int>(times.size());
      std::sort(times.begin(), times.end());
      const double median =
          iters % 2 ? times[iters / 2] : 0.5 * (times[iters / 2 - 1] + times[iters / 2]);
      const double algbw = static_cast<double>(bytes) / median / 1e9;
      if (c.rank() == 0) {
        std::printf(
            "{\"bench\": \"comm_busbw\", \"impl\": \"engine\", \"glibc_tunables\": \"%s\", "
            "\"op\": \"%s\", \"bytes\": %zu, \"ranks\": %d, \"warmup\": %d, \"iters\": %d, "
            "\"median_ms\": %.3f, \"best_ms\": %.3f, \"algbw_gbs\": %.3f, \"busbw_gbs\": %.3f}\n",
            tunables ? tunables : "", op_name(o), bytes, n, warmup, iters, median * 1e3,
            times[0] * 1e3, algbw, algbw * bus_factor(o, n));
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
