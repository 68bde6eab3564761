// Which tensors keep their Adam moments quantized (optim.state_bits < 32,
// optim/adamw.h): every tensor of at least optim::kMinQuantizedNumel
// elements except those optim.state_bits_exclude names, as bitsandbytes
// keeps small tensors and its StableEmbedding's table in 32 bits. Read by
// whoever cuts the model into AdamW ranges (parallel/data_parallel.cc).
#pragma once

#include <vector>

#include "model/layout.h"
#include "optim/adamw.h"

namespace po::parallel {

// Per tensor of `layout` (its tensors() order): quantized or not. A word of
// optim.state_bits_exclude that is neither "token_embedding", "head" nor a
// tensor's name is an error naming it.
std::vector<bool> quantized_tensors(const model::Layout& layout, const optim::AdamWConfig& adam);

// Bytes of Adam's moments for every tensor of `layout` whole (ZeRO-0), as
// AdamW holds them: the ledger's and the planner's count.
int64_t moment_bytes(const model::Layout& layout, const optim::AdamWConfig& adam);

}  // namespace po::parallel
