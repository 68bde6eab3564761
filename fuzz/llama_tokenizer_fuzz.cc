// Fuzzes the Llama tokenizer's three file readers (HF tokenizer.json, llama2.c
// tokenizer.bin, SentencePiece tokenizer.model: data/sentencepiece_model.h's
// protobuf reader) and, when one loads, encode/decode on a slice of the input.
// The first byte picks the reader (mod 3: json, bin, model); the rest is the
// file. Bad input may only
// raise po::core::Error; a decoded encoding must reproduce valid UTF-8 text.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "core/error.h"
#include "data/llama_tokenizer.h"

namespace {

const std::string& scratch_path() {
  static const std::string path = [] {
    char tmpl[] = "/tmp/po_tok_fuzz_XXXXXX";
    const int fd = mkstemp(tmpl);
    if (fd < 0) std::abort();
    close(fd);
    return std::string(tmpl);
  }();
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string& path = scratch_path();
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (size > 1 && std::fwrite(data + 1, 1, size - 1, f) != size - 1) std::abort();
  std::fclose(f);
  try {
    using po::data::LlamaTokenizer;
    LlamaTokenizer tok = data[0] % 3 == 1   ? LlamaTokenizer::from_llama2c_bin(path)
                         : data[0] % 3 == 2 ? LlamaTokenizer::from_sentencepiece(path)
                                            : LlamaTokenizer::from_hf_json(path);
    const std::string_view text(reinterpret_cast<const char*>(data + 1),
                                std::min<size_t>(size - 1, 256));
    const std::vector<int32_t> ids = tok.encode(text, "fuzz");
    for (int32_t id : ids)
      if (id < 0 || id >= tok.vocab_size()) std::abort();
    (void)tok.decode(ids);
  } catch (const po::core::Error&) {
  }
  return 0;
}
