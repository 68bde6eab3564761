// The LM head and its loss over fixed vocabulary pieces.
//
// The head's columns (the vocabulary) are cut into a fixed number of pieces
// that does not depend on the parallel layout. One stage computes them one
// after another; under pipeline parallel with the head spread over the
// pipeline ranks (docs/pipeline.md, "Vocabulary parallelism") each rank
// computes its own pieces with the same calls. What would change bits if the
// vocabulary were cut differently is fixed by the pieces themselves:
//   - each piece's logits, row max and sum of exponentials are its own
//     GEMM and reductions;
//   - the rows' log-sum-exp combines the pieces' statistics in piece order
//     (ops::ce_piece_combine, in double);
//   - the input gradient is one GEMM per piece, the pieces' parts added in a
//     fixed binary tree over the pieces (tree_nodes): a rank sums the
//     subtrees its pieces fill and the last stage adds those in the same
//     tree, so the adds pair up as in one stage;
//   - each piece's weight gradient is a GEMM over its own rows of the table.
#pragma once

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "backend/ops.h"

namespace po::model::vocab {

// Pieces of the head's vocabulary: 8, or V when the vocabulary is smaller.
constexpr int kPieces = 8;

struct Pieces {
  std::vector<int64_t> bounds;  // count() + 1 column boundaries, from 0 to V
  int count() const { return static_cast<int>(bounds.size()) - 1; }
  int64_t begin(int k) const { return bounds[static_cast<size_t>(k)]; }
  int64_t end(int k) const { return bounds[static_cast<size_t>(k) + 1]; }
  int64_t size(int k) const { return end(k) - begin(k); }
};

// V cut into min(kPieces, V) pieces as even as possible (the first V mod P
// one column longer).
Pieces pieces_of(int64_t V);

// A weight operand's rows [r0, ...) of width C (either form may be absent).
backend::cpu::Operand rows(backend::cpu::Operand w, int64_t r0, int64_t C);

// Statistics of one head pass over n rows, for all P pieces: [P, n] each
// (piece k's row r at k·n + r), the target's logit per row, and the
// per-piece gradient scales ce_piece_combine gives.
struct Stats {
  std::vector<float> mx, zt, scale;
  std::vector<double> sum;
  void resize(int pieces, int64_t n);
};

// Piece k's forward over n rows: logits_k [n, Vk] = x · W_k^T (w: the
// table's rows from global row w_row0 on, [.., C]: the whole table at 0, or a
// rank's rows of its pieces), then its statistics into st (row offset 0 .. n); with
// `backward` the logits become their exponentials for piece_backward.
void piece_forward(const Pieces& p, int k, backend::cpu::Operand x, backend::cpu::Operand w,
                   const int32_t* targets, int64_t n, int64_t C, float* logits_k, Stats& st,
                   bool backward, int64_t w_row0 = 0);

// The losses of n rows from every piece's statistics (and with grad_scale !=
// 0 the scales piece_backward reads); a row whose target is ignored (< 0)
// gets loss 0 and a zero gradient.
void combine(int pieces, int64_t n, float* losses, Stats& st, const int32_t* targets,
             float grad_scale);

// Piece k's backward over the same n rows: its logit gradient (f32 in place
// of exps_k, or bf16 bits into grad16_k when given), dW rows of piece k +=
// dlogits^T · x (w and dW from global row w_row0, as above; dW null: none), and dX [n, C]
// = dlogits · W_k (accumulate_dx: +=).
void piece_backward(const Pieces& p, int k, float* exps_k, uint16_t* grad16_k, const Stats& st,
                    const int32_t* targets, backend::cpu::Operand x, backend::cpu::Operand w,
                    float* dW, float* dX, bool accumulate_dx, int64_t n, int64_t C,
                    float grad_scale, int64_t w_row0 = 0);

// The input gradient's tree over pieces [0, P): node [lo, hi) is the sum
// of its halves [lo, mid) + [mid, hi), mid = lo + (hi - lo + 1) / 2; a leaf
// is one piece's GEMM. tree_nodes(P, k0, k1): the largest nodes inside
// [k0, k1), in piece order (what a rank holding those pieces sums and sends).
std::vector<std::pair<int, int>> tree_nodes(int P, int k0, int k1);
// Levels below the root (the scratch buffers tree_sum needs).
int tree_height(int P);

// Node [lo, hi)'s sum of n rows [n, C] into out: `leaf(k, dst)` writes piece
// k's part into dst, `given(lo, hi)` returns a node's sum made elsewhere
// (null: compute it here). scratch: tree_height(P) buffers of n·C floats.
using LeafFn = std::function<void(int k, float* dst)>;
using GivenFn = std::function<const float*(int lo, int hi)>;
void tree_sum(int lo, int hi, float* out, int64_t n, int64_t C, const LeafFn& leaf,
              const GivenFn& given, float* const* scratch);

}  // namespace po::model::vocab
