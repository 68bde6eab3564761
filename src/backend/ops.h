// CPU kernels of the GPT-2 engine, llm.c style: one <op>_forward/<op>_backward
// pair per op family, one file per family in backend/cpu/, built once per
// instruction-set path. The ops below (but the GEMM and thread controls) call
// the kernels table of the path chosen at start-up (backend/kernels.h,
// backend/isa.h); a CUDA backend (backend/cuda/, later) fills the same table.
//
// Shape legend: B batch, T sequence, C channels, V vocab, NH heads, hs = C/NH,
// BT = B*T rows. All tensors are row-major, contiguous, f32.
// Linear weights are stored [OC, C] (out features first, as torch.nn.Linear).
//
// Gradient rule: parameter gradients ACCUMULATE (+=) so that micro-batches add
// up; activation gradients are WRITTEN (=) unless the signature says "+=".
// Every kernel is parallelised with OpenMP internally; callers stay serial.
#pragma once

#include <cstddef>
#include <cstdint>

#include "backend/block_formats.h"
#include "backend/codebook.h"

namespace po::backend::cpu {

// Number of threads kernels use (OpenMP and the BLAS share one pool).
void set_num_threads(int n);
int num_threads();
// Name of the BLAS the build links ("openblas", "blis", "dnnl").
const char* blas_name();
// Precision of gemm()'s products. kBF16 rounds A and B to bf16 (round to
// nearest even) and multiplies them with f32 accumulation and an f32 C: with
// oneDNN on the avx512bf16 and amx paths that is dnnl_gemm_bf16bf16f32, 1.88x the
// f32 sgemm on bench-small's shapes (docs/blas.md); elsewhere the rounded
// operands go through the f32 GEMM (same numbers, no speed-up).
enum class GemmPrecision { kF32, kBF16 };
void set_gemm_precision(GemmPrecision p);
GemmPrecision gemm_precision();
// Whether kBF16 runs on native bf16 instructions here (and is allowed to).
bool native_bf16_gemm();
// Allows (the default) or forbids the native bf16 GEMM: forbidden, bf16
// products go through the f32 GEMM as on a CPU without bf16 instructions (for
// tests and benchmarks of that path on any machine).
void allow_native_bf16_gemm(bool allowed);
// Measured GEMM peak of this machine with the engine's BLAS at `precision`
// (GFLOP/s, on the calling thread's OpenMP threads): the denominator of MFU on
// a CPU build, and the planner's "local" peaks. ~0.3 s on 2 cores.
double measure_gemm_peak_gflops(GemmPrecision precision = GemmPrecision::kF32);

// A GEMM operand: its f32 values, and (optionally) the same values already
// rounded to bf16 (the bits of core::bf16), or the bf16 bits alone. At kBF16
// given bits are used as they are, so an operand rounded once (a bf16
// parameter, a saved bf16 activation, a gradient a kernel wrote in bf16)
// costs no pass over memory per product; f32 values are rounded per call. At
// kF32 the f32 values are used (bf16 bits alone are widened).
struct Operand {
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;
  Operand() = default;
  Operand(std::nullptr_t) {}
  Operand(const float* f) : f32(f) {}  // NOLINT: a plain f32 operand converts
  Operand(const uint16_t* h) : bf16(h) {}  // NOLINT: so do bf16 bits
  Operand(const float* f, const uint16_t* h) : f32(f), bf16(h) {}
  bool empty() const { return f32 == nullptr && bf16 == nullptr; }
};

// Row-major GEMM: C[M,N] = alpha * op(A)[M,K] * op(B)[K,N] + beta * C, at
// gemm_precision().
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, Operand A,
          int64_t lda, Operand B, int64_t ldb, float beta, float* C, int64_t ldc);
// The same with bf16 operands, f32 accumulation and an f32 C, whatever
// gemm_precision() is: oneDNN's dnnl_gemm_bf16bf16f32 where
// native_bf16_gemm(), else the operands widened through the f32 GEMM (bf16
// values are exact in f32, so the products are the same numbers).
void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta,
               float* C, int64_t ldc);

// out[BT,OC] = inp[BT,C] · weight[OC,C]^T + bias[OC]  (bias may be null)
void matmul_forward(float* out, Operand inp, Operand weight, const float* bias, int64_t BT,
                    int64_t C, int64_t OC);
