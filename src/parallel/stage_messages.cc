// The tensors between pipeline stages during a step (stage_messages.h).
#include "parallel/stage_messages.h"

#include <chrono>
#include <set>
#include <utility>

#include "core/error.h"
#include "core/timer.h"

namespace po::parallel {
using pipeline::Action;
using pipeline::Op;

using core::now_ns;

StageMessages::StageMessages(int rank, std::unique_ptr<StageLink> link, const std::vector<Action>& list,
                             tensor::Shape shape, tensor::Shape sent_shape)
    : rank_(rank),
      link_(std::move(link)), list_(list), shape_(std::move(shape)), sent_shape_(std::move(sent_shape)) {}

StageMessages::~StageMessages() {
  if (posted_.empty() && sending_.empty()) return;
  std::set<const float*> busy(sending_.begin(), sending_.end());
  for (const auto& [key, p] : posted_) busy.insert(p.buffer);
  for (auto& b : buffers_)
    if (busy.count(b.get()) > 0) (void)b.release();
  (void)new std::map<Key, Posted>(std::move(posted_));
  (void)link_.release();
}

float* StageMessages::take() {
  if (free_.empty()) {
    buffers_.push_back(std::make_unique<float[]>(static_cast<size_t>(tensor::shape_numel(shape_))));
    free_.push_back(buffers_.back().get());
  }
  float* b = free_.back();
  free_.pop_back();
  return b;
}

void StageMessages::give(float* b) { free_.push_back(b); }

void StageMessages::made(const Key& key, float* buf, int sends) {
  ready_[key] = buf;
  if (sends > 1) fanout_[key] = sends;
}

void StageMessages::begin_step() {
  next_ = 0;
  post_ahead();
}

// The list's next action, posted if it is a receive.
void StageMessages::post_next() {
  const Action& a = list_[next_++];
  if (a.op != Op::kRecv) return;
  Posted& p = posted_[{a.micro, a.stage, static_cast<int>(a.payload)}];
  p.buffer = take();
  link_->post_recv(p.in, p.buffer, shape_, a.peer, pipeline::message_tag(a));
}

void StageMessages::post_ahead() {
  if (!link_) return;
  while (posted_.size() < kWindow && next_ < list_.size()) post_next();
}

void StageMessages::send(const Action& a) {
  const auto it = ready_.find({a.micro, a.stage, static_cast<int>(a.payload)});
  PO_ASSERT(it != ready_.end(), "pipeline: ", pipeline::describe(a), " before its tensor");
  link_->send(it->second, sent_shape_, a.peer, pipeline::message_tag(a));
  const auto f = fanout_.find(it->first);
  if (f == fanout_.end() || --f->second == 0) {
    if (f != fanout_.end()) fanout_.erase(f);
    sending_.push_back(it->second);
    ready_.erase(it);
  }
}

float* StageMessages::get(const Action& consumer, const Key& key, Wait* waited) {
  if (auto it = ready_.find(key); it != ready_.end()) {
    float* b = it->second;
    ready_.erase(it);
    return b;
  }
  PO_ASSERT(link_ != nullptr, "pipeline rank ", rank_, ": no tensor for ", pipeline::describe(consumer));
  while (posted_.find(key) == posted_.end()) {
    PO_ASSERT(next_ < list_.size(), "pipeline rank ", rank_, ": no receive for ", pipeline::describe(consumer));
    post_next();
  }
  auto it = posted_.find(key);
  const int64_t t0 = now_ns();
  link_->finish_recv(it->second.in);
  if (waited != nullptr) *waited = {t0, now_ns(), it->second.in.peer};
  float* b = it->second.buffer;
  posted_.erase(it);
  return b;
}

void StageMessages::end_step() {
  if (link_) link_->wait_sends();
  for (float* b : sending_) give(b);
  sending_.clear();
}

size_t StageMessages::bytes() const {
  return buffers_.size() * static_cast<size_t>(tensor::shape_numel(shape_)) * sizeof(float);
}

}  // namespace po::parallel
