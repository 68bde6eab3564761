// The data group's parameter gathers (pipeline_executor.h): ZeRO-1's
// updated shards (gather_unit) and what ZeRO-3's gathers of a unit for each
// use move (their order and buffers: param_gathers.h).
#include "parallel/pipeline_executor.h"
#include "parallel/pipeline_executor_state.h"

#include <algorithm>

#include "backend/device.h"
#include "core/error.h"

namespace po::parallel {
using namespace executor_detail;  // its helpers and names (pipeline_executor_state.h)

// MPI moves a non-blocking collective on only inside its calls: every
// gather and reduction in flight is polled at each of the model's hooks.
// (Polling takes nothing: what completes is
// still taken in order, where the order says.)
void PipelineExecutor::progress() {
  if (gathers_) gathers_->poll();
  if (reductions_) reductions_->poll();
  early_sums_landed();
}

const void* PipelineExecutor::gather_use(Chunk& c, int u) {
  progress();
  return gathers_->use(c.stage, u);
}

void PipelineExecutor::release_use(int u) {
  gathers_->release(u);
  progress();
}

// Unit u's gather (as stored) into buf, one of ParamGathers' buffers of
// ranks × stride and, with paged shards over dp > 1, a send block of one
// stride after it that the shard comes out of its pages into (on one data
// rank: into buf, and nothing is in flight).
comm::Work PipelineExecutor::start_param_gather(int stage, int u, void* buf) {
  const UnitShard s = shard_of(chunk_of_stage(stage), u, true);
  const int64_t stride = s.layout->stride(s.index);
  char* at = static_cast<char*>(buf);
  if (s.layout->ranks() == 1) {
    shard_out(s, 0, stride, at);
    return comm::Work();
  }
  const void* send = nullptr;
  if (paged_shards_) {
    char* block = at + static_cast<size_t>(stride * s.layout->ranks()) * stored_esz();
    shard_out(s, 0, stride, block);
    send = block;
  } else {
    send = s.at(stored_esz());
  }
  return setup_.data->iall_gather(send, at, static_cast<size_t>(stride), bf16_ ? DType::kBF16 : DType::kF32);
}

// Every data rank's shard of one unit (`mine`: this rank's owned(i)
// elements) into dst, the whole unit: a collective over the data group.
void PipelineExecutor::gather_unit(const ShardLayout& sl, int i, const void* mine, void* dst,
                                   DType dtype) {
  const size_t esz = dtype == DType::kBF16 ? sizeof(uint16_t) : sizeof(float);
  if (sl.ranks() == 1)  // (ZeRO-3 paged on one data rank: the shard is the unit)
    return backend::device_copy(dst, mine, static_cast<size_t>(sl.unit_numel(i)) * esz);
  const int64_t stride = sl.stride(i), owned = sl.owned(i);
  // ZeRO-3 holds no gather buffer: a checkpoint's unit takes one for itself,
  // in the host tier beside the checkpoint's staging (the compute tier's
  // budget is the steps').
  tensor::Storage once;
  if (gather_.size() == 0)
    once = tensor::Storage(static_cast<size_t>(stride * (1 + sl.ranks())) * esz, tensor::Pool::kHost);
  char* send = static_cast<char*>((gather_.size() > 0 ? gather_ : once).data());
  char* recv = send + static_cast<size_t>(stride) * esz;
  backend::device_copy(send, mine, static_cast<size_t>(owned) * esz);
  backend::device_zero(send + static_cast<size_t>(owned) * esz, static_cast<size_t>(stride - owned) * esz);
  setup_.data->all_gather(send, recv, static_cast<size_t>(stride), dtype);
  backend::device_copy(dst, recv, static_cast<size_t>(sl.unit_numel(i)) * esz);
}

}  // namespace po::parallel
