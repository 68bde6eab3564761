// What a rank holds after a step, by kind, whichever engine ran it: the
// step records' memory_per_rank and paging_per_rank (train/rank_records.h)
// read these, from the pipeline executor.
#pragma once

#include <cstddef>
#include <cstdint>

#include "memory/pager.h"
#include "optim/paged_state.h"

namespace po::parallel {

// Bytes this rank holds for model state and communication, by kind.
struct MemoryReport {
  size_t params = 0;      // model parameters as stored (fp32: also the master; stage 3: the shard;
                          // adapters: with the frozen base)
  size_t grads = 0;       // gradients as stored: the whole buffer or this rank's shard
  size_t master = 0;      // fp32 master weights of a bf16 run (this rank's shard)
  size_t adam = 0;        // Adam m + v
  size_t gathered = 0;    // all-gather buffers and per-unit f32 parameter buffers
  size_t buckets = 0;     // per-unit gradient accumulators, reduction staging and padding,
                          // embedding-lookup gathers
  size_t activations = 0;  // (the pipeline executor's: with its weight-gradient queue and messages)
  size_t pages = 0;       // paged optimizer state: the pager's compute-tier frames
  size_t host = 0;        // paged optimizer state: the pager's host-tier frames (not in total)
  // DESIGN.md's model states: what the ledger formulas count.
  size_t model_states() const { return params + grads + master + adam; }
  // Everything in the compute tier.
  size_t total() const { return model_states() + gathered + buckets + activations + pages; }
};

// A rank's paged state after a step, over all its pagers (zero unpaged).
struct PagingReport {
  uint64_t resident_bytes[3] = {};  // by memory::Tier: compute, host, NVMe
  uint64_t lent_frames = 0;         // frames the activations lend beyond the pagers' own
  uint64_t pages_updated_in_backward = 0;

  void add(const optim::PagedState& st) {
    const uint64_t page = st.page_bytes();
    resident_bytes[0] += st.resident(memory::Tier::kCompute) * page;
    resident_bytes[1] += st.resident(memory::Tier::kHost) * page;
    resident_bytes[2] += st.resident(memory::Tier::kNvme) * page;
    lent_frames += st.pager().usable_frames() - st.pager().options().compute_frames;
  }
};

}  // namespace po::parallel
