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
  int signal_lead = 120;          // seconds before the time limit Slurm sends train.stop_signal
  int max_restarts = 0;           // srun steps started again after a failure, within the job
  int chain = 0;                  // > 0: submit this many jobs, each after the last (--dependency=afterany)
};

// Validates the config for nodes × tasks_per_node ranks (the same start-up
// checks train runs, so a bad config fails now, not after the queue wait) and
// returns the script. `binary` is the absolute path of the pagedoptim to run,
// `workdir` the directory relative paths in the config are taken from.
// The script:
// - Slurm sends train.stop_signal `signal_lead` seconds ahead of the time
//   limit (`--signal`); the ranks checkpoint and exit 75 (train/stop.h), and
//   the job requeues itself (`--requeue`, `scontrol requeue`) or, in a chain,
//   leaves the rest to the next job;
// - a requeued job, a chain's later job and a restart pass `--resume`;
// - a job that finds the run's final checkpoint exits at once (a chain ends
//   early);
// - a failed step (not 0, not 75) runs again, resuming, up to max_restarts.
std::string make_sbatch_script(const SbatchOptions& o, const std::string& binary,
                               const std::string& workdir);

// A word the shell reads back exactly: bare when it is plainly safe, else in
// single quotes.
std::string shell_quote(const std::string& s);

// `sbatch --parsable OPTIONS SCRIPT`; returns the job id. Errors name `what`
// and carry sbatch's own message.
std::string submit_batch(const std::string& options, const std::string& script, const std::string& what);

// --chain K: writes the script to `script_path` and submits it K times with
// `sbatch`, each job after the last ends (afterany); returns the job ids.
std::vector<std::string> submit_chain(const SbatchOptions& o, const std::string& script,
                                      const std::string& script_path);

}  // namespace po::cli
