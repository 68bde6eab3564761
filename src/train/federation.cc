// Federation across separately launched jobs: the coordinator and the client
// (federation.h; docs/diloco.md).
#include "train/federation.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>

#include "checkpoint/model_io.h"
#include "checkpoint/outer_file.h"
#include "comm/federation_protocol.h"
#include "comm/tls_stream.h"
#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"
#include "model/layout.h"
#include "model/transformer.h"
#include "parallel/shard_layout.h"
#include "train/fed_round.h"
#include "train/model_setup.h"
#include "train/run_state.h"

namespace po::train {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

optim::OuterConfig federated_server(const core::Config& cfg) {
  const std::string& algo = cfg.get_string("federated.algorithm");
  const double lr = cfg.get_float("federated.server_lr");
  optim::OuterConfig c;
  c.momentum = cfg.get_float("outer.momentum");
  c.beta2 = cfg.get_float("outer.beta2");
  c.eps = cfg.get_float("outer.eps");
  PO_CHECK(algo != "fedprox", "federated.algorithm = \"fedprox\": not built yet (the client's update does not take "
           "the proximal term μ(w − θ) yet; docs/diloco.md)");
  if (algo == "fedavg") {
    c = {optim::OuterKind::kSgd, lr > 0 ? lr : 1.0, 0.0, c.beta2, c.eps};
  } else if (algo == "fedadam" || algo == "fedyogi") {
    c.kind = algo == "fedadam" ? optim::OuterKind::kAdam : optim::OuterKind::kYogi;
    c.lr = lr > 0 ? lr : 0.01;
  } else if (algo == "diloco") {
    c.kind = optim::parse_outer_kind(cfg.get_string("outer.optimizer"));
    c.lr = lr > 0 ? lr : cfg.get_float("outer.lr");
  } else {
    PO_THROW(core::InvalidArgument, "federated.algorithm = \"", algo,
             "\": choose \"fedavg\", \"fedprox\", \"fedadam\", \"fedyogi\" or \"diloco\"");
  }
  return c;
}

std::string federation_secret(const core::Config& cfg) {
  const std::string& file = cfg.get_string("federated.secret_file");
  std::string secret;
  if (!file.empty()) {
    std::ifstream in(file, std::ios::binary);
    PO_CHECK(in.good(), "federated.secret_file = '", file, "': cannot be read");
    secret.assign(std::istreambuf_iterator<char>(in), {});
    while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r')) secret.pop_back();
    PO_CHECK(!secret.empty(), "federated.secret_file = '", file, "' is empty");
  } else if (const char* env = std::getenv("PAGEDOPTIM_FEDERATE_SECRET")) {
    secret = env;
  }
  return secret;
}

namespace {

constexpr int kHandshakeMs = 15000;
// The largest handshake frame either end takes (a Challenge, Hello or
// Welcome is under 200 bytes; a Refuse's reason at most 64 KiB).
constexpr uint64_t kHandshakeFrame = 80 << 10;
// An authenticated peer's Model or Update may be gigabytes on a slow link:
// the whole frame within an hour (before authentication, read_message's
// default minute).
constexpr int kFrameMs = 3600 * 1000;

// The model's tensors as the federation names them (the checkpoint's names
// and shapes), data from a flat buffer per unit.
std::vector<comm::NamedTensor> named_tensors(const model::Layout& layout,
                                             const std::vector<std::vector<float>>& units) {
  std::vector<comm::NamedTensor> out;
  for (const checkpoint::TensorRecord& r : checkpoint_tensors(layout)) {
    const float* p = units[static_cast<size_t>(r.unit)].data() + r.offset;
    out.push_back(comm::f32_tensor(r.name, r.shape, std::span<const float>(p, static_cast<size_t>(r.numel()))));
  }
  return out;
}

// θ's tensors written into a flat buffer per unit (by name: any order);
// InvalidArgument naming `who` for a tensor missing or of another shape.
void fill_units(const model::Layout& layout, const std::vector<comm::NamedTensor>& tensors,
                std::vector<std::vector<float>>& units, const std::string& who) {
  const std::vector<checkpoint::TensorRecord> records = checkpoint_tensors(layout);
  PO_CHECK(tensors.size() == records.size(), who, " has ", tensors.size(), " tensors, this model ", records.size());
  std::map<std::string, const comm::NamedTensor*> by_name;
  for (const comm::NamedTensor& t : tensors) by_name[t.name] = &t;
  for (const checkpoint::TensorRecord& r : records) {
    const auto it = by_name.find(r.name);
    PO_CHECK(it != by_name.end() && it->second->shape == r.shape, who, " has no tensor ", r.name,
             " of this model's shape");
    const std::vector<float> x = comm::tensor_f32(*it->second);
    std::copy(x.begin(), x.end(), units[static_cast<size_t>(r.unit)].begin() + r.offset);
  }
}

// The whole model's units held by one process (a checkpoint written or read whole).
parallel::ShardLayout one_rank(const model::Layout& layout) {
  std::vector<int64_t> numel;
  for (int u = 0; u < layout.num_units(); ++u) numel.push_back(layout.unit_numel(u));
  return parallel::ShardLayout(numel, 1, 0);
}

uint64_t fingerprint_of(const model::Layout& layout) {
  std::vector<comm::NamedTensor> t;
  for (const checkpoint::TensorRecord& r : checkpoint_tensors(layout)) t.push_back({r.name, r.shape, comm::WireDtype::kF32, {}});
  return comm::model_fingerprint(t);
}

std::string ids_text(const std::set<uint32_t>& ids) {
  std::string s = "[";
  for (uint32_t id : ids) s += (s.size() > 1 ? ", " : "") + std::to_string(id);
  return s + "]";
}

// ---- the coordinator ------------------------------------------------------------

class Coordinator {
 public:
  explicit Coordinator(const core::Config& cfg)
      : cfg_(cfg),
        mcfg_(resolve_model_config(cfg)),
        layout_(mcfg_),
        secret_(federation_secret(cfg)),
        rounds_(static_cast<uint64_t>(cfg.get_int("federated.rounds"))),
        min_clients_(static_cast<size_t>(cfg.get_int("federated.min_clients"))),
        timeout_s_(cfg.get_float("federated.round_timeout")),
        dir_((fs::path(cfg.get_string("run.dir")) / "federation").string()) {
    PO_CHECK(!secret_.empty(), "federate serve: no job secret: set federated.secret_file, or "
             "PAGEDOPTIM_FEDERATE_SECRET in the environment");
    PO_CHECK(!layout_.adapters(), "federation of adapters (LoRA): not built yet (docs/diloco.md)");
    fingerprint_ = fingerprint_of(layout_);
    round_.emplace(initial_theta(), federated_server(cfg), 0);
    resume();
  }

