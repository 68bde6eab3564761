#include "checkpoint/peft.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/atomic_file.h"
#include "checkpoint/safetensors.h"
#include "core/error.h"

namespace po::checkpoint {
namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

const char* const kConfig = "adapter_config.json";
const char* const kWeights = "adapter_model.safetensors";

std::string shape_text(const tensor::Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// The Hugging Face module names of the model's adapted layers, once each
// ("q_proj", "attn.c_attn"): the suffix after the block index.
std::vector<std::string> target_modules(const model::Layout& layout) {
  std::vector<std::string> out;
  std::set<std::string> seen;
  for (const model::TensorSpec& t : layout.tensors()) {
    if (t.unit != 1) continue;
    const std::string path = t.name.substr(0, t.name.rfind(".lora_"));
    const size_t dot = path.find('.', path.find_first_of("0123456789"));
    const std::string m = path.substr(dot + 1);
    if (seen.insert(m).second) out.push_back(m);
  }
  return out;
}

}  // namespace

std::string peft_name(const std::string& arch, const std::string& name) {
  return std::string("base_model.model.") + (arch == "gpt2" ? "transformer." : "") + name;
}

void write_peft_adapter(const std::string& dir, model::Transformer& model, const std::string& base) {
  const model::Layout& layout = model.layout();
  PO_CHECK(layout.adapters(), "export --adapter: the model has no adapters (lora.r = 0)");
  const model::LoraConfig& lora = model.config().lora;
  std::error_code ec;
  fs::create_directories(dir, ec);
  PO_CHECK(!ec, "--out '", dir, "': cannot create it: ", ec.message());
  std::vector<StTensorRef> refs;
  for (const model::TensorSpec& t : layout.tensors())
    refs.push_back({peft_name(model.config().arch, t.name), StDtype::kF32, t.shape, model.params() + t.offset});
  write_safetensors(dir + "/" + kWeights, refs, {{"format", "pt"}});
  Json c = {{"peft_type", "LORA"},
            {"task_type", "CAUSAL_LM"},
            {"r", lora.r},
            {"lora_alpha", lora.alpha},
            {"target_modules", target_modules(layout)},
            {"lora_dropout", lora.dropout},
            {"use_rslora", lora.rslora},
            {"use_dora", lora.dora},
            {"bias", "none"},
            {"fan_in_fan_out", model.config().arch == "gpt2"},  // GPT-2's Conv1D
            {"init_lora_weights", true},
            {"base_model_name_or_path", base == "random" ? "" : base}};
  const std::string text = c.dump(2) + "\n";
  write_file_atomic(dir + "/" + kConfig, text.data(), text.size());
}

model::LoraConfig read_peft_config(const std::string& dir) {
  const std::string path = dir + "/" + kConfig;
  std::ifstream f(path);
  PO_CHECK(f.good(), "lora.init = '", dir, "': no ", kConfig, " there (a PEFT adapter directory)");
  Json j;
  try {
    j = Json::parse(f);
  } catch (const Json::exception& e) {
    PO_THROW(core::InvalidArgument, path, ": not JSON: ", e.what());
  }
  PO_CHECK(j.is_object(), path, ": not a JSON object");
  const std::string type = j.value("peft_type", "");
  PO_CHECK(type == "LORA", path, ": peft_type is '", type, "', not LORA");
  auto number = [&](const char* key) {
    PO_CHECK(j.contains(key) && j[key].is_number(), path, ": ", key, " is missing or not a number");
    return j[key].get<double>();
  };
  model::LoraConfig l;
  const double r = number("r");
  PO_CHECK(r >= 1 && r == static_cast<double>(static_cast<int64_t>(r)), path, ": r = ", r,
           " is not a positive integer");
  l.r = static_cast<int64_t>(r);
  l.alpha = j.contains("lora_alpha") ? number("lora_alpha") : 8.0;  // PEFT's default
  l.dropout = j.contains("lora_dropout") ? number("lora_dropout") : 0.0;
  l.rslora = j.value("use_rslora", false);
  l.dora = j.value("use_dora", false);
  PO_CHECK(j.contains("target_modules"), path, ": target_modules is missing");
  const Json& t = j["target_modules"];
  PO_CHECK(t.is_array(), path, ": target_modules is ", t.dump(),
           ": a regular expression is not supported, list the module names");
  for (const Json& m : t) {
    PO_CHECK(m.is_string(), path, ": target_modules holds ", m.dump(), ", not a name");
    l.targets.push_back(m.get<std::string>());
  }
  PO_CHECK(!l.targets.empty(), path, ": target_modules is empty");
  return l;
}

void read_peft_adapter(const std::string& dir, model::Transformer& model) {
  const std::string path = dir + "/" + kWeights;
  const SafetensorsReader f = SafetensorsReader::open(path);
  std::set<std::string> wanted;
  for (const model::TensorSpec& t : model.layout().tensors()) {
    const std::string name = peft_name(model.config().arch, t.name);
    wanted.insert(name);
    PO_CHECK(f.has(name), path, ": no tensor ", name, " (the adapter holds other modules, or ",
             "was made for another model)");
    const StTensor& s = f.get(name);
    PO_CHECK(s.shape == t.shape, path, ": ", name, " is ", shape_text(s.shape), ", the model's is ",
             shape_text(t.shape), " (r = ", model.config().lora.r, " from ", kConfig,
             "; another r or another model's shape)");
    f.read_f32(name, t.shape, model.params() + t.offset);
  }
  for (const std::string& n : f.names())
    PO_CHECK(wanted.count(n) || n.find(".lora_") == std::string::npos, path, ": ", n,
             " adapts no module of this model (made for another architecture or depth?)");
}

}  // namespace po::checkpoint
