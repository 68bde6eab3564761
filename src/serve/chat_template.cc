// Chat templates (api.h): a chat's messages as the prompt text a model was
// tuned on.
#include <string>

#include "serve/api.h"

namespace po::serve {

namespace {

// Python's str.strip(), as Meta's chat_completion applies it to each turn.
std::string strip(std::string_view s) {
  const char* ws = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return "";
  return std::string(s.substr(b, s.find_last_not_of(ws) - b + 1));
}

[[noreturn]] void order_error(std::string_view tmpl, size_t i, const std::string& why) {
  throw ValidationError(core::str_cat("messages[", i, "].role"),
                        core::str_cat("chat template ", tmpl, ": ", why, " (at messages[", i, "])"));
}

// Meta's Llama-2 chat format (llama/generation.py, chat_completion): an
// optional system message folded into the first user turn, then user and
// assistant alternating, ending with the user; each finished pair is one
// sequence "[INST] {user} [/INST] {answer} " (BOS before, EOS after).
std::vector<std::string> render_llama2(const std::vector<ChatMessage>& msgs) {
  size_t i = 0;
  std::string system;
  bool has_system = false;
  if (!msgs.empty() && msgs[0].role == "system") {
    system = msgs[0].content;
    has_system = true;
    i = 1;
  }
  std::vector<std::string> segments;
  if (i == msgs.size()) order_error("llama2", i - 1, "a user message must follow the system message");
  for (bool first = true; i < msgs.size(); i += 2, first = false) {
    if (msgs[i].role != "user") order_error("llama2", i, "roles must alternate user, assistant, user, ...");
    std::string user = msgs[i].content;
    if (first && has_system) user = "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + user;
    // Appended piecewise: GCC 12 warns (-Wrestrict, a false positive) on "lit" + string&&.
    std::string seg = "[INST] ";
    seg += strip(user);
    seg += " [/INST]";
    if (i + 1 < msgs.size()) {
      if (msgs[i + 1].role != "assistant")
        order_error("llama2", i + 1, "roles must alternate user, assistant, user, ...");
      if (i + 2 == msgs.size())
        order_error("llama2", i + 1, "the last message must be the user's");
      seg += ' ';
      seg += strip(msgs[i + 1].content);
      seg += ' ';
    }
    segments.push_back(std::move(seg));
  }
  return segments;
}

std::string render_chatml(const std::vector<ChatMessage>& msgs) {
  std::string out;
  for (const auto& m : msgs) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
  return out + "<|im_start|>assistant\n";
}

// GPT-2 has no chat format: a transcript it can continue.
std::string render_plain(const std::vector<ChatMessage>& msgs) {
  std::string out;
  for (const auto& m : msgs) {
    const char* who = m.role == "system" ? "System" : m.role == "user" ? "User" : "Assistant";
    out += std::string(who) + ": " + m.content + "\n";
  }
  return out + "Assistant:";
}

}  // namespace

std::vector<std::string> chat_template_names() { return {"llama2", "chatml", "plain"}; }

void check_chat_template(std::string_view name) {
  for (const auto& n : chat_template_names())
    if (n == name) return;
  PO_THROW(core::InvalidArgument, "chat template '", name, "' is unknown (known: llama2, chatml, plain)");
}

std::vector<std::string> render_chat_segments(std::string_view template_name,
                                              const std::vector<ChatMessage>& messages) {
  check_chat_template(template_name);
  if (messages.empty()) throw ValidationError("messages", "`messages` cannot be empty");
  if (template_name == "llama2") return render_llama2(messages);
  if (template_name == "chatml") return {render_chatml(messages)};
  return {render_plain(messages)};
}

std::string render_chat(std::string_view template_name, const std::vector<ChatMessage>& messages) {
  std::string out;
  const auto segments = render_chat_segments(template_name, messages);
  for (size_t i = 0; i < segments.size(); ++i) out += (i ? "</s><s>" : "") + segments[i];
  return out;
}

}  // namespace po::serve
