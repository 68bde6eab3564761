#include "model/layout.h"

#include <algorithm>
#include <utility>

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
  const bool gpt2_names = config.arch == "gpt2";
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
  unit_offsets_.push_back(0);
  add(gpt2_names ? "wte.weight" : "model.embed_tokens.weight", {V, C}, 0, Slot::kTokenEmbedding,
      Init::kNormal, P::kVocab);
  if (config.positions == Positions::kLearned)
    add(gpt2_names ? "wpe.weight" : "model.embed_positions.weight", {config.seq_len, C}, 0,
        Slot::kPositionEmbedding, Init::kNormal, P::kReplicated);
  // A part's tensors, appended to unit u (which starts here) as `slot`.
  auto into_unit = [&](int u, Slot slot) -> parts::Declare {
    return [&add, &offset, u, slot, start = offset](parts::Decl d) {
      const int64_t at = offset - start;
      add(d.name, std::move(d.shape), u, slot, d.init, d.partition, std::move(d.parts), d.conv1d);
      return at;
    };
  };
  for (int64_t l = 0; l < L; ++l) {
    unit_offsets_.push_back(offset);
    parts::Block block = parts::declare_block(config, l, into_unit(static_cast<int>(l + 1), Slot::kBlock));
    if (l == 0) block_ = std::move(block);
  }
  unit_offsets_.push_back(offset);
  const int uf = static_cast<int>(L + 1);
  final_norm_ = parts::declare_norm(config, gpt2_names ? "ln_f.weight" : "model.norm.weight",
                                    gpt2_names ? "ln_f.bias" : "model.norm.bias",
                                    into_unit(uf, Slot::kFinalNorm));
  head_ = 0;
  if (!config.tie_embeddings) {
    head_ = tensors_.size();
    add("lm_head.weight", {V, C}, uf, Slot::kHead, Init::kNormal, P::kVocab);
  }
  unit_offsets_.push_back(offset);
  if (config.lora.on()) declare_adapters(config);
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

std::vector<std::pair<int64_t, int64_t>> Layout::norm_ranges() const {
  std::vector<std::pair<int64_t, int64_t>> held;
  if (adapters()) return held;
  auto norm = [&](const parts::Norm& k, int u) {
    if (k.frozen) return;
    held.emplace_back(unit_offset(u) + k.weight, k.C);
    if (k.bias >= 0) held.emplace_back(unit_offset(u) + k.bias, k.C);
  };
  for (int u = 1; u <= n_layer_; ++u) {
    norm(block_.norm1, u);
    norm(block_.norm2, u);
  }
  norm(final_norm_, n_layer_ + 1);
  std::sort(held.begin(), held.end());
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& [at, n] : held)
    if (!out.empty() && out.back().first + out.back().second == at)
      out.back().second += n;
    else
      out.emplace_back(at, n);
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
  const std::vector<TensorSpec>& t = base_tensors();
  return t.size() > 1 && t[1].slot == Slot::kPositionEmbedding ? &t[1] : nullptr;
}

