// Shared helpers for tests that run the `pagedoptim` binary or need small
// token files and run directories.
#pragma once

#include <cctype>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iterator>
#include <random>
#include <stdexcept>
#include <sstream>
#include <initializer_list>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "checkpoint/manifest.h"
#include "checkpoint/sharded.h"
#include "core/error.h"
#include "parallel/shard_layout.h"
#include "data/token_file.h"
#include "model/config.h"
#include "train/run_state.h"

namespace po::test {

// The message of the po error `fn` throws, or "" when it throws none.
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const core::Error& e) {
    return e.what();
  }
  return "";
}

// A 3-block GPT-2 small enough for unit tests (32 wide, vocab 97, seq 16).
inline model::TransformerConfig tiny_model(bool activation_checkpointing = false) {
  model::TransformerConfig c;
  c.n_layer = 3;
  c.n_embd = 32;
  c.n_head = 2;
  c.vocab_size = 97;
  c.seq_len = 16;
  c.activation_checkpointing = activation_checkpointing;
  return c;
}

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs a shell command, capturing stdout+stderr.
inline CommandResult run_command(const std::string& cmd) {
  CommandResult r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

// A fresh empty directory under the system temp dir, removed with everything
// in it by the destructor. The one scratch-directory helper of the test suite.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "po_test_XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) ADD_FAILURE() << "mkdtemp failed for " << tmpl;
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  // Path of `name` inside the directory.
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::string operator/(const std::string& name) const { return file(name); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// Writes `bytes` to `path` (truncating); a failure is a test failure naming the path.
inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out.good()) ADD_FAILURE() << "cannot write " << path;
}

// The whole file as bytes ("" when it cannot be read).
inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Writes a token file of `n` tokens drawn from a small repeating grammar so
// that a model can learn something.
inline void write_tokens(const std::string& path, size_t n, int vocab, uint32_t seed = 1) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (size_t i = 0; i < n; ++i)
    t[i] = static_cast<int32_t>((i % 7 == 0) ? rng() % vocab : (t[i ? i - 1 : 0] * 3 + 1) % vocab);
  po::data::write_token_file(path, t);
}

// Bit-identity across layouts (and with an uninterrupted run) is defined at
// equal threads per rank: oneDNN splits a GEMM's work by the thread count, so
// pp 1 on two threads differs from pp 2 on one thread per rank in the 8th
// digit, while pp 1 on one thread equals it bit for bit. tiny_config runs
// every rank on this many threads, and losses() checks that each run did.
inline constexpr int kThreadsPerRank = 1;

// A tiny model config (1 layer, 32 wide, vocab 64, seq 16) training on `train`.
inline std::string tiny_config(const std::string& train, const std::string& val,
                               const std::string& run_dir, int steps) {
  std::ostringstream os;
  os << "[model]\npreset = \"gpt2-tiny\"\nn_layer = 2\nn_embd = 32\nn_head = 2\n"
     << "vocab_size = 64\nseq_len = 16\n"
     << "[train]\nbatch_size = 4\nmicro_batch_size = 2\nsteps = " << steps
     << "\nlr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 2\nthreads = " << kThreadsPerRank << "\n"
     << "eval_interval = 2\neval_batches = 2\ncheckpoint_interval = 3\n"
     << "[checkpoint]\nkeep = 10\n"
     << "[data]\ntrain = \"" << train << "\"\nval = \"" << val << "\"\n"
     << "[run]\ndir = \"" << run_dir << "\"\n";
  return os.str();
}

namespace detail {
// metrics.jsonl's records, a line each; a last line without its newline is
// parsed too (a finished run's file must be whole) or, with
// `complete_lines_only`, left out (a run still writing it).
inline std::vector<nlohmann::json> metrics_records(const std::string& run_dir,
                                                   bool complete_lines_only) {
  const std::string path = run_dir + "/metrics.jsonl";
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot read metrics file " + path);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<nlohmann::json> out;
  size_t n = 1;
  for (size_t at = 0; at < text.size(); ++n) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) {
      if (complete_lines_only) break;
      end = text.size();
    }
    try {
      out.push_back(nlohmann::json::parse(text.substr(at, end - at)));
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error(path + ":" + std::to_string(n) + ": not JSON: " + e.what());
    }
    at = end + 1;
  }
  return out;
}
}  // namespace detail

