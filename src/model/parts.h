// The parts a decoder block is made of: Norm, Linear, Attention and Mlp,
// and the Block that holds one of each kind in its order. A part knows
//   - its tensors: it declares them in the layout (declare_block, called by
//     Layout's constructor once per block) and keeps their offsets inside the
//     block's unit, the same in every block;
//   - its shapes as this tensor-parallel rank holds them, and its partition;
//   - the arithmetic of its forward and backward on a unit's buffers.
// The block paths (model/transformer_steps.cc: the forward, the fused
// backward and its input and weight halves; model/transformer_decode.cc: the
// one decode path, training's and serving's) are compositions of these calls.
// The tensor group's collectives between parts (Megatron's f and g) stay with
// the Transformer, which holds the group (model/parallel_ops.h); a Linear's
// partition says where they go.
//
// What plugs in here later: an adapter on a Linear (LoRA), an expert Mlp, a
// quantized storage format for a Linear's weight.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "model/config.h"
#include "model/quant_weight.h"
#include "model/tensor_spec.h"

namespace po::model::parts {

using backend::cpu::Operand;

// A tensor as a part declares it; the layout gives it its offset and unit.
struct Decl {
  std::string name;
  tensor::Shape shape;
  Init init = Init::kZeros;
  Partition partition = Partition::kReplicated;
  std::vector<int64_t> parts;  // kSplitRows: rows of each fused part as held (see TensorSpec)
  bool conv1d = false;
};
// Appends a tensor to the unit being laid out; returns its offset inside the unit.
using Declare = std::function<int64_t(Decl)>;

// A low-rank adapter on a Linear (LoRA, DoRA): each adapted piece of the
// Linear's output rows (a fused weight's q, k, v or gate, up are pieces of
// their own, as their Hugging Face modules are) adds s·(x·Aᵀ)·Bᵀ to its
// rows, A [r, in], B [rows, r]; under DoRA its rows are then scaled by
// m / ‖W0 + s·B·A‖ (row norms over the input, detached), the bias not.
// Offsets are inside the unit of the trainable tensors, not the base's.
// Training's dropout on an adapter's input (PEFT's lora_dropout): element
// (i, c) of the [rows, in] input of piece k of the Linear in unit `unit` is
// kept, as x / (1 - p), iff u >= p, u = the top 24 bits of word 0 of
// Philox4x32-10 (core/rng.h) at counter (e, e >> 32, unit · 256 + k, step)
// and key seed ^ kDropoutKey, e = (row0 + i) · in + c, row0 the micro-batch's
// first row in the step's global batch (global sequence index × T). A pure
// function of the step and the token's place in the global batch: any split
// over ranks, micro-batches or a resume keeps the mask.
struct AdapterDropout {
  static constexpr uint64_t kDropoutKey = 0xD80F0C0DE5A1E000ull;
  bool on = false;
  uint64_t seed = 0;
  uint32_t step = 0, unit = 0;
  int64_t row0 = 0;
  // keep[rows · in]: 1 / (1 - p) where kept, 0 where dropped.
  void scales(float* keep, int piece, int64_t rows, int64_t in, float p) const;
};

struct Adapter {
  struct Piece {
    int64_t row0 = 0, rows = 0;  // the Linear's output rows it adapts
    int64_t a = -1, b = -1;      // offsets of A and B
    int64_t m = -1;              // DoRA's magnitude [rows]; -1: LoRA
  };
  std::vector<Piece> pieces;
  int64_t r = 0;
  float scale = 0.0f;    // s = alpha / r, or alpha / sqrt(r) (rsLoRA)
  float dropout = 0.0f;  // p of AdapterDropout (LoRA only)
  bool on() const { return !pieces.empty(); }
};

// y[rows, out] = x[rows, in] · Wᵀ + b, W [out, in] as this rank holds it.
// kSplitRows: column-parallel (every rank sees all of x, computes its rows
// of y); kSplitCols: row-parallel (its columns of x, a partial y that the
// group sums; the bias, replicated, is added by one rank: `with_bias`).
// A weight may be several tensors declared back to back (q | k | v, gate |
// up): one GEMM reads them as one.
struct Linear {
  int64_t weight = -1, bias = -1;  // offsets inside the unit; bias -1: none
  int64_t in = 0, out = 0;
  Partition partition = Partition::kReplicated;
  // Whether the backward computes the weight's and bias's gradients (false:
  // a frozen weight; the input gradient still flows).
  bool trainable = true;
  Adapter lora;  // none unless the model trains adapters

