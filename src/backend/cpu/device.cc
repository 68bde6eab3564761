// The CPU device (backend/device.h): host RAM, streams that run their work as
// it is queued (so every event is done when recorded), and every op of the
// kernels table chosen at start-up (backend/isa.h), plus the GEMM.
#include <cstring>

#include "backend/device.h"
#include "backend/isa.h"
#include "backend/ops.h"
#include "core/error.h"

namespace po::backend {
namespace {

class CpuStream final : public Stream {};

class CpuEvent final : public Event {
 public:
  bool done() const override { return true; }
};

class CpuDevice final : public Device {
 public:
  tensor::DeviceKind kind() const override { return tensor::DeviceKind::kCpu; }
  std::string describe() const override {
    return core::str_cat("cpu: kernels ", cpu::isa_description(), ", ", cpu::num_threads(), " threads, BLAS ",
                         cpu::blas_name());
  }
  void* allocate(size_t bytes, size_t align) override { return tensor::host_allocate(bytes, align); }
  void release(void* p, size_t) override { tensor::host_release(p); }
  void copy(void* dst, const void* src, size_t bytes, Direction, Stream*) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }
  void zero(void* dst, size_t bytes, Stream*) override {
    if (bytes > 0) std::memset(dst, 0, bytes);
  }
  std::unique_ptr<Stream> create_stream() override { return std::make_unique<CpuStream>(); }
  std::unique_ptr<Event> record(Stream&) override { return std::make_unique<CpuEvent>(); }
  void wait(Stream&, const Event&) override {}
  void synchronize(const Event&) override {}
  bool supports(Op op) const override {
    if (op == Op::gemm) return true;
    if (op >= Op::kCount) return false;
    const cpu::Kernels& k = cpu::kernels();
    switch (op) {
#define PO_OP_SUPPORTED(member, name, ret, params, args) \
  case Op::member: return k.member != nullptr;
      PO_KERNELS(PO_OP_SUPPORTED)
#undef PO_OP_SUPPORTED
      default: return false;
    }
  }
};

}  // namespace

const char* op_name(Op op) {
  switch (op) {
#define PO_OP_NAME(member, name, ret, params, args) \
  case Op::member: return #member;
    PO_KERNELS(PO_OP_NAME)
#undef PO_OP_NAME
    case Op::gemm: return "gemm";
    case Op::kCount: break;
  }
  return "?";
}

Device& cpu_device() {
  static CpuDevice d;
  return d;
}

Device& device(tensor::DeviceKind kind) {
  PO_CHECK(kind == tensor::DeviceKind::kCpu, "device ", tensor::device_name(kind),
           ": this build has no backend for it");
  return cpu_device();
}

Device& compute_device() { return cpu_device(); }

}  // namespace po::backend
