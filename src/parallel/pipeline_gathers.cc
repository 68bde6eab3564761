// The data group's parameter gathers (pipeline_executor.h): ZeRO-1's
// updated shards (gather_unit) and ZeRO-3's gathers of a unit for each use.
//
// ZeRO-3: the model asks for a unit's parameters (gather_use) and returns
// them (release_use), one unit of each kind (unit 0, the others) at a time.
// The first step records the (stage, unit) of every request; from the next
// step on the requests are expected in that order, and the gathers of the
// next parallel.prefetch units are issued, non-blocking, while the model
// computes with the one in hand, each into a free buffer of its kind (the
// others' kind has 1 + prefetch; issuing stops at the first that has none
// free). A request off the order (evaluation, a schedule that asks
// otherwise) waits for the gathers in flight and is gathered alone. Every
// decision depends on the sequence of requests only, never on timing, and
// every data rank of a stage makes the same requests, so the collectives
// match across the group; the gathered values are the stored shards, so
// prefetching changes no bit. Nothing stays in flight outside a step or an
// evaluation (the update changes the shards the gathers read).
#include "parallel/pipeline_executor.h"
#include "parallel/pipeline_executor_state.h"

#include <algorithm>

#include "backend/device.h"
#include "core/error.h"

namespace po::parallel {
using namespace executor_detail;  // its helpers and names (pipeline_executor_state.h)

namespace {
int kind_of(int u) { return u == 0 ? 0 : 1; }
}  // namespace

// MPI moves a non-blocking collective on only inside its calls: every
// gather and reduction in flight is polled at each of the model's hooks.
// (Polling takes nothing: what completes is
// still taken in order, where the order says.)
void PipelineExecutor::progress() {
  for (ParamGather& g : param_gathers_) g.work.test();
  for (Reduction& r : reductions_) r.work.test();
  early_sums_landed();
}

const void* PipelineExecutor::gather_use(Chunk& c, int u) {
  progress();
  const int k = kind_of(u);
  PO_ASSERT(use_slot_[k] < 0, "pipeline: unit ", u, "'s parameters asked for while unit ",
            use_[k][static_cast<size_t>(std::max(use_slot_[k], 0))].unit, "'s are in use");
  const std::pair<int, int> key{c.stage, u};
  if (recording_) order_.push_back(key);
  const int n = order_known_ ? static_cast<int>(order_.size()) : 0;
  if (next_ >= n || order_[static_cast<size_t>(next_)] != key) {
    drain_gathers();  // what was prefetched is not what is asked for
    next_ = issued_ = n > 0 && order_.front() == key ? 0 : n;
  }
  size_t slot = 0;
  PipelineStepStats scratch;
  PipelineStepStats& stats = stats_ != nullptr ? *stats_ : scratch;
  ++stats.param_gathers;
  if (next_ < n) {
    if (!param_gathers_.empty()) {
      ++stats.prefetched;
    } else {
      PO_ASSERT(issue_gather(next_), "pipeline: no free buffer for unit ", u, "'s gather");
      issued_ = next_ + 1;
    }
    ParamGather& g = param_gathers_.front();
    PO_ASSERT(g.pos == next_, "pipeline: parameter gathers out of order");
    g.work.wait();
    slot = g.slot;
    param_gathers_.pop_front();
    ++next_;
  } else {  // off the order (or no order yet): gathered alone
    auto [free, work] = start_use_gather(c, u);
    PO_ASSERT(free < use_[k].size(), "pipeline: no free buffer for unit ", u, "'s gather");
    work.wait();
    slot = free;
  }
  UseBuffer& b = use_[k][slot];
  use_slot_[k] = static_cast<int>(slot);
  issue_ahead();  // the next units' gathers run while this one computes
  return b.buf.data();
}

void PipelineExecutor::release_use(int u) {
  const int k = kind_of(u);
  PO_ASSERT(use_slot_[k] >= 0, "pipeline: unit ", u, " returned but not in use");
  use_[k][static_cast<size_t>(use_slot_[k])].unit = -1;
  use_slot_[k] = -1;
  issue_ahead();  // (a buffer is free again)
  progress();
}

// Unit u's gather (as stored) into a free buffer of its kind, which then
// holds u: the buffer and the gather in flight, or (no buffer free) the
// kind's count of buffers and nothing started. Paged shards come out of
// their pages into the send block after the gathered unit (on one data
// rank: into the buffer, and nothing is in flight).
std::pair<size_t, comm::Work> PipelineExecutor::start_use_gather(Chunk& c, int u) {
  auto& bufs = use_[kind_of(u)];
  size_t slot = 0;
  while (slot < bufs.size() && bufs[slot].unit >= 0) ++slot;
  if (slot == bufs.size()) return {slot, comm::Work()};
  bufs[slot].unit = u;
  const UnitShard s = shard_of(c, u, true);
  const int64_t stride = s.layout->stride(s.index);
  char* buf = static_cast<char*>(bufs[slot].buf.data());
  if (s.layout->ranks() == 1) {  // (paged on one data rank: straight into place)
    shard_out(s, 0, stride, buf);
    return {slot, comm::Work()};
  }
  const void* send = nullptr;
  if (paged_shards_) {
    char* block = buf + static_cast<size_t>(stride * s.layout->ranks()) * stored_esz();
    shard_out(s, 0, stride, block);
    send = block;
  } else {
    send = s.at(stored_esz());
  }
  return {slot, setup_.data->iall_gather(send, buf, static_cast<size_t>(stride), bf16_ ? DType::kBF16 : DType::kF32)};
}

// The gather of order_[pos] into a free buffer of its kind; false if none is.
bool PipelineExecutor::issue_gather(int pos) {
  const auto [stage, u] = order_[static_cast<size_t>(pos)];
  auto [slot, work] = start_use_gather(chunk_of_stage(stage), u);
  if (slot == use_[kind_of(u)].size()) return false;
  param_gathers_.push_back({pos, kind_of(u), slot, std::move(work)});
  return true;
}

// Up to parallel.prefetch gathers ahead of the next request, in order;
// with paged shards the pages of the one after them start coming in, so
// its copy out of the pages finds them resident.
void PipelineExecutor::issue_ahead() {
  const int n = static_cast<int>(order_.size());
  if (!order_known_ || next_ >= n) return;
  const int end = std::min(n, next_ + setup_.prefetch);
  issued_ = std::max(issued_, next_);
  while (issued_ < end && issue_gather(issued_)) ++issued_;
  if (!paged_shards_ || issued_ >= n) return;
  const auto [stage, u] = order_[static_cast<size_t>(issued_)];
  const UnitShard s = shard_of(chunk_of_stage(stage), u, true);
  s.adam->paged_state()->prefetch(optim::PagedState::kParam, s.layout->local_offset(s.index), s.layout->stride(s.index));
}

// Every gather in flight waited for and its buffer free again; the order
// restarts at the next request.
void PipelineExecutor::drain_gathers() {
  for (ParamGather& g : param_gathers_) {
    g.work.wait();
    use_[g.kind][g.slot].unit = -1;
  }
  param_gathers_.clear();
  issued_ = next_;
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