  int run() {
    const auto [host, port] = comm::parse_host_port(cfg_.get_string("federated.listen"), "federated.listen", true);
    comm::TlsListener listener(host, port, {cfg_.get_string("federated.tls_cert"), cfg_.get_string("federated.tls_key")});
    std::printf("federation: listening on %s:%d (round %llu of %llu)\n", host.c_str(), listener.port(),
                static_cast<unsigned long long>(round_->round()), static_cast<unsigned long long>(rounds_));
    std::fflush(stdout);
    std::thread acceptor([&] { accept_loop(listener); });
    while (round_->round() < rounds_) run_round();
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    write_final_model();
    // Every connected client is told Done (its thread sends it), then the
    // listener stops.
    const auto until = Clock::now() + std::chrono::seconds(10);
    {
      std::unique_lock lock(mu_);
      cv_.wait_until(lock, until, [&] { return threads_ == 0; });
    }
    stopping_ = true;
    acceptor.join();
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return threads_ == 0; });
    std::printf("federation: done after %llu rounds; clients dropped %llu times, %llu stragglers, %llu updates "
                "refused; model %s\n",
                static_cast<unsigned long long>(round_->round()), static_cast<unsigned long long>(totals_[0]),
                static_cast<unsigned long long>(totals_[1]), static_cast<unsigned long long>(totals_[2]),
                final_path_.c_str());
    return 0;
  }

