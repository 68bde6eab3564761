// Chat templates as pieces: see chat_format.h.
#include "data/chat_format.h"

namespace po::data {
namespace {

using Kind = ChatPiece::Kind;

// Python's str.strip(), as Meta's chat_completion applies it to each turn.
std::string strip(std::string_view s) {
  const char* ws = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return "";
  return std::string(s.substr(b, s.find_last_not_of(ws) - b + 1));
}

[[noreturn]] void order_error(std::string_view tmpl, size_t i, const std::string& why) {
  throw ChatFormatError(i, core::str_cat("chat template ", tmpl, ": ", why, " (at messages[", i, "])"));
}

bool is_system(const ChatMessage& m) { return m.role == "system" || m.role == "developer"; }

void text(std::vector<ChatPiece>& out, std::string s, bool train = false) {
  out.push_back({Kind::kText, std::move(s), train});
}

std::vector<ChatPiece> render_llama2(const std::vector<ChatMessage>& msgs, bool prompt) {
  size_t i = 0;
  std::string system;
  const bool has_system = is_system(msgs[0]);
  if (has_system) {
    system = msgs[0].content;
    i = 1;
  }
  if (i == msgs.size()) order_error("llama2", i - 1, "a user message must follow the system message");
  std::vector<ChatPiece> out;
  const char* alternate = "roles must alternate user, assistant, user, ...";
  for (bool first = true; i < msgs.size(); i += 2, first = false) {
    if (msgs[i].role != "user") order_error("llama2", i, alternate);
    std::string user = msgs[i].content;
    if (first && has_system) user = "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + user;
    out.push_back({Kind::kBos, "", false});
    std::string inst = "[INST] ";  // (piecewise: GCC 12's -Wrestrict false positive on "lit" + string&&)
    inst += strip(user);
    inst += " [/INST]";
    text(out, std::move(inst));
    if (i + 1 == msgs.size()) {
      if (!prompt) order_error("llama2", i, "the last message must be the assistant's");
      break;
    }
    if (msgs[i + 1].role != "assistant") order_error("llama2", i + 1, alternate);
    if (prompt && i + 2 == msgs.size()) order_error("llama2", i + 1, "the last message must be the user's");
    std::string reply = " ";
    reply += strip(msgs[i + 1].content);
    reply += ' ';
    text(out, std::move(reply), true);
    out.push_back({Kind::kEos, "", true});
  }
  return out;
}

// chatml and plain: one message after another, any roles.
std::vector<ChatPiece> render_flat(std::string_view tmpl, const std::vector<ChatMessage>& msgs,
                                   bool prompt) {
  const bool chatml = tmpl == "chatml";
  std::vector<ChatPiece> out{{Kind::kBos, "", false}};
  bool replied = false;
  for (size_t i = 0; i < msgs.size(); ++i) {
    const ChatMessage& m = msgs[i];
    const bool reply = m.role == "assistant";
    replied = replied || reply;
    if (chatml) {
      text(out, "<|im_start|>" + m.role + "\n");
      text(out, m.content + "<|im_end|>", reply);
      text(out, "\n");
    } else if (reply) {
      text(out, "Assistant:");
      text(out, " " + m.content + "\n", true);
    } else {
      text(out, std::string(is_system(m) ? "System" : "User") + ": " + m.content + "\n");
    }
  }
  if (prompt) {
    text(out, chatml ? "<|im_start|>assistant\n" : "Assistant:");
    return out;
  }
  if (!replied) order_error(tmpl, msgs.size() - 1, "the conversation has no assistant turn to train on");
  if (msgs.back().role != "assistant") order_error(tmpl, msgs.size() - 1, "the last message must be the assistant's");
  if (chatml) out.pop_back();  // the reply's closing "\n": EOS ends the example instead
  out.push_back({Kind::kEos, "", true});
  return out;
}

}  // namespace

std::vector<std::string> chat_template_names() { return {"llama2", "chatml", "plain"}; }

void check_chat_template(std::string_view name) {
  for (const auto& n : chat_template_names())
    if (n == name) return;
  PO_THROW(core::InvalidArgument, "chat template '", name, "' is unknown (known: llama2, chatml, plain)");
}

std::vector<ChatPiece> render_chat_pieces(std::string_view template_name,
                                          const std::vector<ChatMessage>& messages,
                                          bool generation_prompt) {
  check_chat_template(template_name);
  if (messages.empty()) throw ChatFormatError(0, "`messages` cannot be empty");
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& r = messages[i].role;
    if (r != "system" && r != "developer" && r != "user" && r != "assistant")
      order_error(template_name, i, "unknown role '" + r + "' (expected system, user or assistant)");
  }
  if (template_name == "llama2") return render_llama2(messages, generation_prompt);
  return render_flat(template_name, messages, generation_prompt);
}

}  // namespace po::data
