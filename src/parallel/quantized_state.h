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

}  // namespace po::parallel
