// Supervised fine-tuning data: `pagedoptim prepare --sft FILE.jsonl`, and the
// sequences training makes of it.
//
// Input: JSON Lines, one record per line (blank lines skipped), either
//   {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
// or {"prompt": "...", "completion": "..."} (one user turn and its reply).
// Each record is rendered with a chat template (data/chat_format.h; by
// default llama2 for a Llama tokenizer, plain for GPT-2's) and tokenized
// piece by piece into one example. The output is DIR/train.bin and
// DIR/val.bin (token files) with DIR/train.mask and DIR/val.mask beside them
// (token_file.h): kMaskLoss on the replies' tokens (and the EOS closing a
// reply), the only targets the loss counts; kMaskStart on each example's
// first token. Record d goes to val iff floor((d+1)·f) > floor(d·f), as
// prepare's documents. A record without a reply, or one whose reply
// tokenizes to nothing, is an error naming the file and line.
//
// Training (data.train naming a token file with a mask beside it): a
// sequence is one example in a row of T tokens, padded (data.pack = false),
// or a row of T tokens holding whole examples one after another in file
// order (data.pack = true; a new row starts when the next example does not
// fit), each at positions 0, 1, ... (Transformer::set_positions). An example
// longer than T is cut to its first T tokens. A token's target is the next
// token of its example where the mask counts it, else ops::kIgnoreTarget.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "data/chat_format.h"
#include "data/token_file.h"

namespace po::data {

// A target the loss skips: the kernels' ops::kIgnoreTarget (the data layer
// sits below the backend; train/ checks the two agree).
inline constexpr int32_t kIgnoreTarget = -1;

struct SftOptions {
  std::string input;          // the .jsonl file
  std::string out_dir;        // created if missing
  double val_fraction = 0.1;  // in [0, 1)
  std::string chat_template;  // "" picks by the tokenizer (see above)
  std::string tokenizer_root, tokenizer;  // as PrepareOptions's
};

struct SftResult {
  std::string train_path, val_path, chat_template;
  int64_t train_examples = 0, val_examples = 0;
  int64_t train_tokens = 0, val_tokens = 0;
  int64_t train_loss_tokens = 0, val_loss_tokens = 0;  // tokens the loss counts
};

// How many of `targets` the loss counts (those not kIgnoreTarget).
int64_t counted_targets(std::span<const int32_t> targets);

// One record's messages (a line of the input; `where` is "FILE:LINE" for
// messages). Throws InvalidArgument: not JSON, not an object, no messages
// nor prompt and completion, a field of the wrong type, no assistant turn.
std::vector<ChatMessage> parse_sft_record(std::string_view line, const std::string& where);

// Throws InvalidArgument naming the file (and line) for bad input, IoError
// if reading or writing fails; nothing is written unless every record is good.
SftResult prepare_sft(const SftOptions& options);

// The examples of a masked token file, as rows of T tokens.
class SftExamples {
 public:
  // Throws InvalidArgument naming the token file if the mask holds no
  // example or no counted token, or does not start an example at token 0.
  // `file` must outlive this.
  SftExamples(const TokenFile& file, std::vector<uint8_t> mask, int64_t T, bool pack);

  // Rows training samples from: examples, or packed rows.
  int64_t rows() const { return static_cast<int64_t>(rows_.size()); }
  int64_t examples() const { return static_cast<int64_t>(starts_.size()) - 1; }
  int64_t truncated() const { return truncated_; }  // examples longer than T
  bool packed() const { return pack_; }
  int64_t seq_len() const { return T_; }

  // Row r: inputs[T] (padding 0), targets[T] (kIgnoreTarget where not
  // counted), positions[T] (packed; may be null unpacked, where they are 0 ..
  // T-1). The padding of a packed row is one more example of its own, all
  // ignored.
  void fill_row(int64_t r, int32_t* inputs, int32_t* targets, int32_t* positions) const;

 private:
  const TokenFile* file_;
  std::vector<uint8_t> mask_;
  int64_t T_;
  bool pack_;
  std::vector<int64_t> starts_;  // examples' first tokens, and the file's end last
  std::vector<int64_t> rows_;    // each row's first example (rows_.back()+...: up to the next row's)
  int64_t truncated_ = 0;
};

}  // namespace po::data
