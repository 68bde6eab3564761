// The NCCL backend at one rank, against references computed locally.
//
// Built with NCCL (PO_HAVE_NCCL): without a CUDA device, create() must fail
// with a core::CommError naming the device, not crash; with a device, every
// collective runs on it (f32, bf16, f16 x sum, avg, max x sizes 0, 1, 1000003),
// plus p2p to self, split, barrier, abort, and the widen/narrow kernels
// bit for bit against core/bf16.h and core/f16.h. The bootstrap is a one-rank
// host-memory loopback, so this test needs neither MPI nor a second GPU; the
// multi-rank run (real processes, one GPU each) is for a multi-GPU machine.
// Built without NCCL: one test that skips, saying so.
#include <gtest/gtest.h>

#ifdef PO_HAVE_NCCL

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/nccl/communicator.h"
#include "comm/nccl/convert.h"
#include "core/bf16.h"
#include "core/error.h"
#include "core/f16.h"

namespace po::comm {
namespace {

using tensor::DType;

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

// A one-rank group over host memory: the bootstrap for create() here.
class SelfCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const std::string& name() const override { return name_; }
  Duration timeout() const override { return std::chrono::seconds(10); }
  // Over one rank a reduction is the input itself, rounded back exactly.
  Work iallreduce(void*, size_t, DType, ReduceOp) override { return {}; }
  Work ireduce_scatter(const void* send, void* recv, size_t n, DType d, ReduceOp) override {
    std::memcpy(recv, send, n * tensor::dtype_size(d));
    return {};
  }
  Work iall_gather(const void* send, void* recv, size_t n, DType d) override {
    std::memcpy(recv, send, n * tensor::dtype_size(d));
    return {};
  }
  Work ibroadcast(void*, size_t, DType, int) override { return {}; }
  Work isend(const void*, size_t, DType, int, int) override { return unsupported(); }
  Work irecv(void*, size_t, DType, int, int) override { return unsupported(); }
  Work iall_to_all(const void* send, void* recv, size_t n, DType d) override {
    std::memcpy(recv, send, n * tensor::dtype_size(d));
    return {};
  }
  Work ibarrier() override { return {}; }
  std::unique_ptr<Communicator> split(int color, int, const std::string&) override {
    if (color == kNoColor) return nullptr;
    return std::make_unique<SelfCommunicator>();
  }

 private:
  static Work unsupported() { PO_THROW(core::InvalidArgument, "SelfCommunicator has no peers"); }
  std::string name_ = "self";
};

// ---- without a device ------------------------------------------------------

TEST(nccl, CreateWithoutDeviceIsCommError) {
  if (device_count() > 0) GTEST_SKIP() << "a CUDA device is present; the device tests cover it";
  SelfCommunicator boot;
  try {
    nccl::NcclCommunicator::create(boot, 0);
    FAIL() << "create() succeeded without a CUDA device";
  } catch (const core::CommError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("no usable CUDA device"), std::string::npos) << what;
    EXPECT_NE(what.find("group 'self' (rank 0 of 1, CUDA device 0)"), std::string::npos) << what;
    EXPECT_NE(what.find("cudaGetDeviceCount"), std::string::npos) << what;
  }
}

// ---- with a device ---------------------------------------------------------

