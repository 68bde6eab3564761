// Which tensors keep their Adam moments quantized (optim.state_bits < 32,
// optim/adamw.h): every tensor of at least optim::kMinQuantizedNumel
// elements except those optim.state_bits_exclude names, as bitsandbytes
// keeps small tensors and its StableEmbedding's table in 32 bits. Read by
// whoever cuts the model into AdamW ranges (parallel/data_parallel.cc).
#pragma once

#include <vector>

#include "model/layout.h"
#include "optim/adamw.h"
#include "parallel/shard_layout.h"

namespace po::parallel {

// Per tensor of `layout` (its tensors() order): quantized or not. A word of
// optim.state_bits_exclude that is neither "token_embedding", "head" nor a
// tensor's name is an error naming it.
std::vector<bool> quantized_tensors(const model::Layout& layout, const optim::AdamWConfig& adam);

// The part of each tensor of `layout` that `shard` gives its rank: the
// tensor's index and the elements [lo, hi) counted from its unit's start
// (tensors it owns none of are left out). The cut of the AdamW ranges.
struct OwnedPiece {
  size_t tensor = 0;
  int64_t lo = 0, hi = 0;
};
std::vector<OwnedPiece> owned_pieces(const model::Layout& layout, const ShardLayout& shard);

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
// holds whole blocks, the ones an unsharded run has. DataParallel builds
// its AdamW from them, and the planner the pages' geometry.
std::vector<optim::ParamRange> adam_ranges(const model::Layout& layout, const optim::AdamWConfig& adam,
                                           const ShardLayout* shard, bool local_params);

}  // namespace po::parallel
