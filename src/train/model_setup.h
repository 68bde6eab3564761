// The model's configuration and weights at the edge: model.* keys (and, for
// model.init = a Llama file, the file's own shape) into one TransformerConfig,
// and weights in and out in the formats users bring: Hugging Face GPT-2
// safetensors, Hugging Face Llama (a directory with config.json and shards, or
// one safetensors file), llama2.c checkpoints, GGUF files (GPT-2 and Llama).
#pragma once

#include <string>

#include "core/config.h"
#include "model/transformer.h"

namespace po::train {

// Model shapes from model.preset (model.arch picks the architecture's
// defaults), any explicitly set model.* keys, and, when model.init names a
// Llama file, the shape stored there; a set key that disagrees with the file
// is an error naming the key and the tensor.
model::TransformerConfig resolve_model_config(const core::Config& config);
// The [lora] section (lora.r = 0: off); lora.targets empty: PEFT's default
// for the family (GPT-2 c_attn; Llama q_proj v_proj). lora.init = DIR: the
// settings of that PEFT adapter (its adapter_config.json; lora.r, if set,
// must agree).
model::LoraConfig lora_config(const core::Config& config, const std::string& arch);
// model.quant ("" or "none", "nf4", "int8"); an unknown name is an error naming the key.
model::WeightQuant weight_quant(const core::Config& config);
// A model with adapters: its frozen base from model.init (a weights file, or
// the random init of `seed`), fresh adapters on it, or lora.init's PEFT
// adapter. Checkpoints hold the adapters alone: every start does this first.
void load_base_and_adapters(const core::Config& config, model::Transformer& model, uint64_t seed);

// Writes the resolved shape of `m` into `config` as explicit model.* keys, so
// that the config a run stores (config.toml, checkpoints) says what was
// trained without reading model.init's file again (it may have moved).
void store_resolved_model(core::Config& config, const model::TransformerConfig& m);


// The architecture and shapes of the weights at `path` (Llama only), with the
// explicitly set model.* keys of `config` as overrides checked against them
// (checkpoint::llama_file_config; the files themselves: checkpoint/model_io.h).
model::TransformerConfig llama_file_config(const std::string& path, const core::Config* config);



}  // namespace po::train
