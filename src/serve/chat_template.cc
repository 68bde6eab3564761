// Chat templates (api.h): a chat's messages as the prompt text a model was
// tuned on, from the pieces data/chat_format.h renders (the ones SFT data
// trains on).
#include <string>

#include "serve/api.h"

namespace po::serve {

std::vector<std::string> chat_template_names() { return data::chat_template_names(); }

void check_chat_template(std::string_view name) { data::check_chat_template(name); }

std::vector<std::string> render_chat_segments(std::string_view template_name,
                                              const std::vector<ChatMessage>& messages) {
  check_chat_template(template_name);
  if (messages.empty()) throw ValidationError("messages", "`messages` cannot be empty");
  std::vector<data::ChatPiece> pieces;
  try {
    pieces = data::render_chat_pieces(template_name, messages, true);
  } catch (const data::ChatFormatError& e) {
    throw ValidationError(core::str_cat("messages[", e.index(), "].role"), e.what());
  }
  // Every rendering opens with a BOS, and each BOS starts a segment (the
  // caller puts BOS before each and EOS between two).
  std::vector<std::string> segments;
  for (const data::ChatPiece& p : pieces) {
    if (p.kind == data::ChatPiece::Kind::kBos) segments.emplace_back();
    if (p.kind == data::ChatPiece::Kind::kText) segments.back() += p.text;
  }
  return segments;
}

std::string render_chat(std::string_view template_name, const std::vector<ChatMessage>& messages) {
  std::string out;
  const auto segments = render_chat_segments(template_name, messages);
  for (size_t i = 0; i < segments.size(); ++i) out += (i ? "</s><s>" : "") + segments[i];
  return out;
}

}  // namespace po::serve
