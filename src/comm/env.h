// Rank / world size / local rank from the launcher's environment variables.
//
// Sources, in priority order (the first whose rank variable is set wins):
//   1. mpirun (OpenMPI):   OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK
//   2. torchrun-style, also our own launcher:
//                          RANK, WORLD_SIZE, LOCAL_RANK (+ MASTER_ADDR/PORT)
//   3. Slurm srun:         SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
//   4. none of them:       a single process, rank 0 of 1.
// Slurm comes last because SLURM_* variables are inherited by everything in a
// job allocation (the batch script, and an mpirun or launcher started from it),
// whereas the other two are set per process by the innermost launcher.
// Within the chosen source every value must parse as an integer, with
// 0 <= rank < world_size and 0 <= local_rank < world_size; a partial set (rank
// without world size) is an InvalidArgument naming the variables.
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace po::comm {

enum class LaunchSource { kNone, kOpenMpi, kTorchrun, kSlurm };
const char* launch_source_name(LaunchSource s);

struct LaunchEnv {
  LaunchSource source = LaunchSource::kNone;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;  // torchrun-style only; empty otherwise
  int master_port = 0;      // torchrun-style only; 0 when unset
};

// Looks up one environment variable; nullopt when unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

// From the process environment.
LaunchEnv detect_launch_env();
// From `lookup` (tests pass a map).
LaunchEnv detect_launch_env(const EnvLookup& lookup);

}  // namespace po::comm
