// Signal handlers on stacks of their own.
//
// oneDNN's generated f32 GEMM kernels before 3.11 (Debian 12 ships 2.6.3)
// point the stack pointer at their workspace on the heap while they run
// (uxlfoundation/oneDNN#4845, fixed upstream by #4855). A signal handled on
// such a thread has its frame (registers and the AVX-512 / AMX state,
// kilobytes) written there, over the heap, and a later free() aborts:
// "corrupted size vs. prev_size" after a SIGTERM mid-step. So every handler
// here is installed with SA_ONSTACK (kHandlerFlags), and every thread that
// runs oneDNN has an alternate signal stack (backend/ops.h's GEMMs give one
// to the calling thread and its OpenMP team): the kernel then writes the
// frame there, whatever the stack pointer holds.
#pragma once

#include <signal.h>

namespace po::core {

// For sigaction: restart interrupted system calls, and run on the thread's
// alternate signal stack.
inline constexpr int kHandlerFlags = SA_RESTART | SA_ONSTACK;

// Gives the calling thread an alternate signal stack (once: later calls
// return at once), freed when the thread ends.
void give_thread_signal_stack();

}  // namespace po::core
