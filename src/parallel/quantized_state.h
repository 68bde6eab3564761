// Which tensors keep their Adam moments quantized (optim.state_bits < 32,
// optim/adamw.h): every tensor of at least optim::kMinQuantizedNumel
// elements except those optim.state_bits_exclude names, as bitsandbytes
// keeps small tensors and its StableEmbedding's table in 32 bits. Read by
// whoever cuts the model into AdamW ranges (parallel/data_parallel.cc).
#pragma once

#include <functional>
#include <vector>

#include "model/layout.h"
#include "optim/adamw.h"
#include "parallel/shard_layout.h"

namespace po::parallel {

// Per tensor of `layout` (its tensors() order): quantized or not. A word of
// optim.state_bits_exclude that is neither "token_embedding", "head" nor a
// tensor's name is an error naming it.
std::vector<bool> quantized_tensors(const model::Layout& layout, const optim::AdamWConfig& adam);

// Bytes of Adam's moments as AdamW holds them for every tensor of `layout`
// whole (ZeRO-0), or for the part `shard` gives its rank (ZeRO 1-3, the
// shard cut on the blocks' grid): the ledger's and the planner's count.
int64_t moment_bytes(const model::Layout& layout, const optim::AdamWConfig& adam,
                     const ShardLayout* shard = nullptr);

// AdamW's ranges for a rank of the data group: every tensor whole at
// ZeRO-0 (`shard` null; the state at the tensor's flat offset), or the part
// `shard` gives the rank (the state at the shard's local offsets, and the
// parameters there too with `local_params`, ZeRO-3). Quantized moments keep
// their blocks on the unit's grid (the layout cuts on it), so each rank
// holds whole blocks, the ones an unsharded run has. The planner reads
// the pages' geometry from them.
std::vector<optim::ParamRange> adam_ranges(const model::Layout& layout, const optim::AdamWConfig& adam,
                                           const ShardLayout* shard, bool local_params);

// The same over units [first, last] of a buffer whose element 0 is unit
// `first`'s (a pipeline chunk's; ShardLayout index i = u - first), for the
// tensors `keep` accepts (all when empty), with `quantized` per tensor
// (quantized_tensors): each cut to the part `shard` owns, its state (m, v,
// the gradient shard) at the shard's local offsets, its parameters at the
// buffer's offsets or, with `local_params` (ZeRO-3), at the state's. With
// one rank the state's offsets are the buffer's. adam_ranges is this over
// the whole model.
std::vector<optim::ParamRange> unit_ranges(const model::Layout& layout, int first, int last, const ShardLayout& shard,
                                           bool local_params, const std::vector<bool>& quantized,
                                           const std::function<bool(const model::TensorSpec&)>& keep = {});

}  // namespace po::parallel
