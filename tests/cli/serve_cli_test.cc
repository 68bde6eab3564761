// `pagedoptim serve` as users run it: a tiny random GPT-2 exported to
// safetensors, the binary started on a free port, its "serving ... on" line
// read, its greedy /generate and /v1/completions compared with `pagedoptim
// generate --temperature 0` token for token, then SIGTERM while a stream is
// running: the stream completes (drain) and the process exits 0. Bad flags
// fail at start with one line naming the flag.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <sstream>
#include <string>
#include <thread>

#include "../test_util.h"
#include "model/transformer.h"
#include "core/http_lib.h"
#include "checkpoint/model_io.h"
#include "checkpoint/peft.h"
#include "train/model_setup.h"

namespace {

using json = nlohmann::json;
using po::test::run_command;
using po::test::TempDir;

const std::string kBin = PO_BINARY;

// A running `pagedoptim serve`: its pid, its stdout read line by line, its
// stderr in a file.
class ServeProcess {
 public:
  ServeProcess(const std::string& args, const std::string& err_path) {
    int out[2];
    if (pipe(out) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], STDOUT_FILENO);
      close(out[0]);
      close(out[1]);
      const std::string cmd = "exec " + kBin + " serve " + args + " 2> " + err_path;
      execl("/bin/sh", "sh", "-c", cmd.c_str(), nullptr);
      _exit(127);
    }
    close(out[1]);
    out_ = fdopen(out[0], "r");
  }
  ~ServeProcess() {
    if (pid_ > 0 && waitpid(pid_, nullptr, WNOHANG) == 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_) fclose(out_);
  }
  // The first stdout line ("" when the process ended first).
  std::string line() {
    char buf[512];
    return out_ && fgets(buf, sizeof buf, out_) ? std::string(buf) : std::string();
  }
  void signal(int sig) { kill(pid_, sig); }
  // The exit code, or -1 when it has not exited within `limit`.
  int wait_exit(std::chrono::seconds limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < until) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }

 private:
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
};

// The ids `pagedoptim generate --temperature 0 --print-ids` prints.
std::vector<int32_t> generate_ids(const std::string& model, const std::string& prompt, int n) {
  const auto r = run_command(kBin + " generate " + model + " --prompt '" + prompt +
                             "' --temperature 0 --max-new-tokens " + std::to_string(n) + " --print-ids");
  std::vector<int32_t> ids;
  const size_t at = r.output.find("ids:");
  if (r.exit_code != 0 || at == std::string::npos) {
    ADD_FAILURE() << "generate failed: " << r.output;
    return ids;
  }
  std::istringstream in(r.output.substr(at + 4));
  for (int32_t id; in >> id;) ids.push_back(id);
  return ids;
}

class ServeCli : public ::testing::Test {
 protected:
  void SetUp() override {
    po::model::TransformerConfig c = po::model::TransformerConfig::arch_defaults("gpt2");
    c.n_layer = 2;
    c.n_embd = 64;  // a GPT-2 safetensors file does not store the head count: 64 wide heads are assumed
    c.n_head = 1;
    c.vocab_size = 50257;
    c.seq_len = 64;
    c.fill_derived();
    po::model::Transformer m(c, 1, c.seq_len);
    m.init_random(3);
    model_ = dir_ / "tiny.safetensors";
    po::checkpoint::export_model_weights(model_, m);
  }
  TempDir dir_;
  std::string model_;
};