// Device memory holding n elements of d, freed on scope exit.
class DeviceBuffer {
 public:
  DeviceBuffer(size_t n, DType d) : bytes_(n * tensor::dtype_size(d)) {
    if (bytes_ > 0) {
      EXPECT_EQ(cudaMalloc(&ptr_, bytes_), cudaSuccess);
    }
  }
  ~DeviceBuffer() { (void)cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }
  // The stream of a collective does not wait for the legacy stream: finish
  // the copy before the collective reads it.
  void upload(const std::vector<uint16_t>& v) { upload_bytes(v.data()); }
  void upload(const std::vector<float>& v) { upload_bytes(v.data()); }
  template <typename T>
  std::vector<T> download() const {
    std::vector<T> v(bytes_ / sizeof(T));
    if (bytes_ > 0) {
      EXPECT_EQ(cudaMemcpy(v.data(), ptr_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return v;
  }

 private:
  void upload_bytes(const void* src) {
    if (bytes_ == 0) return;
    EXPECT_EQ(cudaMemcpy(ptr_, src, bytes_, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  void* ptr_ = nullptr;
  size_t bytes_;
};

// Inputs with fractions, so that they are not all exact in 16 bits.
float value(size_t i) {
  return (static_cast<float>(i % 97) - 48.0f) * 0.37f + 1e-3f * static_cast<float>(i % 7);
}

uint16_t to_half(DType d, float x) {
  return d == DType::kBF16 ? core::f32_to_bf16(x).bits : core::f32_to_f16(x).bits;
}
float from_half(DType d, uint16_t bits) {
  return d == DType::kBF16 ? core::bf16_to_f32(core::bf16{bits})
                           : core::f16_to_f32(core::f16{bits});
}

// The contract's reference for one rank: widen, reduce over size() = 1 rank
// in f32, divide (avg), round once.
uint16_t reference_half(DType d, uint16_t in, ReduceOp op, int size) {
  const float sum = from_half(d, in);
  return to_half(d, op == ReduceOp::kAvg ? sum / static_cast<float>(size) : sum);
}

class nccl_device : public ::testing::Test {
 protected:
  void SetUp() override {
    if (device_count() == 0) GTEST_SKIP() << "no CUDA device: this test runs on a GPU machine";
    comm_ = nccl::NcclCommunicator::create(boot_, 0,
                                           {.name = "one", .timeout = std::chrono::seconds(60)});
  }
  SelfCommunicator boot_;
  std::unique_ptr<nccl::NcclCommunicator> comm_;
};

constexpr size_t kSizes[] = {0, 1, 1000003};
constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax};

TEST_F(nccl_device, AllreduceMatchesReference) {
  EXPECT_EQ(comm_->rank(), 0);
  EXPECT_EQ(comm_->size(), 1);
  for (size_t n : kSizes) {
    for (ReduceOp op : kOps) {
      SCOPED_TRACE(::testing::Message() << n << " elements, " << reduce_op_name(op));
      std::vector<float> f(n);
      for (size_t i = 0; i < n; ++i) f[i] = value(i);
      DeviceBuffer df(n, DType::kF32);
      df.upload(f);
      comm_->allreduce(df.get(), n, DType::kF32, op);
      EXPECT_EQ(df.download<float>(), f) << "F32";  // x / 1 == x exactly
      for (DType d : {DType::kBF16, DType::kF16}) {
        std::vector<uint16_t> h(n), want(n);
        for (size_t i = 0; i < n; ++i) {
          h[i] = to_half(d, f[i]);
          want[i] = reference_half(d, h[i], op, 1);
        }
        DeviceBuffer dh(n, d);
        dh.upload(h);
        comm_->allreduce(dh.get(), n, d, op);
        EXPECT_EQ(dh.download<uint16_t>(), want) << tensor::dtype_name(d);
      }
    }
  }
}

TEST_F(nccl_device, ReduceScatterMatchesReference) {
  for (size_t n : kSizes) {
    for (ReduceOp op : kOps) {
      SCOPED_TRACE(::testing::Message() << n << " elements, " << reduce_op_name(op));
      for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
        std::vector<float> f(n);
        std::vector<uint16_t> h(n), want(n);
        for (size_t i = 0; i < n; ++i) {
          f[i] = value(i);
          h[i] = to_half(d, f[i]);
          want[i] = reference_half(d, h[i], op, 1);
        }
        DeviceBuffer send(n, d), recv(n, d);
        if (d == DType::kF32) {
          send.upload(f);
        } else {
          send.upload(h);
        }
        comm_->reduce_scatter(send.get(), recv.get(), n, d, op);
        if (d == DType::kF32) {
          EXPECT_EQ(recv.download<float>(), f) << "F32";
        } else {
          EXPECT_EQ(recv.download<uint16_t>(), want) << tensor::dtype_name(d);
        }
      }
    }
  }
}

TEST_F(nccl_device, DataMovementCopiesEveryDtype) {
  for (size_t n : kSizes) {
    SCOPED_TRACE(::testing::Message() << n << " elements");
    std::vector<float> f(n);
    for (size_t i = 0; i < n; ++i) f[i] = value(i);
    for (DType d : {DType::kF32, DType::kI32}) {  // 4-byte types move as raw bytes
      DeviceBuffer send(n, d), recv(n, d), all(n, d);
      send.upload(f);
      comm_->all_gather(send.get(), recv.get(), n, d);
      EXPECT_EQ(recv.download<float>(), f) << "all_gather " << tensor::dtype_name(d);
      comm_->all_to_all(send.get(), all.get(), n, d);
      EXPECT_EQ(all.download<float>(), f) << "all_to_all " << tensor::dtype_name(d);
      comm_->broadcast(send.get(), n, d, 0);
      EXPECT_EQ(send.download<float>(), f) << "broadcast " << tensor::dtype_name(d);
    }
  }
}

TEST_F(nccl_device, SendRecvToSelfIsOneBatch) {
  // Posted like MPI (send, recv, then wait): the batch launches both at once.
  const size_t n = 4099;
  std::vector<uint16_t> h(n);
  for (size_t i = 0; i < n; ++i) h[i] = static_cast<uint16_t>(i * 7);
  DeviceBuffer send(n, DType::kU16), recv(n, DType::kU16);
  send.upload(h);
  Work s = comm_->isend(send.get(), n, DType::kU16, 0, 5);
  Work r = comm_->irecv(recv.get(), n, DType::kU16, 0, 5);
  r.wait();
  s.wait();
  EXPECT_EQ(recv.download<uint16_t>(), h);
  EXPECT_THROW(comm_->isend(send.get(), n, DType::kU16, 1, 0), core::InvalidArgument);
  EXPECT_THROW(comm_->irecv(recv.get(), n, DType::kU16, 0, -1), core::InvalidArgument);
}

TEST_F(nccl_device, SplitBarrierAndNonBlockingOverlap) {
  comm_->barrier();
  EXPECT_EQ(comm_->split(Communicator::kNoColor, 0), nullptr);
  std::unique_ptr<Communicator> sub = comm_->split(3, 0);
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->name(), "one/3");
  EXPECT_EQ(sub->size(), 1);
  // Three operations in flight on two communicators, waited out of order.
  const size_t n = 1 << 20;
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = value(i);
  DeviceBuffer a(n, DType::kF32), b(n, DType::kF32), c(n, DType::kF32);
  a.upload(f);
  b.upload(f);
  c.upload(f);
  Work wa = comm_->iallreduce(a.get(), n, DType::kF32, ReduceOp::kSum);
  Work wb = sub->iallreduce(b.get(), n, DType::kF32, ReduceOp::kAvg);
  Work wc = comm_->ibroadcast(c.get(), n, DType::kF32, 0);
  wc.wait();
  wb.wait();
  wa.wait();
  EXPECT_EQ(a.download<float>(), f);
  EXPECT_EQ(b.download<float>(), f);
  EXPECT_EQ(c.download<float>(), f);
  EXPECT_THROW(comm_->allreduce(a.get(), n, DType::kI32, ReduceOp::kSum), core::InvalidArgument);
}

TEST_F(nccl_device, AbortMakesLaterCallsCommError) {
  comm_->abort();
  EXPECT_TRUE(comm_->aborted());
  comm_->abort();  // idempotent
  DeviceBuffer a(1, DType::kF32);
  try {
    comm_->allreduce(a.get(), 1, DType::kF32, ReduceOp::kSum);
    FAIL() << "allreduce after abort() did not throw";
  } catch (const core::CommError& e) {
    EXPECT_NE(std::string(e.what()).find("aborted"), std::string::npos) << e.what();
  }
}

// The kernels against the host conversions, bit for bit (NaN: any NaN), over
// specials, halfway cases, f16 subnormals and overflow, and pseudo-random bits.
TEST_F(nccl_device, ConversionKernelsMatchCore) {
  std::vector<float> x = {0.0f,     -0.0f,     1.0f,  -1.0f,  65504.0f,    65520.0f,
                          70000.0f, 1e-7f,     6e-8f, 3e-5f,  1.00390625f, 1.01171875f,
                          INFINITY, -INFINITY, NAN,   3.4e38f};
  uint32_t state = 12345;
  for (int i = 0; i < 100000; ++i) {
    state = state * 1664525u + 1013904223u;
    float f;
    std::memcpy(&f, &state, 4);
    x.push_back(f);
  }
  const size_t n = x.size();
  DeviceBuffer src(n, DType::kF32), wide(n, DType::kF32), half(n, DType::kU16);
  src.upload(x);
  for (DType d : {DType::kBF16, DType::kF16}) {
    const auto type = d == DType::kBF16 ? nccl::kernels::Half::kBF16 : nccl::kernels::Half::kF16;
    for (float divisor : {1.0f, 3.0f, 8.0f}) {
      ASSERT_EQ(nccl::kernels::narrow(static_cast<const float*>(src.get()), type, half.get(), n,
                                      divisor, nullptr),
                cudaSuccess);
      ASSERT_EQ(nccl::kernels::widen(half.get(), type, static_cast<float*>(wide.get()), n, nullptr),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<uint16_t> got = half.download<uint16_t>();
      const std::vector<float> back = wide.download<float>();
      int bad = 0;
      for (size_t i = 0; i < n && bad < 5; ++i) {
        const uint16_t want = to_half(d, x[i] / divisor);
        const bool both_nan = std::isnan(from_half(d, want)) && std::isnan(from_half(d, got[i]));
        if (!both_nan && got[i] != want) {
          ADD_FAILURE() << tensor::dtype_name(d) << " narrow(" << x[i] << " / " << divisor
                        << "): device 0x" << std::hex << got[i] << ", host 0x" << want << std::dec;
          ++bad;
        }
        const float w = from_half(d, got[i]);
        if (!(std::isnan(w) && std::isnan(back[i])) && std::memcmp(&w, &back[i], 4) != 0) {
          ADD_FAILURE() << tensor::dtype_name(d) << " widen(0x" << std::hex << got[i] << std::dec
                        << "): device " << back[i] << ", host " << w;
          ++bad;
        }
      }
    }
  }
  std::vector<float> y = {3.0f, -6.0f, 1.5f};
  DeviceBuffer dy(y.size(), DType::kF32);
  dy.upload(y);
  ASSERT_EQ(nccl::kernels::divide(static_cast<float*>(dy.get()), y.size(), 3.0f, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(dy.download<float>(), (std::vector<float>{1.0f, -2.0f, 0.5f}));
}

TEST_F(nccl_device, MissingDeviceIndexIsCommError) {
  SelfCommunicator boot;
  const int count = device_count();
  try {
    nccl::NcclCommunicator::create(boot, count);
    FAIL() << "create() accepted CUDA device " << count << " of " << count;
  } catch (const core::CommError& e) {
    EXPECT_NE(std::string(e.what()).find(core::str_cat("CUDA device ", count, " does not exist")),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace po::comm

#else  // !PO_HAVE_NCCL

TEST(nccl, NotBuilt) {
  GTEST_SKIP() << "the NCCL backend was not built (PO_NCCL=OFF, or CUDA/NCCL not found at "
                  "configure time; see docs/comm.md)";
}

#endif
