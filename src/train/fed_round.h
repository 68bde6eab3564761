// One federation round at the coordinator, without transport (docs/diloco.md):
// the global model θ as whole named tensors, the updates of one round taken
// in any order, and the server step on their weighted mean.
//
//   Δ̄ = Σ_k w_k Δ_k,  w_k = n_k / Σ_j n_j  (FedAvg: n_k the client's examples)
//
// summed in client-id order, never arrival order, element by element in
// float32 (each term w_k·Δ_k rounded, then added), so the result does not
// depend on timing. Two clients with the same update give that update bit for
// bit (w = 1/2 each: ½Δ + ½Δ = Δ exactly). The server step is the outer
// optimizer (optim/outer.h): FedAvg is outer SGD at lr 1 without momentum,
// FedAdam and FedYogi its adam and yogi, DiLoCo its nesterov.
//
// An update is refused (InvalidArgument naming the client and what) when it
// is for another round, started from another θ (theta_hash: stale), comes
// twice from one client, or does not hold θ's tensors with θ's shapes.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "comm/federation_protocol.h"
#include "optim/outer.h"

namespace po::train {

class FedRound {
 public:
  // θ (f32 tensors), the server optimizer, and the round about to start.
  FedRound(std::vector<comm::NamedTensor> theta, optim::OuterConfig server, uint64_t round);

  uint64_t round() const { return round_; }
  uint64_t theta_hash() const { return hash_; }
  const std::vector<comm::NamedTensor>& theta() const { return theta_; }
  // The Model message a client of this round is sent.
  comm::Model model() const { return {round_, hash_, theta_}; }

  // Takes a client's update (any order); throws as above.
  void add(comm::Update update);
  size_t received() const { return updates_.size(); }
  // The clients whose updates were taken, ascending.
  std::vector<uint32_t> clients() const;

  // Closes the round: the weighted mean of the updates taken (at least one),
  // in client-id order, and the server step; θ moves on and the next round
  // opens. Returns Δ̄.
  std::vector<std::vector<float>> close();

  // The server optimizer's state (a coordinator's checkpoint): the steps it
  // took and its m and v per tensor (empty where the optimizer keeps none).
  int64_t server_steps() const { return steps_; }
  const std::vector<std::vector<float>>& server_m() const { return m_; }
  const std::vector<std::vector<float>>& server_v() const { return v_; }
  // Takes back what the three above gave; InvalidArgument when a field's
  // size is not its tensor's.
  void restore(int64_t steps, std::vector<std::vector<float>> m, std::vector<std::vector<float>> v);

 private:
  std::vector<comm::NamedTensor> theta_;
  optim::OuterConfig server_;
  uint64_t round_, hash_;
  std::map<uint32_t, comm::Update> updates_;  // by client id: the order sums take
  // The server optimizer's fields besides θ, per tensor (m, v: empty where none).
  std::vector<std::vector<float>> m_, v_;
  int64_t steps_ = 0;
};

}  // namespace po::train
