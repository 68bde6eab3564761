// Hugging Face Llama checkpoints (transformers' LlamaForCausalLM):
//   - a directory: config.json plus model.safetensors, or
//     model.safetensors.index.json ({"weight_map": {tensor: shard file}}) and
//     its shards;
//   - one .safetensors file, with config.json read from its directory when
//     there is one. Without it the shape is inferred from the tensors (n_layer
//     from the layer count, sizes from the embedding and MLP, n_kv_head from
//     k_proj's rows), except the head count, which only the caller can give
//     (LlamaOverrides::n_head); eps, theta and max positions then take
//     LlamaConfig's defaults (1e-6, 10000, 2048) unless overridden.
// F32, BF16 and F16 tensors are read as fp32. A "-bnb-4bit" checkpoint's
// linear layers (bitsandbytes' Linear4bit state dict: M.weight, U8 codes,
// with M.weight.absmax, .quant_map, .nested_absmax, .nested_quant_map and
// .quant_state.bitsandbytes__nf4, its JSON) are NF4 with double
// quantization: read_nf4 gives their codes as stored, read their decoded
// values (backend/nf4.h). Their maps must be bitsandbytes' (the NF4 values
// bit for bit; the dynamic map within 2 ulps, as torch's linspace makes it),
// blocks of 64 and nested blocks of 256; FP4 and single quantization are
// refused naming the tensor. Names and layout are HF's own
// (llama_weights.h); older files' rotary_emb.inv_freq buffers are ignored, any
// other unexpected tensor (a bias, say) is an error, as is lm_head.weight
// missing from an untied model. A tied model's lm_head.weight, if stored, is
// ignored, as transformers does.
//
// The writer makes the single-file form: FILE.safetensors, written exactly as
// the HF library writes it (write_safetensors_hf, metadata {"format": "pt"} as
// transformers' save_pretrained), and config.json beside it. For F32 input an
// import then export is byte-identical to a file that the HF library wrote.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "checkpoint/llama_weights.h"
#include "checkpoint/safetensors.h"

namespace po::checkpoint {

// An NF4 tensor of a "-bnb-4bit" checkpoint: its logical shape and the
// offset of its double quantization, from its quant_state JSON.
struct HfNf4Entry {
  tensor::Shape shape;
  float offset = 0.0f;
};

class HfLlamaReader final : public LlamaReader {
 public:
  // `path`: a model directory or a .safetensors file.
  static std::unique_ptr<HfLlamaReader> open(const std::string& path,
                                             const LlamaOverrides& overrides = {});
  void read(const std::string& name, float* dst) const override;
  using LlamaReader::read;
  bool is_nf4(const std::string& name) const override { return nf4_.count(name) != 0; }
  backend::Nf4Tensor read_nf4(const std::string& name) const override;
  // The file holding tensor `name`, and its stored dtype.
  const SafetensorsReader& file_of(const std::string& name) const;

 private:
  HfLlamaReader(LlamaFormat format, const std::string& origin) : LlamaReader(format, origin) {}

  std::vector<SafetensorsReader> files_;
  std::map<std::string, size_t> where_;  // tensor -> index into files_
  std::map<std::string, HfNf4Entry> nf4_;  // NF4 tensors
  std::map<std::string, size_t> nf4_parts_;  // their companion tensors -> index into files_
};

std::unique_ptr<LlamaReader> open_hf_llama(const std::string& path,
                                           const LlamaOverrides& overrides = {});

// transformers' config.json for `s` (LlamaForCausalLM, torch_dtype float32),
// keys sorted, indented by 2, as save_pretrained writes it.
std::string hf_llama_config_json(const LlamaShape& s);

// A tensor to export: HF name, HF shape, numel(shape) floats.
struct LlamaTensorRef {
  std::string name;
  tensor::Shape shape;
  const float* data = nullptr;
};

// Writes `path` (a .safetensors file) and config.json in its directory.
// `tensors` must be exactly llama_tensor_infos(s), in any order: a missing,
// extra or misshapen tensor is an InvalidArgument naming it. IoError on write
// failure.
void write_hf_llama(const std::string& path, const LlamaShape& s,
                    const std::vector<LlamaTensorRef>& tensors);
void write_hf_llama(const std::string& path, const LlamaWeights& w);

}  // namespace po::checkpoint
