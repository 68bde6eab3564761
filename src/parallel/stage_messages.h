// One rank's tensors between pipeline stages during a step (the executor's:
// pipeline_executor.h): the message buffers [rows, C], the tensors made
// here and waiting for their consumer or their sends, and the receives
// posted ahead of their use.
//
// Each receive of the rank's action list is posted ahead (a window of the
// next kWindow) and waited where its compute asks for it (get); sends go
// out as their tensors are made. A tensor for several ranks (the head's
// statistics) leaves with its last send. Every message carries a shape
// header (StageLink): a mismatch is an error naming both ranks and shapes.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "parallel/pipeline_schedule.h"
#include "parallel/stage_link.h"
#include "tensor/tensor.h"

namespace po::parallel {

class StageMessages {
 public:
  using Key = std::tuple<int, int, int>;  // (micro, stage, payload)
  static constexpr size_t kWindow = 4;    // receives posted ahead of their use

  // `link` null: one stage (local hand-offs only). `list`: this rank's (`rank`)
  // actions, outliving this object. Messages are `shape`; a fault test
  // declares `sent_shape` on its sends instead.
  StageMessages(int rank, std::unique_ptr<StageLink> link, const std::vector<pipeline::Action>& list,
                tensor::Shape shape, tensor::Shape sent_shape);
  // A step that ended in an error leaves receives posted into buffers and
  // sends in flight from them (comm::Work leaks such operations while
  // unwinding rather than wait): their buffers, the receives' headers and
  // the link with its sends' headers are leaked with them, so a message
  // that arrives later lands in memory nobody else owns.
  ~StageMessages();
  StageMessages(const StageMessages&) = delete;
  StageMessages& operator=(const StageMessages&) = delete;

  StageLink* link() { return link_.get(); }
  // A free buffer of one message, and one given back.
  float* take();
  void give(float* b);
  // A tensor made here for `key`'s consumer: a local compute, or `sends`
  // kSend actions.
  void made(const Key& key, float* buf, int sends = 1);

  // The step's start: the first receives posted.
  void begin_step();
  // After each compute: the window filled again.
  void post_ahead();
  // The send `a` (its tensor made here): started.
  void send(const pipeline::Action& a);
  // The tensor `key` that the compute `consumer` reads: made here, or
  // received (waited now: `waited` gets the wait's start and end, ns on the
  // steady clock, and the peer; untouched for a local one). The buffer is
  // the caller's until give().
  struct Wait {
    int64_t start_ns = 0, end_ns = 0;
    int peer = -1;
  };
  float* get(const pipeline::Action& consumer, const Key& key, Wait* waited);
  // The step's end: every send has left its buffer, the buffers are free.
  void end_step();
  // Nothing made and unread, nothing posted.
  bool idle() const { return ready_.empty() && posted_.empty(); }
  size_t bytes() const;

 private:
  void post_next();
  int rank_;
  std::unique_ptr<StageLink> link_;
  const std::vector<pipeline::Action>& list_;
  tensor::Shape shape_, sent_shape_;
  std::vector<std::unique_ptr<float[]>> buffers_;
  std::vector<float*> free_;
  std::map<Key, float*> ready_;  // made here, waiting for their local consumer or send
  std::map<Key, int> fanout_;    // of those, sent to several ranks: the sends still to go
  struct Posted {
    StageLink::Incoming in;
    float* buffer = nullptr;
  };
  std::map<Key, Posted> posted_;
  std::vector<float*> sending_;  // buffers in flight, back to the pool at end_step
  size_t next_ = 0;              // the next action of the list to post (if a receive)
};

}  // namespace po::parallel
