// The device seam (backend/device.h): the CPU device's memory, copies,
// streams and events, which ops it runs, and Storage on a device: the CPU's,
// one this build has no backend for (named), and one a backend registers
// (a stand-in here, counting its calls).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "backend/device.h"
#include "backend/isa.h"
#include "core/error.h"
#include "tensor/tensor.h"

namespace be = po::backend;
using po::tensor::DeviceKind;

namespace {

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const po::core::Error& e) {
    return e.what();
  }
  return "";
}

TEST(Device, CpuAllocatesAlignedZeroedMemoryAndCopiesEveryWay) {
  be::Device& d = be::cpu_device();
  EXPECT_EQ(d.kind(), DeviceKind::kCpu);
  EXPECT_NE(d.describe().find(po::backend::cpu::isa_name(po::backend::cpu::active_isa())), std::string::npos)
      << d.describe();
  for (size_t align : {size_t{64}, size_t{4096}, size_t{2} << 20}) {
    const size_t n = 3 * align + 5;
    auto* p = static_cast<unsigned char*>(d.allocate(n, align));
    ASSERT_EQ(reinterpret_cast<uintptr_t>(p) % align, 0u) << align;
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(p[i], 0) << "byte " << i << " of a fresh allocation";
    d.release(p, n);
  }
  std::vector<float> host(1000), back(1000, -1.0f);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i) * 0.25f;
  const size_t bytes = host.size() * sizeof(float);
  void* a = d.allocate(bytes, 64);
  void* b = d.allocate(bytes, 64);
  auto stream = d.create_stream();
  be::from_host(a, host.data(), bytes);
  d.copy(b, a, bytes, be::Device::Direction::kDeviceToDevice, stream.get());
  const auto event = d.record(*stream);
  d.wait(*stream, *event);
  d.synchronize(*event);
  EXPECT_TRUE(event->done());
  be::to_host(back.data(), b, bytes);
  EXPECT_EQ(back, host);
  be::device_zero(b, bytes / 2);
  be::to_host(back.data(), b, bytes);
  for (size_t i = 0; i < back.size(); ++i) ASSERT_EQ(back[i], i < 500 ? 0.0f : host[i]) << i;
  d.release(a, bytes);
  d.release(b, bytes);
}

TEST(Device, TheCpuRunsEveryOpOfItsTable) {
  be::Device& d = be::cpu_device();
  int ops = 0;
  for (int i = 0; i < static_cast<int>(be::Op::kCount); ++i, ++ops)
    EXPECT_TRUE(d.supports(static_cast<be::Op>(i))) << be::op_name(static_cast<be::Op>(i));
  EXPECT_GT(ops, 50);
  EXPECT_FALSE(d.supports(be::Op::kCount));
  EXPECT_STREQ(be::op_name(be::Op::gemm), "gemm");
  EXPECT_STREQ(be::op_name(be::Op::adamw_update), "adamw_update");
  EXPECT_EQ(&be::compute_device(), &d);
  EXPECT_EQ(&be::device(DeviceKind::kCpu), &d);
}

TEST(Device, ADeviceWithoutABackendIsNamed) {
  EXPECT_NE(error_of([] { be::device(DeviceKind::kCuda); }).find("device cuda: this build has no backend for it"),
            std::string::npos);
  EXPECT_NE(error_of([] { po::tensor::Storage s(1024, po::tensor::Pool::kCompute, 0, DeviceKind::kCuda); })
                .find("a 1024-byte buffer on cuda: this build has no cuda backend"),
            std::string::npos);
}

// What a backend registers for Storage: here host memory behind counters.
class CountingMemory final : public po::tensor::DeviceMemory {
 public:
  void* allocate(size_t bytes, size_t align) override {
    ++allocations;
    return po::tensor::host_allocate(bytes, align);
  }
  void release(void* p, size_t bytes) override {
    ++releases;
    released_bytes += bytes;
    po::tensor::host_release(p);
  }
  int allocations = 0, releases = 0;
  size_t released_bytes = 0;
};

TEST(Device, StorageKnowsItsDeviceAndAllocatesThere) {
  po::tensor::Storage host(256);
  EXPECT_EQ(host.device(), DeviceKind::kCpu);
  CountingMemory mem;
  po::tensor::register_device_memory(DeviceKind::kCuda, &mem);
  const size_t before = po::tensor::pool_bytes_live(po::tensor::Pool::kCompute);
  {
    po::tensor::Storage s(4096, po::tensor::Pool::kCompute, 0, DeviceKind::kCuda);
    EXPECT_EQ(s.device(), DeviceKind::kCuda);
    EXPECT_EQ(mem.allocations, 1);
    EXPECT_EQ(po::tensor::pool_bytes_live(po::tensor::Pool::kCompute), before + 4096)
        << "a device's storage is counted in its pool";
    po::tensor::Storage moved = std::move(s);
    EXPECT_EQ(moved.device(), DeviceKind::kCuda);
    EXPECT_EQ(mem.releases, 0);
  }
  EXPECT_EQ(mem.releases, 1);
  EXPECT_EQ(mem.released_bytes, 4096u);
  EXPECT_EQ(po::tensor::pool_bytes_live(po::tensor::Pool::kCompute), before);
  po::tensor::register_device_memory(DeviceKind::kCuda, nullptr);
}

}  // namespace