// Generation's matmul_forward. Up to kDecodeRowsTiled rows (a serving
// step's decodes), on the avx512 paths (backend/isa.h) where C % 16 == 0: dot-product
// tiles that read each block of weight rows once for every row, every output
// one dot product in a fixed order, so a row's values do not depend on the
// other rows. oneDNN 2.6's sgemm is 2x slower at 16-24 rows (a cliff after
// 12) and faster past ~44 (gpt2-124M's blocks with cold weights,
// bench/backend/decode_rows_bench). More rows go to matmul_forward. The same
// values up to rounding.
void matmul_forward_decode(float* out, const float* inp, const float* weight, const float* bias,
                           int64_t BT, int64_t C, int64_t OC);
constexpr int64_t kDecodeRowsTiled = 40;
// matmul_forward_decode over a weight [OC, C] stored in a GGUF block format
// (backend/block_formats.h: rows of ggml_row_bytes(type, C) bytes), for a
// few rows (a decode step): the blocks are dequantized in registers inside
// the dot products, every output one dot over C in a fixed order, so each
// stored byte is read once and no widened copy of the matrix is made: Q8_0,
// Q4_0, BF16, F16, Q4_K and Q6_K on the avx512 paths; F32, and every type on
// the avx2 path, decode one weight row at a time into a thread's scratch.
void matmul_forward_decode_blocks(float* out, const float* inp, const void* weight, GgmlType type,
                                  const float* bias, int64_t BT, int64_t C, int64_t OC);
// dinp[BT,C] = dout · weight (written, or += when accumulate_dinp);
// dweight[OC,C] += dout^T · inp; dbias[OC] += sum_rows(dout) (dbias may be null).
// dinp, dweight and dbias may each be null (skipped): the input-gradient and
// weight-gradient halves of a backward can run apart (pipeline schedules).
// At kBF16 an f32 dout is rounded once for both products.
void matmul_backward(float* dinp, float* dweight, float* dbias, Operand dout, Operand inp,
                     Operand weight, int64_t BT, int64_t C, int64_t OC,
                     bool accumulate_dinp = false);

// out[BT,C] = (inp - mean) * rstd * weight + bias; saves mean[BT], rstd[BT].
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                       const float* weight, const float* bias, int64_t BT, int64_t C,
                       double eps = 1e-5);
// Fused norm + cast: the same f32 values rounded to bf16 as they are written
// (for an output read only by bf16 GEMMs). The statistics stay f32. The same
// holds for the bf16 overloads of rmsnorm_forward, gelu_forward and
// swiglu_forward: out is exactly f32_to_bf16 of the f32 kernel's out.
void layernorm_forward(uint16_t* out, float* mean, float* rstd, const float* inp,
                       const float* weight, const float* bias, int64_t BT, int64_t C,
                       double eps = 1e-5);
// dinp[BT,C] += ...; dweight[C] += ...; dbias[C] += ...
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean,
                        const float* rstd, int64_t BT, int64_t C);
// The saved input in bf16 (its widened values, the same bits as widening it
// first). The same for rmsnorm_backward, gelu_backward and swiglu_backward.
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const uint16_t* inp, const float* weight, const float* mean,
                        const float* rstd, int64_t BT, int64_t C);

// RMSNorm (Llama): out[BT,C] = inp * rstd * weight, rstd = 1/sqrt(mean(inp^2) + eps);
// saves rstd[BT].
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t BT,
                     int64_t C, double eps);
void rmsnorm_forward(uint16_t* out, float* rstd, const float* inp, const float* weight,
                     int64_t BT, int64_t C, double eps);
// dinp[BT,C] += ...; dweight[C] += ...
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t BT, int64_t C);
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const uint16_t* inp,
                      const float* weight, const float* rstd, int64_t BT, int64_t C);

// SwiGLU: inp[BT,2F] holds gate | up; out[BT,F] = silu(gate) * up.
void swiglu_forward(float* out, const float* inp, int64_t BT, int64_t F);
void swiglu_forward(uint16_t* out, const float* inp, int64_t BT, int64_t F);
// dinp[BT,2F] written (d gate | d up).
void swiglu_backward(float* dinp, const float* inp, const float* dout, int64_t BT, int64_t F);
void swiglu_backward(float* dinp, const uint16_t* inp, const float* dout, int64_t BT, int64_t F);

