// `pagedoptim sbatch`: a ready-to-submit Slurm batch script for a multi-node
// data-parallel run (one task per rank; OpenMPI joins the step via PMIx).
#pragma once

#include <string>
#include <vector>

namespace po::cli {

struct SbatchOptions {
  std::string config_path;        // resolved to an absolute path in the script
  std::vector<std::string> sets;  // --set overrides, passed through
  bool resume = false;
  int nodes = 1;
  int tasks_per_node = 1;         // ranks per node (GPUs per node on a GPU build)
  int cpus_per_task = 0;          // 0: not requested (Slurm's default)
  std::string partition;          // empty: the cluster's default
  std::string time;               // Slurm time limit, e.g. "2:00:00"; empty: default
  std::string job_name;           // empty: "pagedoptim-<run.dir's name>"
};

// Validates the config for nodes × tasks_per_node ranks (the same start-up
// checks train runs, so a bad config fails now, not after the queue wait) and
// returns the script. `binary` is the absolute path of the pagedoptim to run,
// `workdir` the directory relative paths in the config are taken from.
std::string make_sbatch_script(const SbatchOptions& o, const std::string& binary,
                               const std::string& workdir);

}  // namespace po::cli
