// Fault tests' helpers: a long training run launched in the background
// (`pagedoptim train --nproc N`), the PIDs of its ranks, and any pagedoptim
// command as a child process to signal and wait for.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>

#include "test_util.h"

namespace po::test {

inline // PID of the worker process whose environment says it is OpenMPI rank `rank`
// and whose command line contains `marker`; -1 when there is none (yet).
int find_rank_pid(int rank, const std::string& marker) {
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string pid = e.path().filename().string();
    if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string cmdline = po::test::read_file(e.path().string() + "/cmdline");
    if (cmdline.find(marker) == std::string::npos || cmdline.rfind("mpirun", 0) == 0) continue;
    const std::string env = po::test::read_file(e.path().string() + "/environ");
    if (env.find("OMPI_COMM_WORLD_RANK=" + std::to_string(rank) + '\0') != std::string::npos)
      return std::stoi(pid);
  }
  return -1;
}

// Whether `pid` is a live process (a zombie, dead but not yet reaped by its
// new parent, is not).
inline bool alive(int pid) {
  const std::string stat = po::test::read_file("/proc/" + std::to_string(pid) + "/stat");
  const auto paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] != 'Z' &&
         stat[paren + 2] != 'X';
}

// A long `--nproc N` run in the background, for fault tests.
class BackgroundRun {
 public:
  BackgroundRun(const std::string& config, const std::string& run, const std::string& extra,
                int nproc = 2)
      : run_(run), log_(run + ".log"), nproc_(nproc) {
    const std::string cmd = std::string(PO_BINARY) + " train -c " + config + " --set run.dir=" + run +
                            " --set train.steps=1000000 --set train.checkpoint_interval=0" +
                            " --set train.eval_interval=0 --nproc " + std::to_string(nproc) + " " + extra + " > " + log_ +
                            " 2>&1";
    pipe_ = popen(("sh -c '" + cmd + "; echo exit=$?'").c_str(), "r");
  }
  ~BackgroundRun() {
    for (int r = 0; r < nproc_; ++r)
      if (const int pid = find_rank_pid(r, run_); pid > 0) kill(pid, SIGKILL);
    if (pipe_ != nullptr) pclose(pipe_);
  }
  // PID of rank `rank` once training has started; -1 after 30 s without.
  int rank_pid(int rank) {
    for (int i = 0; i < 300; ++i) {
      if (std::filesystem::exists(run_ + "/metrics.jsonl")) {
        const int pid = find_rank_pid(rank, run_);
        if (pid > 0) return pid;
      }
      usleep(100000);
    }
    return -1;
  }
  // PID of the launcher (`pagedoptim train --nproc`, which supervises
  // mpirun: cli/supervise.h); -1 when gone.
  int launcher_pid() const {
    for (const auto& e : std::filesystem::directory_iterator("/proc")) {
      const std::string pid = e.path().filename().string();
      if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
      const std::string cmdline = po::test::read_file(e.path().string() + "/cmdline");
      if (cmdline.rfind("mpirun", 0) != 0 && cmdline.find(run_) != std::string::npos &&
          cmdline.find(std::string("--nproc") + '\0') != std::string::npos)
        return std::stoi(pid);
    }
    return -1;
  }
  // Waits for the launcher to exit; returns the seconds since `t0`.
  double finish(std::chrono::steady_clock::time_point t0) {
    char buf[256];
    while (fgets(buf, sizeof buf, pipe_) != nullptr) tail_ += buf;
    pclose(pipe_);
    pipe_ = nullptr;
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  bool exited_zero() const { return tail_.find("exit=0") != std::string::npos; }
  // The launcher's exit code (-1 before finish()).
  int exit_code() const {
    const auto at = tail_.rfind("exit=");
    return at == std::string::npos ? -1 : std::atoi(tail_.c_str() + at + 5);
  }
  std::string output() const { return po::test::read_file(log_); }

 private:
  std::string run_, log_, tail_;
  int nproc_ = 2;
  FILE* pipe_ = nullptr;
};

// `pagedoptim ARGS > LOG 2>&1` as a child of the test (its pid is
// pagedoptim's own: sh execs it), to signal and to wait for.
class Child {
 public:
  Child(const std::string& args, const std::string& log) {
    const std::string cmd = std::string("exec ") + PO_BINARY + " " + args + " > " + log + " 2>&1";
    pid_ = fork();
    if (pid_ == 0) {
      execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
  }
  ~Child() {
    if (pid_ > 0 && !done_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  bool running() {
    if (done_) return false;
    if (waitpid(pid_, &status_, WNOHANG) == pid_) done_ = true;
    return !done_;
  }
  // The exit code (128 + signal when a signal ended it); -1 after `limit_s`.
  int wait(double limit_s) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(limit_s);
    while (running() && std::chrono::steady_clock::now() < end) usleep(20000);
    if (!done_) return -1;
    return WIFEXITED(status_) ? WEXITSTATUS(status_) : 128 + WTERMSIG(status_);
  }

 private:
  pid_t pid_ = -1;
  int status_ = 0;
  bool done_ = false;
};

}  // namespace po::test