// Rotary embedding frequencies: inv_freq[i] = theta^(-2i/hs), i < hs/2, with
// Llama-3.1's scaling when factor > 0 (long wavelengths divided by factor,
// short ones kept, a smooth blend between).
struct RopeScaling {
  double theta = 10000.0;
  double factor = 0.0;  // 0: no scaling
  double low_freq_factor = 1.0, high_freq_factor = 4.0, original_max_position = 8192.0;
};
void rope_inv_freq(double* inv_freq, int64_t hs, const RopeScaling& scaling);
// cos_t, sin_t [T, hs/2]: row t the angle of position pos0 + t, pair i.
void rope_table(float* cos_t, float* sin_t, int64_t T, int64_t hs, const RopeScaling& scaling,
                int64_t pos0 = 0);
// In place on x[B*T rows of `stride` floats]: the first n_heads heads of hs
// channels of each row rotated by position pos0 + t (rotate-half: channel i
// pairs with i + hs/2). The backward rotates the gradient back.
void rope_forward(float* x, int64_t B, int64_t T, int64_t stride, int64_t n_heads, int64_t hs,
                  const float* cos_t, const float* sin_t, int64_t pos0 = 0);
void rope_backward(float* dx, int64_t B, int64_t T, int64_t stride, int64_t n_heads, int64_t hs,
                   const float* cos_t, const float* sin_t, int64_t pos0 = 0);

// GELU, tanh approximation: out[n] = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
void gelu_forward(float* out, const float* inp, int64_t n);
void gelu_forward(uint16_t* out, const float* inp, int64_t n);
// dinp[n] = gelu'(inp) * dout (written; dinp may alias dout).
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n);
void gelu_backward(float* dinp, const uint16_t* inp, const float* dout, int64_t n);

// out[n] = a[n] + b[n] (out may alias a or b).
void residual_forward(float* out, const float* a, const float* b, int64_t n);

// Causal self-attention, flash style: scores are never stored; the backward
// recomputes them from q, k and the saved log-sum-exp. Grouped-query: NH query
// heads share NKV key/value heads (NKV = NH multi-head, 1 multi-query), query
// head h reading kv head h / (NH/NKV); k and v are never repeated in memory.
// qkv[B,T,(NH+2·NKV)·hs] holds q (NH heads) | k (NKV heads) | v (NKV heads).
// out[B,T,NH·hs] (heads concatenated); lse[B,NH,T] = log sum_j exp(q·k_j / sqrt(hs)).
void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                       int64_t NH, int64_t NKV, int64_t hs);
// dqkv[B,T,(NH+2·NKV)·hs] written. Needs the forward's out and lse.
// At GemmPrecision::kBF16, on the avx512bf16 and amx paths (backend/isa.h),
// both run on bf16 tiles: q (pre-scaled), k, v, dout and each tile's
// probabilities and score gradients rounded to bf16 as they are packed, every
// product accumulated in f32 (vdpbf16ps); the online softmax, lse and the
// gradient accumulators stay f32. Elsewhere, and at kF32, f32 tiles.
bool bf16_attention_tiles();
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                        int64_t hs);
// The saved q, k, v and output in bf16 (read as their widened values: the
// same bits as widening them first).
void attention_backward(float* dqkv, const float* dout, const uint16_t* qkv, const uint16_t* out,
                        const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                        int64_t hs);

