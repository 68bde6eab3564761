// Stop signals that arrive while the process starts (train/stop.h): held
// from the first line of main, handed to StopRequests (a stop after the
// first step) or given back as they were.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include "train/stop.h"

namespace {

using po::train::hold_early_signals;
using po::train::release_early_signals;
using po::train::StopRequests;

// `sig`'s handler now.
sighandler_t handler_of(int sig) {
  struct sigaction now {};
  sigaction(sig, nullptr, &now);
  return now.sa_handler;
}

TEST(EarlySignals, OneHeldBeforeStopRequestsBecomesAStopRequest) {
  signal(SIGUSR1, SIG_DFL);
  hold_early_signals();
  raise(SIGUSR1);  // would have ended the process
  {
    const StopRequests stop(SIGUSR1, 0, /*sigterm=*/false);
    const int early = release_early_signals();
    EXPECT_EQ(early, SIGUSR1) << "the held signal was not remembered";
    EXPECT_EQ(StopRequests::agreed(nullptr), 0) << "a stop before the held signal was raised again";
    raise(early);
    EXPECT_EQ(StopRequests::agreed(nullptr), SIGUSR1) << "the held signal did not become a stop request";
  }
  EXPECT_EQ(handler_of(SIGUSR1), SIG_DFL)
      << "StopRequests gave back the hold's handler instead of the disposition from before the hold";
  EXPECT_EQ(handler_of(SIGUSR2), SIG_DFL) << "release_early_signals left SIGUSR2 held";
}

TEST(EarlySignals, NoneArrivedIsZeroAndEveryDispositionComesBack) {
  signal(SIGUSR2, SIG_DFL);
  signal(SIGHUP, SIG_IGN);  // as under nohup
  hold_early_signals();
  hold_early_signals();  // twice: the second must not take the hold for the old disposition
  EXPECT_NE(handler_of(SIGUSR2), SIG_DFL) << "SIGUSR2 is not held";
  EXPECT_EQ(handler_of(SIGHUP), SIG_IGN) << "an ignored SIGHUP was caught instead of staying ignored";
  EXPECT_EQ(release_early_signals(), 0);
  EXPECT_EQ(handler_of(SIGUSR2), SIG_DFL);
  EXPECT_EQ(handler_of(SIGHUP), SIG_IGN);
  signal(SIGHUP, SIG_DFL);
}

// A held signal that is not the run's stop signal still ends the process,
// only later: what it would have done without the hold.
TEST(EarlySignalsDeathTest, OneThatIsNotTheStopSignalStillEndsTheProcess) {
  EXPECT_EXIT(
      {
        signal(SIGUSR2, SIG_DFL);
        hold_early_signals();
        raise(SIGUSR2);
        const StopRequests stop(SIGUSR1, 0, /*sigterm=*/false);
        if (const int early = release_early_signals()) raise(early);
        _exit(0);
      },
      ::testing::KilledBySignal(SIGUSR2), "");
}

// The supervisor's way: the signal blocked, then raised again, waits for
// sigtimedwait.
TEST(EarlySignals, OneRaisedAgainUnderABlockingMaskWaitsForSigtimedwait) {
  signal(SIGUSR2, SIG_DFL);
  hold_early_signals();
  raise(SIGUSR2);
  sigset_t set, old;
  sigemptyset(&set);
  sigaddset(&set, SIGUSR2);
  sigprocmask(SIG_BLOCK, &set, &old);
  const int early = release_early_signals();
  ASSERT_EQ(early, SIGUSR2);
  raise(early);
  const timespec zero{0, 0};
  EXPECT_EQ(sigtimedwait(&set, nullptr, &zero), SIGUSR2) << "the raised signal is not pending";
  sigprocmask(SIG_SETMASK, &old, nullptr);
}

}  // namespace
