/* OpenMPI's own blocking collectives, the peer that bench/comm/comm_bench.cc
 * (the engine) is measured against: MPI_Allreduce, MPI_Reduce_scatter_block
 * and MPI_Allgather on f32, sum. Plain C and MPI only, so it shows what
 * OpenMPI does by itself in whatever environment it is started with (run it
 * with and without GLIBC_TUNABLES=glibc.malloc.hugetlb=1; bench/comm_busbw.sh
 * does both).
 *
 * Sizes are the TOTAL buffer in MiB, as in nccl-tests: the allreduce buffer,
 * the reduce-scatter send buffer (size() blocks), the all-gather receive
 * buffer (size() blocks). Each (op, size): validate once on small-integer
 * inputs (exact in f32), then W warm-up iterations (default 2), then timed
 * iterations until --min-time seconds (default 1) and at least 5 iterations
 * (or exactly K with --iters). One iteration = barrier, then the call; its
 * time is the maximum over ranks. We report the median of the timed iterations
 * and the best, and busbw from the median: algbw = bytes / time; allreduce
 * busbw = algbw * 2(n-1)/n; reduce-scatter and all-gather busbw = algbw * (n-1)/n.
 * A second of samples, rather than a fixed count, because this machine's
 * memory bandwidth switches between two levels every few seconds.
 *
 *   mpirun -np N ompi_coll [--sizes 1,16,128] [--ops allreduce,reduce_scatter,all_gather]
 *                          [--warmup W] [--min-time S] [--iters K]
 *
 * Rank 0 prints one JSON line per (op, size); keys as in comm_bench. */
#include <mpi.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { kMaxSizes = 16, kMinIters = 5, kMaxIters = 2000 };

