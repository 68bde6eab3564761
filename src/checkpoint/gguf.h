// GGUF files (version 3, and 2, which has the same layout), the model format of
// llama.cpp's ecosystem, read and written as the published specification
// (ggml's docs/gguf.md) lays it out:
//
//   "GGUF" | u32 version | u64 tensor count | u64 metadata count
//   metadata: (string key, u32 value type, value)*      string = u64 length, UTF-8 bytes
//   tensor infos: (string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset)*
//   padding to general.alignment (default 32), then the data section; each
//   tensor's offset is from the data section's start, a multiple of the alignment.
//
// ne[0] is the innermost (row) length: a Hugging Face [out, in] matrix is
// ne = {in, out}. shape() gives the numpy order. Tensor values are decoded by
// backend/block_formats.h. Models on top: gguf_models.h.
//
// Reading checks everything before a value is used: a truncated file, a count
// or length larger than the bytes left, an unknown value type, a nested array,
// a duplicate key or tensor, a tensor whose offset is unaligned, overlaps
// another or runs past the end, a row length that is not whole blocks, or a
// ggml type this engine does not read are each an InvalidArgument naming the
// file and the key or tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "backend/block_formats.h"
#include "tensor/tensor.h"

namespace po::checkpoint {

class MappedFile;

// Metadata value types (gguf.md's gguf_metadata_value_type).
enum class GgufType : uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7,
  kString = 8, kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12,
};
const char* gguf_type_name(GgufType t);

// One metadata value: a number (integers of every width as JSON integers,
// floats as doubles holding the stored float exactly), a bool, a string, or an
// array of one such type (`elem`; arrays of arrays are refused, as ggml does).
struct GgufValue {
  GgufType type = GgufType::kU32;
  GgufType elem = GgufType::kU32;  // kArray: its elements' type
  nlohmann::json value;

  static GgufValue of(GgufType t, nlohmann::json v) { return {t, GgufType::kU32, std::move(v)}; }
  static GgufValue str(std::string s) { return of(GgufType::kString, std::move(s)); }
  static GgufValue u32(uint32_t v) { return of(GgufType::kU32, v); }
  static GgufValue f32(float v) { return of(GgufType::kF32, static_cast<double>(v)); }
  static GgufValue boolean(bool v) { return of(GgufType::kBool, v); }
  static GgufValue array(GgufType elem, nlohmann::json items) { return {GgufType::kArray, elem, std::move(items)}; }
};

using GgufMetadata = std::vector<std::pair<std::string, GgufValue>>;

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> ne;  // ggml order: ne[0] the row length
  backend::GgmlType type = backend::GgmlType::kF32;
  uint64_t offset = 0;  // from the data section's start
  int64_t numel = 0;
  int64_t bytes = 0;
  // numpy order (ne reversed): [out, in] for a matrix.
  tensor::Shape shape() const { return {ne.rbegin(), ne.rend()}; }
};

class GgufFile {
 public:
  // Maps `path` and parses its header (IoError when it cannot be read).
  static GgufFile open(const std::string& path);
  // Parses bytes the caller keeps alive (the fuzzer's); `origin` names them in errors.
  static GgufFile from_bytes(const void* data, size_t size, std::string origin);

  const std::string& origin() const { return origin_; }
  uint32_t version() const { return version_; }
  uint32_t alignment() const { return alignment_; }
  // The data section's offset in the file.
  size_t data_start() const { return data_start_; }
  const GgufMetadata& metadata() const { return metadata_; }
  const GgufValue* find(std::string_view key) const;
  // Typed reads: InvalidArgument "ORIGIN: metadata KEY ..." when absent or of
  // another kind. get_int takes any integer type, get_float any number.
  int64_t get_int(std::string_view key) const;
  double get_float(std::string_view key) const;
  const std::string& get_string(std::string_view key) const;
  std::optional<int64_t> find_int(std::string_view key) const;
  std::optional<double> find_float(std::string_view key) const;
  // The elements of array KEY, which must hold `elem`.
  const nlohmann::json& get_array(std::string_view key, GgufType elem) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(std::string_view name) const;
  // The tensor's stored bytes (inside the file: checked when it opened).
  const std::byte* tensor_data(const GgufTensorInfo& t) const { return data_ + data_start_ + t.offset; }
  // The tensor's values as f32 (numel floats), decoded from its type.
  void read_f32(const GgufTensorInfo& t, float* dst) const;

 private:
  GgufFile() = default;
  void parse();

  std::shared_ptr<const MappedFile> map_;
  const std::byte* data_ = nullptr;
  size_t size_ = 0;
  std::string origin_;
  uint32_t version_ = 0;
  uint32_t alignment_ = 32;
  size_t data_start_ = 0;
  GgufMetadata metadata_;
  std::map<std::string, size_t, std::less<>> key_index_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
};

// Whether the file at `path` starts with GGUF's magic.
bool is_gguf(const std::string& path);

// A tensor to write: its ggml-order dimensions, the type to store it in, and
// a function that fills numel f32 values (called once, when its turn comes,
// so a large model is never held twice).
struct GgufTensorOut {
  std::string name;
  std::vector<int64_t> ne;
  backend::GgmlType type = backend::GgmlType::kF32;
  std::function<void(float*)> fill;
};

// Writes a GGUF v3 file atomically (checkpoint/atomic_file.h): the metadata
// in the order given (general.alignment is added when `alignment` is not 32
// and absent), then the tensors, each encoded to its type (ggml_quantize).
void write_gguf(const std::string& path, const GgufMetadata& metadata,
                const std::vector<GgufTensorOut>& tensors, uint32_t alignment = 32);

}  // namespace po::checkpoint