 private:
  // θ of round 0: model.init's weights, or the random initialisation of train.seed.
  std::vector<comm::NamedTensor> initial_theta() {
    model::Transformer whole(mcfg_.weights_only(), 1, 1);
    const std::string& init = cfg_.get_string("model.init");
    if (init == "random")
      whole.init_random(static_cast<uint64_t>(cfg_.get_int("train.seed")));
    else
      checkpoint::load_model_weights(init, whole);
    std::vector<std::vector<float>> units;
    for (int u = 0; u < whole.num_units(); ++u) {
      const float* p = whole.params() + whole.unit_offset(u);
      units.emplace_back(p, p + whole.unit_numel(u));
    }
    return named_tensors(layout_, units);
  }

  std::string state_path() const { return (fs::path(dir_) / "state.bin").string(); }

  // After round r closed: θ, the server optimizer, the round and the counters.
  void checkpoint_state() {
    checkpoint::OuterFile f;
    const auto& theta = round_->theta();
    for (size_t i = 0; i < theta.size(); ++i) {
      f.names.push_back("theta/" + theta[i].name);
      f.arrays.push_back(comm::tensor_f32(theta[i]));
      f.names.push_back("m/" + theta[i].name);
      f.arrays.push_back(round_->server_m()[i]);
      f.names.push_back("v/" + theta[i].name);
      f.arrays.push_back(round_->server_v()[i]);
    }
    f.steps = {static_cast<int64_t>(round_->round()), round_->server_steps(), static_cast<int64_t>(totals_[0]),
               static_cast<int64_t>(totals_[1]), static_cast<int64_t>(totals_[2]), static_cast<int64_t>(fingerprint_)};
    fs::create_directories(dir_);
    checkpoint::write_outer_file(state_path(), f);
  }

  void resume() {
    if (!fs::exists(state_path())) return;
    const checkpoint::OuterFile f = checkpoint::read_outer_file(state_path());
    const std::string what = state_path();
    PO_CHECK(f.steps.size() == 6, what, ": not a coordinator's state (", f.steps.size(), " counters)");
    PO_CHECK(static_cast<uint64_t>(f.steps[5]) == fingerprint_, what,
             ": written for another model (its tensors' names or shapes differ from this config's)");
    std::vector<comm::NamedTensor> theta;
    std::vector<std::vector<float>> m, v;
    for (const comm::NamedTensor& t : round_->theta()) {
      theta.push_back(comm::f32_tensor(t.name, t.shape, f.array("theta/" + t.name, what)));
      m.push_back(f.array("m/" + t.name, what));
      v.push_back(f.array("v/" + t.name, what));
    }
    round_.emplace(std::move(theta), federated_server(cfg_), static_cast<uint64_t>(f.steps[0]));
    round_->restore(f.steps[1], std::move(m), std::move(v));
    for (int i = 0; i < 3; ++i) totals_[i] = static_cast<uint64_t>(f.steps[2 + i]);
    PO_LOG_INFO("federation: resuming at round ", round_->round(), " from ", what);
  }

  void write_final_model() {
    const int64_t H = std::max<int64_t>(1, cfg_.get_int("train.local_steps"));
    final_path_ = checkpoint_path(cfg_.get_string("run.dir"), static_cast<int64_t>(rounds_) * H);
    std::vector<std::vector<float>> units;
    for (int u = 0; u < layout_.num_units(); ++u) units.emplace_back(static_cast<size_t>(layout_.unit_numel(u)), 0.0f);
    fill_units(layout_, round_->theta(), units, "the federation's model");
    core::Config stored = cfg_;
    store_resolved_model(stored, mcfg_);
    TrainState st;
    st.step = static_cast<int64_t>(rounds_) * H;
    st.seed = static_cast<uint64_t>(cfg_.get_int("train.seed"));
    save_checkpoint_sharded(final_path_, layout_, one_rank(layout_),
                            [&](checkpoint::StateKind, int u) { return units[static_cast<size_t>(u)].data(); }, st,
                            stored.to_toml(), nullptr, {checkpoint::StateKind::kParams});
  }

