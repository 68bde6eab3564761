// SFT data: see sft.h.
#include "data/sft.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <memory>
#include <tuple>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/log.h"
#include "data/chat_format.h"
#include "data/prepare.h"
#include "data/text_tokenizer.h"
#include "data/tokenizer.h"

namespace po::data {
using json = nlohmann::json;

namespace {

std::vector<ChatMessage> record_messages(const json& r, const std::string& where) {
  PO_CHECK(r.is_object(), where, ": a record must be a JSON object, got ", r.type_name());
  auto string_field = [&](const json& obj, const char* key, const std::string& name) {
    const auto it = obj.find(key);
    PO_CHECK(it != obj.end(), where, ": ", name, " is missing");
    PO_CHECK(it->is_string(), where, ": ", name, " must be a string, got ", it->type_name());
    return it->get<std::string>();
  };
  std::vector<ChatMessage> msgs;
  if (const auto m = r.find("messages"); m != r.end()) {
    PO_CHECK(m->is_array(), where, ": \"messages\" must be an array, got ", m->type_name());
    for (size_t i = 0; i < m->size(); ++i) {
      const json& msg = (*m)[i];
      const std::string name = core::str_cat("messages[", i, "]");
      PO_CHECK(msg.is_object(), where, ": ", name, " must be an object, got ", msg.type_name());
      msgs.push_back({string_field(msg, "role", name + ".role"), string_field(msg, "content", name + ".content")});
    }
  } else {
    PO_CHECK(r.contains("prompt") || r.contains("completion"), where,
             ": a record needs \"messages\", or \"prompt\" and \"completion\"");
    msgs.push_back({"user", string_field(r, "prompt", "\"prompt\"")});
    msgs.push_back({"assistant", string_field(r, "completion", "\"completion\"")});
  }
  PO_CHECK(std::any_of(msgs.begin(), msgs.end(), [](const ChatMessage& m) { return m.role == "assistant"; }),
           where, ": the record has no assistant turn, so the loss would count none of its tokens");
  return msgs;
}

// One example's tokens and mask bytes, appended.
void append_example(TextTokenizer& tok, const std::string& tmpl, const std::vector<ChatMessage>& msgs,
                    const std::string& where, std::vector<int32_t>& ids, std::vector<uint8_t>& mask) {
  std::vector<ChatPiece> pieces;
  try {
    pieces = render_chat_pieces(tmpl, msgs, false);
  } catch (const ChatFormatError& e) {
    PO_THROW(core::InvalidArgument, where, ": ", e.what());
  }
  const size_t first = ids.size();
  bool sequence_start = true;  // the next text piece opens a sequence (dummy prefix)
  int64_t counted = 0;
  for (const ChatPiece& p : pieces) {
    const uint8_t m = p.train ? kMaskLoss : 0;
    if (p.kind == ChatPiece::Kind::kBos) {
      sequence_start = true;
      if (const auto bos = tok.bos_id()) {
        ids.push_back(*bos);
        mask.push_back(0);
      }
      continue;
    }
    if (p.kind == ChatPiece::Kind::kEos) {
      ids.push_back(tok.eos_id());
      mask.push_back(m);
      counted += p.train;
      continue;
    }
    const std::vector<int32_t> t = sequence_start ? tok.encode(p.text, where) : tok.encode_continuation(p.text, where);
    sequence_start = sequence_start && t.empty();
    ids.insert(ids.end(), t.begin(), t.end());
    mask.insert(mask.end(), t.size(), m);
    if (p.train) counted += static_cast<int64_t>(t.size());
  }
  PO_CHECK(ids.size() > first, where, ": the record renders to no tokens");
  PO_CHECK(counted > 0, where, ": the record's replies tokenize to nothing the loss could count");
  mask[first] |= kMaskStart;
  mask[first] &= static_cast<uint8_t>(~kMaskLoss);  // nothing precedes an example's first token
}

}  // namespace

int64_t counted_targets(std::span<const int32_t> targets) {
  return static_cast<int64_t>(std::count_if(targets.begin(), targets.end(), [](int32_t t) { return t >= 0; }));
}

std::vector<ChatMessage> parse_sft_record(std::string_view line, const std::string& where) {
  json j;
  try {
    j = json::parse(line);
  } catch (const json::exception& e) {  // a syntax error, or a number out of double's range (out_of_range)
    PO_THROW(core::InvalidArgument, where, ": not JSON: ", e.what());
  }
  return record_messages(j, where);
}

SftResult prepare_sft(const SftOptions& o) {
  PO_CHECK(o.val_fraction >= 0.0 && o.val_fraction < 1.0, "prepare: val_fraction must be in [0, 1), got ",
           o.val_fraction);
  PO_CHECK(!o.out_dir.empty(), "prepare: no output directory");
  std::ifstream in(o.input, std::ios::binary);
  if (!in) PO_THROW(core::IoError, "cannot open SFT input ", o.input);
  const std::unique_ptr<TextTokenizer> tok =
      o.tokenizer.empty() ? std::make_unique<Tokenizer>(Tokenizer::load(o.tokenizer_root)) : load_tokenizer(o.tokenizer);
  PO_CHECK(tok->vocab_size() <= kTokenFileMaxVocab, "prepare: tokenizer ", o.tokenizer, " has ", tok->vocab_size(),
           " ids, more than the ", kTokenFileMaxVocab, " a uint16 token file can hold");
  SftResult r;
  r.chat_template = !o.chat_template.empty() ? o.chat_template : tok->kind() == "llama" ? "llama2" : "plain";
  check_chat_template(r.chat_template);

  std::vector<std::vector<ChatMessage>> records;
  std::vector<std::string> wheres;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = core::str_cat(o.input, ":", n);
    records.push_back(parse_sft_record(line, where));
    wheres.push_back(where);
  }
  if (in.bad()) PO_THROW(core::IoError, "cannot read SFT input ", o.input);
  PO_CHECK(!records.empty(), o.input, ": holds no records");

