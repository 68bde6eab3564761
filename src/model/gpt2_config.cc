#include "model/gpt2_config.h"

#include <map>

#include "core/error.h"

namespace po::model {
namespace {

struct Preset {
  int64_t n_layer, n_embd, n_head, vocab_size, seq_len;
};

const std::map<std::string, Preset>& presets() {
  static const std::map<std::string, Preset> p = {
      {"gpt2-tiny", {2, 128, 4, 50257, 128}},
      {"gpt2-mini", {4, 256, 4, 50257, 128}},
      {"bench-small", {6, 384, 6, 50257, 256}},
      {"gpt2-124M", {12, 768, 12, 50257, 1024}},
      {"gpt2-medium", {24, 1024, 16, 50257, 1024}},
      {"gpt2-large", {36, 1280, 20, 50257, 1024}},
      {"gpt2-xl", {48, 1600, 25, 50257, 1024}},
  };
  return p;
}

}  // namespace

GPT2Config GPT2Config::preset(const std::string& name) {
  auto it = presets().find(name);
  if (it == presets().end()) {
    std::string names;
    for (const auto& [k, v] : presets()) names += (names.empty() ? "" : ", ") + k;
    PO_THROW(core::InvalidArgument, "model.preset: unknown preset '", name, "' (known: ", names,
             ")");
  }
  const Preset& p = it->second;
  GPT2Config c;
  c.n_layer = p.n_layer;
  c.n_embd = p.n_embd;
  c.n_head = p.n_head;
  c.vocab_size = p.vocab_size;
  c.seq_len = p.seq_len;
  return c;
}

std::vector<std::string> GPT2Config::preset_names() {
  std::vector<std::string> out;
  for (const auto& [k, v] : presets()) out.push_back(k);
  return out;
}

void GPT2Config::validate() const {
  PO_CHECK(n_layer >= 1, "model.n_layer must be >= 1, got ", n_layer);
  PO_CHECK(n_embd >= 1, "model.n_embd must be >= 1, got ", n_embd);
  PO_CHECK(n_head >= 1, "model.n_head must be >= 1, got ", n_head);
  PO_CHECK(n_embd % n_head == 0, "model.n_head = ", n_head, " must divide model.n_embd = ", n_embd);
  PO_CHECK(vocab_size >= 2 && vocab_size <= 65536, "model.vocab_size must be in [2, 65536] ",
           "(token files store uint16), got ", vocab_size);
  PO_CHECK(seq_len >= 1, "model.seq_len must be >= 1, got ", seq_len);
}

int64_t GPT2Config::num_params() const {
  const int64_t C = n_embd;
  const int64_t per_block = 2 * C + 3 * C * C + 3 * C + C * C + C + 2 * C + 4 * C * C + 4 * C +
                            4 * C * C + C;
  return vocab_size * C + seq_len * C + n_layer * per_block + 2 * C;
}

std::vector<int64_t> GPT2Config::unit_numels() const {
  const int64_t C = n_embd;
  std::vector<int64_t> n = {vocab_size * C + seq_len * C};
  for (int64_t l = 0; l < n_layer; ++l) n.push_back(12 * C * C + 13 * C);
  n.push_back(2 * C);
  return n;
}

double GPT2Config::flops_per_token(int64_t T) const {
  return 6.0 * static_cast<double>(num_params()) +
         12.0 * static_cast<double>(n_layer * n_embd * T);
}

}  // namespace po::model
