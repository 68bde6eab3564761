// The federation coordinator (train/federation.h) in this process, driven over
// real TLS on 127.0.0.1 by clients that speak the protocol by hand
// (comm/federation_protocol.h), so a test chooses what each sends and when:
//   - the model it ends with does not depend on the order updates arrive in
//     (random delays), and equals FedRound's in-memory sum;
//   - a wrong secret and another model's shape are refused by name, and
//     counted; the round goes on with the others;
//   - a straggler past federated.round_timeout is dropped from its round and
//     counted, its late update refused as stale, and it trains the next round;
//   - a coordinator stopped after a round and started again on its run
//     directory ends where an uninterrupted one does, bit for bit.
// Real training clients, SIGKILL and restarts: federate_launch_test.cc.
#include "train/federation.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../test_util.h"
#include "comm/federation_protocol.h"
#include "comm/tls_stream.h"
#include "core/config.h"
#include "model/layout.h"
#include "train/fed_round.h"
#include "train/model_setup.h"
#include "train/run_state.h"

namespace po::train {
namespace {

namespace fs = std::filesystem;
const std::string kSecret = "federation-test-secret";

core::Config tiny(const std::string& run_dir, int port, const std::vector<std::string>& extra) {
  std::vector<std::string> sets = {"run.dir=" + run_dir, "federated.listen=127.0.0.1:" + std::to_string(port),
                                   "model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.vocab_size=32",
                                   "model.seq_len=8", "train.local_steps=2"};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return core::Config::load(std::string(PO_SOURCE_DIR) + "/configs/tiny.toml", sets);
}

// The model's tensors, named and shaped as the coordinator's (data empty).
std::vector<comm::NamedTensor> shapes_of(const core::Config& cfg) {
  std::vector<comm::NamedTensor> out;
  for (const auto& r : checkpoint_tensors(model::Layout(resolve_model_config(cfg))))
    out.push_back({r.name, r.shape, comm::WireDtype::kF32, {}});
  return out;
}

// A client's update for `round`: values from its id and the round alone.
comm::Update update_of(const comm::Model& m, uint32_t id) {
  comm::Update u{m.round, m.theta_hash, id, 8u * (id + 1), 2, {}};
  std::mt19937 rng(1000 * id + static_cast<uint32_t>(m.round));
  std::normal_distribution<float> g(0.0f, 1e-3f);
  for (const comm::NamedTensor& t : m.tensors) {
    std::vector<float> d(static_cast<size_t>(comm::shape_numel(t.shape)));
    for (float& x : d) x = g(rng);
    u.tensors.push_back(comm::f32_tensor(t.name, t.shape, d));
  }
  return u;
}

// A client speaking the protocol by hand.
struct RawClient {
  comm::TlsStream s;
  comm::Message reply;  // the answer to its Hello: a Welcome or a Refuse

