#include "model/layout.h"

#include <algorithm>

#include "core/error.h"

namespace po::model {

Layout::Layout(const TransformerConfig& unresolved, TensorSplit split)
    : n_layer_(static_cast<int>(unresolved.n_layer)), split_(split) {
  PO_CHECK(split.size >= 1 && split.rank >= 0 && split.rank < split.size,
           "tensor-parallel rank ", split.rank, " is outside parallel.tp = ", split.size);
  const TransformerConfig whole = unresolved.resolved();
  whole.validate();
  // This rank's shapes (the whole model's at tp = 1).
  const TransformerConfig config = whole.shard(split.size);
  vocab_ = whole.vocab_size;
  vocab_rows_ = config.vocab_size;
  const int64_t tp = split.size;
  const int64_t C = config.n_embd, V = config.vocab_size, L = config.n_layer;
  const int64_t hs = config.head_dim(), NH = config.n_head, NKV = config.n_kv_head;
  const int64_t F = config.ffn_hidden;
  const bool gpt2_names = config.arch == "gpt2";
  const bool layer_norm = config.norm == Norm::kLayerNorm;
  int64_t offset = 0;
  auto add = [&](const std::string& name, tensor::Shape shape, int unit, Slot slot, Init init,
                 Partition part, std::vector<int64_t> parts = {}, bool conv1d = false) {
    TensorSpec t;
    t.name = name;
    t.shape = std::move(shape);
    t.offset = offset;
    t.unit = unit;
    t.slot = slot;
    t.init = init;
    t.decay = t.shape.size() >= 2;
    t.partition = part;
    t.global_shape = t.shape;
    if (part == Partition::kSplitRows) {
      t.parts = parts.empty() ? std::vector<int64_t>{t.shape[0]} : std::move(parts);
      t.global_shape[0] *= tp;
    } else if (part == Partition::kSplitCols) {
      t.global_shape[1] *= tp;
    } else if (part == Partition::kVocab) {
      t.global_shape[0] = vocab_;
    }
    t.conv1d = conv1d;
    offset += t.numel();
    tensors_.push_back(std::move(t));
  };
  using P = Partition;
  block_slots_.fill(-1);
  unit_offsets_.push_back(0);
  add(gpt2_names ? "wte.weight" : "model.embed_tokens.weight", {V, C}, 0, Slot::kTokenEmbedding,
      Init::kNormal, P::kVocab);
  if (config.positions == Positions::kLearned)
    add(gpt2_names ? "wpe.weight" : "model.embed_positions.weight", {config.seq_len, C}, 0,
        Slot::kPositionEmbedding, Init::kNormal, P::kReplicated);
  for (int64_t l = 0; l < L; ++l) {
    unit_offsets_.push_back(offset);
    const int u = static_cast<int>(l + 1);
    const int64_t block_start = offset;
    auto slot_here = [&](Slot s) {
      if (l == 0) block_slots_[static_cast<size_t>(s)] = offset - block_start;
      return s;
    };
    auto norm = [&](const std::string& w, const std::string& b, Slot ws, Slot bs) {
      add(w, {C}, u, slot_here(ws), Init::kOnes, P::kReplicated);
      if (layer_norm) add(b, {C}, u, slot_here(bs), Init::kZeros, P::kReplicated);
    };
    if (gpt2_names) {
      // Hugging Face GPT-2 names; linear weights are Conv1D ([in, out]) in its files.
      const std::string h = "h." + std::to_string(l) + ".";
      const bool b = config.bias;
      norm(h + "ln_1.weight", h + "ln_1.bias", Slot::kNorm1, Slot::kNorm1Bias);
      const std::vector<int64_t> qkv = {NH * hs, NKV * hs, NKV * hs};
      const std::vector<int64_t> fc = config.mlp == Mlp::kSwiGLU ? std::vector<int64_t>{F, F}
                                                                  : std::vector<int64_t>{F};
      add(h + "attn.c_attn.weight", {config.qkv_width(), C}, u, slot_here(Slot::kQkv),
          Init::kNormal, P::kSplitRows, qkv, true);
      if (b) add(h + "attn.c_attn.bias", {config.qkv_width()}, u, slot_here(Slot::kQkvBias),
                 Init::kZeros, P::kSplitRows, qkv);
      add(h + "attn.c_proj.weight", {C, NH * hs}, u, slot_here(Slot::kAttnOut),
          Init::kResidualNormal, P::kSplitCols, {}, true);
      if (b) add(h + "attn.c_proj.bias", {C}, u, slot_here(Slot::kAttnOutBias), Init::kZeros,
                 P::kReplicated);
      norm(h + "ln_2.weight", h + "ln_2.bias", Slot::kNorm2, Slot::kNorm2Bias);
      add(h + "mlp.c_fc.weight", {config.fc_width(), C}, u, slot_here(Slot::kFc), Init::kNormal,
          P::kSplitRows, fc, true);
      if (b) add(h + "mlp.c_fc.bias", {config.fc_width()}, u, slot_here(Slot::kFcBias),
                 Init::kZeros, P::kSplitRows, fc);
      add(h + "mlp.c_proj.weight", {C, F}, u, slot_here(Slot::kProj), Init::kResidualNormal,
          P::kSplitCols, {}, true);
      if (b) add(h + "mlp.c_proj.bias", {C}, u, slot_here(Slot::kProjBias), Init::kZeros,
                 P::kReplicated);
      continue;
    }
    // Hugging Face Llama names, [out, in].
    const std::string h = "model.layers." + std::to_string(l) + ".";
    const std::string a = h + "self_attn.", m = h + "mlp.";
    const bool b = config.bias;
    norm(h + "input_layernorm.weight", h + "input_layernorm.bias", Slot::kNorm1, Slot::kNorm1Bias);
    add(a + "q_proj.weight", {NH * hs, C}, u, slot_here(Slot::kQkv), Init::kNormal, P::kSplitRows);
    add(a + "k_proj.weight", {NKV * hs, C}, u, Slot::kPart, Init::kNormal, P::kSplitRows);
    add(a + "v_proj.weight", {NKV * hs, C}, u, Slot::kPart, Init::kNormal, P::kSplitRows);
    if (b) {
      add(a + "q_proj.bias", {NH * hs}, u, slot_here(Slot::kQkvBias), Init::kZeros, P::kSplitRows);
      add(a + "k_proj.bias", {NKV * hs}, u, Slot::kPart, Init::kZeros, P::kSplitRows);
      add(a + "v_proj.bias", {NKV * hs}, u, Slot::kPart, Init::kZeros, P::kSplitRows);
    }
    add(a + "o_proj.weight", {C, NH * hs}, u, slot_here(Slot::kAttnOut), Init::kResidualNormal,
        P::kSplitCols);
    if (b) add(a + "o_proj.bias", {C}, u, slot_here(Slot::kAttnOutBias), Init::kZeros,
               P::kReplicated);
    norm(h + "post_attention_layernorm.weight", h + "post_attention_layernorm.bias", Slot::kNorm2,
         Slot::kNorm2Bias);
    if (config.mlp == Mlp::kSwiGLU) {
      add(m + "gate_proj.weight", {F, C}, u, slot_here(Slot::kFc), Init::kNormal, P::kSplitRows);
      add(m + "up_proj.weight", {F, C}, u, Slot::kPart, Init::kNormal, P::kSplitRows);
      if (b) {
        add(m + "gate_proj.bias", {F}, u, slot_here(Slot::kFcBias), Init::kZeros, P::kSplitRows);
        add(m + "up_proj.bias", {F}, u, Slot::kPart, Init::kZeros, P::kSplitRows);
      }
    } else {
      add(m + "up_proj.weight", {F, C}, u, slot_here(Slot::kFc), Init::kNormal, P::kSplitRows);
      if (b) add(m + "up_proj.bias", {F}, u, slot_here(Slot::kFcBias), Init::kZeros,
                 P::kSplitRows);
    }
    add(m + "down_proj.weight", {C, F}, u, slot_here(Slot::kProj), Init::kResidualNormal,
        P::kSplitCols);
    if (b) add(m + "down_proj.bias", {C}, u, slot_here(Slot::kProjBias), Init::kZeros,
               P::kReplicated);
  }
  unit_offsets_.push_back(offset);
  const int uf = static_cast<int>(L + 1);
  final_norm_ = tensors_.size();
  add(gpt2_names ? "ln_f.weight" : "model.norm.weight", {C}, uf, Slot::kFinalNorm, Init::kOnes,
      P::kReplicated);
  if (layer_norm)
    add(gpt2_names ? "ln_f.bias" : "model.norm.bias", {C}, uf, Slot::kFinalNormBias, Init::kZeros,
        P::kReplicated);
  head_ = 0;
  if (!config.tie_embeddings) {
    head_ = tensors_.size();
    add("lm_head.weight", {V, C}, uf, Slot::kHead, Init::kNormal, P::kVocab);
  }
  unit_offsets_.push_back(offset);
  // Each unit's f32-read ranges, once (a lean widening asks at every visit).
  f32_ranges_.resize(static_cast<size_t>(num_units()));
  for (const TensorSpec& t : tensors_) {
    if (read_as_bf16(t)) continue;
    auto& out = f32_ranges_[static_cast<size_t>(t.unit)];
    const int64_t b = t.offset - unit_offset(t.unit), e = b + t.numel();
    if (!out.empty() && out.back().second == b)
      out.back().second = e;
    else
      out.emplace_back(b, e);
  }
}

int64_t Layout::vocab_real() const {
  return std::clamp<int64_t>(vocab_ - vocab_begin(), 0, vocab_rows_);
}

std::vector<std::pair<int64_t, int64_t>> Layout::replicated_ranges() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const TensorSpec& t : tensors_) {
    if (t.partition != Partition::kReplicated) continue;
    if (!out.empty() && out.back().first + out.back().second == t.offset)
      out.back().second += t.numel();
    else
      out.emplace_back(t.offset, t.numel());
  }
  return out;
}

