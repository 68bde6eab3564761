// What one request's handler holds while the engine works: its engine
// streams, and the state machines that turn their updates into TGI's events
// and OpenAI's chunks (the server's content providers call them, one call per
// wait of up to kPoll).
//
// The engine delivers a request's last token and its end in two updates
// when the handler reads between them (the token in the step, the end after
// it). TGI's final event must carry both: a token known to be the last (EOS,
// max_new_tokens, the context) is held until its end arrives, in the same
// step; after a stop sequence, which only the engine can see, the final
// event repeats the last token with the text left (usually none).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "serve/api.h"
#include "serve/engine.h"

namespace po::serve {

// How long a handler waits on the engine before looking at its client again.
inline constexpr std::chrono::milliseconds kPoll{50};
inline constexpr const char* kCancelledMessage =
    "Incomplete generation: the request was cancelled (the server is shutting down)";

// The streams of one request. Any still running when it goes are
// cancelled, so the engine frees their blocks at its next step.
class Streams {
 public:
  explicit Streams(std::vector<std::shared_ptr<Stream>> s) : s_(std::move(s)), done_(s_.size(), false) {}
  Streams(Streams&&) = default;
  ~Streams() { cancel(); }
  void cancel() {
    for (size_t i = 0; i < s_.size(); ++i)
      if (!done_[i]) s_[i]->cancel();
  }
  size_t size() const { return s_.size(); }
  // Takes `o`'s streams after these (a batch of prompts), leaving `o` empty.
  void append(Streams&& o) {
    for (size_t i = 0; i < o.s_.size(); ++i) {
      s_.push_back(std::move(o.s_[i]));
      done_.push_back(o.done_[i]);
    }
    o.s_.clear();
    o.done_.clear();
  }
  Stream& operator[](size_t i) { return *s_[i]; }
  bool done(size_t i) const { return done_[i]; }
  void mark_done(size_t i) { done_[i] = true; }
  bool all_done() const;

 private:
  std::vector<std::shared_ptr<Stream>> s_;
  std::vector<bool> done_;
};

// One TGI stream in flight: an event per token, the last one with
// generated_text and details.
struct TgiStreamState {
  TgiStreamState(Streams s, TgiRequest q) : ss(std::move(s)), r(std::move(q)) {}
  // The events of one update ("data:" lines); sets `finished` at the end.
  std::string on_update(const Update& u);
  // The events of what the stream has (waiting up to kPoll), as
  // OpenAiStreamState::poll; the stream is marked done at the end.
  std::string poll();

  Streams ss;
  TgiRequest r;
  int64_t prompt_tokens = 0, max_total = 0;
  Generation gen;
  bool finished = false;

 private:
  bool predictably_last(const GeneratedToken& t) const;
  void send(std::string& out, const GeneratedToken& t, const std::string& text, bool last);

  int64_t index_ = 0;
  std::optional<GeneratedToken> held_, last_sent_;
  std::string held_text_, carry_;  // text waiting for a token to ride on
};

// One OpenAI stream in flight: chunks per update and choice, each choice's
// finish_reason, the usage (stream_options.include_usage), then [DONE].
struct OpenAiStreamState {
  // `echoes`: per choice, the text that precedes its output (completions'
  // echo), and the id of its prompt's first token. With prompt
  // log-probabilities the echo chunk waits for them (they come with the
  // first token) and carries the prompt's tokens, the first unscored.
  struct Echo {
    std::string text;
    int32_t first_id = 0;
  };
  OpenAiStreamState(Streams s, OpenAiRequest q, OpenAiMeta m, int64_t prompt, std::vector<Echo> echoes,
                    TokenText names);
  // The chunks of what the streams have (the first open one waits up to
  // kPoll), after the ones that open the stream on the first call; sets
  // `finished` after [DONE] or an error event.
  std::string poll();

  Streams ss;
  OpenAiRequest r;
  OpenAiMeta meta;
  bool finished = false;

 private:
  std::string chunk(size_t i, bool role, const std::string& text, const std::vector<GeneratedToken>& tokens,
                    Finish f) const;
  // The chunks that open the stream (chat: the role; completions: the echo).
  std::string start();

  bool started_ = false;
  int64_t prompt_tokens_;
  TokenText text_of_;
  std::vector<Echo> echoes_;
  std::vector<bool> echoed_;  // the scored echo went out
  // Sends choice i's echo with its prompt's scores (prompt_logprobs).
  std::string scored_echo(size_t i, std::vector<GeneratedToken> prompt);
  std::vector<int64_t> made_, offset_;  // per choice: tokens, bytes of text so far (logprobs' text_offset)
};

}  // namespace po::serve
