// What a request asks of the engine and what it gets back, apart from the
// engine itself (the HTTP layer's parsers and their fuzzer use these alone).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace po::serve {

struct SamplingParams {
  int64_t max_new_tokens = 20;
  // Greedy (argmax) unless do_sample; with do_sample: temperature, then
  // top-k, top-p and typical-p filtering, in that order.
  bool do_sample = false;
  double temperature = 1.0;  // > 0
  int64_t top_k = 0;         // 0: the whole vocabulary
  double top_p = 1.0;        // (0, 1]
  double typical_p = 1.0;    // (0, 1]
  // Penalties on tokens already in the prompt or the output (repetition:
  // CTRL's divide-positive/multiply-negative), or in the output
  // (frequency: × count, presence: once), OpenAI's definitions.
  double repetition_penalty = 1.0;
  double frequency_penalty = 0.0, presence_penalty = 0.0;
  uint64_t seed = 0;  // the request's stream of random numbers: token i uses (seed, i)
  std::vector<std::string> stop;  // stop sequences, matched on the text
  bool ignore_eos = false;
  int64_t top_logprobs = 0;  // also report this many most likely tokens per step (OpenAI's logprobs)
  // Also report the prompt's log-probabilities (TGI's decoder_input_details,
  // OpenAI's echo with logprobs): every prompt position is run through the
  // head, and the prompt's prefix-cache hits are not used.
  bool prompt_logprobs = false;
  // A LoRA adapter the server loaded (--lora NAME=DIR) by its name, whose
  // low-rank products this request's rows add; "": the base model.
  std::string adapter;
};

enum class Finish { kNone, kLength, kEos, kStop, kCancelled };
// TGI's names: "length", "eos_token", "stop_sequence"; "cancelled".
const char* finish_name(Finish f);

struct GeneratedToken {
  int32_t id = 0;
  float logprob = 0;     // log-softmax of the raw logits at the chosen id
  bool special = false;  // the end-of-text token
  std::string text;      // the text this token released (whole characters, stop sequences held back)
  // The top_logprobs most likely tokens (id, logprob of the raw logits),
  // most likely first.
  std::vector<std::pair<int32_t, float>> top;
};

// What a stream got since its last read.
struct Update {
  std::vector<GeneratedToken> tokens;
  std::string text;  // newly released text: whole UTF-8 characters, no stop sequence
  Finish finish = Finish::kNone;  // set on the last update
  std::string error;  // the generation failed (HTTP 424); finish is then kCancelled
  // With prompt_logprobs, in the update of the first token: each prompt
  // token after the first, its log-probability given the ones before and
  // the top_logprobs likeliest there (no text).
  std::vector<GeneratedToken> prompt;
};

}  // namespace po::serve
