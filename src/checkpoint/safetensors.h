// Hugging Face safetensors: an 8-byte little-endian header length N, N bytes
// of JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]},
// optional "__metadata__": {str: str}}, then the data buffer. Offsets are
// relative to the buffer start.
//
// The reader validates the whole header before handing out any tensor, the
// way the reference implementation does: tensors must tile the buffer exactly
// (sorted by offset, no overlap, no gap, ending at the buffer end), and each
// byte size must equal numel * dtype size. Every error is an InvalidArgument
// naming the file (and the tensor). Tensor bytes are NOT guaranteed aligned
// (the format allows any header length): read them with memcpy or read_f32().
//
// The writer lays tensors out in the order given, pads the header with spaces
// to a multiple of 8 bytes (so our own files have aligned data) and writes the
// file atomically (atomic_file.h). The _hf writer instead reproduces byte for
// byte what the Hugging Face library writes (see write_safetensors_hf).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/mapped_file.h"
#include "tensor/tensor.h"

namespace po::checkpoint {

// Every dtype of the safetensors spec (a superset of tensor::DType).
enum class StDtype : uint8_t {
  kBool, kU8, kI8, kF8E5M2, kF8E4M3, kI16, kU16, kF16, kBF16,
  kI32, kU32, kF32, kF64, kI64, kU64,
};

// Bytes per element.
size_t st_dtype_size(StDtype d);
// Spec name: "F32", "BF16", ...
const char* st_dtype_name(StDtype d);
// Inverse of st_dtype_name; nullopt for an unknown name.
std::optional<StDtype> st_dtype_parse(std::string_view name);
// Conversions to and from the engine's dtypes (nullopt when it has no equivalent).
std::optional<tensor::DType> st_to_dtype(StDtype d);
StDtype st_from_dtype(tensor::DType d);

// One tensor of a parsed file. `data` points into the file's bytes.
struct StTensor {
  std::string name;
  StDtype dtype = StDtype::kF32;
  tensor::Shape shape;
  const std::byte* data = nullptr;  // possibly unaligned
  size_t nbytes = 0;
  int64_t numel() const { return tensor::shape_numel(shape); }
};

class SafetensorsReader {
 public:
  // Maps and validates `path`. IoError when it cannot be read, InvalidArgument
  // (naming the file) when it is malformed.
  static SafetensorsReader open(const std::string& path);
  // Validates an in-memory file image; `origin` names it in errors. The bytes
  // are NOT copied: they must outlive the reader.
  static SafetensorsReader from_bytes(const void* data, size_t size, const std::string& origin);

  // Tensor names in data-buffer order.
  const std::vector<std::string>& names() const { return names_; }
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  // nullptr when absent.
  const StTensor* find(const std::string& name) const;
  // InvalidArgument "FILE: missing tensor 'x'" when absent.
  const StTensor& get(const std::string& name) const;
  // get() plus dtype and shape checks, e.g.
  // "FILE: tensor 'h.0.attn.c_attn.weight' has shape [64, 192], expected [64, 193]".
  const StTensor& require(const std::string& name, StDtype dtype, const tensor::Shape& shape) const;
  // Copies tensor `name` as f32 into `dst` (numel(shape) floats), converting
  // from F16 or BF16 if stored so; any other dtype, or a shape mismatch, is an
  // InvalidArgument naming the file and tensor.
  void read_f32(const std::string& name, const tensor::Shape& shape, float* dst) const;
  std::vector<float> read_f32(const std::string& name, const tensor::Shape& shape) const;

  // The "__metadata__" map (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The file path or the `origin` given to from_bytes.
  const std::string& origin() const { return origin_; }

 private:
  SafetensorsReader() = default;
  void parse(const std::byte* data, size_t size);

  std::string origin_;
  MappedFile file_;
  std::map<std::string, StTensor> tensors_;
  std::vector<std::string> names_;
  std::map<std::string, std::string> metadata_;
};

// A tensor to write; `data` holds numel(shape) * st_dtype_size(dtype) bytes.
struct StTensorRef {
  std::string name;
  StDtype dtype = StDtype::kF32;
  tensor::Shape shape;
  const void* data = nullptr;
};

// Writes `tensors` (data in the given order) and `metadata` to `path`
// atomically. InvalidArgument on an empty or duplicate name, the reserved name
// "__metadata__", or a negative dimension; IoError on write failure.
void write_safetensors(const std::string& path, const std::vector<StTensorRef>& tensors,
                       const std::map<std::string, std::string>& metadata = {});
// The same file image in memory (tests, fuzz seeds).
std::string serialize_safetensors(const std::vector<StTensorRef>& tensors,
                                  const std::map<std::string, std::string>& metadata = {});

// The file image that Hugging Face's safetensors library (its Rust `serialize`,
// which `safetensors.torch.save_file` calls) makes of the same tensors, byte for
// byte: tensors sorted by dtype, widest first in the spec's dtype order (the
// order of StDtype), ties by name (bytewise); the header compact JSON as
// serde_json writes it, "__metadata__" first, then each tensor in data order as
// {"dtype":"F32","shape":[..],"data_offsets":[begin,end]}; spaces pad it to a
// multiple of 8 bytes. The library keeps "__metadata__" in a hash map, so with
// two or more keys its order is unspecified; ours is sorted by key. Errors as
// write_safetensors.
std::string serialize_safetensors_hf(const std::vector<StTensorRef>& tensors,
                                     const std::map<std::string, std::string>& metadata = {});
void write_safetensors_hf(const std::string& path, const std::vector<StTensorRef>& tensors,
                          const std::map<std::string, std::string>& metadata = {});

}  // namespace po::checkpoint
