#include "tensor/tensor.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>
#include <sstream>

#include "core/error.h"

namespace po::tensor {
namespace {
std::atomic<size_t> g_live{0};
std::atomic<size_t> g_peak{0};
struct PoolCounters {
  std::atomic<size_t> live{0}, peak{0}, budget{0};
};
PoolCounters g_pools[2];
PoolCounters& counters(Pool p) { return g_pools[static_cast<int>(p)]; }

void raise_peak(std::atomic<size_t>& peak, size_t live) {
  size_t seen = peak.load();
  while (live > seen && !peak.compare_exchange_weak(seen, live)) {}
}
constexpr size_t kHuge = size_t{2} << 20;
}  // namespace

size_t dtype_size(DType d) {
  switch (d) {
    case DType::kF32: case DType::kI32: return 4;
    case DType::kBF16: case DType::kF16: case DType::kU16: return 2;
  }
  return 0;
}

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kI32: return "I32";
    case DType::kU16: return "U16";
  }
  return "?";
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

const char* pool_name(Pool p) { return p == Pool::kCompute ? "compute" : "host"; }

const char* device_name(DeviceKind d) { return d == DeviceKind::kCpu ? "cpu" : "cuda"; }

void* host_allocate(size_t bytes, size_t align) {
  const size_t rounded = (bytes + align - 1) / align * align;
  void* p = std::aligned_alloc(align, rounded);
  if (p == nullptr) PO_THROW(core::OutOfMemory, "cannot allocate ", bytes, " bytes");
  if (align == kHuge) madvise(p, rounded, MADV_HUGEPAGE);
  std::memset(p, 0, bytes);  // pre-fault now, not in the first step
  return p;
}

void host_release(void* p) { std::free(p); }

namespace {
DeviceMemory* g_device_memory[2] = {nullptr, nullptr};
}  // namespace

void register_device_memory(DeviceKind kind, DeviceMemory* memory) {
  PO_CHECK(kind != DeviceKind::kCpu, "the cpu's memory is the host's");
  g_device_memory[static_cast<int>(kind)] = memory;
}

Storage::Storage(size_t bytes, Pool pool, size_t align_override, DeviceKind device)
    : bytes_(bytes), pool_(pool), device_(device) {
  if (bytes == 0) return;
  DeviceMemory* memory = g_device_memory[static_cast<int>(device)];
  PO_CHECK(device == DeviceKind::kCpu || memory != nullptr, "a ", bytes, "-byte buffer on ",
           device_name(device), ": this build has no ", device_name(device), " backend");
  PoolCounters& c = counters(pool);
  const size_t budget = c.budget.load();
  const size_t now = c.live.fetch_add(bytes) + bytes;
  if (budget != 0 && now > budget) {
    c.live.fetch_sub(bytes);
    bytes_ = 0;
    PO_THROW(core::OutOfMemory, "the ", pool_name(pool), " tier's budget of ", budget,
             " bytes (memory.", pool == Pool::kCompute ? "compute" : "host", "_budget) is exceeded: ",
             now - bytes, " bytes held, ", bytes, " more asked for");
  }
  raise_peak(c.peak, now);
  const size_t align = align_override ? align_override : bytes >= kHuge ? kHuge : 64;
  try {
    data_ = device == DeviceKind::kCpu ? host_allocate(bytes, align) : memory->allocate(bytes, align);
  } catch (...) {
    c.live.fetch_sub(bytes);
    bytes_ = 0;
    throw;
  }
  raise_peak(g_peak, g_live.fetch_add(bytes) + bytes);
}

void Storage::release() {
  if (data_ == nullptr) return;
  g_live.fetch_sub(bytes_);
  counters(pool_).live.fetch_sub(bytes_);
  if (device_ == DeviceKind::kCpu) host_release(data_);
  else g_device_memory[static_cast<int>(device_)]->release(data_, bytes_);
  data_ = nullptr;
}

Storage::~Storage() { release(); }

Storage::Storage(Storage&& o) noexcept
    : data_(o.data_), bytes_(o.bytes_), pool_(o.pool_), device_(o.device_) {
  o.data_ = nullptr;
  o.bytes_ = 0;
}

Storage& Storage::operator=(Storage&& o) noexcept {
  if (this != &o) {
    release();
    data_ = o.data_;
    bytes_ = o.bytes_;
    pool_ = o.pool_;
    device_ = o.device_;
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

size_t storage_bytes_live() { return g_live.load(); }
size_t storage_bytes_peak() { return g_peak.load(); }

size_t pool_bytes_live(Pool p) { return counters(p).live.load(); }
size_t pool_bytes_peak(Pool p) { return counters(p).peak.load(); }
void reset_pool_peak(Pool p) { counters(p).peak.store(counters(p).live.load()); }
void set_pool_budget(Pool p, size_t bytes) { counters(p).budget.store(bytes); }
size_t pool_budget(Pool p) { return counters(p).budget.load(); }

SparseStorage::SparseStorage(size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
  if (p == MAP_FAILED) {
    bytes_ = 0;
    PO_THROW(core::OutOfMemory, "reserving ", bytes, " bytes of address space failed: ", std::strerror(errno));
  }
  data_ = p;
}

SparseStorage::~SparseStorage() {
  if (data_ != nullptr) ::munmap(data_, bytes_);  // holes left by release() included
}

SparseStorage::SparseStorage(SparseStorage&& o) noexcept
    : data_(o.data_), bytes_(o.bytes_), released_(o.released_) {
  o.data_ = nullptr;
  o.bytes_ = o.released_ = 0;
}

SparseStorage& SparseStorage::operator=(SparseStorage&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr) ::munmap(data_, bytes_);
    data_ = o.data_;
    bytes_ = o.bytes_;
    released_ = o.released_;
    o.data_ = nullptr;
    o.bytes_ = o.released_ = 0;
  }
  return *this;
}

size_t SparseStorage::release(size_t offset, size_t bytes) {
  PO_ASSERT(offset + bytes <= bytes_, "SparseStorage::release: [", offset, ", ", offset + bytes,
            ") of ", bytes_, " bytes");
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t base = reinterpret_cast<uintptr_t>(data_);
  const uintptr_t lo = (base + offset + page - 1) / page * page;
  const uintptr_t hi = (base + offset + bytes) / page * page;
  if (hi <= lo) return 0;
  PO_CHECK(::munmap(reinterpret_cast<void*>(lo), hi - lo) == 0, "SparseStorage::release: munmap: ",
           std::strerror(errno));
  released_ += hi - lo;
  return hi - lo;
}

}  // namespace po::tensor
