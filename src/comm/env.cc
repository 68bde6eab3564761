// Launcher environment detection; see env.h for the priority order and why.
#include "comm/env.h"

#include <cerrno>
#include <cstdlib>

#include "core/error.h"

namespace po::comm {
namespace {

struct Names {
  LaunchSource source;
  const char* rank;
  const char* size;
  const char* local_rank;
};

constexpr Names kSources[] = {
    {LaunchSource::kOpenMpi, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK"},
    {LaunchSource::kTorchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK"},
    {LaunchSource::kSlurm, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
};

int parse_int(const std::string& name, const std::string& value) {
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(value.c_str(), &end, 10);
  PO_CHECK(!value.empty() && end != nullptr && *end == '\0' && errno == 0 && v >= -(1L << 30) &&
               v <= (1L << 30),
           "environment variable ", name, "='", value, "' is not an integer");
  return static_cast<int>(v);
}

}  // namespace

const char* launch_source_name(LaunchSource s) {
  switch (s) {
    case LaunchSource::kNone: return "none";
    case LaunchSource::kOpenMpi: return "mpirun";
    case LaunchSource::kTorchrun: return "torchrun";
    case LaunchSource::kSlurm: return "slurm";
  }
  return "?";
}

LaunchEnv detect_launch_env(const EnvLookup& lookup) {
  for (const Names& n : kSources) {
    const auto rank = lookup(n.rank);
    if (!rank) continue;
    const auto size = lookup(n.size);
    PO_CHECK(size.has_value(), n.rank, " is set (", *rank, ") but ", n.size,
             " is not: incomplete ", launch_source_name(n.source), " environment");
    LaunchEnv env;
    env.source = n.source;
    env.rank = parse_int(n.rank, *rank);
    env.world_size = parse_int(n.size, *size);
    PO_CHECK(env.world_size >= 1, n.size, "=", env.world_size, " must be at least 1");
    PO_CHECK(env.rank >= 0 && env.rank < env.world_size, "inconsistent ",
             launch_source_name(n.source), " environment: ", n.rank, "=", env.rank,
             " is not in [0, ", n.size, "=", env.world_size, ")");
    // Without a local rank the node layout is unknown: assume a single node,
    // where the local rank is the rank.
    const auto local = lookup(n.local_rank);
    env.local_rank = local ? parse_int(n.local_rank, *local) : env.rank;
    PO_CHECK(env.local_rank >= 0 && env.local_rank < env.world_size, "inconsistent ",
             launch_source_name(n.source), " environment: ", n.local_rank, "=", env.local_rank,
             " is not in [0, ", n.size, "=", env.world_size, ")");
    if (n.source == LaunchSource::kTorchrun) {
      if (auto addr = lookup("MASTER_ADDR")) env.master_addr = *addr;
      if (auto port = lookup("MASTER_PORT")) {
        env.master_port = parse_int("MASTER_PORT", *port);
        PO_CHECK(env.master_port > 0 && env.master_port < 65536, "MASTER_PORT=", *port,
                 " is not a port number (1..65535)");
      }
    }
    return env;
  }
  return LaunchEnv{};
}

LaunchEnv detect_launch_env() {
  return detect_launch_env([](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  });
}

}  // namespace po::comm
