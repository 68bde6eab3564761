// See run_state.h. A one-process checkpoint is a sharded one of a one-rank
// layout, so every path (save, load, resume, export) runs the same code.
#include "train/run_state.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <filesystem>

#include "core/error.h"
#include "core/log.h"
#include "parallel/shard_layout.h"

namespace po::train {
namespace fs = std::filesystem;
namespace {

using checkpoint::StateKind;

// step_N.tmp: a save that did not finish; step_N.old: an old checkpoint
// renamed out of the way before its removal (so that a process killed while
// removing it never leaves a partial step_N behind).
bool is_staging(const std::string& name) {
  return name.size() > 4 && (name.ends_with(".tmp") || name.ends_with(".old")) &&
         checkpoint_step(name.substr(0, name.size() - 4)).has_value();
}

std::vector<int64_t> unit_numels(const model::Transformer& model) {
  std::vector<int64_t> out;
  for (int u = 0; u < model.num_units(); ++u) out.push_back(model.unit_numel(u));
  return out;
}

// Removes the step_*.tmp staging directories of saves that did not finish and
// the step_*.old ones of removals that did not finish.
void remove_stale_staging(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (!is_staging(e.path().filename().string())) continue;
    std::error_code rm;
    fs::remove_all(e.path(), rm);
  }
}

// The whole flat buffers of one process as a ShardSource/ShardDest under a
// one-rank layout: unit u starts at the model's unit offset.
template <typename Ptr>
Ptr* flat_unit(const model::Transformer& model, Ptr* params, Ptr* m, Ptr* v, StateKind k, int u) {
  Ptr* base = k == StateKind::kParams ? params : k == StateKind::kAdamM ? m : v;
  return base == nullptr ? nullptr : base + model.unit_offset(u);
}

}  // namespace

std::string checkpoint_path(const std::string& run_dir, int64_t step) {
  char name[64];
  std::snprintf(name, sizeof(name), "step_%08lld", static_cast<long long>(step));
  return (fs::path(run_dir) / "checkpoints" / name).string();
}

std::optional<int64_t> checkpoint_step(const std::string& name) {
  if (!name.starts_with("step_") || name.size() == 5 || name.size() > 5 + 18) return std::nullopt;
  int64_t step = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

std::vector<std::string> list_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return {};
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    auto step = checkpoint_step(e.path().filename().string());
    if (step && e.is_directory(ec)) found.emplace_back(*step, e.path().string());
  }
  std::sort(found.begin(), found.end());  // by step, also past 8 digits
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(std::move(f.second));
  return out;
}

void remove_old_checkpoints(const std::string& dir, int64_t keep) {
  PO_CHECK(keep >= 1, "checkpoint.keep = ", keep, " must be at least 1");
  remove_stale_staging(dir);
  auto all = list_checkpoints(dir);
  for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i) {
    // Renamed first (atomic): an abort in the middle of remove_all leaves a
    // step_N.old, never a step_N that names files no longer there.
    const std::string old = all[i] + ".old";
    std::error_code ec;
    fs::rename(all[i], old, ec);
    PO_CHECK(!ec, all[i], ": cannot move the old checkpoint aside for removal: ", ec.message());
    fs::remove_all(old, ec);
    PO_CHECK(!ec, old, ": cannot remove old checkpoint: ", ec.message());
  }
}

std::string resolve_checkpoint(const std::string& ckpt_or_run) {
  std::error_code ec;
  const fs::path p(ckpt_or_run);
  if (fs::is_directory(p, ec) && fs::exists(p / "manifest.json", ec)) return ckpt_or_run;
  if (fs::is_directory(p / "checkpoints", ec)) {
    auto ckpts = list_checkpoints((p / "checkpoints").string());
    PO_CHECK(!ckpts.empty(), ckpt_or_run, ": run directory has no checkpoints (",
             (p / "checkpoints").string(), " is empty)");
    return ckpts.back();
  }
  PO_CHECK(!fs::is_regular_file(p, ec), ckpt_or_run,
           ": a file, but checkpoints are directories (step_NNNNNNNN/ with manifest.json)");
  PO_CHECK(fs::is_directory(p, ec), ckpt_or_run, ": no such checkpoint or run directory");
  PO_THROW(core::InvalidArgument, ckpt_or_run,
           ": neither a checkpoint (no manifest.json; not a complete checkpoint) nor a run "
           "directory (no checkpoints/)");
}

std::vector<checkpoint::TensorRecord> checkpoint_tensors(const model::Layout& layout) {
  std::vector<checkpoint::TensorRecord> out;
  for (const auto& info : layout.tensors())
    out.push_back({info.name, info.shape, info.unit, info.offset - layout.unit_offset(info.unit)});
  return out;
}

std::vector<checkpoint::TensorRecord> checkpoint_tensors(const model::Transformer& model) {
  return checkpoint_tensors(model.layout());
}

void save_checkpoint_sharded(const std::string& path, const model::Transformer& model,
                             const parallel::ShardLayout& layout,
                             const checkpoint::ShardSource& source, const TrainState& state,
                             const std::string& config_toml, comm::Communicator* comm,
                             const std::vector<checkpoint::StateKind>& kinds) {
  save_checkpoint_sharded(path, model.layout(), layout, source, state, config_toml, comm, kinds);
}

