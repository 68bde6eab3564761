// Fuzzes SFT data (data/sft.h). The first byte picks the target:
//   even: the input is one JSON Lines record: parse_sft_record, then each
//         chat template's training pieces (a reply must be marked, the
//         rendering must open with BOS);
//   odd:  the input is a loss mask over as many tokens (token i = i mod 50):
//         the examples as rows of T = 1 + (second byte mod 40) tokens, one per
//         row and packed; every row's positions count up from 0 within an
//         example, targets are -1 or the token that follows.
// Bad input may only raise po::core::Error.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/chat_format.h"
#include "data/sft.h"
#include "data/token_file.h"

namespace {

const std::string& scratch_path() {
  static const std::string path = [] {
    char tmpl[] = "/tmp/po_sft_fuzz_XXXXXX";
    const int fd = mkstemp(tmpl);
    if (fd < 0) std::abort();
    close(fd);
    return std::string(tmpl) + ".bin";
  }();
  return path;
}

void fuzz_record(const uint8_t* data, size_t size) {
  const std::string line(reinterpret_cast<const char*>(data), size);
  std::vector<po::data::ChatMessage> msgs;
  try {
    msgs = po::data::parse_sft_record(line, "fuzz:1");
  } catch (const po::core::Error&) {
    return;
  }
  for (const std::string& t : po::data::chat_template_names()) {
    try {
      const auto pieces = po::data::render_chat_pieces(t, msgs, false);
      if (pieces.empty() || pieces.front().kind != po::data::ChatPiece::Kind::kBos) std::abort();
      bool train = false;
      for (const auto& p : pieces) train = train || p.train;
      if (!train) std::abort();
    } catch (const po::core::Error&) {
    }
  }
}

void fuzz_mask(const uint8_t* data, size_t size) {
  if (size < 2) return;
  const int64_t T = 1 + data[0] % 40;
  std::vector<uint8_t> mask(data + 1, data + size);
  std::vector<int32_t> tokens(mask.size());
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i % 50);
  const std::string& path = scratch_path();
  po::data::write_token_file(path, tokens);
  const po::data::TokenFile file(path);
  for (bool pack : {false, true}) {
    try {
      const po::data::SftExamples s(file, mask, T, pack);
      std::vector<int32_t> in(static_cast<size_t>(T)), tg(in.size()), pos(in.size());
      for (int64_t r = 0; r < s.rows(); ++r) {
        s.fill_row(r, in.data(), tg.data(), pos.data());
        for (int64_t t = 0; t < T; ++t) {
          if (pos[t] != 0 && (t == 0 || pos[t] != pos[t - 1] + 1)) std::abort();
          if (tg[t] != -1 && tg[t] != (in[t] + 1) % 50) std::abort();
        }
      }
    } catch (const po::core::Error&) {
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  if (data[0] % 2 == 0)
    fuzz_record(data + 1, size - 1);
  else
    fuzz_mask(data + 1, size - 1);
  return 0;
}