  RawClient(int port, uint32_t id, const std::string& secret, uint64_t fingerprint)
      : s(connect(port)) {
    std::optional<comm::Message> m = s.read_message(10000);
    EXPECT_TRUE(m.has_value()) << "no challenge";
    const auto ch = comm::expect<comm::Challenge>(std::move(*m), "coordinator");
    const comm::Nonce32 bound = comm::bind_challenge(ch.nonce, s.channel_binding());
    s.write_message(comm::make_hello(comm::client_key(secret, id), bound, id, fingerprint));
    m = s.read_message(10000);
    EXPECT_TRUE(m.has_value()) << "no answer to the hello";
    reply = std::move(*m);
  }
  static comm::TlsStream connect(int port) {
    // The coordinator's thread may not listen yet.
    for (int i = 0;; ++i) {
      try {
        return comm::tls_connect("127.0.0.1", port, {}, 5000);
      } catch (const core::CommError&) {
        if (i > 100) throw;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
  }
  comm::Message next() {
    std::optional<comm::Message> m = s.read_message(20000);
    EXPECT_TRUE(m.has_value()) << "the coordinator sent nothing for 20 s";
    return m ? std::move(*m) : comm::Message{comm::Refuse{"(nothing)"}};
  }
};

std::vector<nlohmann::json> rounds_of(const std::string& run_dir) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run_dir + "/federation/metrics.jsonl");
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

// Serves `cfg` on a thread; join() waits for the coordinator to finish.
struct Served {
  std::thread t;
  int status = -1;
  std::string error;
  explicit Served(const core::Config& cfg)
      : t([this, cfg] {
          try {
            status = serve_federation(cfg);
          } catch (const std::exception& e) {
            error = e.what();
          }
        }) {}
  void join() {
    t.join();
    EXPECT_EQ(error, "") << "the coordinator threw";
    EXPECT_EQ(status, 0);
  }
};

// Clients `ids` take part in `rounds` rounds, each answering every Model
// with update_of after a delay from `delay` (id, round → ms).
void run_clients(int port, const std::vector<uint32_t>& ids, uint64_t fp, int rounds,
                 const std::function<int(uint32_t, uint64_t)>& delay) {
  std::vector<std::thread> ts;
  for (uint32_t id : ids)
    ts.emplace_back([=] {
      RawClient c(port, id, kSecret, fp);
      ASSERT_TRUE(std::holds_alternative<comm::Welcome>(c.reply)) << "client " << id << " not welcomed";
      for (int r = 0; r < rounds; ++r) {
        comm::Message m = c.next();
        ASSERT_TRUE(std::holds_alternative<comm::Model>(m)) << "client " << id << " expected a Model in round " << r;
        const auto& model = std::get<comm::Model>(m);
        std::this_thread::sleep_for(std::chrono::milliseconds(delay(id, model.round)));
        c.s.write_message(update_of(model, id));
        comm::Message ack = c.next();
        EXPECT_TRUE(std::holds_alternative<comm::Ack>(ack)) << "client " << id << "'s update not acked";
      }
      EXPECT_TRUE(std::holds_alternative<comm::Done>(c.next())) << "client " << id << " not told Done";
    });
  for (auto& t : ts) t.join();
}

TEST(Federation, TheModelDoesNotDependOnArrivalOrder) {
  po::test::TempDir dir;
  const std::vector<uint32_t> ids = {3, 0, 7};
  std::vector<std::string> hashes;
  for (int trial = 0; trial < 3; ++trial) {
    const int port = po::test::free_tcp_port();
    const std::string run = dir / ("trial" + std::to_string(trial));
    const core::Config cfg = tiny(run, port, {"federated.rounds=2", "federated.min_clients=3",
                                              "federated.algorithm=fedadam"});
    ::setenv("PAGEDOPTIM_FEDERATE_SECRET", kSecret.c_str(), 1);
    Served served(cfg);
    std::mt19937 rng(trial);
    std::vector<int> delays(32);
    for (int& d : delays) d = static_cast<int>(rng() % 60);
    run_clients(port, ids, comm::model_fingerprint(shapes_of(cfg)), 2,
                [&](uint32_t id, uint64_t r) { return delays[(id * 2 + r) % delays.size()]; });
    served.join();
    const auto rounds = rounds_of(run);
    ASSERT_EQ(rounds.size(), 2u);
    EXPECT_EQ(rounds[1]["clients"], nlohmann::json({0, 3, 7}));
    hashes.push_back(rounds[1]["theta_hash"]);
  }
  EXPECT_EQ(hashes[0], hashes[1]) << "trial 1's arrival order changed the model";
  EXPECT_EQ(hashes[0], hashes[2]) << "trial 2's arrival order changed the model";
  // And it is FedRound's sum in memory, round by round.
  const core::Config cfg = tiny(dir / "ref", 1, {"federated.algorithm=fedadam"});
  model::Transformer whole(resolve_model_config(cfg).weights_only(), 1, 1);
  whole.init_random(static_cast<uint64_t>(cfg.get_int("train.seed")));
  std::vector<comm::NamedTensor> theta;
  for (const auto& r : checkpoint_tensors(whole)) {
    const float* p = whole.params() + whole.unit_offset(r.unit) + r.offset;
    theta.push_back(comm::f32_tensor(r.name, r.shape, std::span<const float>(p, static_cast<size_t>(r.numel()))));
  }
  FedRound ref(theta, federated_server(cfg), 0);
  for (int r = 0; r < 2; ++r) {
    for (uint32_t id : ids) ref.add(update_of(ref.model(), id));
    ref.close();
  }
  EXPECT_EQ(hashes[0], checkpoint::hex64(ref.theta_hash())) << "the served model is not FedRound's";
}

TEST(Federation, AWrongSecretAndAnotherModelAreRefusedByName) {
  po::test::TempDir dir;
  const int port = po::test::free_tcp_port();
  const std::string run = dir / "run";
  const core::Config cfg = tiny(run, port, {"federated.rounds=1", "federated.min_clients=1"});
  ::setenv("PAGEDOPTIM_FEDERATE_SECRET", kSecret.c_str(), 1);
  Served served(cfg);
  const uint64_t fp = comm::model_fingerprint(shapes_of(cfg));
  {
    RawClient bad(port, 5, "another-secret", fp);
    ASSERT_TRUE(std::holds_alternative<comm::Refuse>(bad.reply)) << "a wrong secret was welcomed";
    const std::string why = std::get<comm::Refuse>(bad.reply).reason;
    EXPECT_NE(why.find("client 5"), std::string::npos) << why;
    EXPECT_NE(why.find("did not prove its key"), std::string::npos) << why;
  }
  {
    const core::Config other = tiny(dir / "x", 1, {"model.n_embd=32"});
    RawClient bad(port, 6, kSecret, comm::model_fingerprint(shapes_of(other)));
    ASSERT_TRUE(std::holds_alternative<comm::Refuse>(bad.reply)) << "another model's client was welcomed";
    const std::string why = std::get<comm::Refuse>(bad.reply).reason;
    EXPECT_NE(why.find("client 6"), std::string::npos) << why;
    EXPECT_NE(why.find("another model"), std::string::npos) << why;
  }
  run_clients(port, {1}, fp, 1, [](uint32_t, uint64_t) { return 0; });
  served.join();
  const auto rounds = rounds_of(run);
  ASSERT_EQ(rounds.size(), 1u);
  EXPECT_EQ(rounds[0]["clients"], nlohmann::json({1}));
  EXPECT_EQ(rounds[0]["totals"]["refused"], 2);
}

TEST(Federation, AStragglerIsDroppedAndItsLateUpdateRefused) {
  po::test::TempDir dir;
  const int port = po::test::free_tcp_port();
  const std::string run = dir / "run";
  const core::Config cfg =
      tiny(run, port, {"federated.rounds=2", "federated.min_clients=2", "federated.round_timeout=2"});
  ::setenv("PAGEDOPTIM_FEDERATE_SECRET", kSecret.c_str(), 1);
  Served served(cfg);
  const uint64_t fp = comm::model_fingerprint(shapes_of(cfg));
  std::thread fast([&] { run_clients(port, {0}, fp, 2, [](uint32_t, uint64_t) { return 0; }); });
  RawClient slow(port, 1, kSecret, fp);
  ASSERT_TRUE(std::holds_alternative<comm::Welcome>(slow.reply));
  comm::Message m = slow.next();
  ASSERT_TRUE(std::holds_alternative<comm::Model>(m));
  const comm::Model round0 = std::get<comm::Model>(m);
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // past the 2 s timeout, within round 1
  slow.s.write_message(update_of(round0, 1));
  m = slow.next();
  ASSERT_TRUE(std::holds_alternative<comm::Refuse>(m)) << "a late update was not refused";
  const std::string why = std::get<comm::Refuse>(m).reason;
  EXPECT_NE(why.find("stale"), std::string::npos) << why;
  EXPECT_NE(why.find("client 1"), std::string::npos) << why;
  // It gets round 1's model and is counted in it.
  m = slow.next();
  ASSERT_TRUE(std::holds_alternative<comm::Model>(m)) << "the straggler got no next round";
  const comm::Model round1 = std::get<comm::Model>(m);
  EXPECT_EQ(round1.round, 1u);
  EXPECT_NE(round1.theta_hash, round0.theta_hash);
  slow.s.write_message(update_of(round1, 1));
  EXPECT_TRUE(std::holds_alternative<comm::Ack>(slow.next()));
  EXPECT_TRUE(std::holds_alternative<comm::Done>(slow.next()));
  fast.join();
  served.join();
  const auto rounds = rounds_of(run);
  ASSERT_EQ(rounds.size(), 2u);
  EXPECT_EQ(rounds[0]["clients"], nlohmann::json({0}));
  EXPECT_EQ(rounds[0]["stragglers"], nlohmann::json({1}));
  EXPECT_EQ(rounds[1]["clients"], nlohmann::json({0, 1}));
  EXPECT_EQ(rounds[1]["totals"]["stragglers"], 1);
  EXPECT_EQ(rounds[1]["totals"]["refused"], 1);
}

TEST(Federation, ACoordinatorStartedAgainEndsWhereAnUninterruptedOneDoes) {
  po::test::TempDir dir;
  ::setenv("PAGEDOPTIM_FEDERATE_SECRET", kSecret.c_str(), 1);
  const std::vector<std::string> nesterov = {"federated.min_clients=2", "federated.algorithm=diloco"};
  auto serve = [&](const std::string& run, int rounds, int clients_rounds) {
    const int port = po::test::free_tcp_port();
    std::vector<std::string> sets = nesterov;
    sets.push_back("federated.rounds=" + std::to_string(rounds));
    const core::Config cfg = tiny(run, port, sets);
    Served served(cfg);
    run_clients(port, {0, 1}, comm::model_fingerprint(shapes_of(cfg)), clients_rounds,
                [](uint32_t id, uint64_t) { return static_cast<int>(id) * 5; });
    served.join();
  };
  serve(dir / "whole", 3, 3);
  serve(dir / "split", 1, 1);  // stops after round 0 ...
  serve(dir / "split", 3, 2);  // ... and resumes at round 1
  const auto a = rounds_of(dir / "whole"), b = rounds_of(dir / "split");
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  for (int r = 0; r < 3; ++r)
    EXPECT_EQ(a[r]["theta_hash"], b[r]["theta_hash"]) << "round " << r << " after a restart differs";
  po::test::expect_same_checkpoint(dir / "whole", dir / "split", 6, "the final model after a restart");
}

TEST(Federation, ServerOptimizersAndWhatIsNotBuilt) {
  const auto server = [](const std::string& algo) {
    return federated_server(tiny("/tmp/unused", 1, {"federated.algorithm=" + algo}));
  };
  EXPECT_EQ(server("fedavg").kind, optim::OuterKind::kSgd);
  EXPECT_EQ(server("fedavg").lr, 1.0);
  EXPECT_EQ(server("fedavg").momentum, 0.0);
  EXPECT_EQ(server("fedadam").kind, optim::OuterKind::kAdam);
  EXPECT_EQ(server("fedyogi").kind, optim::OuterKind::kYogi);
  EXPECT_EQ(server("fedyogi").lr, 0.01);
  EXPECT_EQ(server("diloco").kind, optim::OuterKind::kNesterov);
  EXPECT_EQ(server("diloco").lr, 0.7);
  std::string e = po::test::error_of([&] { server("fedprox"); });
  EXPECT_NE(e.find("federated.algorithm = \"fedprox\": not built yet"), std::string::npos) << e;
  e = po::test::error_of([&] { server("fedsgd"); });
  EXPECT_NE(e.find("federated.algorithm = \"fedsgd\": choose"), std::string::npos) << e;
}

}  // namespace
}  // namespace po::train