void save_checkpoint_sharded(const std::string& path, const model::Layout& units,
                             const parallel::ShardLayout& layout,
                             const checkpoint::ShardSource& source, const TrainState& state,
                             const std::string& config_toml, comm::Communicator* comm,
                             const std::vector<checkpoint::StateKind>& kinds) {
  checkpoint::CheckpointMeta meta = checkpoint_meta(path, units, layout, state, config_toml);
  if (layout.rank() == 0) remove_stale_staging(fs::path(path).parent_path().string());
  checkpoint::SaveOptions options;
  options.kinds = kinds;
  checkpoint::save_sharded(path, meta, layout, source, comm, options);
}

checkpoint::CheckpointMeta checkpoint_meta(const std::string& path, const model::Layout& units,
                                           const parallel::ShardLayout& layout, const TrainState& state,
                                           const std::string& config_toml) {
  bool same_units = layout.num_units() == units.num_units();
  for (int u = 0; same_units && u < units.num_units(); ++u)
    same_units = layout.unit_numel(u) == units.unit_numel(u);
  PO_CHECK(same_units, path, ": the layout's units are not the model's");
  checkpoint::CheckpointMeta meta;
  meta.step = state.step;
  meta.seed = state.seed;
  meta.tokens = state.tokens;
  meta.adam_t = state.adam_t;
  meta.threads = state.threads;
  meta.config_toml = config_toml;
  meta.tensors = checkpoint_tensors(units);
  if (layout.rank() == 0) {
    // Informational only; a config that does not parse (tests) leaves the defaults.
    try {
      const core::Config cfg = core::Config::parse(config_toml, path + " (config)");
      meta.dp = static_cast<int>(cfg.get_int("parallel.dp"));
      meta.zero_stage = static_cast<int>(cfg.get_int("parallel.zero_stage"));
    } catch (const core::Error&) {
    }
  }
  return meta;
}

TrainState load_checkpoint_sharded(const std::string& path, const model::Transformer& model,
                                   const parallel::ShardLayout& layout,
                                   const checkpoint::ShardDest& dest, comm::Communicator* comm,
                                   const std::vector<checkpoint::StateKind>& kinds) {
  return load_checkpoint_sharded(path, model.layout(), layout, dest, comm, kinds);
}

TrainState load_checkpoint_sharded(const std::string& path, const model::Layout& units,
                                   const parallel::ShardLayout& layout,
                                   const checkpoint::ShardDest& dest, comm::Communicator* comm,
                                   const std::vector<checkpoint::StateKind>& kinds) {
  TrainState s;
  std::exception_ptr error;
  try {
    const checkpoint::Manifest m = checkpoint::read_manifest(path);
    try {
      checkpoint::check_tensors(m, checkpoint_tensors(units), path);
    } catch (const core::InvalidArgument& e) {
      PO_THROW(core::InvalidArgument, e.what(),
               " (model.* settings differ from the run that wrote it)");
    }
    checkpoint::load_sharded(path, m, layout, dest, kinds);
    s.step = m.meta.step;
    s.seed = m.meta.seed;
    s.tokens = m.meta.tokens;
    s.adam_t = m.meta.adam_t;
    s.threads = m.meta.threads;
  } catch (...) {
    error = std::current_exception();
  }
  checkpoint::agree_on_success(comm, error, path + ": loading");
  return s;
}

void save_checkpoint(const std::string& path, const model::Transformer& model, optim::AdamW& opt,
                     const TrainState& state, const std::string& config_toml) {
  const parallel::ShardLayout layout(unit_numels(model), 1, 0);
  TrainState s = state;
  s.adam_t = opt.steps_taken();
  const float* m = opt.m();
  const float* v = opt.v();
  save_checkpoint_sharded(
      path, model, layout,
      [&](StateKind k, int u) { return flat_unit(model, model.params(), m, v, k, u); }, s,
      config_toml, nullptr);
}

void keep_threads(TrainState& state, int threads, bool leader) {
  if (leader && state.threads > 0 && state.threads != threads)
    PO_LOG_WARN("resuming at ", threads, " compute threads per rank from a checkpoint written at ",
                state.threads, ": the continued run matches an uninterrupted one to rounding, not "
                "bit for bit (oneDNN splits a GEMM's work by the thread count; set train.threads = ",
                state.threads, " for the same bits)");
  state.threads = threads;
}

core::Config checkpoint_config(const std::string& path) {
  return core::Config::parse(checkpoint::read_sharded_meta(path).config_toml,
                             path + " (stored config)");
}

TrainState load_checkpoint(const std::string& path, model::Transformer& model, optim::AdamW* opt) {
  const parallel::ShardLayout layout(unit_numels(model), 1, 0);
  float* m = opt != nullptr ? opt->m() : nullptr;
  float* v = opt != nullptr ? opt->v() : nullptr;
  std::vector<StateKind> kinds = {StateKind::kParams};
  if (opt != nullptr)
    kinds = {checkpoint::kAllStateKinds.begin(), checkpoint::kAllStateKinds.end()};
  TrainState s = load_checkpoint_sharded(
      path, model, layout,
      [&](StateKind k, int u) { return flat_unit(model, model.params(), m, v, k, u); }, nullptr,
      kinds);
  if (opt != nullptr) opt->set_steps_taken(s.adam_t);
  return s;
}

}  // namespace po::train
