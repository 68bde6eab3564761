// Chat templates as pieces: one rendering of a conversation that serving
// (the prompt it continues) and SFT data (the tokens a loss counts) share.
//
// Templates: "llama2" (Meta's Llama-2 chat format, llama/generation.py's
// chat_completion), "chatml", "plain" (a transcript GPT-2 can continue).
// A rendering is a list of pieces: text, or the tokenizer's BOS or EOS id.
// Text pieces that hold an assistant's reply are marked `train`: SFT's loss
// counts exactly their tokens (and the EOS that ends a reply). Pieces are
// tokenized one by one (the first of a sequence with TextTokenizer::encode,
// the rest with encode_continuation), as torchtune tokenizes messages, so a
// reply's tokens are the ones generation makes after the prompt's pieces.
//
//   llama2  per user turn (and its reply): BOS "[INST] {user} [/INST]"
//           then " {reply} " EOS; a system message folds into the first
//           user turn as "<<SYS>>\n{system}\n<</SYS>>\n\n"; contents stripped.
//   chatml  "<|im_start|>{role}\n" {content} "<|im_end|>" "\n" per message;
//           the prompt for a reply ends "<|im_start|>assistant\n".
//   plain   "{Role}: {content}\n" per message (User, Assistant, System); the
//           prompt for a reply ends "Assistant:", the reply " {content}\n".
// For training the conversation ends with a reply and EOS follows it (llama2
// after every reply); a tokenizer with a BOS opens chatml and plain with it.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace po::data {

struct ChatMessage {
  std::string role;  // "system" ("developer" is read as it), "user" or "assistant"
  std::string content;
};

struct ChatPiece {
  enum class Kind { kText, kBos, kEos };
  Kind kind = Kind::kText;
  std::string text;    // kText only
  bool train = false;  // a reply's text or the EOS after it
};

// An order of roles the template cannot express; `index` is the message's.
class ChatFormatError : public core::InvalidArgument {
 public:
  ChatFormatError(size_t index, const std::string& message)
      : core::InvalidArgument(message), index_(index) {}
  size_t index() const { return index_; }

 private:
  size_t index_;
};

std::vector<std::string> chat_template_names();
// Throws InvalidArgument naming `name` and the known ones.
void check_chat_template(std::string_view name);

// What a conversation renders to. generation_prompt: the prompt a reply
// continues (serving; the last message is the user's, or any for chatml and
// plain), ending with the assistant's opening. Otherwise training: the
// conversation ends with an assistant's reply, and holds at least one.
// Throws ChatFormatError for an order of roles the template cannot express
// (messages empty included, at index 0), InvalidArgument for an unknown
// template.
std::vector<ChatPiece> render_chat_pieces(std::string_view template_name,
                                          const std::vector<ChatMessage>& messages,
                                          bool generation_prompt);

}  // namespace po::data
