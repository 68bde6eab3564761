// Packed rows (Transformer::set_positions): examples side by side in a row,
// each at its own positions and attending only to itself.
#include <algorithm>

#include "backend/ops.h"
#include "core/error.h"
#include "model/transformer.h"

namespace po::model {
namespace ops = po::backend::cpu;

void Transformer::set_positions(const int32_t* positions) {
  segments_.clear();
  positions_.clear();
  if (positions == nullptr) return;
  PO_CHECK(cp_.size == 1, "packed rows (data.pack) run at cp = 1");
  positions_.assign(positions, positions + B_ * T_);
  for (int64_t b = 0; b < B_; b++) {
    for (int64_t t = 0; t < T_; t++) {
      const int64_t i = b * T_ + t;
      const int32_t p = positions[i];
      if (t == 0 || p == 0) {
        PO_CHECK(p == 0, "packed positions: row ", b, " starts at position ", p, ", not 0");
        segments_.push_back({i, 0});
      } else {
        PO_CHECK(p == positions[i - 1] + 1, "packed positions: row ", b, " column ", t,
                 " holds position ", p, " after ", positions[i - 1],
                 " (an example's positions count up from 0)");
      }
      ++segments_.back().len;
    }
  }
}

// Each example's RoPE and attention alone, as in a batch of one row of its
// length: the kernel's bits for a row depend only on the rows before it in
// the same call, so an example gives the bits it gives unpacked.
void Transformer::packed_attention_forward(float* out, float* lse, float* qkv) {
  const parts::Attention& at = layout_.block().attn;
  const int64_t NH = at.n_head, NKV = at.n_kv_head, hs = at.head_dim, QKV = at.qkv.out;
  std::vector<float> seg_lse(static_cast<size_t>(NH * T_));
  for (const Segment& s : segments_) {
    float* q = qkv + s.row0 * QKV;
    if (rope_cos_ != nullptr) ops::rope_forward(q, 1, s.len, QKV, at.rotated_heads(), hs, rope_cos_, rope_sin_);
    ops::attention_forward(out + s.row0 * NH * hs, seg_lse.data(), q, 1, s.len, NH, NKV, hs);
    const int64_t b = s.row0 / T_, t0 = s.row0 % T_;
    for (int64_t h = 0; h < NH; h++)
      std::copy_n(seg_lse.data() + h * s.len, s.len, lse + (b * NH + h) * T_ + t0);
  }
}

template <class Q>
void Transformer::packed_attention_backward(float* dqkv, const float* dout, const Q* qkv,
                                            const Q* out, const float* lse) {
  const parts::Attention& at = layout_.block().attn;
  const int64_t NH = at.n_head, NKV = at.n_kv_head, hs = at.head_dim, QKV = at.qkv.out;
  std::vector<float> seg_lse(static_cast<size_t>(NH * T_));
  for (const Segment& s : segments_) {
    const int64_t b = s.row0 / T_, t0 = s.row0 % T_;
    for (int64_t h = 0; h < NH; h++)
      std::copy_n(lse + (b * NH + h) * T_ + t0, s.len, seg_lse.data() + h * s.len);
    float* dq = dqkv + s.row0 * QKV;
    ops::attention_backward(dq, dout + s.row0 * NH * hs, qkv + s.row0 * QKV, out + s.row0 * NH * hs,
                            seg_lse.data(), 1, s.len, NH, NKV, hs);
    if (rope_cos_ != nullptr) ops::rope_backward(dq, 1, s.len, QKV, at.rotated_heads(), hs, rope_cos_, rope_sin_);
  }
}

template void Transformer::packed_attention_backward<float>(float*, const float*, const float*,
                                                            const float*, const float*);
template void Transformer::packed_attention_backward<uint16_t>(float*, const float*, const uint16_t*,
                                                               const uint16_t*, const float*);

}  // namespace po::model
