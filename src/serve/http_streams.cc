// TGI events and OpenAI chunks out of engine updates (see http_streams.h).
#include "serve/http_streams.h"

#include <algorithm>
#include <limits>

namespace po::serve {
namespace {

using std::chrono::milliseconds;

// The token texts of an update: the engine's own when they add up to its
// text; otherwise the whole text on the last token.
std::vector<std::string> token_texts(const Update& u) {
  std::vector<std::string> texts;
  std::string joined;
  for (const auto& t : u.tokens) {
    texts.push_back(t.text);
    joined += t.text;
  }
  if (joined != u.text && !texts.empty()) {
    std::fill(texts.begin(), texts.end(), std::string());
    texts.back() = u.text;
  }
  return texts;
}

}  // namespace

bool Streams::all_done() const {
  return std::all_of(done_.begin(), done_.end(), [](bool d) { return d; });
}

bool TgiStreamState::predictably_last(const GeneratedToken& t) const {
  const auto made = static_cast<int64_t>(gen.tokens.size());
  return (t.special && !r.params.ignore_eos) || made >= r.params.max_new_tokens || prompt_tokens + made >= max_total;
}

void TgiStreamState::send(std::string& out, const GeneratedToken& t, const std::string& text, bool last) {
  out += sse_event(tgi_stream_event(++index_, t, text, last ? &gen : nullptr, r.return_full_text ? r.inputs : "",
                                    r.details),
                   false);
  last_sent_ = t;
}

std::string TgiStreamState::poll() {
  Update u;
  if (!ss[0].next(u, kPoll)) return {};
  std::string out = on_update(u);
  if (finished) ss.mark_done(0);
  return out;
}

std::string TgiStreamState::on_update(const Update& u) {
  std::string out;
  const std::vector<std::string> texts = token_texts(u);
  gen.text += u.text;
  for (size_t k = 0; k < u.tokens.size(); ++k) {
    const GeneratedToken& t = u.tokens[k];
    if (held_) {  // a later token came: it was not the last
      send(out, *held_, held_text_, false);
      held_.reset();
    }
    const std::string text = carry_ + texts[k];
    carry_.clear();
    gen.tokens.push_back(t);
    const bool last_here = k + 1 == u.tokens.size();
    if (last_here && u.finish == Finish::kNone && predictably_last(t)) {
      held_ = t;
      held_text_ = text;
    } else if (last_here && (u.finish == Finish::kLength || u.finish == Finish::kEos || u.finish == Finish::kStop)) {
      gen.finish = u.finish;
      send(out, t, text, true);
      finished = true;
      return out;
    } else {
      send(out, t, text, false);
    }
  }
  if (u.tokens.empty()) (held_ ? held_text_ : carry_) += u.text;
  if (u.finish == Finish::kNone) return out;
  finished = true;
  gen.finish = u.finish;
  if (!u.error.empty()) {
    out += sse_event(tgi_error("Request failed during generation: " + u.error, "generation"), false);
  } else if (u.finish == Finish::kCancelled) {
    out += sse_event(tgi_error(kCancelledMessage, "incomplete_generation"), false);
  } else if (held_) {
    send(out, *held_, held_text_ + carry_, true);
  } else if (last_sent_) {
    // The end came after its token went out (a stop sequence matched).
    send(out, *last_sent_, carry_, true);
  } else {
    out += sse_event(tgi_error("Incomplete generation: no token was generated", "incomplete_generation"), false);
  }
  return out;
}

OpenAiStreamState::OpenAiStreamState(Streams s, OpenAiRequest q, OpenAiMeta m, int64_t prompt,
                                     std::vector<Echo> echoes, TokenText names)
    : ss(std::move(s)),
      r(std::move(q)),
      meta(std::move(m)),
      prompt_tokens_(prompt),
      text_of_(std::move(names)),
      echoes_(std::move(echoes)),
      echoed_(ss.size(), false),
      made_(ss.size(), 0),
      offset_(ss.size(), 0) {}

std::string OpenAiStreamState::chunk(size_t i, bool role, const std::string& text,
                                     const std::vector<GeneratedToken>& tokens, Finish f) const {
  const auto index = static_cast<int64_t>(i);
  return sse_event(r.chat ? chat_chunk(meta, index, role, text, tokens, f, r.logprobs, r.include_usage, text_of_)
                          : completion_chunk(meta, index, text, tokens, f, r.logprobs, r.include_usage,
                                             offset_[i], text_of_),
                   true);
}

std::string OpenAiStreamState::start() {
  std::string out;
  for (size_t i = 0; i < ss.size(); ++i) {
    if (r.chat) out += chunk(i, true, "", {}, Finish::kNone);  // OpenAI's first delta: the role
    if (!r.chat && r.echo && !r.params.prompt_logprobs) {
      out += chunk(i, false, echoes_[i].text, {}, Finish::kNone);
      offset_[i] += static_cast<int64_t>(echoes_[i].text.size());
    }
  }
  return out;
}

std::string OpenAiStreamState::scored_echo(size_t i, std::vector<GeneratedToken> prompt) {
  std::vector<GeneratedToken> all(1);
  all[0].id = echoes_[i].first_id;
  all[0].logprob = std::numeric_limits<float>::quiet_NaN();
  for (auto& t : prompt) all.push_back(std::move(t));
  for (GeneratedToken& t : all) t.text = text_of_(t.id);
  std::string out = chunk(i, false, echoes_[i].text, all, Finish::kNone);
  offset_[i] += static_cast<int64_t>(echoes_[i].text.size());
  echoed_[i] = true;
  return out;
}

std::string OpenAiStreamState::poll() {
  std::string out;
  if (!started_) {
    started_ = true;
    out = start();
  }
  bool waited = false;
  for (size_t i = 0; i < ss.size() && !finished; ++i) {
    if (ss.done(i)) continue;
    Update u;
    const bool got = ss[i].next(u, waited ? milliseconds(0) : kPoll);
    waited = true;
    if (!got) continue;
    made_[i] += static_cast<int64_t>(u.tokens.size());
    if (r.params.prompt_logprobs && !echoed_[i] && (!u.prompt.empty() || !u.tokens.empty()))
      out += scored_echo(i, std::move(u.prompt));  // with the first token (a one-token prompt has no scores)
    if (!u.error.empty() || u.finish == Finish::kCancelled) {
      const std::string msg = u.error.empty() ? kCancelledMessage : "Request failed during generation: " + u.error;
      out += sse_event(openai_error(msg, "server_error"), true);
      finished = true;  // ~Streams cancels the other choices
      return out;
    }
    if (!u.text.empty() || (r.logprobs >= 0 && !u.tokens.empty())) {
      out += chunk(i, false, u.text, u.tokens, Finish::kNone);
      for (const auto& t : u.tokens) offset_[i] += static_cast<int64_t>(t.text.size());
    }
    if (u.finish != Finish::kNone) {
      out += chunk(i, false, "", {}, u.finish);
      ss.mark_done(i);
    }
  }
  if (!finished && ss.all_done()) {
    if (r.include_usage) {
      int64_t completion = 0;
      for (int64_t m : made_) completion += m;
      out += sse_event(usage_chunk(meta, r.chat, prompt_tokens_, completion), true);
    }
    out += "data: [DONE]\n\n";
    finished = true;
  }
  return out;
}

}  // namespace po::serve