  // One round: wait for min_clients, open, wait for the answers or the
  // timeout, close, checkpoint.
  void run_round() {
    std::unique_lock lock(mu_);
    auto last_note = Clock::now();
    while (live_.size() < min_clients_) {
      cv_.wait_for(lock, std::chrono::seconds(1));
      if (Clock::now() - last_note > std::chrono::seconds(30)) {
        PO_LOG_INFO("federation: round ", round_->round(), " waits for clients: ", live_.size(), " of ",
                    min_clients_, " connected");
        last_note = Clock::now();
      }
    }
    const uint64_t r = round_->round();
    participants_.clear();
    for (const auto& [id, gen] : live_) participants_.insert(id);
    answered_.clear();
    dropped_.clear();
    model_frame_ = std::make_shared<const std::string>(comm::encode(round_->model()));
    open_ = true;
    core::Timer timer;
    PO_LOG_INFO("federation: round ", r, " open: clients ", ids_text(participants_));
    cv_.notify_all();
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(timeout_s_));
    cv_.wait_until(lock, deadline, [&] { return answered_.size() + dropped_.size() == participants_.size(); });
    open_ = false;
    std::set<uint32_t> stragglers;
    for (uint32_t id : participants_)
      if (!answered_.contains(id) && !dropped_.contains(id)) stragglers.insert(id);
    totals_[0] += dropped_.size();
    totals_[1] += stragglers.size();
    nlohmann::json rec = {{"round", r},
                          {"participants", participants_},
                          {"dropped", dropped_},
                          {"stragglers", stragglers},
                          {"bytes_out", bytes_[0]},
                          {"bytes_in", bytes_[1]}};
    bytes_[0] = bytes_[1] = 0;
    if (round_->received() == 0) {
      PO_LOG_WARN("federation: round ", r, " closed with no update (dropped ", ids_text(dropped_), ", stragglers ",
                  ids_text(stragglers), "); it opens again on the same model");
      rec["repeated"] = true;
    } else {
      const std::vector<uint32_t> clients = round_->clients();
      const std::vector<std::vector<float>> mean = round_->close();
      double sq = 0;
      for (const auto& d : mean)
        for (float x : d) sq += static_cast<double>(x) * x;
      rec["clients"] = clients;
      rec["delta_norm"] = std::sqrt(sq);
      rec["theta_hash"] = checkpoint::hex64(round_->theta_hash());
      PO_LOG_INFO("federation: round ", r, " closed with clients ", ids_text({clients.begin(), clients.end()}),
                  dropped_.empty() ? "" : core::str_cat("; dropped ", ids_text(dropped_)),
                  stragglers.empty() ? "" : core::str_cat("; stragglers ", ids_text(stragglers)),
                  "; |mean update| ", std::sqrt(sq));
    }
    rec["seconds"] = timer.seconds();
    rec["totals"] = {{"dropped", totals_[0]}, {"stragglers", totals_[1]}, {"refused", totals_[2]}};
    checkpoint_state();
    std::ofstream(fs::path(dir_) / "metrics.jsonl", std::ios::app) << rec.dump() << "\n";
    cv_.notify_all();
  }

  void accept_loop(comm::TlsListener& listener) {
    while (!stopping_) {
      std::optional<comm::PendingSocket> s;
      try {
        s = listener.accept_socket(200);
      } catch (const std::exception& e) {
        PO_LOG_WARN("federation: accept: ", e.what());
        continue;
      }
      if (!s) continue;
      {
        std::lock_guard lock(mu_);
        ++threads_;
      }
      std::thread([this, &listener, s = std::move(*s)]() mutable {
        try {
          comm::TlsStream stream = listener.handshake(std::move(s), kHandshakeMs);
          serve_client(stream);
        } catch (const std::exception& e) {
          PO_LOG_WARN("federation: ", e.what());
        }
        std::lock_guard lock(mu_);
        --threads_;
        cv_.notify_all();
      }).detach();
    }
  }

  void refuse(comm::TlsStream& s, const std::string& reason) {
    PO_LOG_WARN("federation: refused ", s.peer(), ": ", reason);
    {
      std::lock_guard lock(mu_);
      ++totals_[2];
    }
    try {
      s.write_message(comm::Refuse{reason});
    } catch (const std::exception&) {
    }
  }

  // One client's connection, on its own thread: the handshake, then each
  // round's model out and its update in.
  void serve_client(comm::TlsStream& s) {
    const comm::Nonce32 nonce = comm::random_nonce();
    const comm::Nonce32 bound = comm::bind_challenge(nonce, s.channel_binding());
    s.write_message(comm::Challenge{nonce});
    std::optional<comm::Message> m =
        s.read_message(kHandshakeMs, [this] { return stopping_.load(); }, kHandshakeMs, kHandshakeFrame);
    if (!m) return;
    const comm::Hello hello = comm::expect<comm::Hello>(std::move(*m), s.peer());
    const std::string who = core::str_cat("client ", hello.client_id, " (", s.peer(), ")");
    if (hello.model_fingerprint != fingerprint_)
      return refuse(s, core::str_cat(who, " trains another model than this federation's (its tensors' names or "
                                          "shapes differ: fingerprint ", checkpoint::hex64(hello.model_fingerprint),
                                     ", the federation's ", checkpoint::hex64(fingerprint_), ")"));
    if (!comm::verify_hello(secret_, bound, hello))
      return refuse(s, core::str_cat(who, " did not prove its key: wrong secret or key for client id ",
                                     hello.client_id));
    const uint32_t id = hello.client_id;
    uint64_t gen = 0, sent = UINT64_MAX, joined_at = 0;
    {
      std::lock_guard lock(mu_);
      gen = ++generation_;
      // A reconnecting client replaces its old connection; in an open round
      // it was a participant of, it is dropped (it waits for the next round).
      if (live_.contains(id) && open_ && participants_.contains(id) && !answered_.contains(id)) dropped_.insert(id);
      live_[id] = gen;
      joined_at = round_->round();
    }
    s.write_message(comm::make_welcome(secret_, bound, hello, joined_at));
    PO_LOG_INFO("federation: ", who, " joined");
    cv_.notify_all();
    const auto current = [&] { return live_.contains(id) && live_[id] == gen; };
    const auto leave = [&](const std::string& why) {
      std::lock_guard lock(mu_);
      if (!current()) return;
      live_.erase(id);
      if (open_ && participants_.contains(id) && !answered_.contains(id)) dropped_.insert(id);
      PO_LOG_WARN("federation: ", who, " left: ", why);
      cv_.notify_all();
    };
    try {
      for (;;) {
        std::shared_ptr<const std::string> frame;
        uint64_t r = 0;
        {
          std::unique_lock lock(mu_);
          cv_.wait(lock, [&] {
            return !current() || done_ ||
                   (open_ && participants_.contains(id) && !dropped_.contains(id) && sent != round_->round());
          });
          if (!current()) return;
          if (done_) {
            lock.unlock();
            s.write_message(comm::Done{round_->round(), round_->theta_hash()});
            s.close();
            return;
          }
          frame = model_frame_;
          r = sent = round_->round();
          bytes_[0] += frame->size();
        }
        s.write(*frame);
        std::optional<comm::Message> msg = s.read_message(
            -1,
            [&] {
              if (stopping_) return true;
              std::lock_guard lock(mu_);
              return !current();
            },
            kFrameMs);
        if (!msg) return;
        comm::Update u = comm::expect<comm::Update>(std::move(*msg), who);
        std::string reason;
        {
          std::lock_guard lock(mu_);
          for (const comm::NamedTensor& t : u.tensors) bytes_[1] += t.data.size();
          if (u.client_id != id) {
            reason = core::str_cat(who, " sent an update signed as client ", u.client_id);
          } else if (!open_ || u.round != round_->round() || !participants_.contains(id) || dropped_.contains(id)) {
            reason = core::str_cat(who, ": its update for round ", u.round, " is stale: round ", r,
                                   " closed without it (past federated.round_timeout); it gets round ",
                                   round_->round(), "'s model next");
          } else {
            try {
              round_->add(std::move(u));
              answered_.insert(id);
            } catch (const core::InvalidArgument& e) {
              reason = e.what();
            }
          }
          cv_.notify_all();
        }
        if (!reason.empty()) {
          refuse(s, reason);
          continue;
        }
        s.write_message(comm::Ack{r, id});
      }
    } catch (const core::CommError& e) {
      leave(e.what());
    } catch (const core::IoError& e) {
      leave(e.what());
    }
  }

  const core::Config& cfg_;
  const model::TransformerConfig mcfg_;
  const model::Layout layout_;
  const std::string secret_;
  const uint64_t rounds_;
  const size_t min_clients_;
  const double timeout_s_;
  const std::string dir_;
  uint64_t fingerprint_ = 0;
  std::string final_path_;

  std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  std::optional<FedRound> round_;
  std::map<uint32_t, uint64_t> live_;  // connected clients: id → its connection's generation
  uint64_t generation_ = 0;
  bool open_ = false, done_ = false;
  std::set<uint32_t> participants_, answered_, dropped_;
  std::shared_ptr<const std::string> model_frame_;
  uint64_t totals_[3] = {0, 0, 0};  // dropped, stragglers, refused
  uint64_t bytes_[2] = {0, 0};      // this round's out and in
  int threads_ = 0;
  std::atomic<bool> stopping_{false};
};

