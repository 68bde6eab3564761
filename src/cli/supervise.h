// The launcher of `pagedoptim train --nproc N` (and of `--max-restarts K`):
// it stays, runs the workers as a child (`mpirun -np N` for N > 1, this
// binary for N = 1) in their own process group, and speaks for them.
// - Signals: the first SIGTERM, SIGINT or SIGHUP, or the stop signal itself,
//   becomes the workers' stop signal (train/stop.h: finish the step,
//   checkpoint, exit 75); mpirun passes only SIGUSR1 and SIGUSR2 on to its
//   ranks, and kills them on SIGTERM. A second signal aborts (SIGTERM to the
//   job), a third kills it.
// - Failures: workers that end with anything but 0 or 75, without having
//   been asked to stop, start again from the newest checkpoint (`--resume`),
//   up to K times, each restart logged on stderr and in RUN/events.jsonl.
// - Hangs: a worker that died and that mpirun has not reaped after
//   `reap_timeout_s` means mpirun is stuck (OpenMPI can hang when a rank
//   dies while it connects); the job is killed and counts as failed.
// - Strays: the supervisor is the subreaper of everything it starts, so a
//   rank that outlives its mpirun comes back to it and is ended (SIGTERM,
//   then SIGKILL after `stray_grace_s`) before the next attempt starts or
//   the supervisor returns: a scheduler that sees the job end sees no rank
//   still writing.
#pragma once

#include <string>
#include <vector>

namespace po::cli {

struct Supervision {
  std::vector<std::string> command;         // the workers' argv (argv[0] found on PATH)
  std::vector<std::string> resume_command;  // the same, resuming: for restarts
  int max_restarts = 0;
  int stop_signal = 0;  // train.stop_signal's number
  std::string run_dir;  // for events.jsonl
  double reap_timeout_s = 10;  // a dead worker mpirun has not reaped by then: mpirun hangs
  double stray_grace_s = 10;   // a stray worker's time to exit after SIGTERM
};

// Runs the workers to the end; returns the exit code to exit with (the
// workers' own, or 128 + a signal that ended them).
int supervise(const Supervision& s);

}  // namespace po::cli
