#include "cli/supervise.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "train/stop.h"

namespace po::cli {
namespace {

constexpr int kSignals[] = {SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2, SIGCHLD};

// Starts `argv` in a process group of its own (the terminal's Ctrl-C reaches
// the supervisor alone), with the signal mask the supervisor had before.
pid_t start(const std::vector<std::string>& argv, const sigset_t& old_mask) {
  std::vector<char*> cargs;
  for (const auto& a : argv) cargs.push_back(const_cast<char*>(a.c_str()));
  cargs.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  PO_CHECK(pid >= 0, "cannot start ", argv[0], ": ", std::strerror(errno));
  if (pid == 0) {
    setpgid(0, 0);
    sigprocmask(SIG_SETMASK, &old_mask, nullptr);
    execvp(cargs[0], cargs.data());
    std::fprintf(stderr, "pagedoptim: cannot start %s: %s%s\n", cargs[0], std::strerror(errno),
                 argv[0] == "mpirun" ? " (install openmpi-bin; scripts/setup does)" : "");
    _exit(127);
  }
  setpgid(pid, pid);  // also here: no race with a signal sent before the child's own call
  return pid;
}

std::string describe(int status) {
  if (WIFSIGNALED(status)) return core::str_cat("signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ")");
  return core::str_cat("exit code ", WEXITSTATUS(status));
}

// One line of RUN/events.jsonl (appended; the run's record of restarts).
void log_event(const std::string& run_dir, const nlohmann::json& e) {
  if (run_dir.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(run_dir, ec);
  std::ofstream f(std::filesystem::path(run_dir) / "events.jsonl", std::ios::app);
  f << e.dump() << "\n";
}

}  // namespace

int supervise(const Supervision& s) {
  sigset_t set, old_mask;
  sigemptyset(&set);
  for (int sig : kSignals) sigaddset(&set, sig);
  sigprocmask(SIG_BLOCK, &set, &old_mask);
  int stops = 0;  // signals received
  for (int attempt = 0;; ++attempt) {
    const auto t0 = std::chrono::steady_clock::now();
    const pid_t child = start(attempt == 0 ? s.command : s.resume_command, old_mask);
    int status = 0;
    for (;;) {
      siginfo_t info{};
      const int sig = sigwaitinfo(&set, &info);
      if (sig < 0) continue;  // EINTR
      if (sig == SIGCHLD) {
        if (waitpid(child, &status, WNOHANG) == child) break;
        continue;
      }
      // A stop request: the workers' stop signal, then SIGTERM, then SIGKILL.
      const int to = ++stops == 1 ? s.stop_signal : stops == 2 ? SIGTERM : SIGKILL;
      std::fprintf(stderr, "pagedoptim: %s: %s\n", strsignal(sig),
                   stops == 1   ? "asking the workers to checkpoint and stop (a second signal aborts)"
                   : stops == 2 ? "aborting the workers (a third signal kills them)"
                                : "killing the workers");
      kill(stops == 3 ? -child : child, to);
    }
    const bool ok = WIFEXITED(status) && (WEXITSTATUS(status) == 0 || WEXITSTATUS(status) == train::kExitResume);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (ok || stops > 0 || attempt >= s.max_restarts) {
      if (!ok && s.max_restarts > 0 && stops == 0)
        std::fprintf(stderr, "pagedoptim: the workers failed (%s) and all %d restarts are used\n",
                     describe(status).c_str(), s.max_restarts);
      sigprocmask(SIG_SETMASK, &old_mask, nullptr);
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    std::fprintf(stderr,
                 "pagedoptim: the workers failed (%s) after %.1f s; restart %d of %d from the newest "
                 "checkpoint\n",
                 describe(status).c_str(), secs, attempt + 1, s.max_restarts);
    log_event(s.run_dir, {{"event", "restart"},
                          {"restart", attempt + 1},
                          {"max_restarts", s.max_restarts},
                          {"failure", describe(status)},
                          {"ran_s", secs},
                          {"time", static_cast<int64_t>(std::time(nullptr))}});
  }
}

}  // namespace po::cli
