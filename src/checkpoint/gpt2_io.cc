#include "checkpoint/gpt2_io.h"

#include <vector>

#include "checkpoint/safetensors.h"
#include "core/error.h"

namespace po::checkpoint {
namespace {

// [rows, cols] -> [cols, rows]
void transpose(const float* src, float* dst, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

}  // namespace

void load_gpt2_safetensors(const std::string& path, model::Transformer& model) {
  SafetensorsReader file = SafetensorsReader::open(path);
  // Hugging Face checkpoints come with or without the "transformer." prefix.
  const std::string prefix = file.has("wte.weight") ? ""
                             : file.has("transformer.wte.weight") ? "transformer."
                                                                  : "";
  std::vector<float> tmp;
  for (const auto& p : model.param_infos()) {
    float* dst = model.params() + p.offset;
    if (p.conv1d) {
      const tensor::Shape hf_shape = {p.shape[1], p.shape[0]};
      tmp = file.read_f32(prefix + p.name, hf_shape);
      transpose(tmp.data(), dst, hf_shape[0], hf_shape[1]);
    } else {
      file.read_f32(prefix + p.name, p.shape, dst);
    }
  }
}

void save_gpt2_safetensors(const std::string& path, const model::Transformer& model) {
  std::vector<StTensorRef> refs;
  std::vector<std::vector<float>> transposed;
  transposed.reserve(model.param_infos().size());
  for (const auto& p : model.param_infos()) {
    const float* src = model.params() + p.offset;
    if (p.conv1d) {
      transposed.emplace_back(static_cast<size_t>(p.numel()));
      transpose(src, transposed.back().data(), p.shape[0], p.shape[1]);
      refs.push_back({p.name, StDtype::kF32, {p.shape[1], p.shape[0]}, transposed.back().data()});
    } else {
      refs.push_back({p.name, StDtype::kF32, p.shape, src});
    }
  }
  const auto& c = model.config();
  write_safetensors(path, refs,
                    {{"format", "pt"},
                     {"n_layer", std::to_string(c.n_layer)},
                     {"n_embd", std::to_string(c.n_embd)},
                     {"n_head", std::to_string(c.n_head)},
                     {"vocab_size", std::to_string(c.vocab_size)},
                     {"n_positions", std::to_string(c.seq_len)}});
}

}  // namespace po::checkpoint
