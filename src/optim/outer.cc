// The outer optimizer (outer.h).
#include "optim/outer.h"

#include <cmath>

#include "core/error.h"

namespace po::optim {

OuterKind parse_outer_kind(const std::string& name) {
  if (name == "sgd") return OuterKind::kSgd;
  if (name == "nesterov") return OuterKind::kNesterov;
  if (name == "adam") return OuterKind::kAdam;
  if (name == "yogi") return OuterKind::kYogi;
  PO_THROW(core::InvalidArgument, "outer.optimizer = \"", name, "\": choose \"sgd\", \"nesterov\", \"adam\" or \"yogi\"");
}

const char* outer_kind_name(OuterKind kind) {
  switch (kind) {
    case OuterKind::kSgd: return "sgd";
    case OuterKind::kNesterov: return "nesterov";
    case OuterKind::kAdam: return "adam";
    case OuterKind::kYogi: return "yogi";
  }
  return "?";
}

namespace {
constexpr StateField kOuterFields[] = {
    {"outer_global", StateDtype::kF32},
    {"outer_m", StateDtype::kF32},
    {"outer_v", StateDtype::kF32},
};
}  // namespace

StateSchema outer_schema(const OuterConfig& c) {
  size_t fields = 3;
  if (c.kind == OuterKind::kSgd || c.kind == OuterKind::kNesterov) fields = c.momentum > 0 ? 2 : 1;
  return {"outer", std::span<const StateField>(kOuterFields, fields)};
}

// PyTorch's float32 operations, in its order (ATen's CPU kernels): an add
// with alpha is one fused multiply-add (vec::fmadd), addcmul and addcdiv
// are value·a·b and value·a/b left to right, then added. std::fma rounds
// once on every CPU, with or without an FMA unit.
void outer_update(const OuterConfig& c, int64_t t, float* global, float* m, float* v, const float* delta,
                  int64_t n, float* out) {
  const float neg_lr = static_cast<float>(-c.lr), mu = static_cast<float>(c.momentum);
  switch (c.kind) {
    case OuterKind::kSgd:
    case OuterKind::kNesterov: {
      const bool nesterov = c.kind == OuterKind::kNesterov;
      for (int64_t i = 0; i < n; ++i) {
        float step = delta[i];
        if (m != nullptr) {
          m[i] = mu * m[i] + delta[i];                             // buf.mul_(μ).add_(Δ̄)
          step = nesterov ? std::fma(m[i], mu, delta[i]) : m[i];  // Δ̄.add(buf, alpha=μ)
        }
        global[i] = std::fma(step, neg_lr, global[i]);  // θ.add_(step, alpha=−lr)
        out[i] = global[i];
      }
      return;
    }
    case OuterKind::kAdam:
    case OuterKind::kYogi: {
      PO_ASSERT(m != nullptr && v != nullptr, "outer ", outer_kind_name(c.kind), " without its moments");
      // (1 − β) rounded once from double, as PyTorch's alpha and value are.
      const float b1 = mu, b2 = static_cast<float>(c.beta2), eps = static_cast<float>(c.eps);
      const float one_b1 = static_cast<float>(1.0 - c.momentum), one_b2 = static_cast<float>(1.0 - c.beta2);
      const double td = static_cast<double>(t);
      const float bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(c.beta2, td)));
      const float neg_step = static_cast<float>(-(c.lr / (1.0 - std::pow(c.momentum, td))));
      const bool yogi = c.kind == OuterKind::kYogi;
      for (int64_t i = 0; i < n; ++i) {
        const float d = delta[i];
        m[i] = std::fma(d, one_b1, b1 * m[i]);  // m.mul_(β1).add_(Δ̄, alpha=1−β1)
        const float d2 = one_b2 * d * d;        // (1−β2)·Δ̄·Δ̄, addcmul's order
        if (yogi) {
          const float dd = d * d;
          v[i] = v[i] > dd ? v[i] - d2 : v[i] < dd ? v[i] + d2 : v[i];  // v − (1−β2)Δ̄²·sign(v − Δ̄²)
        } else {
          v[i] = b2 * v[i] + d2;  // v.mul_(β2).addcmul_(Δ̄, Δ̄, value=1−β2)
        }
        const float denom = std::sqrt(v[i]) / bc2_sqrt + eps;
        global[i] = global[i] + neg_step * m[i] / denom;  // θ.addcdiv_(m, denom, value=−lr/(1−β1^t))
        out[i] = global[i];
      }
      return;
    }
  }
}

}  // namespace po::optim