// Context parallel's attention, in blocks (ring attention, Liu et al. 2023):
// the queries of one chunk of a sequence against the keys and values of
// another chunk of it, the chunks' results merged by their log-sum-exp.
// Operands are row views: element (b, t, c) at p[b·batch + t·row + c], query
// head h at columns h·hs, kv head g at g·hs (of k's and v's own views).
// causal: the two chunks are the same positions (query i sees keys 0..i, nq
// = nk); otherwise every key precedes every query (a later query chunk
// against an earlier key chunk; an earlier one against a later chunk is not
// a block at all). Tiles as attention_forward's: bf16 at kBF16 on the
// avx512bf16 and amx paths, f32 elsewhere.
struct AttnRows {
  const float* p = nullptr;
  int64_t row = 0, batch = 0;
};
struct AttnRowsOut {
  float* p = nullptr;
  int64_t row = 0, batch = 0;
};
// Merges the block's attention into out (nq rows of NH·hs) and lse ((b, h, i)
// at lse[(b·NH + h)·lse_stride + i]): with the block's own normalised o_b and
// lse_b, lse' = log(e^lse + e^lse_b), out' = e^(lse − lse')·out +
// e^(lse_b − lse')·o_b, per row in f32 (attention_lse_merge). Before a
// query chunk's first block out holds 0 and lse −inf (the merge then gives
// the block's own values exactly). A fixed order of blocks gives fixed bits.
void attention_block_forward(AttnRowsOut out, float* lse, int64_t lse_stride, AttnRows q,
                             AttnRows k, AttnRows v, int64_t B, int64_t nq, int64_t nk,
                             int64_t NH, int64_t NKV, int64_t hs, bool causal);
// One row of that merge: out[hs], *lse with the block's o_b[hs], lse_b.
void attention_lse_merge(float* out, float* lse, const float* o_b, float lse_b, int64_t hs);
// The block's gradients, added: dq (nq rows, NH heads) += and dk, dv (nk
// rows, NKV heads) +=, from dout and the attention's final out and lse (every
// block merged). The sum over a query chunk's blocks is attention_backward's.
void attention_block_backward(AttnRowsOut dq, AttnRowsOut dk, AttnRowsOut dv, AttnRows dout,
                              AttnRows out, const float* lse, int64_t lse_stride, AttnRows q,
                              AttnRows k, AttnRows v, int64_t B, int64_t nq, int64_t nk,
                              int64_t NH, int64_t NKV, int64_t hs, bool causal);

// Generation: n new queries q[n rows of q_stride; NH heads of hs first] at
// positions pos0 .. pos0+n-1 against k_cache, v_cache [pos0+n, NKV·hs]
// (already holding the new keys and values); out[n, NH·hs].
void attention_cached_forward(float* out, const float* q, int64_t q_stride, const float* k_cache,
                              const float* v_cache, int64_t n, int64_t pos0, int64_t NH,
                              int64_t NKV, int64_t hs);

// Serving: attention_cached_forward over a paged cache. Position j's keys
// and values are row (block_table[j / block_size] · block_size + j %
// block_size) of k_pool, v_pool [blocks · block_size, NKV·hs]. The same
// arithmetic in the same order as attention_cached_forward, so a sequence
// gives the same bits whichever blocks hold it.
void paged_attention_forward(float* out, const float* q, int64_t q_stride, const float* k_pool,
                             const float* v_pool, const int32_t* block_table, int64_t block_size,
                             int64_t n, int64_t pos0, int64_t NH, int64_t NKV, int64_t hs);

// out[B,T,C] = wte[tokens[b,t]] + wpe[t]  (wpe null: no learned positions)
void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                       int64_t B, int64_t T, int64_t C);
// The same from a table stored in bf16 (its bits): each looked-up row widened
// as it is read, the values embedding_forward gives on the widened table.
void embedding_forward(float* out, const int32_t* tokens, const uint16_t* wte16, const float* wpe,
                       int64_t B, int64_t T, int64_t C);
// dwte[V,C] += scatter of dout rows; dwpe[T,C] += sum over b (dwpe may be null).
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                        int64_t B, int64_t T, int64_t C);

// A target of kIgnoreTarget (any negative id) marks a row the loss skips
// (PyTorch's ignore_index, SFT's prompt tokens and padding): every kernel
// below gives it loss 0 and a zero gradient row.
inline constexpr int32_t kIgnoreTarget = -1;

// Fused softmax + cross-entropy over logits[BT,V]. losses[BT] = -log softmax[target].
// When `grad_scale` != 0, logits are overwritten in place by the gradient of
// grad_scale * sum(losses) w.r.t. the logits: grad_scale * (softmax - onehot).
// (The loss is the mean over BT rows, so callers pass grad_scale = 1/(BT*accum).)
void crossentropy_forward(float* losses, float* logits, const int32_t* targets, int64_t BT,
                          int64_t V, float grad_scale);
