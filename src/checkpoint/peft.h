// PEFT's LoRA adapter files: a directory of adapter_config.json and
// adapter_model.safetensors (metadata {"format": "pt"}), as
// peft.PeftModel.save_pretrained writes them and from_pretrained reads them.
// Tensor names are "base_model.model." + the Hugging Face module path +
// ".lora_A.weight" [r, in], ".lora_B.weight" [out, r] and (DoRA)
// ".lora_magnitude_vector" [out]; GPT-2's modules sit under "transformer.".
// Our Llama weights are in Hugging Face's layout already, so no tensor is
// permuted (torchtune's exporter permutes q and k's lora_B from Meta's).
#pragma once

#include <string>

#include "model/config.h"
#include "model/transformer.h"

namespace po::checkpoint {

// PEFT's name of the adapter tensor `name` (model::Layout's) of an `arch` model.
std::string peft_name(const std::string& arch, const std::string& name);

// Writes the model's adapters (params()) into `dir` (created), with
// base_model_name_or_path = `base` in the config. Nothing already there is
// destroyed: each file is written atomically.
void write_peft_adapter(const std::string& dir, model::Transformer& model, const std::string& base);

// The adapter settings of dir/adapter_config.json: r, lora_alpha,
// target_modules (a list; PEFT's regex string is refused), use_rslora,
// use_dora. InvalidArgument naming the file and key.
model::LoraConfig read_peft_config(const std::string& dir);

// Reads every adapter tensor of `model` from dir/adapter_model.safetensors
// into params(): each must be there with its shape, and the file may hold no
// other LoRA tensor. InvalidArgument naming the file and the tensor.
void read_peft_adapter(const std::string& dir, model::Transformer& model);

}  // namespace po::checkpoint
