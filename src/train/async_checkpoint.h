// checkpoint.async = true: a checkpoint costs the step only a copy of this
// rank's state into host memory; the files are written by a background
// thread while training goes on, and committed (rank 0: manifest, atomic
// rename) at a later step boundary once every rank's file is on disk.
// - Host memory is bounded: one checkpoint in flight, in one image of this
//   rank's file (checkpoint::ShardImage: params, Adam m and v), allocated and
//   touched at set-up; a new checkpoint first waits for the previous one.
// - The writer uses O_DIRECT where the file system allows it: on two cores a
//   buffered write's page-cache copies would take a core from the training
//   threads for seconds.
// - The phases and files are those of a synchronous save
//   (checkpoint/sharded.h): a crash during a background write leaves a
//   staging directory that no reader lists, and the previous checkpoint good.
// - Paged state is read out of its tiers by the copy, on the training thread.
// - Layouts whose files are written by some ranks only (tensor parallel: tp
//   rank 0 of each data group; pipeline: each stage's first rank) gather their
//   slices whole first, as a synchronous save does (train/tp_checkpoint.h,
//   pipeline_train.cc); the other ranks hold no image but take part in every
//   agreement, so a failed write anywhere fails the save on every rank.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/sharded.h"

namespace po::comm {
class Communicator;
}

namespace po::train {

class AsyncCheckpointer {
 public:
  // `comm`: every rank of the job (each save's outcome is agreed over it;
  // nullptr: this process alone). `file`: the shards of the file this rank
  // writes, of `kinds` (nullptr: it writes none); `files`: how many ranks
  // write one (the checkpoint's writers). `staged_source`: the sources of
  // start() share one staging buffer (paging).
  AsyncCheckpointer(comm::Communicator* comm, const parallel::ShardLayout* file, int files,
                    const std::vector<checkpoint::StateKind>& kinds, bool staged_source);
  ~AsyncCheckpointer();  // waits for the writer thread (without committing)
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  // Collective. Waits for (and commits) the save in flight, copies this
  // rank's file's shards out of `source` into the image (a rank without a
  // file ignores it), stages `path` and starts writing. Returns the seconds
  // the caller was held.
  double start(const std::string& path, const checkpoint::CheckpointMeta& meta,
               const checkpoint::ShardSource& source);
  // Collective while a save is in flight: when every rank's file is written,
  // commits it and returns its path; "" otherwise (also when none is in flight).
  std::string poll();
  // Collective: blocks until the save in flight is committed; returns its
  // path ("" when none was in flight).
  std::string finish();
  bool pending() const { return !path_.empty(); }
  int64_t host_bytes() const { return image_ ? image_->file_bytes() : 0; }
  // The background write of the last committed save, seconds.
  double last_write_seconds() const { return write_s_; }

 private:
  std::string commit();

  comm::Communicator* comm_;
  int rank_ = 0, writers_ = 1;
  std::unique_ptr<checkpoint::ShardImage> image_;  // null: this rank writes no file
  std::string path_;  // the save in flight ("" when none)
  checkpoint::CheckpointMeta meta_;
  std::thread writer_;
  std::atomic<bool> done_{false};
  std::exception_ptr error_;
  double write_s_ = 0;
};

}  // namespace po::train