// Every record of a run directory's metrics.jsonl, in order. A file that
// cannot be read, or a line that is not JSON, throws an error naming the file
// (the test fails there): a missing file must never read as an empty curve,
// which would "match" another empty one.
inline std::vector<nlohmann::json> read_metrics(const std::string& run_dir) {
  return detail::metrics_records(run_dir, false);
}

// The records of a run that is still writing: as read_metrics, but a last
// line without its newline (being written while this reads) is left for the
// next look instead of failing the parse.
inline std::vector<nlohmann::json> read_metrics_so_far(const std::string& run_dir) {
  return detail::metrics_records(run_dir, true);
}

// The values of one metric (e.g. "grad_norm", "val_loss") in record order.
// The caller states how many there must be (steps, evaluations); any other
// number throws an error naming the file and the metric.
inline std::vector<double> metric(const std::string& run_dir, const std::string& name,
                                  size_t count) {
  std::vector<double> out;
  for (const auto& j : read_metrics(run_dir))
    if (j.contains(name)) out.push_back(j[name]);
  if (out.size() != count)
    throw std::runtime_error(run_dir + "/metrics.jsonl: expected " + std::to_string(count) + " '" +
                             name + "' values, found " + std::to_string(out.size()));
  return out;
}

// Each metric's `count` values (metric() checks how many), bit for bit: a
// run's against the reference run's, every difference named with `what`.
inline void expect_same_metrics(const std::string& ref, const std::string& run,
                                std::initializer_list<std::pair<const char*, size_t>> keys,
                                const std::string& what) {
  for (const auto& [key, count] : keys) {
    const std::vector<double> a = metric(ref, key, count), b = metric(run, key, count);
    for (size_t i = 0; i < count; ++i)
      EXPECT_EQ(a[i], b[i]) << what << ": " << key << " #" << i + 1 << " differs from the reference run's";
  }
}

// The value of `name` in the last record that has it (null when none), e.g.
// "memory_per_rank" (one row per rank) or "predicted_bytes".
inline nlohmann::json last_metric(const std::string& run_dir, const std::string& name) {
  nlohmann::json last;
  for (const auto& j : read_metrics(run_dir))
    if (j.contains(name)) last = j[name];
  return last;
}

// The train losses of a run directory's metrics.jsonl, in step order: exactly
// `steps` of them, each from a step run at `threads_per_rank` compute threads
// per rank (the count the comparison relies on; a record without the field,
// from an older build, is taken as it is).
inline std::vector<double> losses(const std::string& run_dir, size_t steps,
                                  int threads_per_rank = kThreadsPerRank) {
  for (const auto& j : read_metrics(run_dir))
    if (j.contains("loss") && j.contains("threads_per_rank") &&
        j["threads_per_rank"].get<int>() != threads_per_rank)
      throw std::runtime_error(run_dir + "/metrics.jsonl: step " + j["step"].dump() + " ran at " +
                               j["threads_per_rank"].dump() + " threads per rank; the comparison "
                               "relies on " + std::to_string(threads_per_rank));
  return metric(run_dir, "loss", steps);
}

// Two loss curves of the same, non-zero length agree step by step to a relative 1e-5.
inline void expect_same_curve(const std::vector<double>& a, const std::vector<double>& b,
                              const std::string& what) {
  ASSERT_FALSE(a.empty() && b.empty()) << what << ": both curves are empty";
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_LE(std::fabs(a[i] - b[i]), 1e-5 * std::fabs(a[i]))
        << what << ": step " << i + 1 << " loss " << a[i] << " vs " << b[i];
}

