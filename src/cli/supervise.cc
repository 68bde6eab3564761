#include "cli/supervise.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>

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

struct Proc {
  pid_t pid, ppid;
  char state;  // 'Z': dead, not yet reaped by its parent
};

// The processes whose parent is `parent`, from /proc/PID/stat.
std::vector<Proc> children_of(pid_t parent) {
  std::vector<Proc> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream f(e.path() / "stat");
    std::string stat;
    if (!std::getline(f, stat)) continue;  // gone meanwhile
    // "PID (COMM) STATE PPID ...": COMM may hold spaces and parentheses.
    const auto paren = stat.rfind(')');
    if (paren == std::string::npos || paren + 4 >= stat.size()) continue;
    const pid_t ppid = static_cast<pid_t>(std::strtol(stat.c_str() + paren + 4, nullptr, 10));
    if (ppid == parent) out.push_back({static_cast<pid_t>(std::stol(name)), ppid, stat[paren + 2]});
  }
  return out;
}

// SIGKILL to `launcher`, its process group and each of its children that
// still runs (mpirun puts every rank in a process group of its own).
void kill_job(pid_t launcher) {
  for (const Proc& p : children_of(launcher))
    if (p.state != 'Z') kill(p.pid, SIGKILL);
  kill(-launcher, SIGKILL);
}

// Ends and reaps what an attempt left behind: ranks whose mpirun ended first
// come back to this process, the subreaper. Each gets SIGTERM (a rank's
// handlers remove its swap files on it) and `grace_s` seconds to exit before
// SIGKILL, so that this process returns only once every worker has exited
// and, given the time, cleaned up.
void end_strays(double grace_s) {
  std::vector<pid_t> running;
  for (const Proc& p : children_of(getpid())) {
    if (p.state == 'Z') {
      waitpid(p.pid, nullptr, 0);
      continue;
    }
    std::fprintf(stderr, "pagedoptim: ending worker process %d, left running by its launcher\n",
                 static_cast<int>(p.pid));
    kill(p.pid, SIGTERM);
    running.push_back(p.pid);
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(grace_s);
  while (!running.empty() && std::chrono::steady_clock::now() < until) {
    std::erase_if(running, [](pid_t pid) { return waitpid(pid, nullptr, WNOHANG) == pid; });
    if (!running.empty()) usleep(20'000);
  }
  for (pid_t pid : running) {
    std::fprintf(stderr, "pagedoptim: killing worker process %d: still running %.0f s after SIGTERM\n",
                 static_cast<int>(pid), grace_s);
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
  }
}

// Watches the launcher's children for one that died and stays unreaped:
// mpirun reaps a dead rank within milliseconds, and when it does not, it
// hangs (seen with OpenMPI 4.1 when a rank dies while it connects to the
// PMIx server: mpirun prints that the rank was killed and never exits).
class ReapWatch {
 public:
  explicit ReapWatch(double timeout_s) : timeout_(timeout_s) {}
  // The pid of a child of `launcher` dead for longer than the timeout, or 0.
  pid_t stuck(pid_t launcher) {
    const auto now = std::chrono::steady_clock::now();
    std::map<pid_t, std::chrono::steady_clock::time_point> still;
    pid_t out = 0;
    for (const Proc& p : children_of(launcher)) {
      if (p.state != 'Z') continue;
      const auto it = dead_since_.find(p.pid);
      const auto since = it == dead_since_.end() ? now : it->second;
      still[p.pid] = since;
      if (std::chrono::duration<double>(now - since).count() > timeout_) out = p.pid;
    }
    dead_since_ = std::move(still);
    return out;
  }

 private:
  double timeout_;
  std::map<pid_t, std::chrono::steady_clock::time_point> dead_since_;
};

}  // namespace

int supervise(const Supervision& s) {
  sigset_t set, old_mask;
  sigemptyset(&set);
  for (int sig : kSignals) sigaddset(&set, sig);
  sigprocmask(SIG_BLOCK, &set, &old_mask);
  // One that came while this process started waits for sigtimedwait below.
  if (const int early = train::release_early_signals()) raise(early);
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  int stops = 0;  // signals received
  for (int attempt = 0;; ++attempt) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<std::string>& argv = attempt == 0 ? s.command : s.resume_command;
    const pid_t child = start(argv, old_mask);
    int status = 0;
    std::string failure;  // why the attempt failed, where its exit status does not say
    ReapWatch watch(s.reap_timeout_s);
    for (bool done = false; !done;) {
      siginfo_t info{};
      const timespec tick{0, 500'000'000};
      const int sig = sigtimedwait(&set, &info, &tick);
      if (sig < 0) {
        if (errno != EAGAIN) continue;  // EINTR
        if (const pid_t dead = watch.stuck(child); dead > 0 && stops < 3) {
          failure = core::str_cat(argv[0], " hung: worker process ", dead, " died more than ",
                                  s.reap_timeout_s, " s ago and was never reaped");
          std::fprintf(stderr, "pagedoptim: %s; killing the job\n", failure.c_str());
          kill_job(child);
          waitpid(child, &status, 0);
          done = true;
        }
        continue;
      }
      if (sig == SIGCHLD) {
        // Strays (see end_strays) are reaped here too.
        int st = 0;
        for (pid_t p; (p = waitpid(-1, &st, WNOHANG)) > 0;) {
          if (p == child) {
            status = st;
            done = true;
          }
        }
        continue;
      }
      // A stop request: the workers' stop signal, then SIGTERM, then SIGKILL.
      const int to = ++stops == 1 ? s.stop_signal : stops == 2 ? SIGTERM : SIGKILL;
      std::fprintf(stderr, "pagedoptim: %s: %s\n", strsignal(sig),
                   stops == 1   ? "asking the workers to checkpoint and stop (a second signal aborts)"
                   : stops == 2 ? "aborting the workers (a third signal kills them)"
                                : "killing the workers");
      if (stops == 3)
        kill_job(child);
      else
        kill(child, to);
    }
    end_strays(s.stray_grace_s);
    const bool ok = failure.empty() && WIFEXITED(status) &&
                    (WEXITSTATUS(status) == 0 || WEXITSTATUS(status) == train::kExitResume);
    if (failure.empty()) failure = describe(status);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (ok || stops > 0 || attempt >= s.max_restarts) {
      if (!ok && s.max_restarts > 0 && stops == 0)
        std::fprintf(stderr, "pagedoptim: the workers failed (%s) and all %d restarts are used\n",
                     failure.c_str(), s.max_restarts);
      sigprocmask(SIG_SETMASK, &old_mask, nullptr);
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    std::fprintf(stderr,
                 "pagedoptim: the workers failed (%s) after %.1f s; restart %d of %d from the newest "
                 "checkpoint\n",
                 failure.c_str(), secs, attempt + 1, s.max_restarts);
    log_event(s.run_dir, {{"event", "restart"},
                          {"restart", attempt + 1},
                          {"max_restarts", s.max_restarts},
                          {"failure", failure},
                          {"ran_s", secs},
                          {"time", static_cast<int64_t>(std::time(nullptr))}});
  }
}

}  // namespace po::cli
