// GPT-2 weights to and from Hugging Face safetensors (names such as
// "h.0.attn.c_attn.weight", Conv1D weights stored [in, out], optional
// "transformer." prefix on load).
#pragma once

#include <string>

#include "model/transformer.h"

namespace po::checkpoint {

// Loads every parameter of `model` from `path`. A missing tensor, wrong shape
// or dtype is an InvalidArgument naming the file and the tensor. F16/BF16 are
// converted to f32. "lm_head.weight", if present, must equal wte (tied).
void load_gpt2_safetensors(const std::string& path, model::Transformer& model);

// Writes the model's parameters as f32 safetensors under the Hugging Face
// names, atomically; metadata records the shapes.
void save_gpt2_safetensors(const std::string& path, const model::Transformer& model);

}  // namespace po::checkpoint
