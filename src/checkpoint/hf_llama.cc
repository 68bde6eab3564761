// See hf_llama.h. Opening resolves the shape from config.json, the tensors and
// the caller's overrides, each against the others, then checks every tensor's
// presence, shape and dtype, so a model that opens reads without surprises.
#include "checkpoint/hf_llama.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "backend/quant_map.h"
#include "checkpoint/atomic_file.h"
#include "core/error.h"

namespace po::checkpoint {
namespace {

using Json = nlohmann::json;

constexpr const char* kConfig = "config.json";
constexpr const char* kIndex = "model.safetensors.index.json";
constexpr const char* kSingle = "model.safetensors";

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string dir_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : path.substr(0, slash == 0 ? 1 : slash);
}

std::string join(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

Json read_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) PO_THROW(core::IoError, path, ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    Json j = Json::parse(ss.str());
    PO_CHECK(j.is_object(), path, ": not a JSON object");
    return j;
  } catch (const Json::exception& e) {
    PO_THROW(core::InvalidArgument, path, ": not valid JSON: ", e.what());
  }
}

// config.json's fields, each absent when the file (or the key) is.
struct ConfigValues {
  std::string path;  // "" when there is no config.json
  Json j;
  std::optional<int64_t> integer(const char* key) const {
    if (path.empty() || !j.contains(key) || j[key].is_null()) return std::nullopt;
    PO_CHECK(j[key].is_number_integer(), path, ": ", key, " = ", j[key].dump(), " is not an integer");
    return j[key].get<int64_t>();
  }
  std::optional<double> number(const char* key) const {
    if (path.empty() || !j.contains(key) || j[key].is_null()) return std::nullopt;
    PO_CHECK(j[key].is_number(), path, ": ", key, " = ", j[key].dump(), " is not a number");
    return j[key].get<double>();
  }
  std::optional<bool> boolean(const char* key) const {
    if (path.empty() || !j.contains(key) || j[key].is_null()) return std::nullopt;
    PO_CHECK(j[key].is_boolean(), path, ": ", key, " = ", j[key].dump(), " is not true or false");
    return j[key].get<bool>();
  }
  // "config.json " when there is one, for messages.
  std::string prefix() const { return path.empty() ? "" : std::string(kConfig) + " "; }
};

std::optional<RopeScaling> parse_rope_scaling(const ConfigValues& c) {
  if (c.path.empty() || !c.j.contains("rope_scaling") || c.j["rope_scaling"].is_null())
    return std::nullopt;
  const Json& r = c.j["rope_scaling"];
  PO_CHECK(r.is_object(), c.path, ": rope_scaling is not an object");
  std::string type = r.contains("rope_type") ? r["rope_type"].dump()
                     : r.contains("type")    ? r["type"].dump()
                                             : "";
  PO_CHECK(type == "\"llama3\"", c.path, ": rope_scaling type ", type.empty() ? "(none)" : type,
           " is not supported (only \"llama3\")");
  RopeScaling s;
  auto num = [&](const char* key) {
    PO_CHECK(r.contains(key) && r[key].is_number(), c.path, ": rope_scaling.", key,
             " is missing or not a number");
    return r[key].get<double>();
  };
  s.factor = num("factor");
  s.low_freq_factor = num("low_freq_factor");
  s.high_freq_factor = num("high_freq_factor");
  PO_CHECK(r.contains("original_max_position_embeddings") &&
               r["original_max_position_embeddings"].is_number_integer(),
           c.path, ": rope_scaling.original_max_position_embeddings is missing or not an integer");
  s.original_max_position_embeddings = r["original_max_position_embeddings"].get<int64_t>();
  return s;
}

