// A SentencePiece model file (tokenizer.model: the protobuf ModelProto that
// spm_train writes and Meta's Llama releases ship), read without protobuf:
// the fields a BPE tokenizer needs, from the wire format (varints, fixed32
// floats, length-delimited strings and messages; every other field is
// skipped by its wire type). Field numbers are sentencepiece_model.proto's:
// ModelProto {pieces = 1, trainer_spec = 2, normalizer_spec = 3};
// SentencePiece {piece = 1, score = 2, type = 3}; TrainerSpec {model_type = 3,
// byte_fallback = 35}; NormalizerSpec {name = 1, precompiled_charsmap = 2,
// add_dummy_prefix = 3, remove_extra_whitespaces = 4, escape_whitespaces = 5},
// with the proto's defaults where a field is absent.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace po::data {

struct SentencePieceModel {
  enum class Type : int { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };
  struct Piece {
    std::string text;
    float score = 0;
    Type type = Type::kNormal;
  };
  std::vector<Piece> pieces;  // piece i has id i
  int model_type = 1;         // 1 unigram, 2 BPE, 3 word, 4 char
  bool byte_fallback = false;
  std::string normalizer;     // the normaliser's name ("identity", "nmt_nfkc", ...)
  size_t charsmap_bytes = 0;  // its precompiled character map (empty for identity)
  bool add_dummy_prefix = true, remove_extra_whitespaces = true, escape_whitespaces = true;
};

// Parses `data`, the bytes of the file `path`. Throws InvalidArgument naming
// `path`, the message and the byte offset for a truncated or malformed
// field, a piece type out of range or a model without pieces.
SentencePieceModel parse_sentencepiece_model(std::string_view data, const std::string& path);

}  // namespace po::data
