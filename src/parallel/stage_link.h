// Point-to-point between pipeline stages. Non-blocking sends, each message a
// fixed header (magic, the sender's rank, the tag, the shape) and then its
// payload, tagged by the schedule's (micro-batch, stage, direction)
// (pipeline::message_tag). The receiver checks the header against the shape
// its own schedule expects: a mismatch is an error naming both ranks and
// both shapes (Megatron-LM #5271 swapped tensors matched by order alone),
// never a silent swap, and a missing message is a Timeout after the group's
// timeout (parallel.timeout), never a hang.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "tensor/tensor.h"

namespace po::parallel {

class StageLink {
 public:
  static constexpr int kMaxDims = 4;

  // `group` (the world, or the pipeline group) must outlive this object.
  explicit StageLink(comm::Communicator& group) : group_(group) {}
  ~StageLink();  // waits for the sends still in flight

  // Starts sending x (shape_numel(shape) floats) to `peer` under `tag`; x
  // must stay unchanged until wait_sends().
  void send(const float* x, const tensor::Shape& shape, int peer, int tag);
  // The message (peer, tag): waits for it, checks its header against
  // `expect`, and puts its payload into out (shape_numel(expect) floats).
  // Throws core::CommError on a mismatch (the payload is drained first).
  void recv(float* out, const tensor::Shape& expect, int peer, int tag);
  // A receive posted ahead of its use: post_recv starts the header's and the
  // payload's receives, finish_recv waits for them and checks the header
  // first (as recv does; a mismatch throws before the payload is read).
  struct Incoming {
    std::array<int64_t, 4 + kMaxDims> header{};
    comm::Work head, body;
    tensor::Shape expect;
    int peer = -1, tag = -1;
  };
  void post_recv(Incoming& in, float* out, const tensor::Shape& expect, int peer, int tag);
  void finish_recv(Incoming& in);
  // Every send issued so far has left its buffer.
  void wait_sends();

 private:
  using Header = std::array<int64_t, 4 + kMaxDims>;  // magic, rank, tag, ndims, dims
  struct Pending {
    Header header{};
    comm::Work head, body;
  };
  std::string mismatch(const Header& h, const tensor::Shape& expect, int peer, int tag) const;
  comm::Communicator& group_;
  std::deque<Pending> sends_;  // a deque: headers stay put while in flight
  std::vector<float> drain_;
};

}  // namespace po::parallel
