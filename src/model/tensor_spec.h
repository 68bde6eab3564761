// One declared parameter tensor of the decoder (model/layout.h lays them
// out): its name, shape, initialisation rule and tensor-parallel partition.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace po::model {

enum class Init {
  kZeros,
  kOnes,
  kNormal,          // N(0, 0.02)
  kResidualNormal,  // N(0, 0.02 / sqrt(2L)): projections into the residual stream
  kKaimingUniform,  // U(-1/sqrt(in), 1/sqrt(in)): a LoRA A (Kaiming-uniform, a = sqrt(5))
  kRowNorm,         // the row norms of the frozen weight it adapts: a DoRA magnitude
};

// How tensor parallel splits a tensor (parallel.tp; one value per tensor, as
// Megatron's partition_dim).
enum class Partition {
  kReplicated,  // every tp rank holds all of it (norms, row-parallel biases, wpe)
  kSplitRows,   // along dim 0, the output features: column-parallel q/k/v, fc, gate, up
  kSplitCols,   // along dim 1, the input features: row-parallel o_proj, down/c_proj
  kVocab,       // by vocabulary rows: the token table and the head
};

// What a tensor is to the embedding and head code. A block's tensors are
// kBlock: the block's parts (model/parts.h) know their places.
enum class Slot {
  kTokenEmbedding,
  kPositionEmbedding,
  kBlock,
  kFinalNorm,  // its weight and (LayerNorm) bias
  kHead,
  kAdapter,  // a low-rank adapter's A, B or DoRA magnitude (parts::Adapter)
};

struct TensorSpec {
  std::string name;     // Hugging Face name ("h.0.attn.c_attn.weight", "model.norm.weight")
  tensor::Shape shape;  // engine layout ([out, in] for linear weights)
  int64_t offset = 0;   // elements from the start of all parameters
  int unit = 0;
  Slot slot = Slot::kBlock;
  Init init = Init::kZeros;
  bool decay = false;  // weight decay applies (tensors with >= 2 dims)
  Partition partition = Partition::kReplicated;
  // kSplitRows: the rows of each part of a fused weight as held (c_attn's
  // q | k | v, SwiGLU's c_fc gate | up); each part is split on its own, so a
  // rank holds [q_r; k_r; v_r]. One entry for an unfused weight.
  std::vector<int64_t> parts;
  tensor::Shape global_shape;  // the whole tensor's shape (= shape when not split)
  bool conv1d = false;  // stored transposed ([in, out]) in Hugging Face GPT-2 files
  int64_t numel() const { return tensor::shape_numel(shape); }
};

}  // namespace po::model
