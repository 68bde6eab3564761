// Fuzzes the Hugging Face Llama reader on one model.safetensors (beside a
// fixed config.json: 1 layer, 64 wide, 4 heads, 2 kv heads, MLP 176,
// vocabulary 32), "-bnb-4bit" checkpoints included: the quant_state JSON, the
// NF4 companions and their maps. Bad input may only raise po::core::Error; a
// file that opens must read every tensor with its declared shape, and an NF4
// tensor's codes and scales must have the sizes its shape implies.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/hf_llama.h"
#include "core/error.h"

namespace {

std::string work_dir() {
  static const std::string dir = [] {
    char tmpl[] = "/tmp/hf_llama_fuzz.XXXXXX";
    const char* d = mkdtemp(tmpl);
    if (d == nullptr) std::abort();
    std::ofstream(std::string(d) + "/config.json")
        << R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 176,
              "max_position_embeddings": 32, "model_type": "llama", "num_attention_heads": 4,
              "num_hidden_layers": 1, "num_key_value_heads": 2, "rms_norm_eps": 1e-05,
              "rope_theta": 10000.0, "tie_word_embeddings": false, "vocab_size": 32})";
    return std::string(d);
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string file = work_dir() + "/model.safetensors";
  {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  std::unique_ptr<po::checkpoint::HfLlamaReader> r;
  try {
    r = po::checkpoint::HfLlamaReader::open(work_dir());
  } catch (const po::core::Error&) {
    return 0;
  }
  for (const auto& t : r->tensors()) {
    try {
      const std::vector<float> v = r->read(t.name);
      if (static_cast<int64_t>(v.size()) != po::tensor::shape_numel(t.shape)) std::abort();
      if (!r->is_nf4(t.name)) continue;
      const po::backend::Nf4Tensor q = r->read_nf4(t.name);
      if (q.numel != po::tensor::shape_numel(t.shape)) std::abort();
      if (static_cast<int64_t>(q.codes.size()) != (q.numel + 1) / 2) std::abort();
      if (static_cast<int64_t>(q.absmax_codes.size()) != q.blocks()) std::abort();
    } catch (const po::core::Error&) {
      // a companion tensor of the wrong dtype or shape, a map not bitsandbytes'
    }
  }
  return 0;
}