  // What a step reads: the f32 values (null where the hooks hand out the
  // stored bf16 bits alone), the bits (null where none are held), the bias.
  // `adapter`: the unit of the trainable tensors that holds the adapter's.
  // `q`: a frozen weight held quantized (model.quant), read through the panel
  // GEMMs of model/quant_weight.h; w and w16 are then null.
  struct Weights {
    const float* w = nullptr;
    const uint16_t* w16 = nullptr;
    const float* b = nullptr;
    const float* adapter = nullptr;
    AdapterDropout drop{};  // on: a training pass with lora.dropout > 0
    const QuantWeight* q = nullptr;
  };
  // Where its gradients accumulate (null: not computed).
  struct Grads {
    float* w = nullptr;
    float* b = nullptr;
    float* adapter = nullptr;
  };
  // `unit` holds the weight and bias, `adapter` the adapter's tensors (the
  // same unit when nothing is frozen).
  Weights weights(const float* unit, const uint16_t* bits, bool lean,
                  const float* adapter = nullptr) const;
  Grads grads(float* unit, float* adapter = nullptr) const;

  void forward(float* y, Operand x, const Weights& p, int64_t rows, bool with_bias = true) const;
  // Generation's: few rows, each row's values independent of the others
  // (backend::cpu::matmul_forward_decode).
  void forward_decode(float* y, const float* x, const Weights& p, int64_t rows,
                      bool with_bias = true) const;
  // dx[rows, in] = dy · W (written; null: not computed); g.w += dyᵀ · x,
  // g.b += Σ dy (null members: not computed).
  // With an adapter, dx is needed (the adapter's input gradient adds to it)
  // and so are the weights: the adapter's products are recomputed here.
  void backward(float* dx, const Grads& g, Operand dy, Operand x, const Weights& p,
                int64_t rows) const;
  // Folds the adapter into the weight of `unit` (a base unit's copy): W0 +
  // s·B·A, DoRA's rows then scaled by m / ‖W0 + s·B·A‖. The merged model's
  // logits are the adapted one's.
  void merge(float* unit, const float* adapter) const;
  // y [rows, out], the base's x·W0ᵀ (+ b), gets this Linear's adapter added
  // (LoRA: + s·(x·Aᵀ)·Bᵀ per piece; DoRA: then its rows rescaled), p.adapter
  // the unit of its tensors: what forward adds. Serving runs the base GEMM
  // once for every row and this over each adapter's rows (Punica's split).
  void adapter_forward(float* y, Operand x, const Weights& p, int64_t rows, bool with_bias) const;
};

// LayerNorm (weight and bias) or RMSNorm (weight) over C channels.
struct Norm {
  int64_t weight = -1, bias = -1;  // offsets inside the unit; bias -1: RMSNorm
  model::Norm kind = model::Norm::kLayerNorm;
  int64_t C = 0;
  double eps = 1e-5;
  bool frozen = false;  // no gradients (a fine-tuned model's base)

