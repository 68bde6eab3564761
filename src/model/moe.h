// The mixture-of-experts MLP (issue 39's part, one rank, f32): a bias-free
// router [E, C] scores every row, each row goes to its top k experts, each
// expert a SwiGLU (down(silu(gate x) ⊙ up x)), and the row's output is the
// weighted sum of its experts' outputs:
//
//   p = softmax(x·Wrᵀ) (f32), chosen = the k largest p (ties: the lower
//   expert), w = p[chosen] / Σ p[chosen]   (kSoftmaxTopK: Mixtral)
//                w = p[chosen]               (kSoftmaxTopKRaw: Qwen2-MoE with
//                                             norm_topk_prob = false)
//   y[t] = Σ_{s < k} w[t, s] · E_{chosen[t, s]}(x[t])
//
// Dropless: every row reaches its k experts. Exact by construction, on any
// machine: the rows an expert gets are gathered in row order (expert-major,
// a counting sort), each expert runs its GEMMs on its own rows, and a row's
// k outputs (and its k input gradients) are summed in slot order. Nothing
// is added atomically or in an order that depends on threads.
//
// Losses (their gradients flow into the router):
// - balance, Switch's α·E·Σ_i f_i·P_i counted per sequence (DeepSeek-V3's
//   sequence-wise form): for each sequence of T rows, f_i = the share of its
//   T·k slots routed to expert i, P_i = its rows' mean probability of i; the
//   global loss is α·E·(1/S)·Σ_sequences Σ_i f_i·P_i over the step's S
//   sequences. A sequence is never split across micro-batches or ranks, so
//   the loss and its gradient do not change with gradient accumulation or
//   the data-parallel size (a micro-batch-wide f would);
// - the router z-loss (ST-MoE, arXiv 2202.08906): z·(1/N)·Σ_rows lse², lse
//   the logsumexp of the row's router logits, over the step's N rows.
//
// Weights of one layer, in this order (the block's unit declares them):
// the router [E, C], then per expert e its gate | up rows [2F, C] and its
// down [C, F] (Mixtral's w1 | w3 and w2).
#pragma once

#include <cstdint>
#include <vector>

namespace po::model::moe {

enum class Router { kSoftmaxTopK, kSoftmaxTopKRaw };

struct Shape {
  int64_t C = 0;  // the model's width
  int64_t F = 0;  // an expert's hidden width
  int64_t E = 0;  // experts
  int64_t k = 0;  // experts a row goes to
  Router router = Router::kSoftmaxTopK;

  int64_t expert_numel() const { return 2 * F * C + C * F; }
  int64_t numel() const { return E * C + E * expert_numel(); }  // the layer's weights
};

struct Weights {
  const float* router = nullptr;   // [E, C]
  const float* experts = nullptr;  // E × ([2F, C] gate | up, [C, F] down)
};
struct Grads {
  float* router = nullptr;
  float* experts = nullptr;
};

// Loss coefficients and the step's scale: `seq_scale` 1/S and `row_scale`
// 1/N for the step's S sequences of T rows, N = S·T.
struct Losses {
  double aux = 0.0;  // α (train.moe_aux_loss)
  double z = 0.0;    // z (train.moe_z_loss)
  double seq_scale = 0.0, row_scale = 0.0;
  int64_t T = 0;  // rows per sequence
};

// What forward() keeps for backward() of R rows; the buffers the caller
// lends (floats(R) floats and ints(R) int32s).
struct Saved {
  float* probs = nullptr;   // [R, E] router probabilities
  float* lse = nullptr;     // [R] logsumexp of the router logits
  float* weight = nullptr;  // [R, k] combine weights
  float* h = nullptr;       // [R·k, 2F] experts' gate | up outputs, expert-major
  float* act = nullptr;     // [R·k, F] silu(gate) ⊙ up
  float* y = nullptr;       // [R·k, C] experts' outputs
  int32_t* chosen = nullptr;  // [R, k] experts, in slot order

  static int64_t floats(const Shape& s, int64_t R) {
    return R * s.E + R + R * s.k + R * s.k * (2 * s.F + s.F + s.C);
  }
  static int64_t ints(const Shape& s, int64_t R) { return R * s.k; }
  // Carves the buffers out of f (floats()) and i (ints()).
  static Saved carve(const Shape& s, int64_t R, float* f, int32_t* i);
};

// The scratch of a forward or backward of R rows, lent by the caller
// (floats(R) floats; the model's activation layout holds it, so the ledger
// and the planner count it): the rows gathered expert-major, the slots'
// output gradients (then input gradients), one expert's d(act) [n, F] and
// d(gate | up) [n, 2F] (n <= R·k), the router's [R, E] and the slots' [R, k]
// gradients, and the dispatch (each slot's place, each place's row).
struct Work {
  float* xg = nullptr;    // [R·k, C]
  float* dy = nullptr;    // [R·k, C]
  float* dact = nullptr;  // [R·k, F]
  float* dh = nullptr;    // [R·k, 2F]
  float* dlog = nullptr;  // [R, E]
  float* dw = nullptr;    // [R, k]
  int32_t* pos = nullptr;  // [R·k]
  int32_t* row = nullptr;  // [R·k]

  static int64_t floats(const Shape& s, int64_t R) {
    const int64_t RK = R * s.k;
    return 2 * RK * s.C + 3 * RK * s.F + R * s.E + RK + 2 * RK;
  }
  static Work carve(const Shape& s, int64_t R, float* f);
};

// The losses' values of a forward (their share of the step's loss) and the
// rows each expert got.
struct Stats {
  double aux = 0.0, z = 0.0;
  std::vector<int64_t> tokens;  // [E]
};

// out[R, C] = the layer's output for x[R, C]; the saved activations and the
// losses' values (with `losses`) into `saved` and `stats`.
void forward(const Shape& s, float* out, const float* x, const Weights& w, int64_t R, const Saved& saved,
             const Work& work, const Losses& losses, Stats* stats = nullptr);

// dx[R, C] written: the gradient of Σ dout ⊙ out plus the losses through
// the router; the weights' gradients added into g.
void backward(const Shape& s, float* dx, const Grads& g, const float* dout, const float* x, const Weights& w,
              int64_t R, const Saved& saved, const Work& work, const Losses& losses);

}  // namespace po::model::moe