// A TCP port that nobody listens on now, for a test's MASTER_PORT. Taken below
// the kernel's ephemeral range (ip_local_port_range), so no outgoing
// connection of a concurrent test can grab it between pick and use.
inline int free_tcp_port() {
  std::random_device rd;
  std::mt19937 rng(rd());
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int port = 20000 + static_cast<int>(rng() % 12000);  // [20000, 32000)
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<uint16_t>(port));
    const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    close(fd);
    if (ok) return port;
  }
  ADD_FAILURE() << "no free TCP port in [20000, 32000)";
  return 0;
}

// The mpirun line of the multi-process tests (root allowed, oversubscribed on
// 2 cores, idle ranks yield).
inline const std::string kMpirun =
    "mpirun --allow-run-as-root --oversubscribe --bind-to none --mca mpi_yield_when_idle 1";

// `pagedoptim ARGS` as one process, or as `np` ranks under mpirun.
inline std::string pagedoptim_command(int np, const std::string& args) {
  return (np > 1 ? kMpirun + " -np " + std::to_string(np) + " " : std::string()) + PO_BINARY +
         " " + args;
}

// Run a's checkpoint of `step` against run b's: the same state bit for bit,
// wherever the writers cut it (every kind's values of every unit, read
// through the manifests), the same step, seed, tokens, AdamW step count,
// units, tensors and kinds; and, when both were written by as many ranks
// (and `files`: false where their writers cut the state differently, a
// data-parallel run's slices against a pipeline's stages), every rank file
// byte for byte. (The .json records carry the config, which
// may differ in memory.* and parallel.*, and the writers' threads: left out.)
// A checkpoint's whole state as one rank reads it: per state kind (the
// manifest's order), per unit, its floats.
inline std::vector<std::vector<std::vector<float>>> checkpoint_state(const std::string& dir,
                                                                     const checkpoint::Manifest& m) {
  const parallel::ShardLayout one(m.unit_numel, 1, 0);
  std::vector<std::vector<std::vector<float>>> out(m.kinds.size());
  for (size_t k = 0; k < m.kinds.size(); ++k)
    for (int64_t n : m.unit_numel) out[k].emplace_back(static_cast<size_t>(n));
  checkpoint::load_sharded(dir, m, one, [&](checkpoint::StateKind kind, int u) {
    const size_t k = static_cast<size_t>(std::find(m.kinds.begin(), m.kinds.end(), kind) - m.kinds.begin());
    return out[k][static_cast<size_t>(u)].data();
  }, m.kinds);
  return out;
}

// The trained weights of two runs (their checkpoints at `step`), for runs
// whose reduction orders differ (dp, tp, cp against one process): in every
// unit the largest difference is at most `rel` × the reference unit's
// largest magnitude. A failure names the unit, the element and both values.
inline void expect_close_weights(const std::string& ref, const std::string& run, int64_t step, double rel,
                                 const std::string& what) {
  const std::string ca = train::checkpoint_path(ref, step), cb = train::checkpoint_path(run, step);
  ASSERT_TRUE(std::filesystem::exists(ca)) << what << ": no checkpoint " << ca;
  ASSERT_TRUE(std::filesystem::exists(cb)) << what << ": no checkpoint " << cb;
  const checkpoint::Manifest ma = checkpoint::read_manifest(ca), mb = checkpoint::read_manifest(cb);
  ASSERT_EQ(ma.unit_numel, mb.unit_numel) << what << ": the checkpoints' units differ";
  const auto params = [](const checkpoint::Manifest& m) {
    return static_cast<size_t>(std::find(m.kinds.begin(), m.kinds.end(), checkpoint::StateKind::kParams) -
                               m.kinds.begin());
  };
  const auto sa = checkpoint_state(ca, ma), sb = checkpoint_state(cb, mb);
  const auto& wa = sa[params(ma)];
  const auto& wb = sb[params(mb)];
  double worst = 0;
  for (size_t u = 0; u < wa.size(); ++u) {
    double scale = 0, diff = 0;
    size_t at = 0;
    for (size_t i = 0; i < wa[u].size(); ++i) {
      scale = std::max(scale, std::fabs(static_cast<double>(wa[u][i])));
      const double d = std::fabs(static_cast<double>(wa[u][i]) - static_cast<double>(wb[u][i]));
      if (d > diff) diff = d, at = i;
    }
    worst = std::max(worst, diff / std::max(scale, 1e-30));
    EXPECT_LE(diff, rel * scale) << what << ": unit " << u << "'s weights differ from the reference's by "
                                 << diff << " at element " << at << " (" << wb[u][at] << " vs "
                                 << wa[u][at] << "), more than " << rel << " of its largest, " << scale;
  }
  std::printf("[ weights ] %s: largest difference %.3g of a unit's largest weight\n", what.c_str(), worst);
}

