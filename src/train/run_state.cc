#include "train/run_state.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "checkpoint/container.h"
#include "core/error.h"

namespace po::train {
namespace fs = std::filesystem;

model::GPT2Config resolve_model_config(const core::Config& config) {
  model::GPT2Config m = model::GPT2Config::preset(config.get_string("model.preset"));
  auto over = [&](const char* key, int64_t& field) {
    if (config.is_set(key) && config.get_int(key) > 0) field = config.get_int(key);
  };
  over("model.n_layer", m.n_layer);
  over("model.n_embd", m.n_embd);
  over("model.n_head", m.n_head);
  over("model.vocab_size", m.vocab_size);
  over("model.seq_len", m.seq_len);
  m.activation_checkpointing = config.get_bool("model.activation_checkpointing");
  m.validate();
  return m;
}

std::string checkpoint_path(const std::string& run_dir, int64_t step) {
  char name[64];
  std::snprintf(name, sizeof(name), "step_%08lld.ckpt", static_cast<long long>(step));
  return (fs::path(run_dir) / "checkpoints" / name).string();
}

std::vector<std::string> list_checkpoints(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with("step_") && name.ends_with(".ckpt")) out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());  // zero-padded step numbers sort by step
  return out;
}

std::string resolve_checkpoint(const std::string& ckpt_or_run) {
  std::error_code ec;
  if (fs::is_regular_file(ckpt_or_run, ec)) return ckpt_or_run;
  PO_CHECK(fs::is_directory(ckpt_or_run, ec), ckpt_or_run,
           ": no such checkpoint file or run directory");
  auto ckpts = list_checkpoints((fs::path(ckpt_or_run) / "checkpoints").string());
  PO_CHECK(!ckpts.empty(), ckpt_or_run, ": run directory has no checkpoints (",
           (fs::path(ckpt_or_run) / "checkpoints").string(), " is empty or absent)");
  return ckpts.back();
}

void save_checkpoint(const std::string& path, const model::GPT2& model, optim::AdamW& opt,
                     const TrainState& state, const std::string& config_toml) {
  fs::create_directories(fs::path(path).parent_path());
  const size_t bytes = static_cast<size_t>(model.num_params()) * sizeof(float);
  checkpoint::ContainerWriter w;
  w.set_metadata("format", "pagedoptim-train-checkpoint");
  w.add_copy("config", config_toml);
  w.add_value("step", state.step);
  w.add_value("seed", state.seed);
  w.add_value("tokens", state.tokens);
  w.add_value("adam_t", opt.steps_taken());
  w.add_value("num_params", model.num_params());
  w.add("params", model.params(), bytes);
  w.add("adam_m", opt.m(), bytes);
  w.add("adam_v", opt.v(), bytes);
  w.write(path);
}

core::Config checkpoint_config(const std::string& path) {
  auto r = checkpoint::ContainerReader::open(path);
  return core::Config::parse(r.read_string("config"), path + " (stored config)");
}

TrainState load_checkpoint(const std::string& path, model::GPT2& model, optim::AdamW* opt) {
  auto r = checkpoint::ContainerReader::open(path);
  const auto n = r.read_value<int64_t>("num_params");
  PO_CHECK(n == model.num_params(), path, ": checkpoint holds ", n,
           " parameters but the configured model has ", model.num_params(),
           " (model.* settings differ from the run that wrote it)");
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  r.read_into("params", model.params(), bytes);
  TrainState s;
  s.step = r.read_value<int64_t>("step");
  s.seed = r.read_value<uint64_t>("seed");
  s.tokens = r.read_value<uint64_t>("tokens");
  if (opt != nullptr) {
    r.read_into("adam_m", opt->m(), bytes);
    r.read_into("adam_v", opt->v(), bytes);
    opt->set_steps_taken(r.read_value<int64_t>("adam_t"));
  }
  return s;
}

}  // namespace po::train
