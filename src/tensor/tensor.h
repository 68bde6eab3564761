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
const char* device_name(DeviceKind d);
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

// Accounting pools of Storage: the compute tier (everything kernels touch:
// the default) and the host tier (the pager's host cache, memory/pager.h).
// On a CPU build both are RAM; each may have a hard budget.
enum class Pool : uint8_t { kCompute, kHost };
const char* pool_name(Pool p);

// Host RAM for Storage and the CPU device (backend/device.h): `bytes`
// zero-filled and pre-faulted, `align` a power of two (from 2 MiB: advised
// as huge pages). Throws core::OutOfMemory.
void* host_allocate(size_t bytes, size_t align);
void host_release(void* p);

// The memory of a device other than the host's, registered by its backend
// (backend/cuda/, later) for Storage to allocate on.
class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  virtual void* allocate(size_t bytes, size_t align) = 0;  // zero-filled
  virtual void release(void* p, size_t bytes) = 0;
};
void register_device_memory(DeviceKind kind, DeviceMemory* memory);

// Owning, 64-byte (large: 2 MiB) aligned, zero-filled buffer on a device
// (the CPU's: host RAM). Move-only.
class Storage {
 public:
  Storage() = default;
  // Throws core::OutOfMemory when `pool` has a budget that `bytes` would
  // exceed, and an error naming the device when this build has no backend
  // for it. `align` (a power of two) overrides the default alignment (64
  // bytes, or 2 MiB from 2 MiB up).
  explicit Storage(size_t bytes, Pool pool = Pool::kCompute, size_t align = 0,
                   DeviceKind device = DeviceKind::kCpu);
  ~Storage();
  Storage(Storage&& o) noexcept;
  Storage& operator=(Storage&& o) noexcept;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  float* f32() const { return static_cast<float*>(data_); }
  size_t size() const { return bytes_; }
  DeviceKind device() const { return device_; }

 private:
  void release();
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Pool pool_ = Pool::kCompute;
  DeviceKind device_ = DeviceKind::kCpu;
};

// A large host buffer reserved, not committed: address space mapped with
// MAP_NORESERVE, zero pages made at first touch (no pre-faulting, so a
// reservation may exceed RAM), and release(offset, bytes) gives the whole
// pages inside a range back to the system for good: they are unmapped, so a
// stray read of them faults instead of reading zeros. A frozen base whose
// quantized weights no longer need their f32 values (model.quant) lives in
// one. Not counted in the pools. Move-only.
class SparseStorage {
 public:
  SparseStorage() = default;
  explicit SparseStorage(size_t bytes);
  ~SparseStorage();
  SparseStorage(SparseStorage&& o) noexcept;
  SparseStorage& operator=(SparseStorage&& o) noexcept;
  SparseStorage(const SparseStorage&) = delete;
  SparseStorage& operator=(const SparseStorage&) = delete;

  void* data() const { return data_; }
  float* f32() const { return static_cast<float*>(data_); }
  size_t size() const { return bytes_; }
  // Unmaps the pages wholly inside [offset, offset + bytes); returns how many bytes that was.
  size_t release(size_t offset, size_t bytes);
  size_t released() const { return released_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0, released_ = 0;
};

// Bytes currently held by all live Storage objects, and the high-water mark.
size_t storage_bytes_live();
size_t storage_bytes_peak();
// The same per pool, and the pool's hard budget (0: none). Setting a budget
// below what the pool holds now is allowed; the next allocation then fails.
size_t pool_bytes_live(Pool p);
size_t pool_bytes_peak(Pool p);
// Starts the pool's high-water mark over from what it holds now.
void reset_pool_peak(Pool p);
void set_pool_budget(Pool p, size_t bytes);
size_t pool_budget(Pool p);

}  // namespace po::tensor