// Maps the files of `path` and which holds what (rotary_emb.inv_freq dropped).
void map_files(const std::string& path, bool dir, const std::string& base,
               std::vector<SafetensorsReader>& files, std::map<std::string, size_t>& where) {
  if (!dir) {
    files.push_back(SafetensorsReader::open(path));
  } else if (exists(join(base, kIndex))) {
    const std::string index_path = join(base, kIndex);
    Json index = read_json(index_path);
    PO_CHECK(index.contains("weight_map") && index["weight_map"].is_object(), index_path,
             ": no \"weight_map\" object");
    std::map<std::string, size_t> shard_index;
    for (const auto& [name, file] : index["weight_map"].items()) {
      PO_CHECK(file.is_string(), index_path, ": weight_map['", name, "'] is not a file name");
      const std::string shard = file.get<std::string>();
      PO_CHECK(!shard.empty() && shard.find('/') == std::string::npos, index_path,
               ": weight_map['", name, "'] = \"", shard, "\" is not a file name in the directory");
      auto it = shard_index.find(shard);
      if (it == shard_index.end()) {
        const std::string shard_path = join(base, shard);
        if (!exists(shard_path))
          PO_THROW(core::IoError, index_path, ": shard ", shard, " (holding '", name,
                   "') is missing: no ", shard_path);
        files.push_back(SafetensorsReader::open(shard_path));
        it = shard_index.emplace(shard, files.size() - 1).first;
      }
      PO_CHECK(files[it->second].has(name), index_path, ": weight_map puts '", name, "' in ",
               shard, ", which has no such tensor");
      where[name] = it->second;
    }
  } else if (exists(join(base, kSingle))) {
    files.push_back(SafetensorsReader::open(join(base, kSingle)));
  } else {
    PO_THROW(core::IoError, path, ": neither ", kSingle, " nor ", kIndex, " in the directory");
  }
  if (where.empty())
    for (const auto& name : files[0].names()) where[name] = 0;
  for (auto it = where.begin(); it != where.end();)
    it = ends_with(it->first, ".rotary_emb.inv_freq") ? where.erase(it) : std::next(it);
}

constexpr const char* kNf4State = ".quant_state.bitsandbytes__nf4";
constexpr const char* kNf4Parts[] = {".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", kNf4State};

// bitsandbytes' NF4 tensors (Linear4bit's state dict): each one's quant_state
// JSON read into `nf4` (its logical shape, its offset) and its companion
// tensors moved from `where` to `parts`.
void find_nf4(const std::vector<SafetensorsReader>& files, std::map<std::string, size_t>& where,
              std::map<std::string, HfNf4Entry>& nf4, std::map<std::string, size_t>& parts) {
  for (const auto& entry : where) {
    const std::string& name = entry.first;  // (a plain reference: lambdas below capture it)
    const size_t idx = entry.second;
    PO_CHECK(!ends_with(name, ".quant_state.bitsandbytes__fp4"), files[idx].origin(), ": tensor '", name,
             "': bitsandbytes' FP4 is not supported (NF4 is)");
    if (!ends_with(name, kNf4State)) continue;
    const std::string w = name.substr(0, name.size() - std::string(kNf4State).size());
    const StTensor& t = files[idx].get(name);
    const std::string& f = files[idx].origin();
    PO_CHECK(t.dtype == StDtype::kU8, f, ": tensor '", name, "' is ", st_dtype_name(t.dtype),
             ": a quant_state is JSON in U8 bytes");
    const Json j = Json::parse(std::string(reinterpret_cast<const char*>(t.data), t.nbytes), nullptr, false);
    PO_CHECK(j.is_object(), f, ": tensor '", name, "' is not a JSON object");
    auto get = [&](const char* key) -> const Json& {
      PO_CHECK(j.contains(key), f, ": tensor '", name, "' has no \"", key, "\"");
      return j[key];
    };
    PO_CHECK(get("quant_type") == "nf4", f, ": tensor '", name, "': quant_type ", get("quant_type").dump(),
             ", expected \"nf4\"");
    PO_CHECK(get("blocksize") == backend::kNf4Block, f, ": tensor '", name, "': blocksize ",
             get("blocksize").dump(), ", expected ", backend::kNf4Block);
    PO_CHECK(j.contains("nested_blocksize"), f, ": tensor '", name,
             "' is not double-quantized (bnb_4bit_use_double_quant = false): not supported");
    PO_CHECK(get("nested_blocksize") == backend::kNf4NestedBlock, f, ": tensor '", name, "': nested_blocksize ",
             get("nested_blocksize").dump(), ", expected ", backend::kNf4NestedBlock);
    const Json& shape = get("shape");
    PO_CHECK(shape.is_array() && shape.size() == 2 && shape[0].is_number_integer() && shape[1].is_number_integer() &&
                 shape[0].get<int64_t>() > 0 && shape[1].get<int64_t>() > 0,
             f, ": tensor '", name, "': shape ", shape.dump(), " is not [rows, columns]");
    PO_CHECK(get("nested_offset").is_number(), f, ": tensor '", name, "': nested_offset is not a number");
    nf4[w] = {{shape[0].get<int64_t>(), shape[1].get<int64_t>()}, static_cast<float>(get("nested_offset").get<double>())};
  }
  for (const auto& [w, e] : nf4) {
    PO_CHECK(where.count(w) != 0, files[where.at(w + kNf4State)].origin(), ": '", w, kNf4State,
             "' without the tensor '", w, "' it describes");
    for (const char* part : kNf4Parts) {
      auto it = where.find(w + part);
      PO_CHECK(it != where.end(), files[where.at(w)].origin(), ": NF4 tensor '", w, "' has no '", w, part, "'");
      parts[it->first] = it->second;
      where.erase(it);
    }
  }
}

