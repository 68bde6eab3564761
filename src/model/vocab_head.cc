#include "model/vocab_head.h"

#include <algorithm>
#include <cstring>

#include "backend/device.h"

namespace po::model::vocab {
namespace ops = po::backend::cpu;

Pieces pieces_of(int64_t V) {
  const int64_t P = std::min<int64_t>(kPieces, V);
  Pieces p;
  p.bounds.push_back(0);
  for (int64_t k = 0; k < P; ++k) p.bounds.push_back(p.bounds.back() + V / P + (k < V % P ? 1 : 0));
  return p;
}

ops::Operand rows(ops::Operand w, int64_t r0, int64_t C) {
  return {w.f32 != nullptr ? w.f32 + r0 * C : nullptr, w.bf16 != nullptr ? w.bf16 + r0 * C : nullptr};
}

void Stats::resize(int pieces, int64_t n) {
  const auto pn = static_cast<size_t>(pieces * n);
  mx.resize(pn);
  sum.resize(pn);
  scale.resize(pn);
  zt.resize(static_cast<size_t>(n));
}

void piece_forward(const Pieces& p, int k, ops::Operand x, ops::Operand w, const int32_t* targets,
                   int64_t n, int64_t C, float* logits_k, Stats& st, bool backward,
                   int64_t w_row0) {
  const int64_t Vk = p.size(k), off = static_cast<int64_t>(k) * n;
  ops::matmul_forward(logits_k, x, rows(w, p.begin(k) - w_row0, C), nullptr, n, C, Vk);
  ops::ce_piece_stats(st.mx.data() + off, st.sum.data() + off, st.zt.data(), logits_k, targets, n,
                      Vk, p.begin(k), backward);
}

void combine(int pieces, int64_t n, float* losses, Stats& st, const int32_t* targets,
             float grad_scale) {
  ops::ce_piece_combine(losses, st.scale.data(), st.mx.data(), st.sum.data(), st.zt.data(), targets,
                        pieces, n, grad_scale);
}

void piece_backward(const Pieces& p, int k, float* exps_k, uint16_t* grad16_k, const Stats& st,
                    const int32_t* targets, ops::Operand x, ops::Operand w, float* dW, float* dX,
                    bool accumulate_dx, int64_t n, int64_t C, float grad_scale,
                    int64_t w_row0) {
  const int64_t Vk = p.size(k), v0 = p.begin(k), r0 = v0 - w_row0;
  const float* scale = st.scale.data() + static_cast<int64_t>(k) * n;
  ops::Operand dlogits;
  if (grad16_k != nullptr) {
    ops::ce_piece_grad(grad16_k, exps_k, scale, targets, n, Vk, v0, grad_scale);
    dlogits = ops::Operand(grad16_k);
  } else {
    ops::ce_piece_grad(exps_k, scale, targets, n, Vk, v0, grad_scale);
    dlogits = ops::Operand(exps_k);
  }
  ops::matmul_backward(dX, dW != nullptr ? dW + r0 * C : nullptr, nullptr, dlogits, x,
                       rows(w, r0, C), n, C, Vk, accumulate_dx);
}

namespace {
int tree_mid(int lo, int hi) { return lo + (hi - lo + 1) / 2; }

void collect(int lo, int hi, int k0, int k1, std::vector<std::pair<int, int>>& out) {
  if (lo >= k1 || hi <= k0) return;
  if (lo >= k0 && hi <= k1) {
    out.emplace_back(lo, hi);
    return;
  }
  collect(lo, tree_mid(lo, hi), k0, k1, out);
  collect(tree_mid(lo, hi), hi, k0, k1, out);
}
}  // namespace

std::vector<std::pair<int, int>> tree_nodes(int P, int k0, int k1) {
  std::vector<std::pair<int, int>> out;
  collect(0, P, k0, k1, out);
  return out;
}

int tree_height(int P) {
  int h = 0;
  for (int n = P; n > 1; n = (n + 1) / 2) ++h;
  return h;
}

void tree_sum(int lo, int hi, float* out, int64_t n, int64_t C, const LeafFn& leaf,
              const GivenFn& given, float* const* scratch) {
  const int64_t nc = n * C;
  if (given) {
    if (const float* g = given(lo, hi)) {
      backend::device_copy(out, g, static_cast<size_t>(nc) * sizeof(float));
      return;
    }
  }
  if (hi - lo == 1) return leaf(lo, out);
  const int mid = tree_mid(lo, hi);
  tree_sum(lo, mid, out, n, C, leaf, given, scratch + 1);
  float* right = scratch[0];
  tree_sum(mid, hi, right, n, C, leaf, given, scratch + 1);
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < nc; ++i) out[i] = out[i] + right[i];
}

}  // namespace po::model::vocab
