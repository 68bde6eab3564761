// Model files in the formats users bring, in one room: which format a path
// holds, the model shape it stores, every parameter in, and out under the
// Hugging Face names. Formats: Hugging Face GPT-2 safetensors, Hugging Face
// Llama (a directory with config.json and shards, or one safetensors file),
// llama2.c checkpoints, GGUF files (GPT-2 and Llama). Each family's names
// and layouts are its own reader's (gpt2_io.h, hf_llama.h, llama2c.h,
// gguf_models.h); this file picks the reader. No run keys are read here: a
// caller's model.* overrides come in as LlamaOverrides.
#pragma once

#include <string>

#include "checkpoint/llama_weights.h"
#include "model/transformer.h"

namespace po::checkpoint {

// Whether `path` holds Llama weights (a directory, a llama2.c .bin, a GGUF file
// whose general.architecture is not gpt2, or a safetensors file with
// model.embed_tokens.weight) rather than GPT-2's.
bool is_llama_weights(const std::string& path);

// The architecture and shapes of the Llama weights at `path`, with
// `overrides` checked against them (a disagreement names the key and tensor).
model::TransformerConfig llama_file_config(const std::string& path, const LlamaOverrides& overrides = {});

// The shapes of any weights file: a Llama's config (llama_file_config), a
// GGUF GPT-2's metadata, or a GPT-2 safetensors' tensors.
model::TransformerConfig weights_file_config(const std::string& path);

// Every parameter of `model` from `path` (GPT-2 or Llama formats; a
// quantized Llama base tensor by tensor; adapters' frozen base). Errors name
// the file and the tensor.
void load_model_weights(const std::string& path, model::Transformer& model);

// Writes the model's parameters under the Hugging Face names of its
// architecture: GPT-2 as one safetensors file at `path`; Llama as a
// safetensors file at `path` with config.json beside it.
void export_model_weights(const std::string& path, const model::Transformer& model);

}  // namespace po::checkpoint
