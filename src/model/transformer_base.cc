// A fine-tuned model's frozen base (Layout::adapters()): where it lives
// (its own storage, or another model's through share_base), its block
// linears quantized (model.quant) and decoded, and what it holds, measured
// and predicted. The rest of the decoder's buffers are in transformer.cc.
#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "model/transformer.h"

namespace po::model {

float* Transformer::base_params() {
  if (!layout_.adapters()) return params();
  if (base_owner_ != nullptr) return base_owner_->base_params();
  const int64_t n = layout_.base_unit_offset(last_ + 1) - layout_.base_unit_offset(first_);
  if (config_.quant != WeightQuant::kNone) {
    if (base_sparse_.data() == nullptr) base_sparse_ = tensor::SparseStorage(static_cast<size_t>(n) * sizeof(float));
    return base_sparse_.f32();
  }
  if (base_.data() == nullptr) base_ = tensor::Storage(static_cast<size_t>(n) * sizeof(float));
  return base_.f32();
}

float* Transformer::base_of(int u, float* trainable) {
  if (!layout_.adapters()) return trainable;
  if (holds(u)) return base_params() + base_unit_offset(u);
  PO_ASSERT(u == 0 && base_unit0_ != nullptr, "unit ", u, "'s frozen base is not held by this model (units ",
            first_, "..", last_, ")");
  return base_unit0_;
}

void Transformer::share_base(Transformer& owner, float* unit0) {
  PO_CHECK(layout_.adapters() && owner.layout_.adapters() && owner.first_ == first_ && owner.last_ == last_ &&
               owner.config_.quant == config_.quant && owner.base_owner_ == nullptr,
           "share_base: the owner must be a model with adapters holding the same units (", first_, "..", last_,
           ") and its own base");
  PO_CHECK(base_.data() == nullptr && base_sparse_.data() == nullptr && !quantized_,
           "share_base: this model holds a base of its own already");
  base_owner_ = &owner;
  base_unit0_ = unit0;
}

void Transformer::quantize_base() {
  PO_CHECK(base_owner_ == nullptr, "quantize_base: the base is another model's (share_base)");
  PO_CHECK(config_.quant != WeightQuant::kNone, "quantize_base: model.quant is not set");
  PO_CHECK(!quantized_, "quantize_base: the base is quantized already");
  for (int u = std::max(first_, 1); u <= std::min(last_, layout_.head_unit() - 1); ++u) quantize_unit(u);
  quantized_ = true;
}

namespace {

// fn(linear index, base tensor index, the Linear) for each base tensor of
// block unit u that model.quant quantizes: the pieces of its Linears' weights.
template <class Fn>
void for_each_quantizable(const Layout& l, int u, const Fn& fn) {
  const std::vector<TensorSpec>& tensors = l.base_tensors();
  const int64_t unit0 = l.base_unit_offset(u);
  parts::Block k = l.block();
  const std::vector<parts::Linear*> linears = k.linears();
  for (size_t i = 0; i < linears.size(); ++i) {
    const parts::Linear& lin = *linears[i];
    const int64_t lo = unit0 + lin.weight, hi = lo + lin.out * lin.in;
    for (size_t t = 0; t < tensors.size(); ++t) {
      const TensorSpec& spec = tensors[t];
      if (spec.unit == u && spec.offset >= lo && spec.offset < hi) fn(i, t, lin);
    }
  }
}

}  // namespace

// Unit u's Linears: each base tensor inside a Linear's weight quantized from
// its f32 values, which are then given back.
void Transformer::quantize_unit(int u) {
  PO_ASSERT(layout_.split().size == 1, "model.quant under tensor parallel is not built");
  const std::vector<TensorSpec>& tensors = layout_.base_tensors();
  if (quant_.empty()) {
    quant_.resize(tensors.size());
    quant_linears_.resize(static_cast<size_t>(last_ - first_ + 1));
  }
  float* base = base_params();
  std::array<QuantWeight, 4>& lins = quant_linears_[static_cast<size_t>(u - first_)];
  for_each_quantizable(layout_, u, [&](size_t i, size_t t, const parts::Linear& lin) {
    const TensorSpec& spec = tensors[t];
    PO_ASSERT(spec.shape.size() == 2 && spec.shape[1] == lin.in, "quantize_unit: ", spec.name,
              " is not a [rows, ", lin.in, "] piece of its Linear");
    float* w = base + (spec.offset - layout_.base_unit_offset(first_));
    if (quant_[t].format == WeightQuant::kNone)  // (set_quantized may have given it)
      quant_[t] = quantize_weight(config_.quant, w, spec.shape[0], spec.shape[1], spec.name);
    lins[i].parts.push_back(&quant_[t]);
    base_sparse_.release(static_cast<size_t>(w - base) * sizeof(float),
                         static_cast<size_t>(spec.numel()) * sizeof(float));
  });
  parts::Block k = layout_.block();
  const std::vector<parts::Linear*> linears = k.linears();
  for (size_t i = 0; i < linears.size(); ++i)
    PO_ASSERT(lins[i].rows() == linears[i]->out, "quantize_unit: unit ", u, "'s Linear ", i, " has ",
              linears[i]->out, " rows, its tensors ", lins[i].rows());
}

size_t Transformer::predicted_frozen_bytes(const TransformerConfig& config, UnitRange units, TensorSplit split) {
  const Layout l(config.resolved(), split);
  if (!l.adapters()) return 0;
  const int last = units.last < 0 ? l.head_unit() : units.last;
  const std::vector<TensorSpec>& tensors = l.base_tensors();
  std::vector<bool> quantized(tensors.size(), false);
  if (config.quant != WeightQuant::kNone)
    for (int u = std::max(units.first, 1); u <= std::min(last, l.head_unit() - 1); ++u)
      for_each_quantizable(l, u, [&](size_t, size_t t, const parts::Linear&) { quantized[t] = true; });
  size_t n = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const TensorSpec& spec = tensors[t];
    if (spec.unit < units.first || spec.unit > last) continue;
    n += quantized[t] ? QuantTensor::predicted_bytes(config.quant, spec.shape[0], spec.shape[1])
                      : static_cast<size_t>(spec.numel()) * sizeof(float);
  }
  return n;
}