const TensorSpec* Layout::find(const std::string& name) const {
  for (const TensorSpec& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

const TensorSpec& Layout::tensor(const std::string& name) const {
  const TensorSpec* t = find(name);
  PO_CHECK(t != nullptr, "the model has no tensor named '", name, "'");
  return *t;
}

const TensorSpec* Layout::position_embedding() const {
  return tensors_.size() > 1 && tensors_[1].slot == Slot::kPositionEmbedding ? &tensors_[1]
                                                                              : nullptr;
}

const TensorSpec* Layout::final_norm_bias() const {
  const size_t i = final_norm_ + 1;
  return i < tensors_.size() && tensors_[i].slot == Slot::kFinalNormBias ? &tensors_[i] : nullptr;
}

std::vector<int> Layout::head_units() const {
  if (tied()) return {0, head_unit()};
  return {head_unit()};
}

std::vector<Step> Layout::training_steps() const {
  std::vector<Step> s = {{Step::kEmbedForward}};
  for (int l = 0; l < n_layer_; ++l) s.push_back({Step::kBlockForward, l});
  s.push_back({Step::kHead});
  for (int l = n_layer_ - 1; l >= 0; --l) s.push_back({Step::kBlockBackward, l});
  s.push_back({Step::kEmbedBackward});
  return s;
}

std::vector<int> Layout::step_units(const Step& s) const {
  switch (s.kind) {
    case Step::kEmbedForward:
      return {0};
    case Step::kBlockForward:
    case Step::kBlockBackward:
      return {s.layer + 1};
    case Step::kHead:
      return head_units();
    case Step::kEmbedBackward:
      return {};  // writes unit 0's gradient, reads no parameters
  }
  return {};
}

std::vector<int> Layout::param_visit_order() const {
  std::vector<int> order;
  for (const Step& s : training_steps())
    for (int u : step_units(s)) order.push_back(u);
  return order;
}

bool Layout::read_as_bf16(const TensorSpec& t) {
  return t.shape.size() == 2 && t.slot != Slot::kPositionEmbedding;
}

}  // namespace po::model
