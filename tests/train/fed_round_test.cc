// A federation round at the coordinator (train/fed_round.h), without
// transport: the weighted mean is taken in client-id order, so it is the
// same bits whatever order the updates arrive in; two clients with one
// update give that update; stale, repeated and misshapen updates are
// refused naming the client.
#include "train/fed_round.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

using po::comm::NamedTensor;
using po::comm::Update;

std::vector<NamedTensor> model(uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> a(300), b(17);
  for (auto& x : a) x = n(g);
  for (auto& x : b) x = n(g);
  return {po::comm::f32_tensor("h.0.attn.c_attn.weight", {20, 15}, a),
          po::comm::f32_tensor("ln_f.bias", {17}, b)};
}

Update update(const po::train::FedRound& r, uint32_t client, uint64_t examples, uint32_t seed) {
  Update u;
  u.round = r.round();
  u.theta_hash = r.theta_hash();
  u.client_id = client;
  u.num_examples = examples;
  u.steps_done = 10;
  u.tensors = model(seed);
  for (auto& t : u.tensors) {  // small pseudo-gradients
    std::vector<float> x = po::comm::tensor_f32(t);
    for (auto& v : x) v *= 0.01f;
    t = po::comm::f32_tensor(t.name, t.shape, x);
  }
  return u;
}

const po::optim::OuterConfig kFedAvg{po::optim::OuterKind::kSgd, 1.0, 0.0, 0.99, 1e-8};
const po::optim::OuterConfig kFedAdam{po::optim::OuterKind::kAdam, 0.1, 0.9, 0.99, 1e-3};

bool same_bits(const std::vector<NamedTensor>& a, const std::vector<NamedTensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].data != b[i].data) return false;
  return true;
}

TEST(FedRound, TheMeanIsTheSameBitsWhateverOrderUpdatesArriveIn) {
  for (const auto& server : {kFedAvg, kFedAdam}) {
    std::vector<NamedTensor> first;
    std::mt19937 g(40);
    for (int trial = 0; trial < 20; ++trial) {
      po::train::FedRound r(model(1), server, 0);
      std::vector<Update> ups;
      for (uint32_t c = 0; c < 5; ++c) ups.push_back(update(r, c * 3 + 1, 100 + 37 * c, 10 + c));
      std::shuffle(ups.begin(), ups.end(), g);  // the arrival order
      for (auto& u : ups) r.add(std::move(u));
      EXPECT_EQ(r.clients(), (std::vector<uint32_t>{1, 4, 7, 10, 13}));
      r.close();
      if (trial == 0) first = r.theta();
      EXPECT_TRUE(same_bits(first, r.theta())) << po::optim::outer_kind_name(server.kind) << ", arrival order "
                                               << trial << ": θ differs from the first order's";
    }
  }
}

TEST(FedRound, TwoClientsWithOneUpdateAreThatClient) {
  po::train::FedRound one(model(1), kFedAvg, 0), two(model(1), kFedAvg, 0);
  one.add(update(one, 0, 64, 9));
  two.add(update(two, 3, 64, 9));
  two.add(update(two, 8, 64, 9));
  const auto m1 = one.close(), m2 = two.close();
  for (size_t i = 0; i < m1.size(); ++i)
    EXPECT_EQ(0, std::memcmp(m1[i].data(), m2[i].data(), m1[i].size() * 4)) << "tensor " << i << ": mean differs";
  EXPECT_TRUE(same_bits(one.theta(), two.theta())) << "two clients on one update moved θ elsewhere than one";
  EXPECT_EQ(one.round(), 1u);
}

TEST(FedRound, FedAvgMovesThetaToTheWeightedMeanOfTheClients) {
  po::train::FedRound r(model(1), kFedAvg, 5);
  const std::vector<NamedTensor> theta0 = r.theta();
  const Update a = update(r, 2, 300, 21), b = update(r, 1, 100, 22);
  r.add(a);
  r.add(b);
  r.close();
  for (size_t i = 0; i < theta0.size(); ++i) {
    const auto t0 = po::comm::tensor_f32(theta0[i]), t1 = po::comm::tensor_f32(r.theta()[i]);
    const auto da = po::comm::tensor_f32(a.tensors[i]), db = po::comm::tensor_f32(b.tensors[i]);
    for (size_t j = 0; j < t0.size(); ++j) {
      const double want = t0[j] - (0.25 * db[j] + 0.75 * da[j]);
      EXPECT_NEAR(t1[j], want, 2e-6 * (std::fabs(t0[j]) + 1)) << theta0[i].name << "[" << j << "]";
    }
  }
}

TEST(FedRound, RefusesStaleRepeatedAndMisshapenUpdatesNamingTheClient) {
  po::train::FedRound r(model(1), kFedAvg, 3);
  struct Case {
    Update u;
    std::string says;
  };
  std::vector<Case> cases;
  Update stale = update(r, 4, 10, 1);
  stale.theta_hash ^= 1;
  cases.push_back({stale, "client 4 trained from another model than this round's"});
  Update late = update(r, 5, 10, 1);
  late.round = 2;
  cases.push_back({late, "client 5 sent an update for round 2"});
  Update shape = update(r, 6, 10, 1);
  shape.tensors[1] = po::comm::f32_tensor("ln_f.bias", {16}, std::vector<float>(16));
  cases.push_back({shape, "client 6: ln_f.bias has another shape"});
  Update missing = update(r, 7, 10, 1);
  missing.tensors[0].name = "h.0.mlp.c_fc.weight";
  cases.push_back({missing, "client 7 sent no h.0.attn.c_attn.weight"});
  for (auto& c : cases) {
    try {
      r.add(c.u);
      ADD_FAILURE() << "accepted: " << c.says;
    } catch (const po::core::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(c.says), std::string::npos) << e.what();
    }
  }
  r.add(update(r, 4, 10, 1));
  try {
    r.add(update(r, 4, 10, 2));
    ADD_FAILURE() << "a second update of client 4 was accepted";
  } catch (const po::core::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("client 4 sent a second update"), std::string::npos) << e.what();
  }
  EXPECT_EQ(r.received(), 1u);
}

}  // namespace