size_t Transformer::frozen_bytes() const {
  if (!layout_.adapters() || base_owner_ != nullptr) return 0;
  // (By index: quantized() finds a tensor by name, a quadratic walk on the
  // per-step memory report.)
  const std::vector<TensorSpec>& tensors = layout_.base_tensors();
  size_t n = 0;
  for (size_t k = 0; k < tensors.size(); ++k) {
    if (!holds(tensors[k].unit)) continue;
    const bool q = k < quant_.size() && quant_[k].format != WeightQuant::kNone;
    n += q ? quant_[k].bytes() : static_cast<size_t>(tensors[k].numel()) * sizeof(float);
  }
  return n;
}

void Transformer::set_quantized(const TensorSpec& t, QuantTensor q) {
  PO_CHECK(config_.quant == q.format, "set_quantized: ", t.name, " is ", weight_quant_name(q.format),
           ", the model's model.quant is ", weight_quant_name(config_.quant));
  PO_CHECK(!quantized_, "set_quantized: ", t.name, ": the base is quantized already");
  PO_CHECK(q.rows == t.shape[0] && q.cols == t.shape[1], "set_quantized: ", t.name, " is [", t.shape[0], ", ",
           t.shape[1], "], the quantized tensor [", q.rows, ", ", q.cols, "]");
  PO_CHECK(t.unit >= 1 && t.unit < layout_.head_unit() && holds(t.unit), "set_quantized: ", t.name,
           " is not a block's weight of this model");
  const std::vector<TensorSpec>& tensors = layout_.base_tensors();
  if (quant_.empty()) {
    quant_.resize(tensors.size());
    quant_linears_.resize(static_cast<size_t>(last_ - first_ + 1));
  }
  for (size_t k = 0; k < tensors.size(); ++k)
    if (tensors[k].name == t.name) {
      quant_[k] = std::move(q);
      return;
    }
  PO_THROW(core::InvalidArgument, "set_quantized: the base has no tensor ", t.name);
}

void Transformer::attach_quant(BlockWeights& P, int u) const {
  if (base_owner_ != nullptr) return base_owner_->attach_quant(P, u);
  if (!quantized_) return;
  const std::array<QuantWeight, 4>& lins = quant_linears_[static_cast<size_t>(u - first_)];
  parts::Linear::Weights* ws[] = {&P.qkv, &P.out, &P.up, &P.down};
  for (size_t i = 0; i < 4; ++i) {
    ws[i]->q = &lins[i];
    ws[i]->w = nullptr;
    ws[i]->w16 = nullptr;
  }
}

const QuantTensor* Transformer::quantized(const TensorSpec& base_tensor) const {
  if (base_owner_ != nullptr) return base_owner_->quantized(base_tensor);
  if (!quantized_) return nullptr;
  const std::vector<TensorSpec>& tensors = layout_.base_tensors();
  for (size_t t = 0; t < tensors.size(); ++t)
    if (tensors[t].name == base_tensor.name)
      return quant_[t].format == WeightQuant::kNone ? nullptr : &quant_[t];
  return nullptr;
}

size_t Transformer::quantized_bytes() const {
  size_t n = 0;
  for (const QuantTensor& q : quant_) n += q.format == WeightQuant::kNone ? 0 : q.bytes();
  return n;
}

void Transformer::base_values(float* out) {
  if (base_owner_ != nullptr) return base_owner_->base_values(out);
  const int64_t first = layout_.base_unit_offset(first_);
  const int64_t n = layout_.base_unit_offset(last_ + 1) - first;
  if (!quantized_) {
    std::memcpy(out, base_params(), static_cast<size_t>(n) * sizeof(float));
    return;
  }
  const float* base = base_params();
  const std::vector<TensorSpec>& tensors = layout_.base_tensors();
  for (size_t t = 0; t < tensors.size(); ++t) {
    const TensorSpec& spec = tensors[t];
    if (!holds(spec.unit)) continue;
    float* dst = out + (spec.offset - first);
    if (quant_[t].format != WeightQuant::kNone)
      quant_[t].decode(0, quant_[t].rows, dst);
    else
      std::memcpy(dst, base + (spec.offset - first), static_cast<size_t>(spec.numel()) * sizeof(float));
  }
}

}  // namespace po::model
