// ZeRO 0-1 over dp > 1: the data group's sums of the stored gradients, in
// buckets of consecutive units (the executor's: pipeline_executor.h).
//
// Each chunk's units are summed in buckets (grad_buckets: about
// parallel.bucket_size each, in the order the backward finishes them). With
// parallel.overlap_comm a bucket's all-reduce starts, non-blocking, as soon
// as every micro-batch's backward has finished its units, and runs while
// the backward goes on; finish() starts the rest and the extra sums (the
// tied replicas') and waits for all. A bucket is the same in-place
// all-reduce of the same elements whenever it starts, so overlap changes no
// bit. A bucket marked `at_step` (unit 0's unless the lookup is deferred,
// the vocabulary-parallel head's: their rows come at the step) always waits
// for finish().
//
// bf16 gradients go over the wire in bf16 (parallel.reduce_dtype bf16), or
// widened into one f32 staging buffer (one unit at most: grad_buckets),
// summed, and rounded back before the next staged sum starts.
#pragma once

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "tensor/tensor.h"

namespace po::parallel {

class BucketSums {
 public:
  struct Config {
    comm::Communicator* data = nullptr;
    bool bf16 = false, reduce_bf16 = false;  // stored gradients in bf16; summed in bf16
    bool overlap = false;                    // parallel.overlap_comm
    int micro_batches = 1;                   // the backwards that finish each unit per step
    int64_t staging_numel = 0;               // bf16 summed in f32: the largest unit
  };
  struct Bucket {
    int lo = 0, hi = 0;  // units (global indices)
    bool at_step = false;
  };
  explicit BucketSums(Config config);
  ~BucketSums();  // (sums still in flight leak the staging buffer)
  BucketSums(const BucketSums&) = delete;
  BucketSums& operator=(const BucketSums&) = delete;

  // A chunk's buckets (covering units first.., in the order they finish)
  // over its stored gradients: unit u's first element at
  // grads + (offset(u) - offset(first)) elements. Returns the chunk's index.
  int add_chunk(void* grads, int first, std::vector<Bucket> buckets, const std::function<int64_t(int)>& offset);
  // A micro-batch's backward has finished unit u of chunk `chunk` (a unit
  // outside it is ignored); with overlap the bucket's sum starts once every
  // micro-batch has, unless it waits for the step.
  void unit_finished(int chunk, int u);
  // Each bucket whose sum has been seen landed since the last call, once:
  // f(chunk, lo, hi). A staged (bf16 in f32) sum lands at the step.
  void landed(const std::function<void(int chunk, int lo, int hi)>& f);
  // The step: every bucket not yet started, then `extra` (the stored
  // gradients of n elements each, in order), all waited; then the next
  // step's counts start.
  void finish(const std::vector<std::pair<void*, int64_t>>& extra);

  // The last finish(): the buckets started during the backward, all of
  // them, and the wait for the sums.
  int overlapped() const { return overlapped_; }
  int buckets() const { return all_; }
  double wait_seconds() const { return wait_s_; }
  size_t bytes() const { return staging_.size(); }

 private:
  struct Chunk {
    char* grads = nullptr;
    int first = 0;
    std::vector<Bucket> buckets;
    std::vector<int64_t> at, numel;  // per bucket: its first element (from grads) and its elements
    std::vector<int> bucket_of;      // per unit (from first)
    std::vector<char> started;       // per bucket, this step
    std::vector<int> unfinished;     // per bucket: its units not yet finished by every micro-batch
    std::vector<int> finished;       // per unit: the micro-batches that have
  };
  struct Sum {
    comm::Work work;
    uint16_t* narrow_into = nullptr;  // staged: where its n values go back
    int64_t n = 0;
    int chunk = -1, lo = 0, hi = -1;  // a bucket's (-1: an extra sum, or already reported landed)
  };
  void reset();
  void start_bucket(int chunk, size_t b);
  void start(void* grads, int64_t n);
  void narrow_staged();

  Config config_;
  std::vector<Chunk> chunks_;
  std::vector<Sum> sums_;
  tensor::Storage staging_;
  int started_ = 0, overlapped_ = 0, all_ = 0;
  double wait_s_ = 0;
};

}  // namespace po::parallel
