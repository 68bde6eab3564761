#include "comm/mpi/progress.h"

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "comm/mpi/check.h"
#include "comm/mpi/communicator.h"
#include "comm/mpi/ring.h"
#include "comm/mpi/topology.h"
#include "core/cpus.h"

namespace po::comm::mpi::progress {
namespace {

constexpr auto kInterval = std::chrono::microseconds(50);

std::mutex g_mutex;  // guards g_thread, g_stop, g_probe and the wake-up
std::condition_variable g_wake;
// Never destroyed: a run ending on an error exits without stop(), and a
// joinable std::thread destroyed at exit would call std::terminate.
std::thread* g_thread = nullptr;
bool g_stop = false;
bool g_started = false;
MPI_Comm g_probe = MPI_COMM_NULL;
std::atomic<int> g_in_flight{0};

void loop() {
  std::unique_lock lock(g_mutex);
  while (!g_stop) {
    if (g_in_flight.load(std::memory_order_acquire) == 0) {
      g_wake.wait(lock, [] { return g_stop || g_in_flight.load() > 0; });
      continue;
    }
    lock.unlock();
    ring::progress_all();
    int flag = 0;
    MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, g_probe, &flag, MPI_STATUS_IGNORE);
    std::this_thread::sleep_for(kInterval);
    lock.lock();
  }
}

}  // namespace

void start(MPI_Comm world) {
  std::lock_guard lock(g_mutex);
  if (g_started) return;
  g_started = true;  // decided once per process, whatever the outcome
  const char* env = std::getenv("PO_MPI_PROGRESS");
  if (env && std::strcmp(env, "0") == 0) return;
  const bool forced = env && std::strcmp(env, "1") == 0;
  if (thread_level() != ThreadLevel::kMultiple) return;
  // Without a spare CPU per rank the thread takes its time from compute:
  // measured on 2 cores, 2 ranks: steps 2-3% slower for no less exposed
  // communication (the polls at unit boundaries already finish the buckets);
  // 8 ranks on 2 cores: the collective tests 80 s instead of 56 s. So it runs
  // only where each rank has a CPU to spare. Every rank of the node decides
  // the same way.
  if (!forced && 2 * ranks_on_this_node(world) > core::usable_cpus()) return;
  PO_MPI_CHECK(MPI_Comm_dup(world, &g_probe));
  g_stop = false;
  g_thread = new std::thread(loop);
}

void stop() {
  {
    std::lock_guard lock(g_mutex);
    g_stop = true;
  }
  g_wake.notify_all();
  if (g_thread != nullptr && g_thread->joinable()) g_thread->join();
  std::lock_guard lock(g_mutex);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (g_probe != MPI_COMM_NULL && !finalized) MPI_Comm_free(&g_probe);
  g_probe = MPI_COMM_NULL;
}

void op_started() {
  if (g_in_flight.fetch_add(1, std::memory_order_acq_rel) == 0) {
    std::lock_guard lock(g_mutex);  // pairs with the wait's predicate check
    g_wake.notify_one();
  }
}

void op_finished() { g_in_flight.fetch_sub(1, std::memory_order_acq_rel); }

bool running() {
  std::lock_guard lock(g_mutex);
  return g_thread != nullptr && g_thread->joinable();
}

}  // namespace po::comm::mpi::progress