// The fields the tensors state (sizes, layers, kv heads) and the head count,
// config.json checked against the tensors and the overrides against both.
void resolve_tensor_fields(const std::string& path, const ConfigValues& c, const LlamaOverrides& ov,
                           const std::vector<SafetensorsReader>& files,
                           const std::map<std::string, size_t>& where,
                           const std::map<std::string, HfNf4Entry>& nf4, LlamaShape& s) {
  const std::string cfg = c.prefix();
  // What the tensors state (an NF4 tensor: the shape its quant_state gives).
  struct Seen {
    tensor::Shape shape;
  };
  auto tensor = [&](const std::string& name) -> Seen {
    auto it = where.find(name);
    PO_CHECK(it != where.end(), path, ": missing tensor '", name, "'");
    if (auto q = nf4.find(name); q != nf4.end()) return {q->second.shape};
    const StTensor& t = files[it->second].get(name);
    PO_CHECK(t.shape.size() == 2, files[it->second].origin(), ": tensor '", name,
             "' has shape ", tensor::shape_str(t.shape), ", expected 2 dimensions");
    return {t.shape};
  };
  const Seen emb = tensor("model.embed_tokens.weight");
  int64_t n_layer_t = 0;
  for (const auto& [name, _] : where) {
    if (name.rfind("model.layers.", 0) != 0) continue;
    const std::string rest = name.substr(13);
    const size_t dot = rest.find('.');
    try {
      size_t used = 0;
      const int64_t l = std::stoll(rest.substr(0, dot), &used);
      if (used == dot && l >= 0 && l < (int64_t{1} << 30)) n_layer_t = std::max(n_layer_t, l + 1);
    } catch (const std::exception&) {
    }
  }
  PO_CHECK(n_layer_t > 0, path, ": no model.layers.N tensors");
  const Seen gate = tensor("model.layers.0.mlp.gate_proj.weight");
  const Seen q = tensor("model.layers.0.self_attn.q_proj.weight");
  const Seen k = tensor("model.layers.0.self_attn.k_proj.weight");

  // config.json against the tensors, then the overrides against both.
  auto resolve = [&](const char* key, const char* ov_key, const std::optional<int64_t>& ov_value,
                     int64_t tensor_value, const std::string& tensor_evidence) {
    std::optional<int64_t> cv = c.integer(key);
    PO_CHECK(!cv || *cv == tensor_value, c.path, ": ", key, " = ", *cv, " but ", tensor_evidence);
    detail::override_must_match(path, ov_key, ov_value, tensor_value,
                                cv ? core::str_cat(cfg, key, " = ", *cv) : tensor_evidence);
    return tensor_value;
  };
  s.dim = resolve("hidden_size", "model.n_embd", ov.dim, emb.shape[1],
                  core::str_cat("model.embed_tokens.weight has ", emb.shape[1], " columns"));
  s.vocab_size = resolve("vocab_size", "model.vocab_size", ov.vocab_size, emb.shape[0],
                         core::str_cat("model.embed_tokens.weight has ", emb.shape[0], " rows"));
  s.hidden_dim = resolve("intermediate_size", "model.ffn_hidden", ov.hidden_dim, gate.shape[0],
                         core::str_cat("model.layers.0.mlp.gate_proj.weight has ", gate.shape[0], " rows"));
  s.n_layer = resolve("num_hidden_layers", "model.n_layer", ov.n_layer, n_layer_t,
                      core::str_cat("the tensors have layers 0..", n_layer_t - 1));

  // Heads: the tensors cannot tell, config.json or the caller must.
  std::optional<int64_t> heads = c.integer("num_attention_heads");
  if (heads) {
    detail::override_must_match(path, "model.n_head", ov.n_head, *heads,
                                core::str_cat(cfg, "num_attention_heads = ", *heads));
  } else {
    heads = ov.n_head;
    PO_CHECK(heads.has_value(), path, ": the number of attention heads cannot be read from the "
             "tensors: give model.n_head, or put a config.json with num_attention_heads beside the file");
  }
  s.n_head = *heads;
  PO_CHECK(s.n_head > 0 && s.dim % s.n_head == 0, path, ": hidden_size ", s.dim,
           " is not divisible by ", c.integer("num_attention_heads") ? "num_attention_heads " : "model.n_head ",
           s.n_head);
  const int64_t hs = s.dim / s.n_head;
  if (auto hd = c.integer("head_dim"))
    PO_CHECK(*hd == hs, c.path, ": head_dim = ", *hd, " but hidden_size / num_attention_heads = ",
             hs, ": a separate head_dim is not supported");
  PO_CHECK(q.shape[0] == s.dim, path, ": model.layers.0.self_attn.q_proj.weight has ", q.shape[0],
           " rows, expected hidden_size ", s.dim, " (", s.n_head, " heads of ", hs, ")");
  PO_CHECK(k.shape[0] % hs == 0, path, ": model.layers.0.self_attn.k_proj.weight has ", k.shape[0],
           " rows, not a multiple of the head size ", hs);
  const int64_t kv_t = k.shape[0] / hs;
  const std::string kv_evidence = core::str_cat("model.layers.0.self_attn.k_proj.weight has ",
                                                k.shape[0], " rows = ", kv_t, " kv heads of ", hs);
  std::optional<int64_t> kv_c = c.integer("num_key_value_heads");
  if (!kv_c && c.integer("num_attention_heads")) kv_c = s.n_head;  // LlamaConfig's default
  PO_CHECK(!kv_c || *kv_c == kv_t, c.path, ": num_key_value_heads = ", *kv_c,
           c.integer("num_key_value_heads") ? "" : " (absent: num_attention_heads)", " but ",
           kv_evidence);
  detail::override_must_match(path, "model.n_kv_head", ov.n_kv_head, kv_t,
                              kv_c ? core::str_cat(cfg, "num_key_value_heads = ", *kv_c) : kv_evidence);
  s.n_kv_head = kv_t;

}

