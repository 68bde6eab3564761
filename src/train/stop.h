// Stopping a run on request, the way a cluster asks: SIGTERM (a scheduler's
// stop, `kill`, Ctrl-C's SIGINT) or train.stop_signal (what Slurm's
// `--signal=USR1@120` sends ahead of a time limit) makes every rank finish
// the step it is in, write a checkpoint and exit with kExitResume ("resume
// me"). A second signal, or train.stop_timeout seconds without finishing,
// aborts at once: checkpoints are written atomically, so the last complete
// one stays good.
#pragma once

#include <string>

namespace po::comm {
class Communicator;
}

namespace po::train {

// sysexits.h's EX_TEMPFAIL: the run stopped cleanly at a checkpoint and asks
// to be resumed (`--resume`, a requeue, the next job of a chain).
inline constexpr int kExitResume = 75;

// The signal number of "USR1", "SIGUSR2", "TERM", ... (the ones a stop request
// may use: TERM, INT, HUP, USR1, USR2, XCPU); errors name `key`.
int stop_signal_number(const std::string& name, const std::string& key);

// From the first line of main until the process knows what to do with them:
// HUP, USR1, USR2 and XCPU (stop signals whose default action ends the
// process) are caught and the first one remembered, so that a stop request
// that arrives while the process starts is neither fatal nor lost. Slurm
// sends its time-limit signal (`--signal=USR1@120`) when its periodic check
// falls, which can be while a step's tasks are still starting. A signal the
// process inherited as ignored stays ignored; TERM and INT are left alone
// (under mpirun, TERM must end a rank at once). The window before main, while
// the dynamic loader maps the libraries (3-6 ms here), remains.
void hold_early_signals();

// Gives the held signals back their dispositions from before
// hold_early_signals() (those not taken over since by StopRequests or
// another handler) and returns the one that arrived, 0 if none. The caller
// raises it again once its own handling is in place, so that it lands where
// it would have: a stop request, a blocked signal for sigtimedwait, or its
// default action.
int release_early_signals();

// While alive, SIGTERM (when `sigterm`), SIGINT and `extra_signal` request a
// stop; their previous handlers come back on destruction. `timeout_s` > 0 arms
// an alarm at the first request. Under OpenMPI's mpirun, SIGTERM is how mpirun
// aborts a job whose rank died: it must end the process at once (a graceful
// stop would wait on the dead rank), so there only `extra_signal` (which
// mpirun forwards) and SIGINT ask for a stop.
class StopRequests {
 public:
  StopRequests(int extra_signal, double timeout_s, bool sigterm = true);
  ~StopRequests();
  StopRequests(const StopRequests&) = delete;
  StopRequests& operator=(const StopRequests&) = delete;

  // Collective over `world` (null: this process alone): whether any rank was
  // asked to stop, so that all stop after the same step. 0: none; else this
  // process's signal, or -1 when only another rank had one.
  static int agreed(comm::Communicator* world);

 private:
  int signals_[3];
};

}  // namespace po::train
