#include "train/stop.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <iterator>

#include "comm/communicator.h"
#include "core/error.h"
#include "core/signal_stack.h"

namespace po::train {
namespace {

std::atomic<int> g_requested{0};
unsigned g_timeout_s = 0;
struct sigaction g_previous[3];

constexpr struct {
  const char* name;
  int number;
} kStopSignals[] = {{"TERM", SIGTERM}, {"INT", SIGINT},   {"HUP", SIGHUP},
                    {"USR1", SIGUSR1}, {"USR2", SIGUSR2}, {"XCPU", SIGXCPU}};

// First request: remember it and arm the timeout (alarm() is
// async-signal-safe; SIGALRM's default action ends the process). Second: the
// signal's default action, now.
extern "C" void on_stop_request(int sig) {
  int none = 0;
  if (g_requested.compare_exchange_strong(none, sig)) {
    if (g_timeout_s > 0) alarm(g_timeout_s);
    static const char msg[] =
        "pagedoptim: stop requested: finishing this step and writing a checkpoint (a second signal "
        "aborts)\n";
    ssize_t ignored = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)ignored;
    return;
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

// hold_early_signals(): the signals held, their dispositions before, and the
// first that arrived.
constexpr int kHeld[] = {SIGHUP, SIGUSR1, SIGUSR2, SIGXCPU};
struct sigaction g_before_hold[std::size(kHeld)];
bool g_holding[std::size(kHeld)] = {};
std::atomic<int> g_early{0};

extern "C" void on_early_signal(int sig) {
  int none = 0;
  g_early.compare_exchange_strong(none, sig);
}

bool is_early_handler(const struct sigaction& a) {
  return (a.sa_flags & SA_SIGINFO) == 0 && a.sa_handler == on_early_signal;
}

// The disposition hold_early_signals() replaced for `sig` (null: not held).
const struct sigaction* before_hold(int sig) {
  for (size_t i = 0; i < std::size(kHeld); ++i)
    if (kHeld[i] == sig && g_holding[i]) return &g_before_hold[i];
  return nullptr;
}

}  // namespace

void hold_early_signals() {
  struct sigaction sa {};
  sa.sa_handler = on_early_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = core::kHandlerFlags;  // (core/signal_stack.h)
  for (size_t i = 0; i < std::size(kHeld); ++i) {
    struct sigaction now {};
    if (sigaction(kHeld[i], nullptr, &now) != 0 || now.sa_handler == SIG_IGN) continue;
    if (is_early_handler(now)) continue;  // held already
    g_before_hold[i] = now;
    g_holding[i] = sigaction(kHeld[i], &sa, nullptr) == 0;
  }
}

int release_early_signals() {
  for (size_t i = 0; i < std::size(kHeld); ++i) {
    if (!g_holding[i]) continue;
    struct sigaction now {};
    if (sigaction(kHeld[i], nullptr, &now) == 0 && is_early_handler(now))
      sigaction(kHeld[i], &g_before_hold[i], nullptr);
    g_holding[i] = false;
  }
  return g_early.exchange(0);
}

int stop_signal_number(const std::string& name, const std::string& key) {
  std::string n = name;
  if (n.starts_with("SIG")) n = n.substr(3);
  for (const auto& s : kStopSignals)
    if (n == s.name) return s.number;
  PO_THROW(core::InvalidArgument, key, " = \"", name,
           "\": choose one of TERM, INT, HUP, USR1, USR2, XCPU");
}

StopRequests::StopRequests(int extra_signal, double timeout_s, bool sigterm)
    : signals_{sigterm ? SIGTERM : 0, SIGINT, extra_signal} {
  g_requested = 0;
  g_timeout_s = timeout_s > 0 ? static_cast<unsigned>(std::ceil(timeout_s)) : 0;
  struct sigaction sa {};
  sa.sa_handler = on_stop_request;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = core::kHandlerFlags;  // (core/signal_stack.h)
  for (int i = 0; i < 3; ++i) {
    if (signals_[i] == 0) continue;
    sigaction(signals_[i], &sa, &g_previous[i]);
    // Taking over a held signal: what comes back on destruction is what it
    // had before the hold.
    if (is_early_handler(g_previous[i]))
      if (const struct sigaction* b = before_hold(signals_[i])) g_previous[i] = *b;
  }
}

StopRequests::~StopRequests() {
  for (int i = 2; i >= 0; --i)
    if (signals_[i] != 0) sigaction(signals_[i], &g_previous[i], nullptr);
  alarm(0);
}

int StopRequests::agreed(comm::Communicator* world) {
  const int mine = g_requested.load();
  float flag = mine != 0 ? 1.0f : 0.0f;
  if (world != nullptr) world->allreduce(&flag, 1, tensor::DType::kF32, comm::ReduceOp::kMax);
  return flag == 0 ? 0 : mine != 0 ? mine : -1;
}

}  // namespace po::train