// The tie (config.json, else the missing lm_head) and the fields only
// config.json states. A tied model's stored lm_head is dropped from `where`.
void resolve_config_fields(const std::string& path, const ConfigValues& c, const LlamaOverrides& ov,
                           std::map<std::string, size_t>& where, LlamaShape& s) {
  const std::string cfg = c.prefix();
  const bool has_head = where.count("lm_head.weight") != 0;
  // Tie: config.json says (default false), else the missing lm_head does.
  std::optional<bool> tie_c = c.boolean("tie_word_embeddings");
  if (!c.path.empty() && !tie_c) tie_c = false;
  if (tie_c) {
    PO_CHECK(*tie_c || has_head, c.path, ": tie_word_embeddings = false",
             c.boolean("tie_word_embeddings") ? "" : " (absent)", " but lm_head.weight is missing");
    if (*tie_c) where.erase("lm_head.weight");
  }
  s.tie_word_embeddings = tie_c ? *tie_c : !has_head;
  detail::override_must_match(
      path, "model.tie_embeddings", ov.tie_word_embeddings, s.tie_word_embeddings,
      c.boolean("tie_word_embeddings")
          ? core::str_cat(cfg, "tie_word_embeddings = ", s.tie_word_embeddings ? "true" : "false")
          : std::string(has_head ? "lm_head.weight is present" : "lm_head.weight is absent"));

  // Fields only config.json states.
  if (auto eps = c.number("rms_norm_eps")) {
    detail::override_must_match(path, "model.norm_eps", ov.rms_norm_eps, *eps,
                                core::str_cat(cfg, "rms_norm_eps = ", *eps));
    s.rms_norm_eps = *eps;
  } else {
    s.rms_norm_eps = ov.rms_norm_eps.value_or(1e-6);
  }
  if (auto theta = c.number("rope_theta")) {
    detail::override_must_match(path, "model.rope_theta", ov.rope_theta, *theta,
                                core::str_cat(cfg, "rope_theta = ", *theta));
    s.rope_theta = *theta;
  } else {
    s.rope_theta = ov.rope_theta.value_or(10000.0);
  }
  if (auto pos = c.integer("max_position_embeddings")) {
    s.max_seq_len = *pos;
    detail::apply_seq_len_override(path, ov.max_seq_len, &s.max_seq_len,
                                   core::str_cat(cfg, "max_position_embeddings = ", *pos));
  } else {
    s.max_seq_len = ov.max_seq_len.value_or(2048);
  }
  s.rope_scaling = parse_rope_scaling(c);
}

