#include "cli/sweep.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "checkpoint/atomic_file.h"
#include "cli/sbatch.h"
#include "core/config.h"
#include "core/error.h"
#include "train/run_state.h"
#include "train/stop.h"
#include "train/trainer.h"

namespace po::cli {
namespace fs = std::filesystem;
namespace {

// "train.lr=3e-4" -> "lr=3e-4", with only characters a file name and a shell take plainly.
std::string name_part(const std::string& key, const std::string& value) {
  const std::string k = key.substr(key.rfind('.') + 1);
  std::string out = k + "=";
  for (char c : value) out += std::isalnum(static_cast<unsigned char>(c)) || std::strchr(".-+", c) ? c : '_';
  return out;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// DIR/sweep.json, as run_sweep wrote it.
nlohmann::json read_sweep(const std::string& path) {
  try {
    return nlohmann::json::parse(read_text(path));
  } catch (const std::exception& e) {
    PO_THROW(core::InvalidArgument, path, ": not a sweep (", e.what(), ")");
  }
}

// argv of `pagedoptim train` for one point.
std::vector<std::string> train_argv(const std::string& binary, const std::string& config,
                                    const std::vector<std::string>& sets, const std::string& run_dir, int nproc) {
  std::vector<std::string> a = {binary, "train", "-c", config};
  for (const auto& s : sets) a.insert(a.end(), {"--set", s});
  a.insert(a.end(), {"--set", "run.dir=" + run_dir, "--resume"});
  if (nproc > 1) a.insert(a.end(), {"--nproc", std::to_string(nproc)});
  return a;
}

pid_t spawn(const std::vector<std::string>& argv, const std::string& log) {
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  PO_CHECK(pid >= 0, "sweep: cannot start a run: ", std::strerror(errno));
  if (pid == 0) {
    if (!log.empty()) {
      FILE* f = std::freopen(log.c_str(), "a", stdout);
      if (f == nullptr || dup2(fileno(stdout), STDERR_FILENO) < 0) _exit(126);
    }
    std::vector<char*> c;
    for (const auto& s : argv) c.push_back(const_cast<char*>(s.c_str()));
    c.push_back(nullptr);
    execv(c[0], c.data());
    _exit(127);
  }
  return pid;
}

int exit_code(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }

void record_exit(const std::string& run_dir, int code) {
  const std::string text = std::to_string(code) + "\n";
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  checkpoint::write_file_atomic((fs::path(run_dir) / "exit_code").string(), text.data(), text.size());
}

}  // namespace

std::vector<SweepPoint> sweep_points(const std::vector<std::string>& grid) {
  std::vector<SweepPoint> points = {{"", {}}};
  for (const std::string& g : grid) {
    const auto eq = g.find('=');
    PO_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < g.size(), "--grid '", g,
             "': expected section.key=v1,v2,...");
    const std::string key = g.substr(0, eq);
    std::vector<std::string> values;
    std::stringstream ss(g.substr(eq + 1));
    for (std::string v; std::getline(ss, v, ',');) {
      PO_CHECK(!v.empty(), "--grid '", g, "': an empty value");
      values.push_back(v);
    }
    std::vector<SweepPoint> next;
    for (const auto& p : points) {
      for (const auto& v : values) {
        SweepPoint q = p;
        if (!q.name.empty()) q.name.append("_");
        q.name.append(name_part(key, v));
        q.sets.push_back(key + "=" + v);
        next.push_back(std::move(q));
      }
    }
    points = std::move(next);
  }
  PO_CHECK(!grid.empty(), "sweep: give at least one --grid section.key=v1,v2,...");
  char buf[32];
  for (size_t i = 0; i < points.size(); ++i) {
    std::snprintf(buf, sizeof buf, "p%03zu_", i);
    points[i].name = buf + points[i].name;
  }
  return points;
}

int run_sweep(const SweepOptions& o, const std::string& binary, const std::string& workdir) {
  const std::string config = fs::absolute(fs::path(workdir) / o.config_path).lexically_normal();
  const auto points = sweep_points(o.grid);
  const core::Config base = core::Config::load(config, o.sets);
  const std::string dir =
      fs::absolute(fs::path(workdir) / (o.dir.empty() ? base.get_string("run.dir") : o.dir)).lexically_normal();
  // Every point checked first: a bad value fails now, naming its point.
  for (const auto& p : points) {
    std::vector<std::string> sets = o.sets;
    sets.insert(sets.end(), p.sets.begin(), p.sets.end());
    try {
      train::check_config(core::Config::load(config, sets));
    } catch (const std::exception& e) {
      PO_THROW(core::InvalidArgument, "sweep point ", p.name, ": ", e.what());
    }
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  PO_CHECK(!ec, "sweep directory '", dir, "': cannot create: ", ec.message());
  nlohmann::json j = {{"config", config}, {"sets", o.sets}, {"grid", o.grid}, {"nproc", o.nproc}};
  for (const auto& p : points) j["points"].push_back({{"name", p.name}, {"sets", p.sets}});
  const std::string text = j.dump(2) + "\n";
  checkpoint::write_file_atomic((fs::path(dir) / "sweep.json").string(), text.data(), text.size());

  if (o.slurm) {
    std::ostringstream s;
    s << "#!/bin/bash\n"
      << "# Generated by `pagedoptim sweep --slurm`: " << points.size() << " points of " << config
      << ", one array task each.\n"
      << "#SBATCH --job-name=pagedoptim-sweep-" << fs::path(dir).filename().string() << "\n"
      << "#SBATCH --array=0-" << points.size() - 1 << (o.throttle > 0 ? "%" + std::to_string(o.throttle) : "")
      << "\n"
      << "#SBATCH --nodes=" << o.nodes << "\n"
      << "#SBATCH --ntasks-per-node=" << o.tasks_per_node << "\n"
      << "#SBATCH --requeue\n"
      << "#SBATCH --signal=" << sigabbrev_np(train::stop_signal_number(base.get_string("train.stop_signal"), "train.stop_signal"))
      << "@120\n"
      << "#SBATCH --output=" << dir << "/slurm-%A_%a.out\n";
    if (!o.partition.empty()) s << "#SBATCH --partition=" << o.partition << "\n";
    if (!o.time.empty()) s << "#SBATCH --time=" << o.time << "\n";
    s << "cd " << shell_quote(fs::absolute(workdir).lexically_normal()) << "\n"
      << "# Each task trains its point (resuming whatever it has), one rank per Slurm task.\n"
      << "srun --mpi=pmix --kill-on-bad-exit=1 " << shell_quote(binary) << " sweep --run-point "
      << "\"$SLURM_ARRAY_TASK_ID\" " << shell_quote(dir) << "\n"
      << "rc=$?\n"
      << "if [ $rc -eq 75 ]; then scontrol requeue \"${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}\"; fi\n"
      << "exit $rc\n";
    const std::string script = (fs::path(dir) / "sweep.sh").string();
    const std::string st = s.str();
    checkpoint::write_file_atomic(script, st.data(), st.size());
    const std::string out = submit_batch("", script, "sweep");
    std::printf("submitted sweep %s: %zu points as array job %s (%s); `pagedoptim sweep --status %s`\n",
                dir.c_str(), points.size(), out.c_str(), script.c_str(), dir.c_str());
    return 0;
  }

  // Locally: up to `parallel` points at once, in order.
  std::map<pid_t, size_t> running;
  size_t next = 0, failed = 0;
  auto wait_one = [&] {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, 0);
    auto it = running.find(pid);
    if (it == running.end()) return;
    const auto& p = points[it->second];
    const int code = exit_code(status);
    record_exit((fs::path(dir) / p.name).string(), code);
    failed += code != 0;
    if (code == 0)
      std::printf("sweep: %s done\n", p.name.c_str());
    else
      std::printf("sweep: %s failed (exit %d, see its train.log)\n", p.name.c_str(), code);
    running.erase(it);
  };
  while (next < points.size() || !running.empty()) {
    while (next < points.size() && static_cast<int>(running.size()) < std::max(1, o.parallel)) {
      const auto& p = points[next];
      const std::string run = (fs::path(dir) / p.name).string();
      fs::create_directories(run, ec);
      std::vector<std::string> sets = o.sets;
      sets.insert(sets.end(), p.sets.begin(), p.sets.end());
      std::printf("sweep: %s starts (%zu of %zu)\n", p.name.c_str(), next + 1, points.size());
      running[spawn(train_argv(binary, config, sets, run, o.nproc), run + "/train.log")] = next;
      ++next;
    }
    wait_one();
  }
  std::printf("%s", sweep_status(dir).c_str());
  return failed == 0 ? 0 : 1;
}

int run_sweep_point(const std::string& dir, int index, const std::string& binary) {
  const std::string path = (fs::path(dir) / "sweep.json").string();
  nlohmann::json j = read_sweep(path);  // not const: operator[] of a missing key reads as null
  PO_CHECK(index >= 0 && index < static_cast<int>(j["points"].size()), path, ": no point ", index, " (it has ",
           j["points"].size(), ")");
  const auto& p = j["points"][static_cast<size_t>(index)];
  std::vector<std::string> sets = j["sets"].get<std::vector<std::string>>();
  for (const auto& s : p["sets"]) sets.push_back(s.get<std::string>());
  const std::string run = (fs::path(dir) / p["name"].get<std::string>()).string();
  // Under srun every task runs this: the ranks of one point's training.
  const pid_t pid = spawn(train_argv(binary, j["config"].get<std::string>(), sets, run, 1), "");
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  const int code = exit_code(status);
  const char* procid = std::getenv("SLURM_PROCID");
  if (procid == nullptr || std::string(procid) == "0") record_exit(run, code);
  return code;
}

std::string sweep_status(const std::string& dir) {
  const std::string path = (fs::path(dir) / "sweep.json").string();
  std::error_code ec;
  PO_CHECK(fs::exists(path, ec), "sweep --status ", dir, ": no sweep.json there (not a sweep directory)");
  nlohmann::json j = read_sweep(path);  // not const: operator[] of a missing key reads as null
  std::ostringstream out;
  char line[512];
  std::snprintf(line, sizeof line, "%-36s %-9s %13s %10s %13s\n", "point", "state", "step", "loss", "best val loss");
  out << line;
  for (const auto& p : j["points"]) {
    const std::string name = p["name"].get<std::string>();
    const fs::path run = fs::path(dir) / name;
    int64_t step = -1, total = -1;
    double loss = -1, best_val = -1;
    {
      std::ifstream f(run / "metrics.jsonl");
      for (std::string l; std::getline(f, l);) {
        try {
          const auto r = nlohmann::json::parse(l);
          if (r.contains("loss")) {
            step = r["step"].get<int64_t>();
            loss = r["loss"].get<double>();
          }
          if (r.contains("val_loss") && (best_val < 0 || r["val_loss"].get<double>() < best_val))
            best_val = r["val_loss"].get<double>();
        } catch (const std::exception&) {  // a line being written
        }
      }
    }
    try {
      total = core::Config::parse(read_text((run / "config.toml").string()), "config").get_int("train.steps");
    } catch (const std::exception&) {
    }
    std::string state = "pending";
    const std::string code = read_text((run / "exit_code").string());
    // The final checkpoint is saved before its step's metrics line is written
    // (the line records the save's time): complete once that line is there
    // too, or the run has exited, never "complete" with a step short.
    const bool complete = total >= 0 && fs::exists(train::checkpoint_path(run.string(), total), ec) &&
                          (step == total || !code.empty());
    if (complete) {
      state = "complete";
    } else if (!code.empty() && std::stoi(code) == 75) {
      state = "stopped";
    } else if (!code.empty() && std::stoi(code) != 0) {
      state = "failed";
    } else if (step >= 0 || fs::exists(run / "config.toml", ec)) {
      state = "running";
    }
    const std::string steps = step < 0 ? "-" : std::to_string(step) + "/" + (total < 0 ? "?" : std::to_string(total));
    std::snprintf(line, sizeof line, "%-36s %-9s %13s %10s %13s\n", name.c_str(), state.c_str(), steps.c_str(),
                  loss < 0 ? "-" : std::to_string(loss).substr(0, 8).c_str(),
                  best_val < 0 ? "-" : std::to_string(best_val).substr(0, 8).c_str());
    out << line;
  }
  return out.str();
}

}  // namespace po::cli
