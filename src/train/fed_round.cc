// One federation round at the coordinator (fed_round.h).
#include "train/fed_round.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "core/error.h"

namespace po::train {

FedRound::FedRound(std::vector<comm::NamedTensor> theta, optim::OuterConfig server, uint64_t round)
    : theta_(std::move(theta)), server_(server), round_(round), hash_(comm::theta_hash(theta_)) {
  const size_t fields = optim::outer_schema(server_).fields.size();
  for (const comm::NamedTensor& t : theta_) {
    PO_CHECK(t.dtype == comm::WireDtype::kF32, "federation: θ's tensor ", t.name, " is not f32");
    const size_t n = static_cast<size_t>(comm::shape_numel(t.shape));
    m_.emplace_back(fields > 1 ? n : 0, 0.0f);
    v_.emplace_back(fields > 2 ? n : 0, 0.0f);
  }
}

void FedRound::add(comm::Update u) {
  const std::string who = core::str_cat("federation round ", round_, ": client ", u.client_id);
  PO_CHECK(u.round == round_, who, " sent an update for round ", u.round);
  PO_CHECK(u.theta_hash == hash_, who, " trained from another model than this round's (a stale update; ",
           "it gets the current one)");
  PO_CHECK(!updates_.contains(u.client_id), who, " sent a second update");
  PO_CHECK(u.num_examples > 0, who, " trained on no examples");
  PO_CHECK(u.tensors.size() == theta_.size(), who, " sent ", u.tensors.size(), " tensors, the model has ",
           theta_.size());
  // In θ's order, whatever the client's.
  std::vector<comm::NamedTensor> ordered;
  for (const comm::NamedTensor& t : theta_) {
    auto it = std::find_if(u.tensors.begin(), u.tensors.end(), [&](const auto& x) { return x.name == t.name; });
    PO_CHECK(it != u.tensors.end(), who, " sent no ", t.name);
    PO_CHECK(it->shape == t.shape, who, ": ", t.name, " has another shape than the model's");
    ordered.push_back(std::move(*it));
  }
  u.tensors = std::move(ordered);
  updates_.emplace(u.client_id, std::move(u));
}

std::vector<uint32_t> FedRound::clients() const {
  std::vector<uint32_t> out;
  for (const auto& [id, u] : updates_) out.push_back(id);
  return out;
}

std::vector<std::vector<float>> FedRound::close() {
  PO_CHECK(!updates_.empty(), "federation round ", round_, ": no update to close it with");
  uint64_t total = 0;
  for (const auto& [id, u] : updates_) total += u.num_examples;
  std::vector<std::vector<float>> mean;
  ++steps_;
  for (size_t i = 0; i < theta_.size(); ++i) {
    const size_t n = static_cast<size_t>(comm::shape_numel(theta_[i].shape));
    std::vector<float> d(n, 0.0f);
    for (const auto& [id, u] : updates_) {  // client-id order
      const float w = static_cast<float>(static_cast<double>(u.num_examples) / static_cast<double>(total));
      const std::vector<float> x = comm::tensor_f32(u.tensors[i]);
      for (size_t j = 0; j < n; ++j) d[j] = d[j] + w * x[j];
    }
    std::vector<float> g = comm::tensor_f32(theta_[i]), out(n);
    optim::outer_update(server_, steps_, g.data(), m_[i].empty() ? nullptr : m_[i].data(),
                        v_[i].empty() ? nullptr : v_[i].data(), d.data(), static_cast<int64_t>(n), out.data());
    theta_[i] = comm::f32_tensor(theta_[i].name, theta_[i].shape, g);
    mean.push_back(std::move(d));
  }
  updates_.clear();
  ++round_;
  hash_ = comm::theta_hash(theta_);
  return mean;
}

void FedRound::restore(int64_t steps, std::vector<std::vector<float>> m, std::vector<std::vector<float>> v) {
  PO_CHECK(m.size() == m_.size() && v.size() == v_.size(), "federation: a server state of ", m.size(),
           " tensors for a model of ", m_.size());
  for (size_t i = 0; i < m_.size(); ++i)
    PO_CHECK(m[i].size() == m_[i].size() && v[i].size() == v_[i].size(), "federation: the server state of ",
             theta_[i].name, " holds ", m[i].size(), " and ", v[i].size(), " elements, not ", m_[i].size(), " and ",
             v_[i].size());
  steps_ = steps;
  m_ = std::move(m);
  v_ = std::move(v);
}

}  // namespace po::train
