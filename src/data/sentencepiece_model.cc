// parse_sentencepiece_model(): see sentencepiece_model.h.
#include "data/sentencepiece_model.h"

#include <cmath>
#include <cstring>

#include "core/error.h"

namespace po::data {
namespace {

// One protobuf message's bytes, read field by field.
class Wire {
 public:
  Wire(std::string_view data, size_t base, const std::string& path, const char* message)
      : data_(data), base_(base), path_(path), message_(message) {}
  bool done() const { return pos_ >= data_.size(); }
  // The next field's number and wire type.
  std::pair<uint32_t, int> key() {
    const uint64_t k = varint();
    check(k >> 3 != 0 && k >> 3 <= 0x1FFFFFFF, "field number 0 or too large");
    return {static_cast<uint32_t>(k >> 3), static_cast<int>(k & 7)};
  }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      check(pos_ < data_.size(), "a varint runs past the end");
      const auto b = static_cast<uint8_t>(data_[pos_++]);
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) return v;
    }
    fail("a varint longer than 10 bytes");
  }
  float fixed32() {
    check(data_.size() - pos_ >= 4, "a 4-byte field runs past the end");
    float f;
    std::memcpy(&f, data_.data() + pos_, 4);  // little-endian on every target we build for
    pos_ += 4;
    return f;
  }
  // A length-delimited field's bytes and their offset in the file.
  std::pair<std::string_view, size_t> bytes() {
    const uint64_t n = varint();
    check(n <= data_.size() - pos_, "a length-delimited field runs past the end");
    const size_t at = base_ + pos_;
    const std::string_view v = data_.substr(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return {v, at};
  }
  void skip(int wire) {
    switch (wire) {
      case 0: (void)varint(); return;
      case 1: check(data_.size() - pos_ >= 8, "an 8-byte field runs past the end"); pos_ += 8; return;
      case 2: (void)bytes(); return;
      case 5: (void)fixed32(); return;
      default: fail("wire type " + std::to_string(wire) + " (groups are not read)");
    }
  }
  void expect(int wire, int want, const char* field) {
    check(wire == want, std::string(field) + " has wire type " + std::to_string(wire) + ", not " +
                            std::to_string(want));
  }
  void check(bool ok, const std::string& what) const {
    if (!ok) fail(what);
  }
  [[noreturn]] void fail(const std::string& what) const {
    PO_THROW(core::InvalidArgument, path_, ": not a SentencePiece model: in ", message_, " at byte ", base_ + pos_,
             ": ", what);
  }

 private:
  std::string_view data_;
  size_t base_, pos_ = 0;
  const std::string& path_;
  const char* message_;
};

SentencePieceModel::Piece read_piece(std::string_view data, size_t at, const std::string& path) {
  Wire w(data, at, path, "a piece");
  SentencePieceModel::Piece p;
  while (!w.done()) {
    const auto [field, wire] = w.key();
    if (field == 1) {
      w.expect(wire, 2, "piece");
      p.text = std::string(w.bytes().first);
    } else if (field == 2) {
      w.expect(wire, 5, "score");
      p.score = w.fixed32();
      w.check(!std::isnan(p.score), "a NaN score");
    } else if (field == 3) {
      w.expect(wire, 0, "type");
      const uint64_t t = w.varint();
      w.check(t >= 1 && t <= 6, "piece type " + std::to_string(t) + " (1-6)");
      p.type = static_cast<SentencePieceModel::Type>(t);
    } else {
      w.skip(wire);
    }
  }
  return p;
}

void read_trainer(std::string_view data, size_t at, const std::string& path, SentencePieceModel& m) {
  Wire w(data, at, path, "trainer_spec");
  while (!w.done()) {
    const auto [field, wire] = w.key();
    if (field == 3 && wire == 0) m.model_type = static_cast<int>(w.varint());
    else if (field == 35 && wire == 0) m.byte_fallback = w.varint() != 0;
    else w.skip(wire);
  }
}

void read_normalizer(std::string_view data, size_t at, const std::string& path, SentencePieceModel& m) {
  Wire w(data, at, path, "normalizer_spec");
  while (!w.done()) {
    const auto [field, wire] = w.key();
    if (field == 1 && wire == 2) m.normalizer = std::string(w.bytes().first);
    else if (field == 2 && wire == 2) m.charsmap_bytes = w.bytes().first.size();
    else if (field == 3 && wire == 0) m.add_dummy_prefix = w.varint() != 0;
    else if (field == 4 && wire == 0) m.remove_extra_whitespaces = w.varint() != 0;
    else if (field == 5 && wire == 0) m.escape_whitespaces = w.varint() != 0;
    else w.skip(wire);
  }
}

}  // namespace

SentencePieceModel parse_sentencepiece_model(std::string_view data, const std::string& path) {
  SentencePieceModel m;
  Wire w(data, 0, path, "the model");
  while (!w.done()) {
    const auto [field, wire] = w.key();
    if (field >= 1 && field <= 3) {
      w.expect(wire, 2, field == 1 ? "pieces" : field == 2 ? "trainer_spec" : "normalizer_spec");
      const auto [bytes, at] = w.bytes();
      if (field == 1) m.pieces.push_back(read_piece(bytes, at, path));
      else if (field == 2) read_trainer(bytes, at, path, m);
      else read_normalizer(bytes, at, path, m);
    } else {
      w.skip(wire);
    }
  }
  PO_CHECK(!m.pieces.empty(), path, ": not a SentencePiece model: no pieces");
  return m;
}

}  // namespace po::data
