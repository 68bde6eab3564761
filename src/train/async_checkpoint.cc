#include "train/async_checkpoint.h"

#include "comm/communicator.h"
#include "core/error.h"
#include "core/timer.h"
#include "parallel/shard_layout.h"

namespace po::train {
namespace {

checkpoint::SaveOptions kinds_option(const std::vector<checkpoint::StateKind>& kinds) {
  checkpoint::SaveOptions o;
  o.kinds = kinds;
  return o;
}

}  // namespace

AsyncCheckpointer::AsyncCheckpointer(comm::Communicator* comm, const parallel::ShardLayout* file, int files,
                                     const std::vector<checkpoint::StateKind>& kinds, bool staged_source)
    : comm_(comm), rank_(comm != nullptr ? comm->rank() : 0), writers_(files) {
  PO_ASSERT(rank_ != 0 || file != nullptr, "a background checkpoint: rank 0 commits, so it must write a file");
  if (file == nullptr) return;
  image_ = std::make_unique<checkpoint::ShardImage>(*file, kinds_option(kinds));
  image_->set_direct_sources(!staged_source);
}

AsyncCheckpointer::~AsyncCheckpointer() {
  if (writer_.joinable()) writer_.join();
}

double AsyncCheckpointer::start(const std::string& path, const checkpoint::CheckpointMeta& meta,
                                const checkpoint::ShardSource& source) {
  core::Timer held;
  finish();
  if (image_) image_->fill(meta, source);  // from here training may change the state
  // Staged by rank 0 before any rank writes (as a synchronous save does).
  std::exception_ptr e;
  if (rank_ == 0) {
    try {
      checkpoint::prepare_sharded_save(path);
    } catch (...) {
      e = std::current_exception();
    }
  }
  checkpoint::agree_on_success(comm_, e, core::str_cat(path, ": preparing the checkpoint"));
  path_ = path;
  meta_ = meta;
  error_ = nullptr;
  done_ = image_ == nullptr;
  if (!image_) return held.seconds();
  writer_ = std::thread([this, path] {
    core::Timer t;
    try {
      image_->write(path);
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
  return commit();
}

// Every rank's writer is done (or is waited for): agree on success, then
// rank 0 commits.
std::string AsyncCheckpointer::commit() {
  if (writer_.joinable()) writer_.join();
  const std::string path = path_;
  path_.clear();
  checkpoint::agree_on_success(comm_, error_, core::str_cat(path, ": writing a shard in the background"));
  std::exception_ptr e;
  if (rank_ == 0) {
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