// ---- the client ------------------------------------------------------------------

class Client {
 public:
  Client(const std::string& address, const core::Config& cfg, std::string config_path, std::vector<std::string> sets,
         int nproc)
      : cfg_(cfg),
        mcfg_(resolve_model_config(cfg)),
        layout_(mcfg_),
        id_(static_cast<uint32_t>(cfg.get_int("federated.client_id"))),
        H_(cfg.get_int("train.local_steps")),
        rounds_(cfg.get_int("federated.rounds")),
        run_dir_(cfg.get_string("run.dir")),
        config_path_(std::move(config_path)),
        sets_(std::move(sets)),
        nproc_(nproc) {
    std::tie(host_, port_) = comm::parse_host_port(address, "federate join's address");
    PO_CHECK(H_ > 0, "federate join: train.local_steps = 0: set the inner steps each round trains (H)");
    PO_CHECK(!layout_.adapters(), "federation of adapters (LoRA): not built yet (docs/diloco.md)");
    PO_CHECK(cfg.get_int("parallel.replicas") == 1, "federate join: parallel.replicas = ",
             cfg.get_int("parallel.replicas"), ": a client is one replica (the coordinator is the outer level)");
    const std::string& key_file = cfg.get_string("federated.key_file");
    if (!key_file.empty()) {
      std::ifstream in(key_file);
      std::string hex;
      in >> hex;
      PO_CHECK(hex.size() == 64 && hex.find_first_not_of("0123456789abcdefABCDEF") == std::string::npos,
               "federated.key_file = '", key_file, "': expected the client key as 64 hex digits");
      for (size_t i = 0; i < 32; ++i) key_[i] = static_cast<uint8_t>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
    } else {
      const std::string secret = federation_secret(cfg);
      PO_CHECK(!secret.empty(), "federate join: no key: set federated.key_file (this client's key), "
               "federated.secret_file, or PAGEDOPTIM_FEDERATE_SECRET in the environment");
      key_ = comm::client_key(secret, id_);
    }
    fingerprint_ = fingerprint_of(layout_);
    who_ = core::str_cat("client ", id_);
  }

