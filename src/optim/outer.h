// The outer optimizer of low-communication training (DiLoCo, Douillard et
// al. 2023; FedOpt, Reddi et al. 2020): every train.local_steps inner steps
// each replica's pseudo-gradient Δ_k = θ − θ_k (the global copy minus the
// replica's parameters) is averaged into Δ̄, and θ takes one step on Δ̄.
//
//   sgd       b ← μb + Δ̄ (μ = 0: b = Δ̄);   θ ← θ − lr·b
//   nesterov  b ← μb + Δ̄;                  θ ← θ − lr·(Δ̄ + μb)   (torch.optim.SGD, nesterov=True)
//   adam      m ← β1m + (1−β1)Δ̄;  v ← β2v + (1−β2)Δ̄²;
//             θ ← θ − lr·(m/(1−β1^t)) / (√(v/(1−β2^t)) + eps)    (torch.optim.Adam)
//   yogi      as adam, with v ← v − (1−β2)·Δ̄²·sign(v − Δ̄²)      (Zaheer et al. 2018)
//
// μ and β1 are outer.momentum, β2 outer.beta2, eps outer.eps; t counts the
// outer steps from 1. Outer SGD at lr 1 without momentum is FedAvg: θ
// becomes the replicas' mean (up to rounding: θ − (θ − θ_k) ≠ θ_k in
// floating point). DiLoCo's setting: nesterov, lr 0.7, μ 0.9.
//
// The state is a schema (optim/state_schema.h): the global copy, then the
// fields the kind keeps, all fp32 and element-wise, so it pages as Adam's
// does (train/outer_sync.h keeps it on NVMe between outer steps).
#pragma once

#include <cstdint>
#include <string>

#include "optim/state_schema.h"

namespace po::optim {

enum class OuterKind : uint8_t { kSgd, kNesterov, kAdam, kYogi };

// outer.optimizer's value; throws InvalidArgument naming the key.
OuterKind parse_outer_kind(const std::string& name);
const char* outer_kind_name(OuterKind kind);

struct OuterConfig {
  OuterKind kind = OuterKind::kNesterov;
  double lr = 0.7;
  double momentum = 0.9;  // μ (sgd, nesterov) or β1 (adam, yogi)
  double beta2 = 0.99;
  double eps = 1e-8;
};

// Field indices of the outer schema: the global copy, the momentum buffer
// (or Adam's m; absent for sgd at μ = 0), Adam's v (adam, yogi).
inline constexpr int kOuterGlobal = 0, kOuterM = 1, kOuterV = 2;
StateSchema outer_schema(const OuterConfig& c);

// One outer step, outer step number t (1-based), on n elements: `delta`
// holds Δ̄; `global`, `m`, `v` are the state's fields (m, v null where the
// schema has none). Writes the new θ to `global` and to `out` (the
// replica's parameters). Fixed float32 arithmetic, element by element: the
// same bits on every rank and tier.
void outer_update(const OuterConfig& c, int64_t t, float* global, float* m, float* v, const float* delta,
                  int64_t n, float* out);

}  // namespace po::optim