inline void expect_same_checkpoint(const std::string& a, const std::string& b, int64_t step,
                                   const std::string& what, bool files = true) {
  const std::string ca = train::checkpoint_path(a, step), cb = train::checkpoint_path(b, step);
  ASSERT_TRUE(std::filesystem::exists(ca)) << ca;
  ASSERT_TRUE(std::filesystem::exists(cb)) << cb;
  const checkpoint::Manifest ma = checkpoint::read_manifest(ca), mb = checkpoint::read_manifest(cb);
  EXPECT_EQ(ma.meta.step, mb.meta.step) << what;
  EXPECT_EQ(ma.meta.seed, mb.meta.seed) << what;
  EXPECT_EQ(ma.meta.tokens, mb.meta.tokens) << what;
  EXPECT_EQ(ma.meta.adam_t, mb.meta.adam_t) << what;
  // Equal bits are defined at equal threads per rank (kThreadsPerRank).
  if (ma.meta.threads > 0 && mb.meta.threads > 0) {
    EXPECT_EQ(ma.meta.threads, mb.meta.threads)
        << what << ": the checkpoints were written at different threads per rank";
  }
  ASSERT_EQ(ma.unit_numel, mb.unit_numel) << what << ": the checkpoints' units differ";
  ASSERT_EQ(ma.kinds, mb.kinds) << what << ": the checkpoints hold different state kinds";
  ASSERT_EQ(ma.meta.tensors.size(), mb.meta.tensors.size()) << what;
  for (size_t i = 0; i < ma.meta.tensors.size(); ++i)
    EXPECT_TRUE(ma.meta.tensors[i].name == mb.meta.tensors[i].name &&
                ma.meta.tensors[i].shape == mb.meta.tensors[i].shape &&
                ma.meta.tensors[i].unit == mb.meta.tensors[i].unit &&
                ma.meta.tensors[i].offset == mb.meta.tensors[i].offset)
        << what << ": tensor " << i << " (" << ma.meta.tensors[i].name << ") is recorded differently";
  // The whole state, unit by unit, as one rank reads it.
  const auto sa = checkpoint_state(ca, ma), sb = checkpoint_state(cb, mb);
  for (size_t k = 0; k < sa.size(); ++k)
    for (size_t u = 0; u < sa[k].size(); ++u) {
      const auto& x = sa[k][u];
      const auto& y = sb[k][u];
      const auto d = std::mismatch(x.begin(), x.end(), y.begin(), [](float p, float q) {
        return std::memcmp(&p, &q, sizeof p) == 0;
      });
      EXPECT_TRUE(d.first == x.end())
          << what << ": " << checkpoint::state_kind_name(ma.kinds[k]) << " of unit " << u
          << " differs from the reference run's at element " << (d.first - x.begin()) << " ("
          << (d.first == x.end() ? 0.0f : *d.first) << " vs " << (d.first == x.end() ? 0.0f : *d.second)
          << ")";
    }
  if (!files || ma.writers != mb.writers) return;
  // The same files in both (the manifest and one per writer), then their bytes.
  auto names = [](const std::string& dir) {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(dir)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  };
  EXPECT_EQ(names(ca), names(cb)) << what << ": the checkpoints hold different files";
  for (const auto& e : std::filesystem::directory_iterator(ca)) {
    const std::string name = e.path().filename().string();
    if (name.ends_with(".json")) continue;
    EXPECT_EQ(read_file(e.path().string()), read_file(cb + "/" + name))
        << what << ": " << name << " differs from the reference run's";
  }
}