static int cmp_double(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

static void die(const char* msg) {
  fprintf(stderr, "ompi_coll: %s\n", msg);
  MPI_Abort(MPI_COMM_WORLD, 1);
}

/* Small integers, distinct per rank and position, exact in f32 sums. */
static float input_value(int rank, size_t i) { return (float)(rank + 1 + (int)(i % 7)); }

typedef struct {
  const char* name;
  double bus_factor; /* busbw / algbw, times n: 2(n-1) or (n-1) */
} OpInfo;

/* One collective call of op `o` on `count_total` floats (the total buffer). */
static void run_op(int o, float* send, float* recv, size_t count_total, int n) {
  const int block = (int)(count_total / (size_t)n);
  int rc = MPI_SUCCESS;
  if (o == 0) {
    rc = MPI_Allreduce(MPI_IN_PLACE, recv, (int)count_total, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  } else if (o == 1) {
    rc = MPI_Reduce_scatter_block(send, recv, block, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  } else {
    rc = MPI_Allgather(send, block, MPI_FLOAT, recv, block, MPI_FLOAT, MPI_COMM_WORLD);
  }
  if (rc != MPI_SUCCESS) die("collective failed");
}

/* Fills the inputs of op `o` and checks one call's result; returns 0 if exact. */
static int validate(int o, float* send, float* recv, size_t count_total, int rank, int n) {
  const size_t block = count_total / (size_t)n;
  size_t bad = 0;
  if (o == 0) {
    for (size_t i = 0; i < count_total; i++) recv[i] = input_value(rank, i);
  } else if (o == 1) {
    for (size_t i = 0; i < count_total; i++) send[i] = input_value(rank, i);
  } else {
    for (size_t i = 0; i < block; i++) send[i] = input_value(rank, i);
  }
  run_op(o, send, recv, count_total, n);
  const size_t out = o == 1 ? block : count_total;
  for (size_t i = 0; i < out && !bad; i++) {
    float want = 0.0f;
    if (o == 0) {
      for (int r = 0; r < n; r++) want += input_value(r, i);
    } else if (o == 1) {
      for (int r = 0; r < n; r++) want += input_value(r, (size_t)rank * block + i);
    } else {
      want = input_value((int)(i / block), i % block);
    }
    if (recv[i] != want) {
      fprintf(stderr, "ompi_coll: rank %d: %s element %zu is %g, expected %g\n", rank,
              o == 0 ? "allreduce" : o == 1 ? "reduce_scatter" : "all_gather", i, recv[i], want);
      bad = 1;
    }
  }
  /* Zeros from here on: repeated in-place sums must not grow to inf. */
  memset(send, 0, count_total * sizeof(float));
  memset(recv, 0, count_total * sizeof(float));
  return (int)bad;
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);

  double sizes_mib[kMaxSizes] = {1, 16, 128};
  int num_sizes = 3, warmup = 2, iters_override = 0;
  double min_time = 1.0;
  const char* ops_filter = NULL; /* NULL: all three */
  for (int a = 1; a < argc; a++) {
    if (!strcmp(argv[a], "--sizes") && a + 1 < argc) {
      num_sizes = 0;
      for (char* tok = strtok(argv[++a], ","); tok && num_sizes < kMaxSizes; tok = strtok(NULL, ","))
        sizes_mib[num_sizes++] = atof(tok);
    } else if (!strcmp(argv[a], "--ops") && a + 1 < argc) {
      ops_filter = argv[++a];
    } else if (!strcmp(argv[a], "--warmup") && a + 1 < argc) {
      warmup = atoi(argv[++a]);
    } else if (!strcmp(argv[a], "--min-time") && a + 1 < argc) {
      min_time = atof(argv[++a]);
    } else if (!strcmp(argv[a], "--iters") && a + 1 < argc) {
      iters_override = atoi(argv[++a]);
    } else {
      if (rank == 0) fprintf(stderr, "usage: ompi_coll [--sizes 1,16,128] [--ops allreduce,...] [--warmup W] [--min-time S] [--iters K]\n");
      MPI_Finalize();
      return 2;
    }
  }

  const OpInfo ops[3] = {{"allreduce", 2.0 * (n - 1)}, {"reduce_scatter", n - 1.0},
                         {"all_gather", n - 1.0}};
  const char* tunables = getenv("GLIBC_TUNABLES");
  for (int s = 0; s < num_sizes; s++) {
    /* Round down to whole blocks of n floats. */
    size_t count = (size_t)(sizes_mib[s] * 1048576.0) / sizeof(float) / (size_t)n * (size_t)n;
    if (count == 0) die("size too small for this many ranks");
    const size_t bytes = count * sizeof(float);
    float* send = malloc(bytes);
    float* recv = malloc(bytes);
    if (!send || !recv) die("out of memory");
    for (int o = 0; o < 3; o++) {
      if (ops_filter && !strstr(ops_filter, ops[o].name)) continue;
      int bad = validate(o, send, recv, count, rank, n), any_bad = 0;
      MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
      if (any_bad) die("validation failed");
      static double times[kMaxIters];
      int iters = 0;
      double spent = 0.0; /* the same on every rank: a sum of maxima */
      for (int it = 0;; it++) {
        if (iters_override > 0 ? iters >= iters_override || iters == kMaxIters
                               : (iters >= kMinIters && spent >= min_time) || iters == kMaxIters)
          break;
        MPI_Barrier(MPI_COMM_WORLD);
        const double t0 = MPI_Wtime();
        run_op(o, send, recv, count, n);
        double dt = MPI_Wtime() - t0, dt_max = 0.0;
        MPI_Allreduce(&dt, &dt_max, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (it >= warmup) {
          times[iters++] = dt_max;
          spent += dt_max;
        }
      }
      qsort(times, (size_t)iters, sizeof(double), cmp_double);
      const double median = iters % 2 ? times[iters / 2] : 0.5 * (times[iters / 2 - 1] + times[iters / 2]);
      const double algbw = (double)bytes / median / 1e9;
      if (rank == 0) {
        printf("{\"bench\": \"comm_busbw\", \"impl\": \"openmpi\", \"glibc_tunables\": \"%s\", "
               "\"op\": \"%s\", \"bytes\": %zu, \"ranks\": %d, \"warmup\": %d, \"iters\": %d, "
               "\"median_ms\": %.3f, \"best_ms\": %.3f, \"algbw_gbs\": %.3f, \"busbw_gbs\": %.3f}\n",
               tunables ? tunables : "", ops[o].name, bytes, n, warmup, iters, median * 1e3,
               times[0] * 1e3, algbw, algbw * ops[o].bus_factor / n);
        fflush(stdout);
      }
    }
    free(send);
    free(recv);
  }
  MPI_Finalize();
  return 0;
}
