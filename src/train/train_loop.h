// The one loop every layout trains in: for each step the learning rate, the
// layout's step, evaluation, the agreed stop, checkpoints (and committing the
// background ones), metrics.jsonl and the progress line, in the same order
// on every rank. A layout brings only its steps (LayoutSteps): the
// pipeline executor's, at every pp (train/pipeline_train.cc).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "data/token_file.h"
#include "optim/schedule.h"
#include "train/async_checkpoint.h"
#include "train/launch.h"
#include "train/run_inputs.h"
#include "train/run_state.h"
#include "train/trainer.h"

namespace po::train {

// One layout's part of the loop. Each call is made on every rank, in the
// loop's order (they may be collectives); records are read on the leader.
class LayoutSteps {
 public:
  virtual ~LayoutSteps() = default;
  struct Outcome {
    double loss = 0;     // the step's mean loss over the global batch (every rank's)
    double grad_norm = 0;
    double seconds = 0;  // the step's wall time
    // The step's records for metrics.jsonl (the leader's; the loop adds
    // checkpoint_ms and threads_per_rank to the first).
    std::vector<nlohmann::json> records;
  };
  // Step `step` (0-based) at learning rate `lr`, and every collective its
  // report takes; `after` is the run's state once the step is done.
  virtual Outcome step(int64_t step, double lr, const TrainState& after) = 0;
  // Whether every rank evaluates (sharded or split layers), or the leader alone.
  virtual bool evaluates_everywhere() const = 0;
  // The mean validation loss over train.eval_batches micro-batches of `val`.
  virtual double evaluate(const data::TokenFile& val) = 0;
  // Checkpoint `state` at `path`: written, or with `async` copied for the
  // background writer. A collective; returns the seconds it held the step.
  virtual double save(const std::string& path, const TrainState& state, AsyncCheckpointer* async) = 0;
};

// What the loop needs besides the layout's steps.
struct LoopSetup {
  const Plan& p;
  const optim::LrSchedule& sched;
  comm::Communicator* world = nullptr;  // every rank of the job (null: one process)
  const data::TokenFile* val = nullptr;  // null without data.val
  std::string run_dir;
  int log_interval = 1;  // train.log_interval
  bool leader = true;    // rank 0: writes metrics and the progress
  int threads = 1;       // compute threads per rank (recorded with every step)
  AsyncCheckpointer* async = nullptr;  // checkpoint.async: written in the background
};

// The loop's setup from a run's inputs (no background writer yet).
LoopSetup loop_setup(const RunInputs& r);

// Steps state.step .. train.steps; train.steps = 0 at step 0 checkpoints the
// starting state (an imported model becomes a run that export, generate and
// --resume read). Stops after the step in which any rank was asked to
// (train/stop.h), with that step checkpointed.
TrainResult run_steps(LayoutSteps& steps, const LoopSetup& l, TrainState& state);

}  // namespace po::train
