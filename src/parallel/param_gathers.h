// ZeRO-3's gathers of a unit's stored parameters for each use, prefetched
// along the order the model asks for them (the executor's: its slots' hooks
// ask, pipeline_executor.h).
//
// The model asks for a unit (use) and returns it (release), one unit of each
// kind (unit 0, the others) at a time. The first step records the (stage,
// unit) of every request; from the next step on the requests are expected
// in that order, and the gathers of the next `prefetch` units are issued,
// non-blocking, while the model computes with the one in hand, each into a
// free buffer of its kind (the others' kind has 1 + prefetch; issuing stops
// at the first that has none free). A request off the order (evaluation, a
// schedule that asks otherwise) waits for the gathers in flight and is
// gathered alone. Every decision depends on the sequence of requests only,
// never on timing, and every data rank of a stage makes the same requests,
// so the collectives match across the group; the gathered values are the
// stored shards, so prefetching changes no bit. Nothing stays in flight
// outside a step or an evaluation (the update changes the shards the
// gathers read): drain().
//
// What a gather moves is the owner's (Start): this class holds the buffers,
// the order and what is in flight.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "tensor/tensor.h"

namespace po::parallel {

class ParamGathers {
 public:
  // Unit u of `stage` gathered, as stored, into buf (its kind's buffer):
  // the collective in flight, or an empty Work where it is done already.
  using Start = std::function<comm::Work(int stage, int u, void* buf)>;
  // The gather after those issued: its source may start coming in (paged
  // shards' pages). May be empty.
  using Ahead = std::function<void(int stage, int u)>;

  // bytes[k]: one buffer of kind k (0: unit 0's, 1: the others'); 1 of
  // unit 0's kind and 1 + prefetch of the others'.
  ParamGathers(std::array<size_t, 2> bytes, int prefetch, Start start, Ahead ahead = {});
  // Gathers still in flight (a step that threw) leak their buffers rather
  // than free memory a collective may still write.
  ~ParamGathers();
  ParamGathers(const ParamGathers&) = delete;
  ParamGathers& operator=(const ParamGathers&) = delete;

  // A step's start: its requests are recorded as the order if none is yet.
  void begin_step();
  // Its end: nothing in flight, and the recorded order becomes the order.
  void end_step();
  // Unit u's parameters (of `stage`'s chunk), gathered, until release(u).
  const void* use(int stage, int u);
  // The buffer unit u is in use in (use(u) and not yet released).
  const void* in_use(int u) const;
  void release(int u);
  // Every gather in flight waited for, its buffer free again; the order
  // restarts at the next request.
  void drain();
  // Moves the gathers in flight on (MPI progresses inside its calls only).
  void poll();

  // Since begin_step: the uses, and of them those prefetched.
  int uses() const { return uses_; }
  int prefetched() const { return prefetched_; }
  size_t bytes() const;

 private:
  struct Buffer {
    tensor::Storage buf;
    int unit = -1;  // the unit it holds or is gathering (-1: free)
  };
  struct InFlight {
    int pos = 0;  // in order_
    int kind = 0;
    size_t slot = 0;
    comm::Work work;
  };
  static int kind_of(int u) { return u == 0 ? 0 : 1; }
  std::pair<size_t, comm::Work> start(int stage, int u);
  bool issue(int pos);
  void issue_ahead();

  int prefetch_;
  Start start_;
  Ahead ahead_;
  std::vector<Buffer> bufs_[2];
  int in_use_[2] = {-1, -1};  // the buffer of each kind in use (-1: none)
  std::vector<std::pair<int, int>> order_;  // (stage, unit), the first step's requests
  bool order_known_ = false, recording_ = false;
  std::deque<InFlight> in_flight_;
  int next_ = 0, issued_ = 0;  // order_'s next request, and the next gather to issue
  int uses_ = 0, prefetched_ = 0;
};

}  // namespace po::parallel
