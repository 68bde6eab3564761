// load_tokenizer(): see text_tokenizer.h.
#include "data/text_tokenizer.h"

#include <filesystem>

#include "core/error.h"
#include "data/llama_tokenizer.h"
#include "data/tokenizer.h"

namespace po::data {
namespace fs = std::filesystem;

std::unique_ptr<TextTokenizer> load_tokenizer(const std::string& path) {
  if (path.empty()) return std::make_unique<Tokenizer>(Tokenizer::load(""));
  std::error_code ec;
  const fs::path p(path);
  if (fs::is_directory(p, ec)) {
    if (fs::is_regular_file(p / "tokenizer.json", ec))
      return std::make_unique<LlamaTokenizer>(LlamaTokenizer::from_hf_json((p / "tokenizer.json").string()));
    if (fs::is_regular_file(p / "tokenizer.bin", ec))
      return std::make_unique<LlamaTokenizer>(LlamaTokenizer::from_llama2c_bin((p / "tokenizer.bin").string()));
    if (fs::is_regular_file(p / "tokenizer.model", ec))
      return std::make_unique<LlamaTokenizer>(LlamaTokenizer::from_sentencepiece((p / "tokenizer.model").string()));
    return std::make_unique<Tokenizer>(Tokenizer::load(path));
  }
  PO_CHECK(fs::exists(p, ec), "tokenizer ", path, " does not exist");
  const std::string name = p.filename().string();
  const std::string ext = p.extension().string();
  if (name == "encoder.json" || name == "vocab.bpe") {
    const fs::path dir = p.parent_path().empty() ? fs::path(".") : p.parent_path();
    return std::make_unique<Tokenizer>(Tokenizer(TokenizerFiles{(dir / "encoder.json").string(), (dir / "vocab.bpe").string()}));
  }
  if (ext == ".json") return std::make_unique<LlamaTokenizer>(LlamaTokenizer::from_hf_json(path));
  if (ext == ".bin") return std::make_unique<LlamaTokenizer>(LlamaTokenizer::from_llama2c_bin(path));
  if (ext == ".model") return std::make_unique<LlamaTokenizer>(LlamaTokenizer::from_sentencepiece(path));
  PO_THROW(core::InvalidArgument, "tokenizer ", path,
           ": unknown kind of file (expected a tokenizer.json, a llama2.c tokenizer.bin, a SentencePiece "
           "tokenizer.model, GPT-2's encoder.json or vocab.bpe, or a directory holding one of them)");
}

}  // namespace po::data
