// The device seam (issue 36 item 2), after ggml's backend interface
// (ggml-backend-impl.h): a device allocates, copies, orders work on streams
// with events, and says which kernels it runs (`supports`). The kernels
// themselves are the table of backend/kernels.h, one per instruction-set path
// on the CPU; a CUDA backend is backend/cuda/: a Device and a table, with
// nothing in model/, parallel/ or optim/ to change.
//
// Storage knows its device (tensor/tensor.h); the state buffers of
// parallel/, model/ and optim/ (parameters, gradients, masters, shards,
// their send and receive buffers) live on the compute device, and their
// bulk copies and clears go through it: device_copy() within it,
// to_host()/from_host() for what leaves it (checkpoint staging, the pager's
// host tier), device_zero(). Copies of rows inside a kernel's work (a KV
// cache's, context parallel's) are the kernels' own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "backend/kernels.h"
#include "tensor/tensor.h"

namespace po::backend {

// Every op a device may run: the kernels table's, and the GEMM.
enum class Op : uint16_t {
#define PO_OP_ENUM(member, name, ret, params, args) member,
  PO_KERNELS(PO_OP_ENUM)
#undef PO_OP_ENUM
  gemm,
  kCount
};
const char* op_name(Op op);

// Work queued in order on a device; an Event marks a point in a stream.
class Stream {
 public:
  virtual ~Stream() = default;
};
class Event {
 public:
  virtual ~Event() = default;
  virtual bool done() const = 0;
};

class Device {
 public:
  enum class Direction : uint8_t { kDeviceToDevice, kHostToDevice, kDeviceToHost };
  virtual ~Device() = default;
  virtual tensor::DeviceKind kind() const = 0;
  // "cpu: avx512bf16 (detected), 2 threads, dnnl" and the like.
  virtual std::string describe() const = 0;

  // `bytes` zero-filled bytes aligned to `align` (a power of two); null never
  // (throws core::OutOfMemory). release() takes what allocate() gave.
  virtual void* allocate(size_t bytes, size_t align) = 0;
  virtual void release(void* p, size_t bytes) = 0;

  // Copies and clears, ordered on `stream` (null: the default stream, and
  // the call returns once done).
  virtual void copy(void* dst, const void* src, size_t bytes, Direction d, Stream* stream = nullptr) = 0;
  virtual void zero(void* dst, size_t bytes, Stream* stream = nullptr) = 0;

  virtual std::unique_ptr<Stream> create_stream() = 0;
  // An event at the stream's current end; wait(): `stream` runs nothing
  // queued after this call until `event` is done; synchronize(): the host waits.
  virtual std::unique_ptr<Event> record(Stream& stream) = 0;
  virtual void wait(Stream& stream, const Event& event) = 0;
  virtual void synchronize(const Event& event) = 0;

  // Whether this device runs `op` (else the caller falls back to the CPU's).
  virtual bool supports(Op op) const = 0;
};

// The CPU: RAM, synchronous streams, the kernels table of its instruction-set path.
Device& cpu_device();
// The device of `kind`; a kind this build has no backend for is an error naming it.
Device& device(tensor::DeviceKind kind);
// Where kernels run and the state buffers live (the CPU in this build).
Device& compute_device();

// The state buffers' bulk copies on the compute device.
inline void device_copy(void* dst, const void* src, size_t bytes) {
  compute_device().copy(dst, src, bytes, Device::Direction::kDeviceToDevice);
}
inline void to_host(void* host_dst, const void* src, size_t bytes) {
  compute_device().copy(host_dst, src, bytes, Device::Direction::kDeviceToHost);
}
inline void from_host(void* dst, const void* host_src, size_t bytes) {
  compute_device().copy(dst, host_src, bytes, Device::Direction::kHostToDevice);
}
inline void device_zero(void* dst, size_t bytes) { compute_device().zero(dst, bytes); }

}  // namespace po::backend
