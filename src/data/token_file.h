// Token files in llm.c's format: a header of 256 little-endian int32
// ([0] = 20240520 magic, [1] = 1 version, [2] = token count), then the tokens as
// little-endian uint16. Writing is atomic (temp file in the same directory,
// fsync, rename, fsync of the directory): a crash or error never leaves a
// half-written file under the final name. Reading maps the file read-only and
// validates the header, the size and (optionally) every token id.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace po::data {

inline constexpr int32_t kTokenFileMagic = 20240520;
inline constexpr int32_t kTokenFileVersion = 1;
inline constexpr size_t kTokenFileHeaderInts = 256;
inline constexpr size_t kTokenFileHeaderBytes = kTokenFileHeaderInts * sizeof(int32_t);
// Ids are uint16: a vocabulary of at most this many ids fits.
inline constexpr int32_t kTokenFileMaxVocab = 65536;

// SFT's loss masks (`pagedoptim prepare --sft`, data/sft.h) sit beside their
// token file with the same header (magic kMaskFileMagic) and one byte per
// token: kMaskLoss where the loss counts the token as a target, kMaskStart
// on an example's first token.
inline constexpr int32_t kMaskFileMagic = 20241206;
inline constexpr uint8_t kMaskLoss = 1, kMaskStart = 2;

// Writes `tokens` to `path` atomically. Throws InvalidArgument if an id does not
// fit in uint16, IoError (naming the file) if writing fails.
void write_token_file(const std::string& path, std::span<const int32_t> tokens);

// `text` to `path` atomically (temp file beside it, fsync, rename): the file
// is whole or as it was. An IoError naming the path.
void write_text_atomically(const std::string& path, std::string_view text);

// The mask file of a token file: DIR/train.bin -> DIR/train.mask.
std::string mask_path(const std::string& token_path);
// Writes a mask atomically. Throws IoError naming the file.
void write_mask_file(const std::string& path, std::span<const uint8_t> mask);
// Reads a mask, checking its header and that it masks `tokens` tokens
// (InvalidArgument naming the file), IoError if it cannot be read.
std::vector<uint8_t> read_mask_file(const std::string& path, size_t tokens);

// Validates a whole token file held in memory and returns its tokens (a view into
// `data`, which must be 2-byte aligned after the header, as mmap is). `name` is
// used in messages. vocab_size <= 0 skips the id check. Throws InvalidArgument
// naming `name` for: fewer bytes than the header, wrong magic, wrong version,
// a token count that disagrees with the size, an id >= vocab_size (position and value).
std::span<const uint16_t> parse_token_file(std::span<const std::byte> data, std::string_view name,
                                           int32_t vocab_size = 0);

// A read-only memory-mapped token file. Move-only; unmaps on destruction.
class TokenFile {
 public:
  TokenFile() = default;
  // Opens and validates `path` (see parse_token_file). IoError if it cannot be opened.
  explicit TokenFile(const std::string& path, int32_t vocab_size = 0);
  ~TokenFile();
  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const std::string& path() const { return path_; }
  // Number of tokens.
  size_t size() const { return tokens_.size(); }
  uint16_t operator[](size_t i) const { return tokens_[i]; }
  std::span<const uint16_t> tokens() const { return tokens_; }

 private:
  void release() noexcept;

  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  std::span<const uint16_t> tokens_;
};

}  // namespace po::data