// Every tensor of the model: present, shaped, of a float dtype; nothing else.
void check_tensors(const std::string& path, const std::vector<LlamaTensorInfo>& tensors,
                   const std::vector<SafetensorsReader>& files,
                   const std::map<std::string, size_t>& where,
                   const std::map<std::string, HfNf4Entry>& nf4, const LlamaShape& s) {
  std::set<std::string> expected;
  for (const auto& info : tensors) {
    expected.insert(info.name);
    auto it = where.find(info.name);
    PO_CHECK(it != where.end(), path, ": missing tensor '", info.name, "'");
    const SafetensorsReader& f = files[it->second];
    const StTensor& t = f.get(info.name);
    if (auto q = nf4.find(info.name); q != nf4.end()) {  // codes, two to a byte
      const int64_t n = tensor::shape_numel(q->second.shape);
      PO_CHECK(q->second.shape == info.shape, f.origin(), ": NF4 tensor '", info.name, "' has shape ",
               tensor::shape_str(q->second.shape), " in its quant_state, expected ", tensor::shape_str(info.shape));
      PO_CHECK(t.dtype == StDtype::kU8 && t.numel() == (n + 1) / 2, f.origin(), ": NF4 tensor '", info.name,
               "' holds ", t.numel(), " ", st_dtype_name(t.dtype), " values, expected ", (n + 1) / 2,
               " U8 bytes of codes for ", n, " weights");
      continue;
    }
    PO_CHECK(t.shape == info.shape, f.origin(), ": tensor '", info.name, "' has shape ",
             tensor::shape_str(t.shape), ", expected ", tensor::shape_str(info.shape),
             " (hidden_size ", s.dim, ", intermediate_size ", s.hidden_dim, ", ", s.n_head,
             " heads, ", s.n_kv_head, " kv heads, vocab ", s.vocab_size, ")");
    PO_CHECK(t.dtype == StDtype::kF32 || t.dtype == StDtype::kBF16 || t.dtype == StDtype::kF16,
             f.origin(), ": tensor '", info.name, "' has dtype ", st_dtype_name(t.dtype),
             "; F32, BF16 or F16 expected");
  }
  for (const auto& [name, idx] : where)
    PO_CHECK(expected.count(name) != 0, files[idx].origin(), ": unexpected tensor '", name,
             "': not part of a Llama of this shape (", s.n_layer, " layers, no biases)");
}

}  // namespace