// The base moves to its own space; tensors_ and the units become the
// adapters: in every block, per adapted piece of each Linear in order, its
// A [r, in], B [rows, r] and (DoRA) magnitude [rows], named after the base
// module as PEFT names them (without PEFT's "base_model.model." prefix).
void Layout::declare_adapters(const TransformerConfig& config) {
  const LoraConfig& lora = config.lora;
  PO_CHECK(split_.size == 1, "lora: adapters under tensor parallel (parallel.tp = ", split_.size,
           ") are not built yet");
  PO_CHECK(lora.alpha > 0, "lora.alpha must be > 0, got ", lora.alpha);
  PO_CHECK(!lora.targets.empty(), "lora.targets is empty: name the modules to adapt");
  base_ = std::move(tensors_);
  base_offsets_ = std::move(unit_offsets_);
  tensors_.clear();
  // Module paths of a unit's base tensors that are pieces of `lin`, in row order.
  auto pieces_of = [&](int u, const parts::Linear& lin) {
    std::vector<const TensorSpec*> out;
    int64_t at = base_offsets_[static_cast<size_t>(u)] + lin.weight, rows = 0;
    for (const TensorSpec& t : base_)
      if (t.unit == u && t.offset == at && rows < lin.out) {
        out.push_back(&t);
        rows += t.shape[0];
        at += t.numel();
      }
    PO_ASSERT(rows == lin.out, "lora: the pieces of a linear cover ", rows, " of ", lin.out, " rows");
    return out;
  };
  auto module = [](const std::string& weight) { return weight.substr(0, weight.size() - 7); };
  auto matches = [](const std::string& path, const std::string& target) {  // PEFT's rule
    return path == target || (path.size() > target.size() &&
                              path.compare(path.size() - target.size(), target.size(), target) == 0 &&
                              path[path.size() - target.size() - 1] == '.');
  };
  std::vector<bool> used(lora.targets.size(), false);
  std::vector<std::string> known;
  int64_t offset = 0;
  unit_offsets_ = {0, 0};  // the embedding unit: nothing trains
  for (int l = 0; l < n_layer_; ++l) {
    const int u = l + 1;
    const int64_t start = offset;
    for (parts::Linear* lin : block_.linears()) {
      int64_t row0 = 0;
      for (const TensorSpec* t : pieces_of(u, *lin)) {
        const std::string path = module(t->name);
        const int64_t rows = t->shape[0];
        bool adapt = false;
        for (size_t i = 0; i < lora.targets.size(); ++i)
          if (matches(path, lora.targets[i])) adapt = used[i] = true;
        if (l == 0) {
          const size_t dot = path.find('.', path.find_first_of("0123456789"));
          known.push_back(path.substr(dot + 1));
        }
        if (adapt) {
          parts::Adapter::Piece pc{row0, rows};
          auto add = [&](const std::string& name, tensor::Shape shape, Init init) {
            TensorSpec a;
            a.name = path + name;
            a.shape = std::move(shape);
            a.global_shape = a.shape;
            a.offset = offset;
            a.unit = u;
            a.slot = Slot::kAdapter;
            a.init = init;
            a.decay = a.shape.size() >= 2;
            offset += a.numel();
            tensors_.push_back(std::move(a));
            return tensors_.back().offset - start;
          };
          pc.a = add(".lora_A.weight", {lora.r, lin->in}, Init::kKaimingUniform);
          pc.b = add(".lora_B.weight", {rows, lora.r}, Init::kZeros);
          if (lora.dora) pc.m = add(".lora_magnitude_vector", {rows}, Init::kRowNorm);
          if (l == 0) lin->lora.pieces.push_back(pc);
        }
        row0 += rows;
      }
      lin->trainable = false;
      lin->lora.r = lora.r;
      lin->lora.scale = static_cast<float>(lora.scale());
      lin->lora.dropout = static_cast<float>(lora.dropout);
    }
    unit_offsets_.push_back(offset);
  }
  unit_offsets_.push_back(offset);  // the final norm and head: frozen
  block_.norm1.frozen = block_.norm2.frozen = true;
  final_norm_.frozen = true;
  for (size_t i = 0; i < lora.targets.size(); ++i) {
    std::string names;
    for (const std::string& k : known) names += (names.empty() ? "" : " ") + k;
    PO_CHECK(used[i], "lora.targets: '", lora.targets[i], "' is not a linear layer of this ",
             config.arch, " model (its linear layers: ", names, ")");
  }
}

std::vector<int64_t> Layout::unit_numels() const {
  std::vector<int64_t> n;
  for (int u = 0; u < num_units(); ++u) n.push_back(unit_numel(u));
  return n;
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

bool Layout::read_as_bf16(const TensorSpec& t) {
  return t.shape.size() == 2 && t.slot != Slot::kPositionEmbedding && t.slot != Slot::kAdapter;
}

}  // namespace po::model