  struct Weights {
    const float* w = nullptr;
    const float* b = nullptr;
  };
  struct Grads {
    float* w = nullptr;
    float* b = nullptr;
  };
  Weights weights(const float* unit) const { return {unit + weight, bias < 0 ? nullptr : unit + bias}; }
  Grads grads(float* unit) const {
    if (unit == nullptr || frozen) return {};
    return {unit + weight, bias < 0 ? nullptr : unit + bias};
  }
  // out written in f32, or (uint16_t) rounded to bf16 as written; mean is
  // unused by RMSNorm.
  void forward(float* out, float* mean, float* rstd, const float* in, const Weights& p,
               int64_t rows) const;
  void forward(uint16_t* out, float* mean, float* rstd, const float* in, const Weights& p,
               int64_t rows) const;
  // dinp += ...; g.w, g.b += ... (g.b ignored by RMSNorm). `in` as saved:
  // f32, or bf16 read as its widened values.
  void backward(float* dinp, const Grads& g, const float* dout, Operand in, const Weights& p,
                const float* mean, const float* rstd, int64_t rows) const;
};

// Multi-head attention with grouped keys and values: a column-parallel
// q | k | v projection, RoPE where the model rotates, the attention kernel,
// a row-parallel output projection. Heads as this rank holds them.
struct Attention {
  Linear qkv, out;
  int64_t n_head = 0, n_kv_head = 0, head_dim = 0;
  bool rope = false;
  int64_t rotated_heads() const { return n_head + n_kv_head; }  // q and k: the first of a row
};

// The feed-forward: a column-parallel up projection (GELU: F outputs;
// SwiGLU: gate | up, 2F), the activation, a row-parallel down projection.
struct Mlp {
  Linear up, down;
  model::Mlp act = model::Mlp::kGeluTanh;
  int64_t hidden = 0;  // F as held

  void act_forward(float* out, const float* in, int64_t rows) const;
  void act_forward(uint16_t* out, const float* in, int64_t rows) const;
  // dinp written: [rows, F] (GELU, may alias dout) or [rows, 2F] (SwiGLU).
  void act_backward(float* dinp, Operand in, const float* dout, int64_t rows) const;
};

// A mixture-of-experts MLP (model/moe.h) in place of the dense one: its
// router's and first expert's offsets inside the unit (the experts follow
// one another, each its gate | up rows then its down).
struct MoeMlp {
  int64_t router = -1, experts = -1;
  moe::Shape shape;
  bool on() const { return router >= 0; }
};

// A pre-norm block: x + attn(norm1(x)), then + mlp(norm2(·)) (or, with
// moe.on(), + moe(norm2(·)); its mlp then holds no tensor).
struct Block {
  Norm norm1;
  Attention attn;
  Norm norm2;
  Mlp mlp;
  MoeMlp moe;

  // A unit's weights as a step reads them, and its gradient accumulators.
  struct Weights {
    Norm::Weights norm1, norm2;
    Linear::Weights qkv, out, up, down;
    moe::Weights moe;
  };
  struct Grads {
    Norm::Grads norm1, norm2;
    Linear::Grads qkv, out, up, down;
    moe::Grads moe;
  };
  // `unit` holds the base tensors, `adapters` the adapters' (the same
  // unit when nothing is frozen).
  Weights weights(const float* unit, const uint16_t* bits, bool lean,
                  const float* adapters = nullptr) const;
  Grads grads(float* unit, float* adapters = nullptr) const;
  // Its Linears in order (q|k|v, o, up, down).
  std::vector<Linear*> linears() { return {&attn.qkv, &attn.out, &mlp.up, &mlp.down}; }
  std::array<const Linear*, 4> linears_const() const { return {&attn.qkv, &attn.out, &mlp.up, &mlp.down}; }
};

// Declares block l's tensors (Hugging Face GPT-2 or Llama names by
// config.arch) through `add`, in the layout's order, for `held` shapes (this
// tensor-parallel rank's, TransformerConfig::shard) and returns its parts.
Block declare_block(const TransformerConfig& held, int64_t l, const Declare& add);
// Declares a norm's weight (and, for LayerNorm, bias) named w and b.
Norm declare_norm(const TransformerConfig& config, const std::string& w, const std::string& b,
                  const Declare& add);

}  // namespace po::model::parts