std::unique_ptr<HfLlamaReader> HfLlamaReader::open(const std::string& path,
                                                   const LlamaOverrides& ov) {
  const bool dir = is_directory(path);
  std::unique_ptr<HfLlamaReader> r(
      new HfLlamaReader(dir ? LlamaFormat::kHfDirectory : LlamaFormat::kSafetensors, path));
  const std::string base = dir ? path : dir_of(path);
  map_files(path, dir, base, r->files_, r->where_);
  ConfigValues c;
  if (exists(join(base, kConfig))) {
    c.path = join(base, kConfig);
    c.j = read_json(c.path);
  }
  find_nf4(r->files_, r->where_, r->nf4_, r->nf4_parts_);
  LlamaShape s;
  resolve_tensor_fields(path, c, ov, r->files_, r->where_, r->nf4_, s);
  resolve_config_fields(path, c, ov, r->where_, s);
  r->set_shape(s);
  check_tensors(path, r->tensors(), r->files_, r->where_, r->nf4_, s);
  return r;
}

const SafetensorsReader& HfLlamaReader::file_of(const std::string& name) const {
  shape_of(name);  // the model's tensor?
  return files_[where_.at(name)];
}

void HfLlamaReader::read(const std::string& name, float* dst) const {
  if (is_nf4(name)) return backend::dequantize_nf4(read_nf4(name), dst);
  file_of(name).read_f32(name, shape_of(name), dst);
}

backend::Nf4Tensor HfLlamaReader::read_nf4(const std::string& name) const {
  auto e = nf4_.find(name);
  PO_CHECK(e != nf4_.end(), origin(), ": tensor '", name, "' is not stored as bitsandbytes' NF4");
  const int64_t n = tensor::shape_numel(e->second.shape);
  backend::Nf4Tensor t;
  t.numel = n;
  t.offset = e->second.offset;
  const int64_t blocks = t.blocks(), nested = (blocks + backend::kNf4NestedBlock - 1) / backend::kNf4NestedBlock;
  const SafetensorsReader& wf = file_of(name);
  const StTensor& codes = wf.get(name);
  const auto* c = reinterpret_cast<const uint8_t*>(codes.data);
  t.codes.assign(c, c + codes.nbytes);
  auto part = [&](const char* suffix) -> const SafetensorsReader& { return files_[nf4_parts_.at(name + suffix)]; };
  const StTensor& absmax = part(".absmax").require(name + ".absmax", StDtype::kU8, {blocks});
  const auto* a = reinterpret_cast<const uint8_t*>(absmax.data);
  t.absmax_codes.assign(a, a + blocks);
  t.nested_absmax = part(".nested_absmax").read_f32(name + ".nested_absmax", {nested});
  // The maps the codes index: bitsandbytes' (then the engine decodes with its own).
  const std::vector<float> nf4 = part(".quant_map").read_f32(name + ".quant_map", {16});
  const std::vector<float> want = backend::nf4_map();
  for (size_t i = 0; i < 16; ++i)
    PO_CHECK(nf4[i] == want[i], part(".quant_map").origin(), ": tensor '", name, ".quant_map' value ", i, " is ",
             nf4[i], ", bitsandbytes' NF4 map has ", want[i]);
  const std::vector<float> dyn = part(".nested_quant_map").read_f32(name + ".nested_quant_map", {256});
  const backend::Codebook& signed8 = backend::codebook(backend::QuantMap::kSigned8);
  for (size_t i = 0; i < 256; ++i) {
    int32_t x = 0, y = 0;
    std::memcpy(&x, &dyn[i], 4);
    std::memcpy(&y, &signed8.value[i], 4);
    PO_CHECK(std::abs(static_cast<int64_t>(x) - y) <= 2, part(".nested_quant_map").origin(), ": tensor '", name,
             ".nested_quant_map' value ", i, " is ", dyn[i], ", bitsandbytes' signed dynamic map has ",
             signed8.value[i]);
  }
  return t;
}