TEST_F(ServeCli, ServesGenerateGreedyAndDrainsOnSigterm) {
  ServeProcess p(model_ + " --port 0 --max-concurrent-requests 4 --threads 1", dir_ / "serve.err");
  const std::string first = p.line();
  const std::string want_head = "serving " + model_ + " on http://127.0.0.1:";
  ASSERT_TRUE(first.starts_with(want_head)) << "stdout: " << first << "\nstderr: " << po::test::read_file(dir_ / "serve.err");
  const int port = std::stoi(first.substr(want_head.size()));
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(std::chrono::seconds(30));

  auto h = cli.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  const auto want = generate_ids(model_, "Hello there", 8);
  auto g = cli.Post("/generate", R"({"inputs":"Hello there","parameters":{"max_new_tokens":8}})", "application/json");
  ASSERT_TRUE(g);
  ASSERT_EQ(g->status, 200) << g->body;
  std::vector<int32_t> got;
  const json generated = json::parse(g->body);
  for (const auto& t : generated["details"]["tokens"]) got.push_back(t["id"]);
  // The same greedy tokens, all of them (an empty answer must not pass).
  ASSERT_FALSE(want.empty()) << "generate gave no tokens";
  ASSERT_EQ(got.size(), want.size()) << "/generate gave " << got.size() << " tokens, generate " << want.size();
  for (size_t k = 0; k < got.size(); ++k) EXPECT_EQ(got[k], want[k]) << "/generate token " << k;
  auto o = cli.Post("/v1/completions", R"({"prompt":"Hello there","max_tokens":8,"temperature":0,"logprobs":0})",
                    "application/json");
  ASSERT_TRUE(o);
  ASSERT_EQ(o->status, 200) << o->body;
  EXPECT_EQ(json::parse(o->body)["choices"][0]["logprobs"]["tokens"].size(), got.size());

  // A stream in flight when SIGTERM comes finishes (the drain's grace), then the process exits 0.
  std::string streamed;
  std::thread client([&] {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(std::chrono::seconds(30));
    auto s = c.Post("/v1/completions", R"({"prompt":"x","max_tokens":60,"ignore_eos":true,"stream":true})",
                    "application/json");
    if (s) streamed = s->body;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  p.signal(SIGTERM);
  const int code = p.wait_exit(std::chrono::seconds(40));
  client.join();
  EXPECT_EQ(code, 0) << po::test::read_file(dir_ / "serve.err");
  EXPECT_TRUE(streamed.ends_with("data: [DONE]\n\n")) << "the running stream was cut: " << streamed;
  EXPECT_NE(po::test::read_file(dir_ / "serve.err").find("draining"), std::string::npos);
}

// The clients users run: npm's openai (completions and chat, streaming and
// not, maxRetries 0) and @huggingface/inference (textGenerationStream),
// under node, against the real binary with an API key. Greedy texts must
// agree with each other and with `generate`.
TEST_F(ServeCli, RealClientsStreamWhatGenerateGives) {
  ServeProcess p(model_ + " --port 0 --threads 1 --api-key test-key", dir_ / "serve.err");
  const std::string first = p.line();
  const size_t at = first.rfind(':');
  ASSERT_TRUE(first.starts_with("serving ") && at != std::string::npos)
      << "stdout: " << first << "\nstderr: " << po::test::read_file(dir_ / "serve.err");
  const std::string base = "http://127.0.0.1:" + std::to_string(std::stoi(first.substr(at + 1)));
  const auto r = run_command("node " + std::string(PO_SOURCE_DIR) + "/tests/serve/clients.mjs " + base +
                             " test-key 'Hello there' 12 2>&1");
  ASSERT_EQ(r.exit_code, 0) << "the clients failed (run scripts/setup for the npm packages): " << r.output;
  const json got = json::parse(r.output.substr(r.output.find('{')));
  const std::string completion = got["completion"];
  std::printf("[clients] completion %s\n", json(completion).dump().c_str());
  EXPECT_FALSE(completion.empty()) << "12 greedy tokens of a random model gave no text";
  EXPECT_EQ(got["completion_stream"], completion) << "openai completions: streamed vs not";
  EXPECT_EQ(got["hf_stream"], completion) << "@huggingface/inference's stream vs openai's completion";
  EXPECT_EQ(got["tgi_generate"], completion) << "/generate (a TGI client, @huggingface/inference 2.8.1) vs openai's";
  EXPECT_EQ(got["tgi_compat"], completion) << "TGI's compat route / vs openai's completion";
  EXPECT_EQ(got["tgi_stream"], completion) << "/generate_stream's token events vs openai's completion";
  EXPECT_EQ(got["tgi_stream_final"], completion) << "/generate_stream's generated_text vs openai's completion";
  EXPECT_FALSE(got["chat"].get<std::string>().empty()) << "openai chat gave no text";
  EXPECT_EQ(got["chat_stream"], got["chat"]) << "openai chat: streamed vs not";
  const int used = got["completion_usage"]["completion_tokens"].get<int>();
  EXPECT_TRUE(used >= 1 && used <= 12) << "completion usage: " << got["completion_usage"];
  EXPECT_GT(got["chat_stream_usage"]["total_tokens"].get<int>(), 0) << "no usage in the final chunk";
  // echo with logprobs: the prompt and the completion, every token scored but the first.
  const json& echo = got["echo"];
  EXPECT_EQ(echo["text"], "Hello there" + completion) << echo;
  std::string joined;
  for (const auto& t : echo["tokens"]) joined += t.get<std::string>();
  EXPECT_EQ(joined, echo["text"]) << echo;
  ASSERT_GT(echo["token_logprobs"].size(), 2u) << echo;
  EXPECT_TRUE(echo["token_logprobs"][0].is_null()) << echo;
  for (size_t i = 1; i < echo["token_logprobs"].size(); ++i)
    EXPECT_TRUE(echo["token_logprobs"][i].is_number()) << "token " << i << ": " << echo;
  EXPECT_EQ(got["models"], json::array({model_})) << "/v1/models";
  EXPECT_EQ(got["wrong_key_status"], 401) << "a wrong key must be refused";
  // The text `generate` prints after the prompt.
  const auto g = run_command(kBin + " generate " + model_ + " --prompt 'Hello there' --temperature 0 --max-new-tokens 12");
  ASSERT_EQ(g.exit_code, 0) << g.output;
  // (stderr's timing line follows the text: compare the line that starts with the prompt)
  const size_t text_at = g.output.rfind("Hello there");
  ASSERT_NE(text_at, std::string::npos) << g.output;
  const std::string printed = g.output.substr(text_at, g.output.find('\n', text_at) - text_at);
  EXPECT_EQ("Hello there" + completion, printed) << "the served completion differs from generate's text";
  EXPECT_NE(g.output.find("tokens/s"), std::string::npos) << "generate prints no timings: " << g.output;
}

// `serve --lora a=DIR --lora b=DIR` (PEFT directories): requests of a, b and
// the base, sent at once, each give the greedy tokens `generate` gives on the
// model `merge` makes of that adapter (and on the base).
TEST_F(ServeCli, LoraAdaptersGiveTheirMergedModelsTokens) {
  po::model::TransformerConfig c = po::model::TransformerConfig::arch_defaults("gpt2");
  c.n_layer = 2, c.n_embd = 64, c.n_head = 1, c.vocab_size = 50257, c.seq_len = 64;
  const po::model::TransformerConfig base_config = c;
  std::map<std::string, std::string> merged;
  for (const std::string name : {"a", "b"}) {
    po::model::TransformerConfig ac = base_config;
    ac.lora.r = 4;
    ac.lora.alpha = 8;
    ac.lora.targets = name == "a" ? std::vector<std::string>{"c_attn", "c_fc"} : std::vector<std::string>{"attn.c_proj", "mlp.c_proj"};
    po::model::Transformer m(ac, 1, ac.seq_len);
    po::checkpoint::load_model_weights(model_, m);
    m.init_adapters(name == "a" ? 5 : 6);
    for (const po::model::TensorSpec& t : m.param_infos())  // B not 0: the adapter changes the output
      if (t.name.find("lora_B") != std::string::npos)
        for (int64_t i = 0; i < t.numel(); ++i) m.params()[t.offset + i] = 0.2f * static_cast<float>(((i * 7919 + (name == "a" ? 1 : 2)) % 17) - 8) / 8.0f;
    po::checkpoint::write_peft_adapter(dir_ / name, m, model_);
    merged[name] = dir_ / (name + ".safetensors");
    const auto r = run_command(kBin + " merge " + model_ + " " + (dir_ / name) + " --out " + merged[name]);
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  ServeProcess p(model_ + " --port 0 --threads 1 --lora a=" + (dir_ / "a") + " --lora b=" + (dir_ / "b"),
                 dir_ / "serve.err");
  const std::string first = p.line();
  const std::string want_head = "serving " + model_ + " on http://127.0.0.1:";
  ASSERT_TRUE(first.starts_with(want_head)) << "stdout: " << first << "\nstderr: " << po::test::read_file(dir_ / "serve.err");
  const int port = std::stoi(first.substr(want_head.size()));
  const std::vector<std::string> adapters = {"", "a", "b"};
  std::vector<std::vector<int32_t>> got(adapters.size());
  std::vector<std::string> answers(adapters.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < adapters.size(); ++i)
    clients.emplace_back([&, i] {
      httplib::Client cli("127.0.0.1", port);
      cli.set_read_timeout(std::chrono::seconds(30));
      json body = {{"inputs", "Hello there"}, {"parameters", {{"max_new_tokens", 8}}}};
      if (!adapters[i].empty()) body["parameters"]["adapter_id"] = adapters[i];
      auto g = cli.Post("/generate", body.dump(), "application/json");
      answers[i] = g ? std::to_string(g->status) + " " + g->body : "no answer: " + httplib::to_string(g.error());
      if (!g || g->status != 200) return;
      const json answer = json::parse(g->body);
      for (const auto& t : answer["details"]["tokens"]) got[i].push_back(t["id"]);
    });
  for (auto& t : clients) t.join();
  for (size_t i = 0; i < adapters.size(); ++i) {
    const auto want = generate_ids(adapters[i].empty() ? model_ : merged[adapters[i]], "Hello there", 8);
    ASSERT_FALSE(want.empty());
    ASSERT_EQ(got[i].size(), want.size()) << "adapter '" << adapters[i] << "': " << answers[i];
    for (size_t k = 0; k < want.size(); ++k) EXPECT_EQ(got[i][k], want[k]) << "adapter '" << adapters[i] << "' token " << k;
  }
  EXPECT_NE(got[1], got[0]) << "adapter a gave the base's tokens";
  p.signal(SIGTERM);
  EXPECT_EQ(p.wait_exit(std::chrono::seconds(40)), 0);
}

TEST_F(ServeCli, BadFlagsFailAtStartNamingTheFlag) {
  struct Case {
    std::string args, want;
  } cases[] = {
      {model_ + " --port 0 --kv-budget lots", "--kv-budget"},
      {model_ + " --port 0 --chat-template vicuna", "chat template 'vicuna'"},
      {model_ + " --port 0 --max-total-tokens 500", "--max-total-tokens"},
      {dir_ / "missing.safetensors", "missing.safetensors"},
      {model_ + " --port 0 --lora a", "--lora 'a': expected NAME=DIR"},
      {model_ + " --port 0 --lora a=" + std::string(PO_SOURCE_DIR) + "/tests/golden/peft_llama",
       "peft_llama"},  // another architecture's adapter
  };
  for (const auto& c : cases) {
    const auto r = run_command(kBin + " serve " + c.args);
    EXPECT_EQ(r.exit_code, 1) << c.args << ": " << r.output;
    EXPECT_NE(r.output.find(c.want), std::string::npos) << c.args << ": " << r.output;
    EXPECT_NE(r.output.find("pagedoptim: error: "), std::string::npos) << c.args << ": " << r.output;
  }
  const auto open = run_command(kBin + " serve " + (dir_ / "missing.safetensors") + " --host 0.0.0.0 --port 0");
  EXPECT_NE(open.output.find("warning: serving on 0.0.0.0 without --api-key"), std::string::npos) << open.output;
}

}  // namespace