// The smallest compute budget a paged run accepts, from the one-line error
// of a run given too little ("... at least N bytes ..."); 0 if none is named.
inline int64_t named_minimum_budget(const std::string& output) {
  const std::string key = "at least ";
  for (size_t at = output.find(key); at != std::string::npos; at = output.find(key, at + 1)) {
    size_t end = at + key.size();
    while (end < output.size() && std::isdigit(static_cast<unsigned char>(output[end]))) ++end;
    if (end > at + key.size() && output.compare(end, 6, " bytes") == 0)
      return std::stoll(output.substr(at + key.size(), end - at - key.size()));
  }
  return 0;
}

// Token files for in-process training of the tiny model (train::train):
// tiny_config() text for a run directory under the same temporary directory.
struct TinyData {
  TempDir dir;
  std::string train = dir / "train.bin", val = dir / "val.bin";
  TinyData() {
    write_tokens(train, 20000, 64, 1);
    write_tokens(val, 4000, 64, 2);
  }
  std::string config_text(const std::string& run, int steps) const {
    return tiny_config(train, val, dir / run, steps);
  }
};

// A fixture for tests that train the tiny model through the binary: token
// files and a tiny_config() of steps() steps in a fresh directory per test.
class TinyTraining : public ::testing::Test {
 protected:
  virtual int steps() const { return 20; }
  void SetUp() override {
    write_tokens(train_, 30000, 64);
    write_tokens(val_, 3000, 64, 2);
    write_file(config_, tiny_config(train_, val_, dir_ / "unused", steps()) + "\n");
  }
  // `pagedoptim train -c CONFIG` with run.dir = dir_/name, parallel.dp = dp
  // and parallel.tp = tp (as dp × tp ranks under mpirun), then `args`.
  CommandResult run_train(const std::string& name, int dp, const std::string& args,
                          int tp = 1) const {
    return run_command(pagedoptim_command(
        dp * tp, "train -c " + config_ + " --set run.dir=" + (dir_ / name) +
                     " --set parallel.dp=" + std::to_string(dp) +
                     (tp > 1 ? " --set parallel.tp=" + std::to_string(tp) : std::string()) + " " +
                     args));
  }
  // The same, expected to succeed; returns the run directory.
  std::string train_ok(const std::string& name, int dp, const std::string& args) const {
    const CommandResult r = run_train(name, dp, args);
    EXPECT_EQ(r.exit_code, 0) << name << ": train " << args << "\n" << r.output;
    return dir_ / name;
  }
  // A new run directory dir_/name holding a copy of run `src`'s checkpoint
  // of `step` (to --resume from); returns its path.
  std::string copy_checkpoint(const std::string& src, int64_t step, const std::string& name) const {
    const std::string run = dir_ / name;
    std::filesystem::create_directories(run + "/checkpoints");
    std::filesystem::copy(train::checkpoint_path(src, step), train::checkpoint_path(run, step),
                          std::filesystem::copy_options::recursive);
    return run;
  }
  TempDir dir_;
  std::string train_ = dir_ / "train.bin", val_ = dir_ / "val.bin", config_ = dir_ / "c.toml";
};

// ||got - want|| / ||want|| <= tol for a tensor against a reference (PyTorch);
// on failure the message names the tensor and the largest element
// difference. Returns the relative error.
inline double expect_close(const float* got, const std::vector<float>& want,
                           const std::string& what, double tol) {
  double diff2 = 0, ref2 = 0, worst = 0;
  size_t worst_i = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    diff2 += d * d;
    ref2 += static_cast<double>(want[i]) * want[i];
    if (std::fabs(d) > worst) {
      worst = std::fabs(d);
      worst_i = i;
    }
  }
  const double rel = std::sqrt(diff2) / std::max(std::sqrt(ref2), 1e-30);
  EXPECT_LE(rel, tol) << what << ": relative error " << rel << " (limit " << tol
                      << "); largest difference at element " << worst_i << ": engine "
                      << got[worst_i] << " vs reference " << want[worst_i];
  return rel;
}

}  // namespace po::test
