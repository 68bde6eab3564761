// The kernels table: every op of ops.h whose code depends on the instruction
// set, as one function pointer each. The CPU backend builds its kernel files
// once per instruction-set path (backend/cpu/kernel_isa.h) and fills one table
// per path; ops.h's functions call the table chosen at start-up (backend/isa.h).
// A CUDA backend fills the same table from backend/cuda/.
//
// PO_KERNELS(X) lists the ops as X(member, name, ret, (params), (args)):
// `member` names the table's entry (an overloaded op has one per overload),
// `name` the ops.h function. The parameter lists are ops.h's, without its
// default arguments.
#pragma once

#include "backend/ops.h"

namespace po::backend::cpu {

// clang-format off
#define PO_KERNELS(X)                                                                              \
  X(matmul_forward, matmul_forward, void,                                                          \
    (float* out, Operand inp, Operand weight, const float* bias, int64_t BT, int64_t C,            \
     int64_t OC), (out, inp, weight, bias, BT, C, OC))                                             \
  X(matmul_forward_decode, matmul_forward_decode, void,                                            \
    (float* out, const float* inp, const float* weight, const float* bias, int64_t BT, int64_t C,  \
     int64_t OC), (out, inp, weight, bias, BT, C, OC))                                             \
  X(matmul_forward_decode_blocks, matmul_forward_decode_blocks, void,                              \
    (float* out, const float* inp, const void* weight, GgmlType type, const float* bias,           \
     int64_t BT, int64_t C, int64_t OC), (out, inp, weight, type, bias, BT, C, OC))                \
  X(matmul_backward, matmul_backward, void,                                                        \
    (float* dinp, float* dweight, float* dbias, Operand dout, Operand inp, Operand weight,         \
     int64_t BT, int64_t C, int64_t OC, bool accumulate_dinp),                                     \
    (dinp, dweight, dbias, dout, inp, weight, BT, C, OC, accumulate_dinp))                         \
  X(layernorm_forward, layernorm_forward, void,                                                    \
    (float* out, float* mean, float* rstd, const float* inp, const float* weight,                  \
     const float* bias, int64_t BT, int64_t C, double eps),                                        \
    (out, mean, rstd, inp, weight, bias, BT, C, eps))                                              \
  X(layernorm_forward_bf16, layernorm_forward, void,                                               \
    (uint16_t* out, float* mean, float* rstd, const float* inp, const float* weight,               \
     const float* bias, int64_t BT, int64_t C, double eps),                                        \
    (out, mean, rstd, inp, weight, bias, BT, C, eps))                                              \
  X(layernorm_backward, layernorm_backward, void,                                                  \
    (float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,               \
     const float* weight, const float* mean, const float* rstd, int64_t BT, int64_t C),            \
    (dinp, dweight, dbias, dout, inp, weight, mean, rstd, BT, C))                                  \
  X(layernorm_backward_bf16, layernorm_backward, void,                                             \
    (float* dinp, float* dweight, float* dbias, const float* dout, const uint16_t* inp,            \
     const float* weight, const float* mean, const float* rstd, int64_t BT, int64_t C),            \
    (dinp, dweight, dbias, dout, inp, weight, mean, rstd, BT, C))                                  \
  X(rmsnorm_forward, rmsnorm_forward, void,                                                        \
    (float* out, float* rstd, const float* inp, const float* weight, int64_t BT, int64_t C,        \
     double eps), (out, rstd, inp, weight, BT, C, eps))                                            \
  X(rmsnorm_forward_bf16, rmsnorm_forward, void,                                                   \
    (uint16_t* out, float* rstd, const float* inp, const float* weight, int64_t BT, int64_t C,     \
     double eps), (out, rstd, inp, weight, BT, C, eps))                                            \
  X(rmsnorm_backward, rmsnorm_backward, void,                                                      \
    (float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,        \
     const float* rstd, int64_t BT, int64_t C), (dinp, dweight, dout, inp, weight, rstd, BT, C))   \
  X(rmsnorm_backward_bf16, rmsnorm_backward, void,                                                 \
    (float* dinp, float* dweight, const float* dout, const uint16_t* inp, const float* weight,     \
     const float* rstd, int64_t BT, int64_t C), (dinp, dweight, dout, inp, weight, rstd, BT, C))   \
  X(swiglu_forward, swiglu_forward, void, (float* out, const float* inp, int64_t BT, int64_t F),   \
    (out, inp, BT, F))                                                                             \
  X(swiglu_forward_bf16, swiglu_forward, void,                                                     \
    (uint16_t* out, const float* inp, int64_t BT, int64_t F), (out, inp, BT, F))                   \
  X(swiglu_backward, swiglu_backward, void,                                                        \
    (float* dinp, const float* inp, const float* dout, int64_t BT, int64_t F),                     \
    (dinp, inp, dout, BT, F))                                                                      \
  X(swiglu_backward_bf16, swiglu_backward, void,                                                   \
    (float* dinp, const uint16_t* inp, const float* dout, int64_t BT, int64_t F),                  \
    (dinp, inp, dout, BT, F))                                                                      \
  X(rope_inv_freq, rope_inv_freq, void,                                                            \
    (double* inv_freq, int64_t hs, const RopeScaling& scaling), (inv_freq, hs, scaling))           \
  X(rope_table, rope_table, void,                                                                  \
    (float* cos_t, float* sin_t, int64_t T, int64_t hs, const RopeScaling& scaling, int64_t pos0), \
    (cos_t, sin_t, T, hs, scaling, pos0))                                                          \
  X(rope_forward, rope_forward, void,                                                              \
    (float* x, int64_t B, int64_t T, int64_t stride, int64_t n_heads, int64_t hs,                  \
     const float* cos_t, const float* sin_t, int64_t pos0),                                        \
    (x, B, T, stride, n_heads, hs, cos_t, sin_t, pos0))                                            \
  X(rope_backward, rope_backward, void,                                                            \
    (float* dx, int64_t B, int64_t T, int64_t stride, int64_t n_heads, int64_t hs,                 \
     const float* cos_t, const float* sin_t, int64_t pos0),                                        \
    (dx, B, T, stride, n_heads, hs, cos_t, sin_t, pos0))                                           \
  X(gelu_forward, gelu_forward, void, (float* out, const float* inp, int64_t n), (out, inp, n))   \
  X(gelu_forward_bf16, gelu_forward, void, (uint16_t* out, const float* inp, int64_t n),           \
    (out, inp, n))                                                                                 \
  X(gelu_backward, gelu_backward, void,                                                            \
    (float* dinp, const float* inp, const float* dout, int64_t n), (dinp, inp, dout, n))           \
  X(gelu_backward_bf16, gelu_backward, void,                                                       \
    (float* dinp, const uint16_t* inp, const float* dout, int64_t n), (dinp, inp, dout, n))        \
  X(residual_forward, residual_forward, void,                                                      \
    (float* out, const float* a, const float* b, int64_t n), (out, a, b, n))                       \
  X(attention_forward, attention_forward, void,                                                    \
    (float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,      \
     int64_t hs), (out, lse, qkv, B, T, NH, NKV, hs))                                              \
  X(bf16_attention_tiles, bf16_attention_tiles, bool, (), ())                                      \
  X(attention_backward, attention_backward, void,                                                  \
    (float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,         \
     int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t hs),                                   \
    (dqkv, dout, qkv, out, lse, B, T, NH, NKV, hs))                                                \
  X(attention_backward_bf16, attention_backward, void,                                             \
    (float* dqkv, const float* dout, const uint16_t* qkv, const uint16_t* out, const float* lse,   \
     int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t hs),                                   \
    (dqkv, dout, qkv, out, lse, B, T, NH, NKV, hs))                                                \
  X(attention_block_forward, attention_block_forward, void,                                        \
    (AttnRowsOut out, float* lse, int64_t lse_stride, AttnRows q, AttnRows k, AttnRows v,          \
     int64_t B, int64_t nq, int64_t nk, int64_t NH, int64_t NKV, int64_t hs, bool causal),         \
    (out, lse, lse_stride, q, k, v, B, nq, nk, NH, NKV, hs, causal))                               \
  X(attention_lse_merge, attention_lse_merge, void,                                                \
    (float* out, float* lse, const float* o_b, float lse_b, int64_t hs), (out, lse, o_b, lse_b, hs)) \
  X(attention_block_backward, attention_block_backward, void,                                      \
    (AttnRowsOut dq, AttnRowsOut dk, AttnRowsOut dv, AttnRows dout, AttnRows out,                  \
     const float* lse, int64_t lse_stride, AttnRows q, AttnRows k, AttnRows v, int64_t B,          \
     int64_t nq, int64_t nk, int64_t NH, int64_t NKV, int64_t hs, bool causal),                    \
    (dq, dk, dv, dout, out, lse, lse_stride, q, k, v, B, nq, nk, NH, NKV, hs, causal))             \
  X(attention_cached_forward, attention_cached_forward, void,                                      \
    (float* out, const float* q, int64_t q_stride, const float* k_cache, const float* v_cache,     \
     int64_t n, int64_t pos0, int64_t NH, int64_t NKV, int64_t hs),                                \
    (out, q, q_stride, k_cache, v_cache, n, pos0, NH, NKV, hs))                                    \
  X(paged_attention_forward, paged_attention_forward, void,                                        \
    (float* out, const float* q, int64_t q_stride, const float* k_pool, const float* v_pool,       \
     const int32_t* block_table, int64_t block_size, int64_t n, int64_t pos0, int64_t NH,          \
     int64_t NKV, int64_t hs),                                                                     \
    (out, q, q_stride, k_pool, v_pool, block_table, block_size, n, pos0, NH, NKV, hs))             \
  X(embedding_forward, embedding_forward, void,                                                    \
    (float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B, int64_t T,  \
     int64_t C), (out, tokens, wte, wpe, B, T, C))                                                 \
  X(embedding_forward_bf16, embedding_forward, void,                                               \
    (float* out, const int32_t* tokens, const uint16_t* wte16, const float* wpe, int64_t B,        \
     int64_t T, int64_t C), (out, tokens, wte16, wpe, B, T, C))                                    \
  X(embedding_backward, embedding_backward, void,                                                  \
    (float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,     \
     int64_t C), (dwte, dwpe, dout, tokens, B, T, C))                                              \
  X(crossentropy_forward, crossentropy_forward, void,                                              \
    (float* losses, float* logits, const int32_t* targets, int64_t BT, int64_t V,                  \
     float grad_scale), (losses, logits, targets, BT, V, grad_scale))                              \
  X(crossentropy_forward_bf16, crossentropy_forward_bf16, void,                                    \
    (float* losses, float* logits, uint16_t* grad16, const int32_t* targets, int64_t BT,           \
     int64_t V, float grad_scale), (losses, logits, grad16, targets, BT, V, grad_scale))           \
  X(ce_piece_stats, ce_piece_stats, void,                                                          \
    (float* mx, double* sum, float* zt, float* logits, const int32_t* targets, int64_t n,          \
     int64_t Vk, int64_t v0, bool store_exp), (mx, sum, zt, logits, targets, n, Vk, v0, store_exp)) \
  X(ce_piece_combine, ce_piece_combine, void,                                                      \
    (float* losses, float* scale, const float* mx, const double* sum, const float* zt,             \
     const int32_t* targets, int64_t pieces, int64_t n, float grad_scale),                         \
    (losses, scale, mx, sum, zt, targets, pieces, n, grad_scale))                                  \
  X(ce_piece_grad, ce_piece_grad, void,                                                            \
    (float* exps, const float* scale, const int32_t* targets, int64_t n, int64_t Vk, int64_t v0,   \
     float grad_scale), (exps, scale, targets, n, Vk, v0, grad_scale))                             \
  X(ce_piece_grad_bf16, ce_piece_grad, void,                                                       \
    (uint16_t* grad16, const float* exps, const float* scale, const int32_t* targets, int64_t n,   \
     int64_t Vk, int64_t v0, float grad_scale), (grad16, exps, scale, targets, n, Vk, v0, grad_scale)) \
  X(embedding_forward_slice, embedding_forward_slice, void,                                        \
    (float* out, const int32_t* tokens, const float* wte_slice, int64_t v0, int64_t nv, int64_t n, \
     int64_t C), (out, tokens, wte_slice, v0, nv, n, C))                                           \
  X(embedding_forward_slice_bf16, embedding_forward_slice, void,                                   \
    (float* out, const int32_t* tokens, const uint16_t* wte16_slice, int64_t v0, int64_t nv,       \
     int64_t n, int64_t C), (out, tokens, wte16_slice, v0, nv, n, C))                              \
  X(position_embedding_add, position_embedding_add, void,                                          \
    (float* out, const float* wpe, int64_t row0, int64_t n, int64_t T, int64_t C),                 \
    (out, wpe, row0, n, T, C))                                                                     \
  X(embedding_backward_slice, embedding_backward_slice, void,                                      \
    (float* dwte_slice, float* dwpe, const float* dout, const int32_t* tokens, int64_t B,          \
     int64_t T, int64_t C, int64_t v0, int64_t nv), (dwte_slice, dwpe, dout, tokens, B, T, C, v0, nv)) \
  X(vocab_ce_max, vocab_ce_max, void,                                                              \
    (float* row_max, const float* logits, int64_t n, int64_t Vl, int64_t nv),                      \
    (row_max, logits, n, Vl, nv))                                                                  \
  X(vocab_ce_sums, vocab_ce_sums, void,                                                            \
    (double* sums, float* logits, const int32_t* targets, const float* row_max, int64_t n,         \
     int64_t Vl, int64_t nv, int64_t v0, bool store_exp),                                          \
    (sums, logits, targets, row_max, n, Vl, nv, v0, store_exp))                                    \
  X(vocab_ce_finish, vocab_ce_finish, void,                                                        \
    (float* losses, float* logits, const int32_t* targets, const float* row_max,                   \
     const double* sums, int64_t n, int64_t Vl, int64_t nv, int64_t v0, float grad_scale),         \
    (losses, logits, targets, row_max, sums, n, Vl, nv, v0, grad_scale))                           \
  X(sum_squares, sum_squares, double, (const float* x, int64_t n), (x, n))                         \
  X(scale, scale, void, (float* x, float s, int64_t n), (x, s, n))                                 \
  X(bf16_to_f32, bf16_to_f32, void, (float* dst, const uint16_t* src, int64_t n), (dst, src, n))   \
  X(f32_to_bf16, f32_to_bf16, void, (uint16_t* dst, const float* src, int64_t n), (dst, src, n))   \
  X(bf16_round_f32, bf16_round_f32, void, (float* dst, const float* src, int64_t n),               \
    (dst, src, n))                                                                                 \
  X(bf16_add_f32, bf16_add_f32, void, (uint16_t* dst, const float* src, int64_t n), (dst, src, n)) \
  X(bf16_add_bf16, bf16_add_bf16, void, (uint16_t* dst, const uint16_t* src, int64_t n),           \
    (dst, src, n))                                                                                 \
  X(sum_squares_bf16, sum_squares_bf16, double, (const uint16_t* x, int64_t n), (x, n))            \
  X(adamw_update, adamw_update, void,                                                              \
    (float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1,        \
     float beta2, float eps, float weight_decay, float grad_scale, int64_t t),                     \
    (param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, grad_scale, t))                    \
  X(adamw_update_mixed, adamw_update_mixed, void,                                                  \
    (float* master, const uint16_t* grad, float* m, float* v, uint16_t* param_out, int64_t n,      \
     float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale,          \
     int64_t t), (master, grad, m, v, param_out, n, lr, beta1, beta2, eps, weight_decay,           \
                  grad_scale, t))                                                                \
  X(quantize_blockwise, quantize_blockwise, void,                                                  \
    (const Codebook* map, const float* x, int64_t n, int64_t block, uint8_t* codes,                \
     float* absmax, int64_t first_block), (map, x, n, block, codes, absmax, first_block))          \
  X(dequantize_blockwise, dequantize_blockwise, void,                                              \
    (const Codebook* map, const uint8_t* codes, const float* absmax, int64_t n, int64_t block,     \
     float* x, int64_t first_block), (map, codes, absmax, n, block, x, first_block))               \
  X(adamw_update_quant, adamw_update_quant, void,                                                  \
    (float* param, const float* grad, const uint16_t* grad_bf16, uint16_t* param_out,              \
     const QuantMoments* q, int64_t n, float lr, float beta1, float beta2, float eps,              \
     float weight_decay, float grad_scale, int64_t t),                                             \
    (param, grad, grad_bf16, param_out, q, n, lr, beta1, beta2, eps, weight_decay, grad_scale, t))
// clang-format on

struct Kernels {
  const char* isa = nullptr;  // the path it was built for (checked when installed: backend/cpu/isa.cc)
#define PO_KERNEL_MEMBER(member, name, ret, params, args) ret(*member) params = nullptr;
  PO_KERNELS(PO_KERNEL_MEMBER)
#undef PO_KERNEL_MEMBER
};

// The table ops.h's functions call: the instruction-set path chosen at
// start-up (backend/isa.h).
const Kernels& kernels();

}  // namespace po::backend::cpu
