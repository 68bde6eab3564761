// The one loop (train_loop.h).
#include "train/train_loop.h"

#include <filesystem>
#include <optional>

#include "core/error.h"
#include "core/timer.h"
#include "train/metrics.h"
#include "train/stop.h"
#include "train/train_step.h"

namespace po::train {
namespace fs = std::filesystem;

LoopSetup loop_setup(const RunInputs& r) {
  return {r.p,          r.sched,       r.launch.job(),
          r.val,        r.run_dir,     static_cast<int>(r.cfg.get_int("train.log_interval")),
          r.launch.leader, r.threads, nullptr};
}

TrainResult run_steps(LayoutSteps& steps, const LoopSetup& l, TrainState& state) {
  const Plan& p = l.p;
  const std::string ckpt_dir = (fs::path(l.run_dir) / "checkpoints").string();
  std::optional<MetricsWriter> metrics;
  if (l.leader) metrics.emplace((fs::path(l.run_dir) / "metrics.jsonl").string());
  Progress progress;
  TrainResult result;
  result.run_dir = l.run_dir;
  result.leader = l.leader;
  // A background save is committed once every rank has written it, at the
  // latest before the next save starts and before the run ends.
  auto commit_async = [&](bool wait) {
    if (l.async == nullptr || !l.async->pending()) return;
    const std::string done = wait ? l.async->finish() : l.async->poll();
    if (done.empty() || !l.leader) return;
    remove_old_checkpoints(ckpt_dir, p.keep);
    progress.line(core::str_cat(fs::path(done).filename().string(), " committed (written in ",
                                static_cast<int>(l.async->last_write_seconds() * 1000),
                                " ms in the background)"));
  };
  auto save = [&] {
    const double held = steps.save(checkpoint_path(l.run_dir, state.step), state, l.async);
    if (!l.leader) return;
    if (l.async != nullptr) {
      progress.line(core::str_cat("checkpoint step ", state.step, " copied in ",
                                  static_cast<int>(held * 1000), " ms; writing in the background"));
      return;
    }
    remove_old_checkpoints(ckpt_dir, p.keep);
    progress.line(core::str_cat("checkpoint step ", state.step, " saved in ",
                                static_cast<int>(held * 1000), " ms"));
  };
  if (p.steps == 0 && state.step == 0) {
    save();
    commit_async(true);
  }
  double timed_s = 0;  // for the ETA: the steps after the first (which pays one-time costs)
  int64_t timed_steps = 0;
  for (int64_t step = state.step; step < p.end(); ++step) {
    TrainState after = state;
    after.step = step + 1;
    after.tokens += static_cast<uint64_t>(tokens_per_step(p));
    const double lr = l.sched.at(step);
    LayoutSteps::Outcome s = steps.step(step, lr, after);
    state = after;
    if (step > 0 || p.steps == 1) {
      timed_s += s.seconds;
      ++timed_steps;
    }
    result.last_loss = s.loss;
    const bool eval_now = l.val != nullptr &&
                          ((p.eval_interval > 0 && state.step % p.eval_interval == 0) ||
                           state.step == p.end());
    const double vl =
        eval_now && (l.leader || steps.evaluates_everywhere()) ? steps.evaluate(*l.val) : 0.0;
    // A stop request (train/stop.h) on any rank: all checkpoint this step and stop.
    const int stop = state.step < p.end() ? StopRequests::agreed(l.world) : 0;
    const bool last = state.step == p.end() || stop;
    const bool ckpt_now = (p.ckpt_interval > 0 && state.step % p.ckpt_interval == 0) || last;
    core::Timer ckpt_timer;
    commit_async(ckpt_now);
    if (ckpt_now) save();
    if (last) commit_async(true);
    const double ckpt_s = ckpt_timer.seconds();
    if (stop) result.stopped_by = stop;
    if (!l.leader) {
      if (stop) break;
      continue;
    }
    PO_CHECK(!s.records.empty(), "train: the step made no metrics record");
    s.records.front()["checkpoint_ms"] = ckpt_s * 1000;  // what checkpointing held this step
    s.records.front()["threads_per_rank"] = l.threads;   // bit-identity holds at equal threads
    for (const auto& r : s.records) metrics->write(r);
    const double avg = timed_steps > 0 ? timed_s / static_cast<double>(timed_steps) : s.seconds;
    if (state.step % l.log_interval == 0 || state.step == p.end())
      progress.step(state.step, p.end(), s.loss, lr, s.grad_norm, tokens_per_step(p) / s.seconds,
                    avg * static_cast<double>(p.end() - state.step));
    if (eval_now) {
      result.last_val_loss = vl;
      metrics->write({{"step", state.step}, {"val_loss", vl}});
      progress.line(core::str_cat("step ", state.step, " | val loss ", vl));
    }
    if (stop) break;
  }
  progress.finish();
  result.steps = state.step;
  return result;
}

}  // namespace po::train