  int run() {
    const double patience = cfg_.get_float("federated.connect_timeout");
    auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(patience));
    for (;;) {
      std::optional<comm::TlsStream> s;
      try {
        s.emplace(comm::tls_connect(host_, port_, {cfg_.get_string("federated.tls_ca")}, kHandshakeMs));
      } catch (const core::CommError& e) {
        PO_CHECK(Clock::now() < deadline, who_, ": no coordinator at ", host_, ":", port_, " for ", patience,
                 " s (federated.connect_timeout): ", e.what());
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
        continue;
      }
      try {
        if (session(*s)) return 0;
      } catch (const core::CommError& e) {
        PO_LOG_WARN(who_, ": lost the coordinator (", e.what(), "); reconnecting");
      } catch (const core::IoError& e) {
        PO_LOG_WARN(who_, ": lost the coordinator (", e.what(), "); reconnecting");
      }
      deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(patience));
    }
  }

 private:
  // One connection: the handshake, then rounds until Done (true) or the
  // connection fails (a CommError or IoError).
  bool session(comm::TlsStream& s) {
    const std::string coord = "the coordinator at " + s.peer();
    std::optional<comm::Message> m = s.read_message(kHandshakeMs, {}, kHandshakeMs, kHandshakeFrame);
    if (!m) PO_THROW(core::CommError, coord, " sent no challenge within ", kHandshakeMs / 1000, " s");
    const comm::Challenge ch = comm::expect<comm::Challenge>(std::move(*m), coord);
    const comm::Nonce32 bound = comm::bind_challenge(ch.nonce, s.channel_binding());
    const comm::Hello hello = comm::make_hello(key_, bound, id_, fingerprint_);
    s.write_message(hello);
    m = s.read_message(kHandshakeMs, {}, kHandshakeMs, kHandshakeFrame);
    if (!m) PO_THROW(core::CommError, coord, " did not answer the hello within ", kHandshakeMs / 1000, " s");
    if (const auto* refused = std::get_if<comm::Refuse>(&*m))
      PO_THROW(core::InvalidArgument, who_, ": refused by ", coord, ": ", refused->reason);
    const comm::Welcome welcome = comm::expect<comm::Welcome>(std::move(*m), coord);
    PO_CHECK(comm::verify_welcome(key_, bound, hello, welcome), who_, ": ", coord,
             " could not prove it holds the job's secret (another federation, or a man in the middle)");
    PO_LOG_INFO(who_, ": joined ", coord, " at round ", welcome.round);
    for (;;) {
      m = s.read_message(-1, {}, kFrameMs);
      if (const auto* done = std::get_if<comm::Done>(&*m)) {
        PO_LOG_INFO(who_, ": the federation is done after ", done->round, " rounds (model ",
                    checkpoint::hex64(done->theta_hash), ")");
        return true;
      }
      comm::Model model = comm::expect<comm::Model>(std::move(*m), coord);
      const uint64_t r = model.round;
      comm::Update update;
      try {
        update = train_round(std::move(model));
      } catch (const core::CommError& e) {  // not the connection's: the round's training failed
        throw std::runtime_error(e.what());
      } catch (const core::IoError& e) {
        throw std::runtime_error(e.what());
      }
      s.write_message(update);
      m = s.read_message(-1, {}, kFrameMs);
      if (const auto* refused = std::get_if<comm::Refuse>(&*m)) {
        PO_LOG_WARN(who_, ": round ", r, "'s update refused: ", refused->reason);
        continue;
      }
      (void)comm::expect<comm::Ack>(std::move(*m), coord);
    }
  }

  // Per state kind, per unit: a whole model's state in one process.
  using State = std::map<checkpoint::StateKind, std::vector<std::vector<float>>>;

  State empty_state() const {
    State st;
    for (checkpoint::StateKind k : checkpoint::kAllStateKinds)
      for (int u = 0; u < layout_.num_units(); ++u)
        st[k].emplace_back(static_cast<size_t>(layout_.unit_numel(u)), 0.0f);
    return st;
  }

  TrainState load(const std::string& path, State& st, const std::vector<checkpoint::StateKind>& kinds) const {
    return load_checkpoint_sharded(path, layout_, one_rank(layout_),
                                   [&](checkpoint::StateKind k, int u) { return st[k][static_cast<size_t>(u)].data(); },
                                   nullptr, kinds);
  }

  // Round r: θ into RUN/checkpoints/step_<rH> with this client's optimizer
  // state, `pagedoptim train` to step (r+1)H, Δ = θ − θ_k.
  comm::Update train_round(comm::Model model) {
    PO_CHECK(comm::theta_hash(model.tensors) == model.theta_hash, who_, ": round ", model.round,
             "'s model does not hash to the hash it carries");
    const int64_t start = static_cast<int64_t>(model.round) * H_, end = start + H_;
    const std::string ckpt_dir = (fs::path(run_dir_) / "checkpoints").string();
    std::optional<std::string> base;
    for (const std::string& c : list_checkpoints(ckpt_dir)) {
      if (*checkpoint_step(fs::path(c).filename().string()) > start)
        fs::remove_all(c);  // a round trained before the coordinator restarted
      else
        base = c;
    }
    State st = empty_state();
    TrainState ts;
    if (base) ts = load(*base, st, {checkpoint::kAllStateKinds.begin(), checkpoint::kAllStateKinds.end()});
    const std::vector<std::vector<float>>& theta = st[checkpoint::StateKind::kParams];
    fill_units(layout_, model.tensors, st[checkpoint::StateKind::kParams],
               core::str_cat(who_, ": round ", model.round, "'s model"));
    ts.step = start;
    ts.seed = static_cast<uint64_t>(cfg_.get_int("train.seed"));
    const uint64_t tokens_before = ts.tokens;
    core::Config stored = cfg_;
    store_resolved_model(stored, mcfg_);
    const std::string start_path = checkpoint_path(run_dir_, start);
    save_checkpoint_sharded(start_path, layout_, one_rank(layout_),
                            [&](checkpoint::StateKind k, int u) { return st[k][static_cast<size_t>(u)].data(); }, ts,
                            stored.to_toml(), nullptr,
                            {checkpoint::kAllStateKinds.begin(), checkpoint::kAllStateKinds.end()});
    PO_LOG_INFO(who_, ": round ", model.round, ": training steps ", start, "..", end);
    run_train(end);
    const std::string end_path = checkpoint_path(run_dir_, end);
    State after = empty_state();
    const TrainState te = load(end_path, after, {checkpoint::StateKind::kParams});
    comm::Update u;
    u.round = model.round;
    u.theta_hash = model.theta_hash;
    u.client_id = id_;
    u.num_examples = (te.tokens - tokens_before) / static_cast<uint64_t>(mcfg_.seq_len);
    u.steps_done = static_cast<uint64_t>(te.step - start);
    // Δ = θ − θ_k, unit by unit, then named as θ's tensors.
    std::vector<std::vector<float>>& local = after[checkpoint::StateKind::kParams];
    for (size_t k = 0; k < local.size(); ++k)
      for (size_t i = 0; i < local[k].size(); ++i) local[k][i] = theta[k][i] - local[k][i];
    u.tensors = named_tensors(layout_, local);
    return u;
  }

  // `pagedoptim train` on this client's config, resumed from step_<start>,
  // until step `end`; the child dies with this process.
  void run_train(int64_t end) const {
    std::vector<std::string> args = {"pagedoptim", "train", "-c", config_path_};
    for (const std::string& s : sets_) args.insert(args.end(), {"--set", s});
    const int64_t keep = std::max<int64_t>(cfg_.get_int("checkpoint.keep"), 2);
    args.insert(args.end(), {"--set", core::str_cat("train.steps=", rounds_ * H_), "--set",
                             core::str_cat("train.stop_at=", end), "--set", "train.local_steps=0", "--set",
                             core::str_cat("checkpoint.keep=", keep), "--resume"});
    if (nproc_ > 1) args.insert(args.end(), {"--nproc", std::to_string(nproc_)});
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t parent = getpid();
    std::fflush(nullptr);
    const pid_t pid = fork();
    PO_CHECK(pid >= 0, who_, ": fork failed: ", std::strerror(errno));
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);
      execv("/proc/self/exe", argv.data());
      _exit(127);
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    PO_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, who_, ": the round's training (pagedoptim train to step ",
             end, ") failed with ", WIFEXITED(status) ? core::str_cat("exit ", WEXITSTATUS(status))
                                                      : core::str_cat("signal ", WTERMSIG(status)),
             "; its output is above");
  }

  const core::Config& cfg_;
  const model::TransformerConfig mcfg_;
  const model::Layout layout_;
  const uint32_t id_;
  const int64_t H_, rounds_;
  const std::string run_dir_, config_path_;
  const std::vector<std::string> sets_;
  const int nproc_;
  std::string host_, who_;
  int port_ = 0;
  comm::Key32 key_{};
  uint64_t fingerprint_ = 0;
};

}  // namespace

int serve_federation(const core::Config& cfg) {
  signal(SIGPIPE, SIG_IGN);
  Coordinator c(cfg);
  return c.run();
}

int join_federation(const std::string& address, const core::Config& cfg, const std::string& config_path,
                    const std::vector<std::string>& sets, int nproc) {
  signal(SIGPIPE, SIG_IGN);
  Client c(address, cfg, config_path, sets, nproc);
  return c.run();
}

}  // namespace po::train