std::unique_ptr<LlamaReader> open_hf_llama(const std::string& path, const LlamaOverrides& overrides) {
  return HfLlamaReader::open(path, overrides);
}

std::string hf_llama_config_json(const LlamaShape& s) {
  Json j = Json::object();  // std::map: keys sorted, as json.dumps(sort_keys=True)
  j["architectures"] = Json::array({"LlamaForCausalLM"});
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["head_dim"] = s.head_dim();
  j["hidden_act"] = "silu";
  j["hidden_size"] = s.dim;
  j["initializer_range"] = 0.02;
  j["intermediate_size"] = s.hidden_dim;
  j["max_position_embeddings"] = s.max_seq_len;
  j["mlp_bias"] = false;
  j["model_type"] = "llama";
  j["num_attention_heads"] = s.n_head;
  j["num_hidden_layers"] = s.n_layer;
  j["num_key_value_heads"] = s.n_kv_head;
  j["pretraining_tp"] = 1;
  j["rms_norm_eps"] = s.rms_norm_eps;
  if (s.rope_scaling) {
    const RopeScaling& r = *s.rope_scaling;
    j["rope_scaling"] = {{"factor", r.factor},
                         {"high_freq_factor", r.high_freq_factor},
                         {"low_freq_factor", r.low_freq_factor},
                         {"original_max_position_embeddings", r.original_max_position_embeddings},
                         {"rope_type", "llama3"}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["rope_theta"] = s.rope_theta;
  j["tie_word_embeddings"] = s.tie_word_embeddings;
  j["torch_dtype"] = "float32";
  j["use_cache"] = true;
  j["vocab_size"] = s.vocab_size;
  return j.dump(2) + "\n";
}

void write_hf_llama(const std::string& path, const LlamaShape& s,
                    const std::vector<LlamaTensorRef>& tensors) {
  llama_shape_check(s, path);
  std::map<std::string, const LlamaTensorRef*> given;
  for (const auto& t : tensors)
    PO_CHECK(given.emplace(t.name, &t).second, path, ": tensor '", t.name, "' given twice");
  std::vector<StTensorRef> refs;
  for (const auto& info : llama_tensor_infos(s)) {
    auto it = given.find(info.name);
    PO_CHECK(it != given.end(), path, ": missing tensor '", info.name, "'");
    PO_CHECK(it->second->shape == info.shape, path, ": tensor '", info.name, "' has shape ",
             tensor::shape_str(it->second->shape), ", expected ", tensor::shape_str(info.shape));
    PO_CHECK(it->second->data != nullptr, path, ": tensor '", info.name, "' has no data");
    refs.push_back({info.name, StDtype::kF32, info.shape, it->second->data});
    given.erase(it);
  }
  PO_CHECK(given.empty(), path, ": unexpected tensor '", given.empty() ? "" : given.begin()->first,
           "': not part of a Llama of this shape");
  write_safetensors_hf(path, refs, {{"format", "pt"}});
  const std::string config = hf_llama_config_json(s);
  write_file_atomic(join(dir_of(path), kConfig), config.data(), config.size());
}

void write_hf_llama(const std::string& path, const LlamaWeights& w) {
  std::vector<LlamaTensorRef> refs;
  for (const auto& [name, t] : w.tensors) refs.push_back({name, t.shape, t.values.data()});
  write_hf_llama(path, w.shape, refs);
}

}  // namespace po::checkpoint
