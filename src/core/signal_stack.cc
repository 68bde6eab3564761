#include "core/signal_stack.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "core/error.h"

namespace po::core {
namespace {

// The thread's alternate stack: set on construction, taken back (then
// freed) when the thread ends.
struct SignalStack {
  stack_t ss{};
  SignalStack() {
    // Room for a frame with the AMX state (about 11 KiB) and the handler.
    const long min = sysconf(_SC_MINSIGSTKSZ);
    ss.ss_size = std::max<size_t>(size_t{64} << 10, min > 0 ? 4 * static_cast<size_t>(min) : 0);
    ss.ss_sp = std::malloc(ss.ss_size);
    PO_CHECK(ss.ss_sp != nullptr, "cannot allocate a signal stack of ", ss.ss_size, " bytes");
    PO_CHECK(sigaltstack(&ss, nullptr) == 0, "sigaltstack failed");
  }
  ~SignalStack() {
    stack_t off{};
    off.ss_flags = SS_DISABLE;
    sigaltstack(&off, nullptr);
    std::free(ss.ss_sp);
  }
};

}  // namespace

void give_thread_signal_stack() { thread_local SignalStack stack; }

}  // namespace po::core
