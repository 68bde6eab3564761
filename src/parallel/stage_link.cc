#include "parallel/stage_link.h"

#include <algorithm>

#include "core/error.h"

namespace po::parallel {
namespace {

constexpr int64_t kMagic = 0x504f5032;  // "PO P2"

tensor::Shape header_shape(const std::array<int64_t, 4 + StageLink::kMaxDims>& h) {
  const int64_t n = std::clamp<int64_t>(h[3], 0, StageLink::kMaxDims);
  return tensor::Shape(h.begin() + 4, h.begin() + 4 + n);
}

}  // namespace

StageLink::~StageLink() {
  try {
    wait_sends();
  } catch (...) {  // (a destructor must not throw; the failure was reported where it happened)
  }
}

void StageLink::send(const float* x, const tensor::Shape& shape, int peer, int tag) {
  PO_CHECK(shape.size() <= static_cast<size_t>(kMaxDims), "pipeline message of ", shape.size(),
           " dimensions: at most ", kMaxDims);
  Pending& p = sends_.emplace_back();
  p.header = {kMagic, group_.rank(), tag, static_cast<int64_t>(shape.size())};
  std::copy(shape.begin(), shape.end(), p.header.begin() + 4);
  p.head = group_.isend(p.header.data(), 2 * p.header.size(), tensor::DType::kI32, peer, 2 * tag);
  p.body = group_.isend(x, static_cast<size_t>(tensor::shape_numel(shape)), tensor::DType::kF32,
                        peer, 2 * tag + 1);
}

// What is wrong with a received header, or "" when it is the one expected.
std::string StageLink::mismatch(const Header& h, const tensor::Shape& expect, int peer,
                                int tag) const {
  const tensor::Shape sent = header_shape(h);
  if (h[0] == kMagic && h[1] == peer && h[2] == tag && sent == expect) return "";
  return core::str_cat(
      "pipeline message (tag ", tag, "): rank ", group_.rank(), " expected ",
      tensor::shape_str(expect), " from rank ", peer, ", which sent ",
      h[0] == kMagic ? tensor::shape_str(sent) : std::string("no header"),
      h[0] == kMagic && h[2] != tag ? core::str_cat(" under tag ", h[2]) : std::string());
}

void StageLink::recv(float* out, const tensor::Shape& expect, int peer, int tag) {
  Header h{};
  group_.recv(h.data(), 2 * h.size(), tensor::DType::kI32, peer, 2 * tag);  // int64s, as raw bits
  if (const std::string wrong = mismatch(h, expect, peer, tag); !wrong.empty()) {
    if (h[0] == kMagic) {  // drain the payload, so the link stays usable for the error's report
      drain_.resize(static_cast<size_t>(tensor::shape_numel(header_shape(h))));
      group_.recv(drain_.data(), drain_.size(), tensor::DType::kF32, peer, 2 * tag + 1);
    }
    PO_THROW(core::CommError, wrong);
  }
  group_.recv(out, static_cast<size_t>(tensor::shape_numel(expect)), tensor::DType::kF32, peer,
              2 * tag + 1);
}

void StageLink::post_recv(Incoming& in, float* out, const tensor::Shape& expect, int peer,
                          int tag) {
  in.expect = expect;
  in.peer = peer;
  in.tag = tag;
  in.head = group_.irecv(in.header.data(), 2 * in.header.size(), tensor::DType::kI32, peer, 2 * tag);
  in.body = group_.irecv(out, static_cast<size_t>(tensor::shape_numel(expect)), tensor::DType::kF32,
                         peer, 2 * tag + 1);
}

void StageLink::finish_recv(Incoming& in) {
  in.head.wait();
  if (const std::string wrong = mismatch(in.header, in.expect, in.peer, in.tag); !wrong.empty())
    PO_THROW(core::CommError, wrong);
  in.body.wait();
}

void StageLink::wait_sends() {
  for (Pending& p : sends_) {
    p.head.wait();
    p.body.wait();
  }
  sends_.clear();
}

}  // namespace po::parallel