// The same losses, with the gradient (grad_scale != 0) written as bf16 bits
// into grad16[BT,V] instead: each value rounded to nearest even from the f32
// that crossentropy_forward would leave (the cast fused into the pass that
// scales, so a bf16 GEMM reads it without another pass). logits is clobbered.
void crossentropy_forward_bf16(float* losses, float* logits, uint16_t* grad16,
                               const int32_t* targets, int64_t BT, int64_t V, float grad_scale);

// Cross-entropy over vocabulary pieces: the head's columns cut into pieces
// that are computed one after another, or on different pipeline ranks
// (model/vocab_head.h), with the same bits either way. Per piece, logits
// [n, Vk] for global columns [v0, v0 + Vk):
//   ce_piece_stats: mx[r] = the row's max, sum[r] = sum of exp(z - mx) (f32
//     blocks of 1024 added in double, as crossentropy_forward), the exps
//     stored in place when store_exp; zt[r] = the target's logit where the
//     piece holds the target (other rows untouched).
//   ce_piece_combine: for P pieces' statistics ([P, n], piece k's row r at
//     k·n + r): M = max of the mx, S = sum over k in order of
//     sum_k · exp(mx_k - M) (double), losses[r] = log S + M - zt[r]; with
//     grad_scale != 0, scale[k·n + r] = f32(grad_scale · exp(mx_k - M) / S).
//     An ignored row (target < 0) gets loss 0 and scales 0.
//   ce_piece_grad: the piece's gradient, exps · scale[r], minus grad_scale at
//     the target's column: f32 in place, or bf16 bits into grad16 (as
//     crossentropy_forward_bf16 rounds them).
// With one piece these give crossentropy_forward's (and _bf16's) bits.
void ce_piece_stats(float* mx, double* sum, float* zt, float* logits, const int32_t* targets,
                    int64_t n, int64_t Vk, int64_t v0, bool store_exp);
void ce_piece_combine(float* losses, float* scale, const float* mx, const double* sum,
                      const float* zt, const int32_t* targets, int64_t pieces, int64_t n,
                      float grad_scale);
void ce_piece_grad(float* exps, const float* scale, const int32_t* targets, int64_t n, int64_t Vk,
                   int64_t v0, float grad_scale);
void ce_piece_grad(uint16_t* grad16, const float* exps, const float* scale, const int32_t* targets,
                   int64_t n, int64_t Vk, int64_t v0, float grad_scale);

// Vocabulary-parallel embedding (tensor parallel; Layout::vocab_begin/vocab_real):
// a rank's table holds global rows [v0, v0 + nv). Tokens in that range are
// looked up (row t - v0), the others give zero rows, so the sum over the
// tensor group is the lookup; positions are added after that sum.
void embedding_forward_slice(float* out, const int32_t* tokens, const float* wte_slice,
                             int64_t v0, int64_t nv, int64_t n, int64_t C);
void embedding_forward_slice(float* out, const int32_t* tokens, const uint16_t* wte16_slice,
                             int64_t v0, int64_t nv, int64_t n, int64_t C);
// out[i,:] += wpe[(row0 + i) % T,:] for the rows i < n: rows row0 .. of a
// [B,T] batch (all of it: row0 = 0, n = B·T).
void position_embedding_add(float* out, const float* wpe, int64_t row0, int64_t n, int64_t T,
                            int64_t C);
// embedding_backward for the tokens in [v0, v0 + nv) (the others add nothing
// to dwte_slice); dwpe as there, from every row.
void embedding_backward_slice(float* dwte_slice, float* dwpe, const float* dout,
                              const int32_t* tokens, int64_t B, int64_t T, int64_t C, int64_t v0,
                              int64_t nv);

// Vocabulary-parallel cross-entropy (Megatron's): a rank holds logits [n, Vl]
// for global columns v0 .., of which the first nv are real (the rest pad the
// vocabulary and never count). The loss needs three per-row reductions over
// the tensor group, done by the caller between the phases:
//   1. row_max[r] = max of the real logits (then: max over the group);
//   2. sums[2r] = sum of exp(z - row_max) (then: sum over the group), kept in
//      place as exp when store_exp; sums[2r+1] = the target's logit when this
//      slice holds it, else 0 (then: sum over the group);
//   3. losses[r] = log(sum) + max - z_target; with grad_scale != 0 the slice
//      becomes grad_scale * (softmax - onehot) (padding columns 0).
void vocab_ce_max(float* row_max, const float* logits, int64_t n, int64_t Vl, int64_t nv);
void vocab_ce_sums(double* sums, float* logits, const int32_t* targets, const float* row_max,
                   int64_t n, int64_t Vl, int64_t nv, int64_t v0, bool store_exp);
