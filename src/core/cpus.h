// How many CPUs this process may run on.
#pragma once

namespace po::core {

// CPUs in this process's affinity mask (Slurm's --cpus-per-task, taskset),
// not the machine's count; at least 1.
int usable_cpus();

}  // namespace po::core
