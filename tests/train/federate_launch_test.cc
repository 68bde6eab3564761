// Federation with real processes on 127.0.0.1 (`pagedoptim federate serve`
// and `federate join`, each client training its rounds with `pagedoptim
// train`; train/federation.h, docs/diloco.md), one thread per process
// (bit-identity is defined at equal threads per rank):
//   - two clients on identical data give one client's model bit for bit
//     (FedAvg: ½Δ + ½Δ = Δ); a client with the wrong secret is refused by name;
//   - four clients, one killed with SIGKILL mid-round and started again: the
//     round closes without it, naming it, the drop is counted, it rejoins
//     the next round and the run completes;
//   - a coordinator killed with SIGKILL after a round and started again ends
//     in the uninterrupted run's model bit for bit (its clients reconnect and
//     train the interrupted round again from the same state).
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../background_run.h"
#include "../test_util.h"

namespace {

namespace fs = std::filesystem;
using po::test::Child;

class Federation : public po::test::TinyTraining {
 protected:
  int steps() const override { return 4; }
  void SetUp() override {
    TinyTraining::SetUp();
    po::test::write_file(secret_, "launch-test-secret\n");
    po::test::write_file(wrong_, "not-the-secret\n");
  }
  // The federation's settings: H = 2 inner steps a round of `rounds`.
  std::string common(int port, int rounds, const std::string& secret) const {
    return " --set train.local_steps=2 --set federated.rounds=" + std::to_string(rounds) +
           " --set federated.listen=127.0.0.1:" + std::to_string(port) + " --set federated.secret_file=" + secret +
           " --set train.checkpoint_interval=0 --set train.eval_interval=0 --set federated.connect_timeout=60";
  }
  std::unique_ptr<Child> serve(const std::string& name, int port, int rounds, const std::string& extra) const {
    return std::make_unique<Child>("federate serve -c " + config_ + " --set run.dir=" + (dir_ / name) +
                                       common(port, rounds, secret_) + " " + extra,
                                   dir_ / (name + ".log"));
  }
  std::unique_ptr<Child> join(const std::string& name, int port, int rounds, int id, const std::string& extra = "",
                              const std::string& secret = "") const {
    return std::make_unique<Child>("federate join 127.0.0.1:" + std::to_string(port) + " -c " + config_ +
                                       " --set run.dir=" + (dir_ / name) +
                                       common(port, rounds, secret.empty() ? secret_ : secret) +
                                       " --set federated.client_id=" + std::to_string(id) + " " + extra,
                                   dir_ / (name + ".log"));
  }
  // The coordinator's round records so far.
  std::vector<nlohmann::json> rounds_of(const std::string& name) const {
    std::vector<nlohmann::json> out;
    std::ifstream in((dir_ / name) + "/federation/metrics.jsonl");
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) out.push_back(nlohmann::json::parse(line));
    return out;
  }
  // Waits (at most 120 s) until the coordinator has closed `n` rounds.
  bool wait_rounds(const std::string& name, size_t n) const {
    for (int i = 0; i < 6000; ++i) {
      if (rounds_of(name).size() >= n) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }
  // Waits (at most 120 s) until `name`'s log holds `text`.
  bool wait_log(const std::string& name, const std::string& text) const {
    for (int i = 0; i < 6000; ++i) {
      if (log(name).find(text) != std::string::npos) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }
  // "c<id>", a client's run name (appended: GCC 12 warns falsely on "c" + std::string).
  static std::string client_name(int id) {
    std::string name = "c";
    name += std::to_string(id);
    return name;
  }
  std::string log(const std::string& name) const { return po::test::read_file(dir_ / (name + ".log")); }
  void expect_exit(Child& c, const std::string& name, int code = 0) const {
    EXPECT_EQ(c.wait(240), code) << name << ":\n" << log(name);
  }
  std::string secret_ = dir_ / "secret", wrong_ = dir_ / "wrong";
};

TEST_F(Federation, TwoClientsOnIdenticalDataGiveOneClientsModel) {
  {
    const int port = po::test::free_tcp_port();
    auto coord = serve("one", port, 2, "--set federated.min_clients=1");
    // The wrong secret first: refused by name, nothing trained.
    auto bad = join("bad", port, 2, 9, "", wrong_);
    expect_exit(*bad, "bad", 1);
    EXPECT_NE(log("bad").find("client 9"), std::string::npos) << log("bad");
    EXPECT_NE(log("bad").find("did not prove its key"), std::string::npos) << log("bad");
    EXPECT_FALSE(fs::exists((dir_ / "bad") + "/checkpoints")) << "a refused client trained";
    auto c0 = join("one_c0", port, 2, 0);
    expect_exit(*c0, "one_c0");
    expect_exit(*coord, "one");
  }
  {
    const int port = po::test::free_tcp_port();
    auto coord = serve("two", port, 2, "--set federated.min_clients=2");
    auto c0 = join("two_c0", port, 2, 0);
    auto c1 = join("two_c1", port, 2, 1);
    expect_exit(*c0, "two_c0");
    expect_exit(*c1, "two_c1");
    expect_exit(*coord, "two");
  }
  const auto one = rounds_of("one"), two = rounds_of("two");
  ASSERT_EQ(one.size(), 2u) << log("one");
  ASSERT_EQ(two.size(), 2u) << log("two");
  EXPECT_EQ(two[1]["clients"], nlohmann::json({0, 1}));
  EXPECT_EQ(one[1]["totals"]["refused"], 1);
  // The models after 2 rounds of H = 2: the final checkpoint at step 4.
  po::test::expect_same_checkpoint(dir_ / "one", dir_ / "two", 4, "two identical clients vs one");
}

TEST_F(Federation, AClientKilledMidRoundIsDroppedAndRejoins) {
  const int port = po::test::free_tcp_port();
  auto coord = serve("fed", port, 3, "--set federated.min_clients=4");
  std::vector<std::unique_ptr<Child>> clients;
  for (int id = 0; id < 4; ++id) clients.push_back(join(client_name(id), port, 3, id));
  // Killed once it has round 1's model (killed earlier, round 1 would wait for a fourth client).
  ASSERT_TRUE(wait_log("c3", "round 1: training steps 2..4")) << log("c3");
  ASSERT_EQ(kill(clients[3]->pid(), SIGKILL), 0);
  EXPECT_EQ(clients[3]->wait(30), 128 + SIGKILL);
  ASSERT_TRUE(wait_rounds("fed", 2)) << log("fed");
  // Round 2 waits for four clients: client 3 started again.
  clients[3] = join("c3", port, 3, 3);
  for (int id = 0; id < 4; ++id) expect_exit(*clients[id], client_name(id));
  expect_exit(*coord, "fed");
  const auto rounds = rounds_of("fed");
  ASSERT_EQ(rounds.size(), 3u) << log("fed");
  EXPECT_EQ(rounds[0]["clients"], nlohmann::json({0, 1, 2, 3}));
  EXPECT_EQ(rounds[1]["clients"], nlohmann::json({0, 1, 2})) << rounds[1].dump();
  EXPECT_EQ(rounds[1]["dropped"], nlohmann::json({3})) << rounds[1].dump();
  EXPECT_EQ(rounds[2]["clients"], nlohmann::json({0, 1, 2, 3})) << rounds[2].dump();
  EXPECT_EQ(rounds[2]["totals"]["dropped"], 1);
  EXPECT_NE(log("fed").find("round 1 closed with clients [0, 1, 2]; dropped [3]"), std::string::npos) << log("fed");
  EXPECT_TRUE(fs::exists(po::train::checkpoint_path(dir_ / "fed", 6))) << "no final model";
}

TEST_F(Federation, ACoordinatorKilledAndStartedAgainEndsInTheUninterruptedModel) {
  const std::string diloco = "--set federated.min_clients=2 --set federated.algorithm=diloco";
  {
    const int port = po::test::free_tcp_port();
    auto coord = serve("whole", port, 3, diloco);
    auto c0 = join("whole_c0", port, 3, 0), c1 = join("whole_c1", port, 3, 1);
    expect_exit(*c0, "whole_c0");
    expect_exit(*c1, "whole_c1");
    expect_exit(*coord, "whole");
  }
  const int port = po::test::free_tcp_port();
  auto coord = serve("killed", port, 3, diloco);
  auto c0 = join("killed_c0", port, 3, 0), c1 = join("killed_c1", port, 3, 1);
  ASSERT_TRUE(wait_rounds("killed", 2)) << log("killed");
  ASSERT_EQ(kill(coord->pid(), SIGKILL), 0);
  EXPECT_EQ(coord->wait(30), 128 + SIGKILL);
  const std::string first = log("killed");
  coord = serve("killed", port, 3, diloco);
  expect_exit(*c0, "killed_c0");
  expect_exit(*c1, "killed_c1");
  expect_exit(*coord, "killed");
  EXPECT_NE(log("killed").find("resuming at round 2"), std::string::npos) << first << log("killed");
  EXPECT_NE(log("killed_c0").find("reconnecting"), std::string::npos) << log("killed_c0");
  po::test::expect_same_checkpoint(dir_ / "whole", dir_ / "killed", 6, "a coordinator killed after round 1");
}

}  // namespace
