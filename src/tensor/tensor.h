// Dtypes, shapes, a non-owning Tensor view and owning aligned Storage.
// Storage is allocated once and reused: fresh pages cost ~12 µs each on the
// reference machine, so large buffers are 2 MiB aligned, advised as huge
// pages and pre-faulted at allocation, never per step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace po::tensor {

enum class DType : uint8_t { kF32, kBF16, kF16, kI32, kU16 };
enum class DeviceKind : uint8_t { kCpu, kCuda };

size_t dtype_size(DType d);
const char* dtype_name(DType d);

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& s);
std::string shape_str(const Shape& s);

// Non-owning view: pointer, dtype, shape (row-major, contiguous), device.
struct Tensor {
  void* data = nullptr;
  DType dtype = DType::kF32;
  Shape shape;
  DeviceKind device = DeviceKind::kCpu;

  int64_t numel() const { return shape_numel(shape); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  float* f32() const { return static_cast<float*>(data); }
};

// Owning, 64-byte (large: 2 MiB) aligned, zero-filled host buffer. Move-only.
class Storage {
 public:
  Storage() = default;
  explicit Storage(size_t bytes);
  ~Storage();
  Storage(Storage&& o) noexcept;
  Storage& operator=(Storage&& o) noexcept;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  float* f32() const { return static_cast<float*>(data_); }
  size_t size() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Bytes currently held by all live Storage objects, and the high-water mark.
size_t storage_bytes_live();
size_t storage_bytes_peak();

}  // namespace po::tensor
