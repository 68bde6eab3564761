#include "train/async_checkpoint.h"

#include <chrono>
#include <cstring>

#include "comm/communicator.h"
#include "core/error.h"
#include "core/timer.h"
#include "parallel/shard_layout.h"

namespace po::train {

AsyncCheckpointer::AsyncCheckpointer(comm::Communicator* comm) : comm_(comm) {}

AsyncCheckpointer::~AsyncCheckpointer() {
  if (writer_.joinable()) writer_.join();
}

double AsyncCheckpointer::start(const std::string& path, const checkpoint::CheckpointMeta& meta,
                                const parallel::ShardLayout& layout,
                                const checkpoint::ShardSource& source,
                                const std::vector<checkpoint::StateKind>& kinds) {
  core::Timer held;
  finish();
  // The copy: every (kind, unit) slice this rank owns, back to back.
  size_t total = 0;
  for (size_t k = 0; k < kinds.size(); ++k)
    for (int u = 0; u < layout.num_units(); ++u) total += static_cast<size_t>(layout.owned(u));
  // Kept from one save to the next: a fresh buffer would pay a page fault per
  // 4 KiB on the training thread at every checkpoint.
  if (copy_size_ < total) {
    copy_.reset(new float[total]);
    copy_size_ = total;
  }
  std::vector<size_t> offset;  // per (kind, unit)
  size_t at = 0;
  for (checkpoint::StateKind kind : kinds) {
    for (int u = 0; u < layout.num_units(); ++u) {
      offset.push_back(at);
      const auto n = static_cast<size_t>(layout.owned(u));
      if (n == 0) continue;
      std::memcpy(copy_.get() + at, source(kind, u), n * sizeof(float));
      at += n;
    }
  }
  // Staged by rank 0 before any rank writes (as a synchronous save does).
  const bool leader = layout.rank() == 0;
  std::exception_ptr e;
  if (leader) {
    try {
      checkpoint::prepare_sharded_save(path);
    } catch (...) {
      e = std::current_exception();
    }
  }
  checkpoint::agree_on_success(comm_, e, core::str_cat(path, ": preparing the checkpoint"));
  path_ = path;
  meta_ = meta;
  writers_ = layout.ranks();
  done_ = false;
  error_ = nullptr;
  // The writer reads only the copy: training may change the state at once.
  const int units = layout.num_units();
  std::vector<checkpoint::StateKind> order = kinds;
  checkpoint::ShardSource from_copy = [this, offset, order, units](checkpoint::StateKind kind, int u) -> const float* {
    size_t k = 0;
    while (order[k] != kind) ++k;
    return copy_.get() + offset[k * static_cast<size_t>(units) + static_cast<size_t>(u)];
  };
  checkpoint::SaveOptions options;
  options.kinds = kinds;
  writer_ = std::thread([this, path, layout, from_copy, options] {
    core::Timer t;
    try {
      checkpoint::write_shard(path, meta_, layout, from_copy, options);
    } catch (...) {
      error_ = std::current_exception();
    }
    write_s_ = t.seconds();
    done_ = true;
  });
  return held.seconds();
}

std::string AsyncCheckpointer::poll() {
  if (!pending()) return "";
  float all_done = done_ ? 1.0f : 0.0f;
  if (comm_ != nullptr && comm_->size() > 1)
    comm_->allreduce(&all_done, 1, tensor::DType::kF32, comm::ReduceOp::kSum);
  const float need = comm_ != nullptr ? static_cast<float>(comm_->size()) : 1.0f;
  if (all_done < need) return "";
  return commit();
}

std::string AsyncCheckpointer::finish() {
  if (!pending()) return "";
  if (writer_.joinable()) writer_.join();
  return commit();
}

// Every rank's writer is done: agree on success, then rank 0 commits.
std::string AsyncCheckpointer::commit() {
  if (writer_.joinable()) writer_.join();
  const std::string path = path_;
  path_.clear();
  const bool leader = comm_ == nullptr || comm_->rank() == 0;
  checkpoint::agree_on_success(comm_, error_, core::str_cat(path, ": writing a shard in the background"));
  std::exception_ptr e;
  if (leader) {
    try {
      checkpoint::commit_sharded(path, meta_, writers_);
    } catch (...) {
      e = std::current_exception();
    }
  }
  checkpoint::agree_on_success(comm_, e, core::str_cat(path, ": committing the checkpoint"));
  return path;
}

}  // namespace po::train
