// Where a training run runs and what it is: the batch split (Plan), the
// processes (Launch: the MPI world at parallel.dp > 1, this rank, the CPU
// threads it uses) and the run directory. Everything here is checked before
// run.dir is touched; a wrong launch fails before MPI_Init can abort.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "core/config.h"
#include "model/transformer.h"

namespace po::comm::mpi {
class Session;
}

namespace po::train {

// The step's shape, from train.* and parallel.* (checked).
struct Plan {
  int64_t batch = 0, micro = 0, accum = 0, T = 0, steps = 0;
  int64_t dp = 1;  // data-parallel ranks; accum counts this rank's micro-batches
  int64_t tp = 1;  // tensor-parallel ranks (each dp replica is tp processes)
  int64_t pp = 1;  // pipeline stages (each replica is tp × pp processes); m = accum micro-batches
  int64_t cp = 1;  // context-parallel ranks: each holds T / cp of every sequence's positions
  // DiLoCo's replicas (parallel.replicas): each a whole dp × tp × pp × cp
  // mesh training on its own batch of `batch` sequences, the mesh's slowest
  // axis; every local_steps steps their parameters meet in an outer step.
  int64_t replicas = 1;
  int64_t local_steps = 0;
  int64_t replica_world() const { return dp * tp * pp * cp; }
  int64_t world() const { return replicas * replica_world(); }
  int64_t eval_interval = 0, eval_batches = 0, ckpt_interval = 0, keep = 0;
  // train.stop_at: the run ends (with a checkpoint) after this step, while
  // the learning-rate schedule still spans `steps` (a federated client trains
  // one round of a longer schedule per run; docs/diloco.md). 0: at `steps`.
  int64_t stop_at = 0;
  int64_t end() const { return stop_at > 0 && stop_at < steps ? stop_at : steps; }
};

Plan make_plan(const core::Config& cfg, const model::TransformerConfig& m);

// This process's place in the run. At parallel.dp × parallel.tp > 1: one process per rank,
// launched by mpirun, srun (OpenMPI's PMIx) or a torchrun-style rendezvous;
// every rank has checked that all resolved the same config and run the same
// binary. Not movable: the MPI session finalizes after the world is freed.
struct Launch {
  Launch(const core::Config& cfg, const Plan& plan);
  ~Launch();
  Launch(const Launch&) = delete;
  Launch& operator=(const Launch&) = delete;

  std::unique_ptr<comm::mpi::Session> mpi_session;  // declared first: finalized last
  // parallel.replicas > 1: the whole job, and the ranks at this rank's place
  // in every replica, in replica order (the outer step's group); else null.
  // `world` is then this replica's ranks (null when it is one process):
  // everything but the outer step runs within a replica.
  std::unique_ptr<comm::Communicator> everyone, across;
  std::unique_ptr<comm::Communicator> world;        // null in a single process
  // The mesh's groups (comm/mesh.h, tp fastest), null where their axis is 1:
  // gradients reduce and ZeRO shards over dp_group(); split layers reduce
  // over tp_group(). At tp = 1 the data group is the world itself.
  comm::Communicator* dp_group() const {
    return data ? data.get() : meshed ? nullptr : world.get();
  }
  comm::Communicator* tp_group() const { return tensor.get(); }
  comm::Communicator* pp_group() const { return pipeline.get(); }
  // At cp > 1 the data group is dp × cp (gradients, the loss and ZeRO's
  // shards span it, as in Megatron-LM) and the context group is cp's.
  comm::Communicator* cp_group() const { return context.get(); }
  std::unique_ptr<comm::Communicator> data, tensor, pipeline, context;
  bool meshed = false;  // the world is split into groups (tp, pp or cp > 1)
  int local_ranks = 1;                              // ranks sharing this node's CPUs
  int rank = 0;     // in the replica
  int replica = 0;  // parallel.replicas: this rank's
  // The job's processes agree on stops (train/stop.h): every replica's.
  comm::Communicator* job() const { return everyone ? everyone.get() : world.get(); }
  int dp_rank = 0, tp_rank = 0, pp_rank = 0, cp_rank = 0;  // this rank's mesh coordinates
  bool leader = true;  // only rank 0 (of replica 0) writes the run directory
};

// train.threads (0: this rank's share of the usable CPUs) and the GEMM
// precision of train.precision. Returns the thread count.
int setup_compute(const core::Config& cfg, int local_ranks);
// train.precision = "auto": "bf16" where this process's CPU and BLAS have a
// native bf16 GEMM, else "fp32", written back into `cfg` (each process
// resolves it from its own CPU: on a cluster of mixed CPUs name the
// precision). Other values are left as they are. Returns the result.
std::string resolve_precision(core::Config& cfg);

// Refuses to mix a new run into a directory that holds another one.
void prepare_run_dir(const std::string& dir, bool resume);

}  // namespace po::train
