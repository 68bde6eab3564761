// Signals while oneDNN's GEMMs run (core/signal_stack.h). oneDNN before 3.11
// (Debian 12 ships 2.6.3) points the stack pointer at a heap workspace inside
// its f32 GEMM kernels (uxlfoundation/oneDNN#4845): a signal handled on that
// thread has its frame written over the heap, and a later free() aborts.
// That is how a SIGTERM mid-step once ended a training run with "corrupted
// size vs. prev_size" instead of a checkpoint. With our handlers' flags
// (SA_ONSTACK) and the GEMMs' signal stacks, a storm of signals (one every
// 37 µs, tens of thousands) over 400 GEMMs leaves the operands, the products
// and the heap whole, on one thread and on an OpenMP team of two (where the
// signal may land on the worker). Without them this aborts within the
// first GEMMs of this size (measured 2026-12-07: every one of 8 runs, Intel
// Xeon with AMX; a worker thread without its stack too).
#include <gtest/gtest.h>
#include <sys/time.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "backend/ops.h"
#include "core/signal_stack.h"

namespace cpu = po::backend::cpu;

namespace {

std::atomic<long> g_signals{0};
extern "C" void count_signal(int) { g_signals.fetch_add(1, std::memory_order_relaxed); }

// Runs in a child (EXPECT_EXIT): exits 0 when every product was right and
// the signals came, else says what differed and exits 1.
void gemms_under_a_signal_storm(int threads) {
  cpu::set_num_threads(threads);
  struct sigaction sa {};
  sa.sa_handler = count_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = po::core::kHandlerFlags;
  sigaction(SIGALRM, &sa, nullptr);
  itimerval every{};
  every.it_interval.tv_usec = 37;
  every.it_value.tv_usec = 37;
  setitimer(ITIMER_REAL, &every, nullptr);
  constexpr int64_t M = 256, N = 256, K = 512;
  for (int i = 0; i < 400; ++i) {
    // Fresh operands each time: their chunks sit beside oneDNN's workspace.
    std::vector<float> a(M * K, 1.0f), b(K * N, 0.5f), c(M * N, -1.0f);
    cpu::gemm(false, false, M, N, K, 1.0f, cpu::Operand(a.data()), K, cpu::Operand(b.data()), N, 0.0f,
              c.data(), N);
    for (size_t j = 0; j < c.size(); ++j)  // (A and B hold at least as many)
      if (c[j] != 0.5f * K || a[j] != 1.0f || b[j] != 0.5f) {
        std::fprintf(stderr, "GEMM %d: element %zu: C %g (want %g), A %g, B %g\n", i, j, c[j], 0.5 * K, a[j], b[j]);
        std::exit(1);
      }
  }
  itimerval off{};
  setitimer(ITIMER_REAL, &off, nullptr);
  if (g_signals.load() < 100) {
    std::fprintf(stderr, "only %ld signals arrived: the storm did not happen\n", g_signals.load());
    std::exit(1);
  }
  std::exit(0);
}

TEST(SignalFrames, AStormOfSignalsDuringGemmsLeavesTheHeapWhole) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  for (int threads : {1, 2})
    EXPECT_EXIT(gemms_under_a_signal_storm(threads), ::testing::ExitedWithCode(0), "")
        << "on " << threads << " thread(s): a signal frame written over the heap (core/signal_stack.h)";
}

}  // namespace