void vocab_ce_finish(float* losses, float* logits, const int32_t* targets, const float* row_max,
                     const double* sums, int64_t n, int64_t Vl, int64_t nv, int64_t v0,
                     float grad_scale);

// Sum of squares of x[n], in double (for the global gradient norm).
double sum_squares(const float* x, int64_t n);
// x[n] *= s
void scale(float* x, float s, int64_t n);

// bf16 storage (the bits of core::bf16): widen; round to nearest even;
// dst = round(dst + src) (gradient accumulation into bf16); sum of squares in
// double (the global norm of bf16 gradients).
void bf16_to_f32(float* dst, const uint16_t* src, int64_t n);
void f32_to_bf16(uint16_t* dst, const float* src, int64_t n);
// dst = src rounded to bf16 and widened back (a bf16 store and load in one).
void bf16_round_f32(float* dst, const float* src, int64_t n);
void bf16_add_f32(uint16_t* dst, const float* src, int64_t n);
void bf16_add_bf16(uint16_t* dst, const uint16_t* src, int64_t n);
double sum_squares_bf16(const uint16_t* x, int64_t n);

// AdamW on n elements, nanoGPT/PyTorch semantics with bias correction:
//   g = grad * grad_scale; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2
//   param *= 1 - lr * weight_decay            (decoupled decay first, as torch.optim.AdamW)
//   param -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// t is the 1-based step count.
void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, float grad_scale,
                  int64_t t);

// Mixed precision: the same update of the fp32 master weights from bf16
// gradients, writing the rounded result to the bf16 parameters param_out[n].
void adamw_update_mixed(float* master, const uint16_t* grad, float* m, float* v,
                        uint16_t* param_out, int64_t n, float lr, float beta1, float beta2,
                        float eps, float weight_decay, float grad_scale, int64_t t);

// Blockwise quantization (backend/codebook.h): x[n] in blocks of `block`
// (the first one `first_block` long when nonzero, the last one possibly
// short), each stored as absmax[b] and one code per element (packed two to
// a byte for a 4-bit codebook, blocks then even-sized but the last, its last
// low nibble 0 when odd). dequantize_blockwise is its inverse, value × absmax.
void quantize_blockwise(const Codebook* map, const float* x, int64_t n, int64_t block,
                        uint8_t* codes, float* absmax, int64_t first_block = 0);
void dequantize_blockwise(const Codebook* map, const uint8_t* codes, const float* absmax,
                          int64_t n, int64_t block, float* x, int64_t first_block = 0);

// Adam's moments stored blockwise (optim.state_bits 8 or 4): m on its
// codebook, v on its own. The call's elements are cut into blocks of
// `block`, the first one `first_block` long (0: a whole block; the rest of
// a block a range starts inside, optim/adamw.h), the last one possibly short.
struct QuantMoments {
  uint8_t* m = nullptr;
  float* m_absmax = nullptr;
  uint8_t* v = nullptr;
  float* v_absmax = nullptr;
  const Codebook* m_map = nullptr;
  const Codebook* v_map = nullptr;
  int64_t block = 256;      // at most kMaxQuantBlock, even for 4 bits
  int64_t first_block = 0;  // even for 4 bits
};
inline constexpr int64_t kMaxQuantBlock = 4096;

// adamw_update with quantized moments: each block's m and v are dequantized,
// take adamw_update's arithmetic (the same float32 operations, in the same
// order, so the step differs from the 32-bit one only by the state's
// rounding), and are requantized with their new absmax. The parameter takes
// the update from the unquantized new m and v (bitsandbytes' order). Exactly
// one of grad (float32) and grad_bf16 is given; param_out (bf16 parameters
// written from the fp32 master) may be null.
void adamw_update_quant(float* param, const float* grad, const uint16_t* grad_bf16,
                        uint16_t* param_out, const QuantMoments* q, int64_t n, float lr,
                        float beta1, float beta2, float eps, float weight_decay,
                        float grad_scale, int64_t t);

}  // namespace po::backend::cpu
