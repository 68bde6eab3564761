// `pagedoptim k8s`: the manifests of a gang-scheduled training job on
// Kubernetes, printed as YAML for `kubectl apply -f -`:
// - a Secret holding the job's rendezvous secret (comm/rendezvous.h: only
//   pods that hold it join), generated fresh;
// - a headless Service, so that pod 0 has a stable name
//   (NAME-0.NAME.NAMESPACE.svc) to be MASTER_ADDR;
// - an Indexed Job of `nodes` pods (completions = parallelism = nodes,
//   backoffLimit 0: a failed rank fails the job, to be resumed); each pod runs
//   `procs_per_node` ranks with the torchrun-style variables the launch path
//   reads (RANK = JOB_COMPLETION_INDEX × procs + local, WORLD_SIZE,
//   LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and `--resume`;
// - gang scheduling, one of: `workload` (Kubernetes 1.35's Workload API,
//   scheduling.k8s.io/v1alpha2, a gang of minCount = nodes, the pods linked
//   by workloadRef), `kueue` (the Job created suspended in a LocalQueue; Kueue
//   admits all its pods at once), `volcano` (a Volcano PodGroup of minMember
//   = nodes, the pods scheduled by Volcano).
// The config is checked for nodes × procs_per_node ranks first, as sbatch does.
#pragma once

#include <string>
#include <vector>

namespace po::cli {

struct K8sOptions {
  std::string config_path;        // its path inside the image (or on a shared volume)
  std::vector<std::string> sets;
  int nodes = 1, procs_per_node = 1;
  std::string image;
  std::string gang = "workload";  // workload | kueue | volcano
  std::string queue = "default";  // kueue's LocalQueue
  std::string name;               // default: pagedoptim-<run.dir's name>
  std::string namespace_ = "default";
  int cpus = 0;                   // CPU request per pod (0: none)
  std::string memory;             // memory request per pod ("" : none), e.g. 64Gi
  std::string binary = "pagedoptim";  // the binary's path inside the image
};

std::string make_k8s_manifests(const K8sOptions& o, const std::string& workdir);

}  // namespace po::cli
