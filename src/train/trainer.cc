// train(): the wiring. Launch (train/launch), the data, the schedule of
// learning rates, then every layout's steps through the pipeline executor
// (train/pipeline_train: pp = 1 is its one-stage schedule). Every input is
// validated before run.dir is touched.
#include "train/trainer.h"

#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "comm/env.h"
#include "core/error.h"
#include "core/log.h"
#include "data/loader.h"
#include "data/split.h"
#include "data/token_file.h"
#include "optim/adamw.h"
#include "train/optim_keys.h"
#include "optim/schedule.h"
#include "train/launch.h"
#include "train/live_metrics.h"
#include "train/model_setup.h"
#include "train/pipeline_train.h"
#include "train/run_inputs.h"
#include "train/run_state.h"
#include "train/stop.h"

namespace po::train {
namespace fs = std::filesystem;
namespace {

// data.train, data.val and model.init name files that exist.
void check_inputs(const core::Config& cfg) {
  PO_CHECK(!cfg.get_string("data.train").empty(), "data.train is not set (a token file from ",
           "`pagedoptim prepare`)");
  for (const char* key : {"data.train", "data.val"}) {
    const std::string& path = cfg.get_string(key);
    std::error_code ec;
    PO_CHECK(path.empty() || fs::is_regular_file(path, ec), key, " = '", path,
             "': no such file (make token files with `pagedoptim prepare`)");
  }
  const std::string& init = cfg.get_string("model.init");
  std::error_code ec;
  PO_CHECK(init == "random" || fs::is_regular_file(init, ec) || fs::is_directory(init, ec),
           "model.init = '", init,
           "': no such file (give \"random\", a .safetensors file, a Hugging Face model "
           "directory or a llama2.c .bin)");
}

// data.val, when set (null otherwise).
std::unique_ptr<data::TokenFile> open_val(const core::Config& cfg,
                                          const model::TransformerConfig& mcfg) {
  if (cfg.get_string("data.val").empty()) return nullptr;
  return std::make_unique<data::TokenFile>(cfg.get_string("data.val"),
                                           static_cast<int32_t>(mcfg.vocab_size));
}

// SFT data: the examples of a token file with a loss mask beside it (data/sft.h), else null.
std::unique_ptr<data::SftExamples> open_sft(const data::TokenFile& file, const Plan& p, bool pack,
                                            const char* key) {
  const std::string mask = data::mask_path(file.path());
  if (!fs::exists(mask)) return nullptr;
  auto sft = std::make_unique<data::SftExamples>(file, data::read_mask_file(mask, file.size()), p.T, pack);
  PO_LOG_INFO(key, ": SFT data, ", sft->examples(), " examples in ", sft->rows(), pack ? " packed" : "",
              " rows of ", p.T, " tokens (the loss counts the replies' tokens, ", mask, ")",
              sft->truncated() > 0 ? core::str_cat("; ", sft->truncated(), " examples cut to ", p.T, " tokens") : "");
  return sft;
}

// Fail now, not at the first evaluation.
void check_val_batch(const data::TokenFile& val, const Plan& p, const data::SftExamples* sft) {
  data::EvalSampler windows(val, p.T, sft);
  PO_CHECK(windows.num_sequences() >= p.micro, "data.val = '", val.path(), "' has ", val.size(),
           " tokens: too few for one validation batch of ", p.micro, " x ", p.T + 1);
}

optim::LrSchedule lr_schedule(const core::Config& cfg, const Plan& p) {
  optim::LrSchedule sched;
  sched.kind = cfg.get_string("train.schedule");
  sched.lr = cfg.get_float("train.lr");
  sched.min_lr = cfg.get_float("train.min_lr");
  sched.warmup_steps = cfg.get_int("train.warmup_steps");
  sched.total_steps = p.steps;
  sched.validate();
  return sched;
}

// data.split: this client's share of the documents (data/split.h).
void split_data(const core::Config& cfg, const data::TokenFile& train, data::BatchSampler& sampler, bool leader) {
  const data::Split split = data::parse_split(cfg.get_string("data.split"), "data.split");
  if (split.kind == data::Split::Kind::kNone) return;
  const int K = static_cast<int>(cfg.get_int("data.split_clients"));
  const int k = static_cast<int>(cfg.get_int("federated.client_id"));
  const std::vector<data::Document> docs = data::read_documents(train.path(), static_cast<int64_t>(train.size()));
  const std::vector<size_t> mine =
      data::client_documents(docs, split, K, k, static_cast<uint64_t>(cfg.get_int("train.seed")));
  PO_CHECK(!mine.empty(), "data.split = \"", cfg.get_string("data.split"), "\": client ", k, " of ", K,
           " gets no document of ", train.path(), "'s ", docs.size());
  sampler.restrict_to(data::document_spans(docs, mine));
  if (!leader) return;
  std::set<std::string> groups;
  for (size_t i : mine) groups.insert(data::source_group(docs[i].source));
  std::string names;
  for (const std::string& g : groups) names += (names.empty() ? "" : ", ") + g;
  PO_LOG_INFO("data.split = \"", cfg.get_string("data.split"), "\": client ", k, " of ", K, " trains on ", mine.size(),
              " of ", docs.size(), " documents (", sampler.windows(), " windows) from ", groups.size(), " source",
              groups.size() == 1 ? "" : "s", groups.size() <= 4 ? " (" + names + ")" : "");
}

}  // namespace

void check_config(const core::Config& cfg) { (void)make_plan(cfg, resolve_model_config(cfg)); }

TrainResult train(const core::Config& cfg) {
  const model::TransformerConfig mcfg = resolve_model_config(cfg);
  const Plan p = make_plan(cfg, mcfg);
  const std::string run_dir = cfg.get_string("run.dir");
  const bool resume = cfg.get_bool("train.resume");
  const uint64_t seed = static_cast<uint64_t>(cfg.get_int("train.seed"));
  // From here a stop request is a checkpoint after the current step (train/stop.h).
  // Under mpirun a SIGTERM is mpirun aborting the job (a rank died): it ends
  // the process at once; mpirun forwards the stop signal.
  const StopRequests stop_requests(
      stop_signal_number(cfg.get_string("train.stop_signal"), "train.stop_signal"), cfg.get_float("train.stop_timeout"),
      comm::detect_launch_env().source != comm::LaunchSource::kOpenMpi);
  // One that came while the process started: a stop after the first step.
  if (const int early = release_early_signals()) raise(early);
  const Launch launch(cfg, p);
  // train.metrics_port: rank 0 serves the run's latest metrics.
  std::optional<LiveMetrics> live;
  if (launch.leader && cfg.get_int("train.metrics_port") > 0) {
    live.emplace(cfg.get_string("train.metrics_host"), static_cast<int>(cfg.get_int("train.metrics_port")));
    PO_LOG_INFO("metrics: http://", cfg.get_string("train.metrics_host"), ":", live->port(), "/metrics");
  }
  const int threads = setup_compute(cfg, launch.local_ranks);

  // Validate every input before touching run.dir.
  check_inputs(cfg);
  data::TokenFile train_data(cfg.get_string("data.train"), static_cast<int32_t>(mcfg.vocab_size));
  const std::unique_ptr<data::TokenFile> val_data = open_val(cfg, mcfg);
  const bool pack = cfg.get_bool("data.pack");
  const std::unique_ptr<data::SftExamples> train_sft = open_sft(train_data, p, pack, "data.train");
  const std::unique_ptr<data::SftExamples> val_sft = val_data ? open_sft(*val_data, p, pack, "data.val") : nullptr;
  PO_CHECK(!pack || train_sft, "data.pack = true packs SFT examples, but data.train = '", train_data.path(),
           "' has no loss mask beside it (", data::mask_path(train_data.path()),
           "; write both with pagedoptim prepare --sft)");
  PO_CHECK(!val_data || !train_sft == !val_sft, "data.val = '", cfg.get_string("data.val"), "' ",
           val_sft ? "has" : "has no", " loss mask beside it but data.train ", train_sft ? "has" : "has none",
           ": validate SFT data on SFT data (both from pagedoptim prepare --sft)");
  data::BatchSampler sampler(train_data, p.T, seed, train_sft.get());
  split_data(cfg, train_data, sampler, launch.leader);
  if (val_data) check_val_batch(*val_data, p, val_sft.get());
  const optim::LrSchedule sched = lr_schedule(cfg, p);

  core::Config stored = cfg;
  store_resolved_model(stored, mcfg);
  const RunInputs run{cfg, mcfg, p, launch, sampler, sched, val_data.get(), val_sft.get(),
                      train::adamw_config(cfg), run_dir, stored.to_toml(), seed, resume, threads};
  // Every layout through the executor: pp = 1 is its one-stage schedule.
  TrainResult result = train_pipeline(run);
  // Stopped on request: every rank leaves together, once rank 0 has reported
  // and every rank has freed its state (its swap files removed): mpirun ends
  // the job when the first rank exits non-zero, killing the others wherever
  // they are, and the --nproc launcher returns when mpirun does.
  if (result.stopped_by != 0) {
    if (result.leader)  // before the barrier: once another rank exits, mpirun may end this one
      std::fprintf(stderr,
                   "pagedoptim: stopped on request after step %lld; checkpoint written; exit %d "
                   "(resume with --resume)\n",
                   static_cast<long long>(result.steps), kExitResume);
    if (launch.job() != nullptr) launch.job()->ibarrier().wait();
  }
  return result;
}

}  // namespace po::train
