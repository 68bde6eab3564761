// `pagedoptim sweep`: the cross product of --grid values as one run
// directory per point under a sweep directory (DIR/sweep.json lists them).
// - Locally the points train one after another, or N at a time
//   (--parallel), each as `pagedoptim train` with its --set overrides and
//   its own log; a point that fails does not stop the others.
// - With --slurm they go to Slurm as one array job (--array=0-(n-1)%K), each
//   task training its point; a task requeued or run again resumes.
// - `--status DIR` tabulates the points: state, step, last loss, best
//   validation loss.
// Every point's config is checked before anything runs or is submitted.
#pragma once

#include <string>
#include <vector>

namespace po::cli {

struct SweepOptions {
  std::string config_path;
  std::vector<std::string> sets;  // common overrides
  std::vector<std::string> grid;  // "section.key=v1,v2,..."
  std::string dir;                // the sweep directory (default: the config's run.dir)
  int parallel = 1;               // local: points at once
  int nproc = 1;                  // processes per point (--nproc of each train)
  bool slurm = false;             // submit an array job instead of running here
  int throttle = 0;               // --slurm: array tasks at once (0: no limit)
  int nodes = 1, tasks_per_node = 1;
  std::string partition, time;
};

// One point: its name and overrides.
struct SweepPoint {
  std::string name;
  std::vector<std::string> sets;
};

// The cross product of `grid` in order (the first key slowest); errors name
// the --grid argument.
std::vector<SweepPoint> sweep_points(const std::vector<std::string>& grid);

int run_sweep(const SweepOptions& o, const std::string& binary, const std::string& workdir);

// The status table of the sweep in `dir`.
std::string sweep_status(const std::string& dir);

// `sweep --run-point I DIR`: trains point I of DIR's sweep.json in this
// process (an array task's body); returns train's exit code.
int run_sweep_point(const std::string& dir, int index, const std::string& binary);

}  // namespace po::cli