  const double f = o.val_fraction;
  auto val_before = [f](size_t d) { return static_cast<int64_t>(std::floor(static_cast<double>(d) * f + 1e-9)); };
  std::vector<int32_t> train, val;
  std::vector<uint8_t> train_mask, val_mask;
  for (size_t d = 0; d < records.size(); ++d) {
    const bool to_val = val_before(d + 1) > val_before(d);
    append_example(*tok, r.chat_template, records[d], wheres[d], to_val ? val : train, to_val ? val_mask : train_mask);
    ++(to_val ? r.val_examples : r.train_examples);
  }
  PO_CHECK(!train.empty(), o.input, ": the split leaves no training examples (", records.size(), " records)");
  auto counted = [](const std::vector<uint8_t>& m) {
    return static_cast<int64_t>(std::count_if(m.begin(), m.end(), [](uint8_t b) { return (b & kMaskLoss) != 0; }));
  };
  std::tie(r.train_path, r.val_path) = output_paths(o.out_dir);
  write_token_file(r.train_path, train);
  write_mask_file(mask_path(r.train_path), train_mask);
  write_token_file(r.val_path, val);
  write_mask_file(mask_path(r.val_path), val_mask);
  r.train_tokens = static_cast<int64_t>(train.size());
  r.val_tokens = static_cast<int64_t>(val.size());
  r.train_loss_tokens = counted(train_mask);
  r.val_loss_tokens = counted(val_mask);
  return r;
}

SftExamples::SftExamples(const TokenFile& file, std::vector<uint8_t> mask, int64_t T, bool pack)
    : file_(&file), mask_(std::move(mask)), T_(T), pack_(pack) {
  PO_CHECK(T >= 1, file.path(), ": sequence length must be >= 1, got ", T);
  PO_CHECK(mask_.size() == file.size(), file.path(), ": its mask has ", mask_.size(), " bytes for ", file.size(),
           " tokens");
  PO_CHECK(!mask_.empty() && (mask_[0] & kMaskStart) != 0, mask_path(file.path()),
           ": the first token does not start an example");
  bool any = false;
  for (size_t i = 0; i < mask_.size(); ++i) {
    if (mask_[i] & kMaskStart) starts_.push_back(static_cast<int64_t>(i));
    any = any || (mask_[i] & kMaskLoss) != 0;
  }
  PO_CHECK(any, mask_path(file.path()), ": the mask counts no token: the loss would be over nothing");
  starts_.push_back(static_cast<int64_t>(mask_.size()));
  int64_t used = T;  // the current packed row's tokens (full: the first example opens a row)
  for (int64_t e = 0; e < examples(); ++e) {
    const int64_t len = std::min(T, starts_[e + 1] - starts_[e]);
    truncated_ += starts_[e + 1] - starts_[e] > T;
    if (!pack_ || used + len > T) {
      rows_.push_back(e);
      used = 0;
    }
    used += len;
  }
}

void SftExamples::fill_row(int64_t r, int32_t* inputs, int32_t* targets, int32_t* positions) const {
  PO_CHECK(r >= 0 && r < rows(), "SFT row ", r, " is outside 0 .. ", rows() - 1);
  std::fill_n(inputs, T_, 0);
  std::fill_n(targets, T_, kIgnoreTarget);
  const std::span<const uint16_t> tok = file_->tokens();
  const int64_t last = r + 1 < rows() ? rows_[static_cast<size_t>(r + 1)] : examples();
  int64_t at = 0;
  for (int64_t e = rows_[static_cast<size_t>(r)]; e < last; ++e) {
    const int64_t s = starts_[static_cast<size_t>(e)], len = starts_[static_cast<size_t>(e) + 1] - s;
    const int64_t n = std::min(len, T_ - at);
    for (int64_t k = 0; k < n; ++k) {
      inputs[at + k] = tok[static_cast<size_t>(s + k)];
      if (k + 1 < len && (mask_[static_cast<size_t>(s + k + 1)] & kMaskLoss) != 0)
        targets[at + k] = tok[static_cast<size_t>(s + k + 1)];
      if (positions != nullptr) positions[at + k] = static_cast<int32_t>(k);
    }
    at += n;
  }
  if (positions != nullptr)  // unpacked: the row's positions; packed: the padding's own
    for (int64_t t = at; t < T_; ++t) positions[t] = static_cast<int32_t>(pack_ ? t - at : t);
}

}  // namespace po::data
