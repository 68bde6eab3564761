// Every collective of the MPI backend on real processes, against references
// computed locally. Run under mpirun (tests/CMakeLists.txt registers 1, 2, 3,
// 4 and 8 ranks); rank k's input is value(k, i), small integers in [-6, 6], so
// sums over up to 8 ranks (|sum| <= 48) are exact in f32, bf16 and f16 and the
// comparisons are exact: avg is checked as round(dtype, f32 sum / size), the
// same single rounding the backend does. Every rank runs every collective even
// when a check fails (EXPECT, never an early return), so one failing rank
// fails its test without hanging the others; a rank that does hang is ended by
// the communicator's timeout. Ranks other than 0 print only failures.
//
// 16-bit reductions carry 16 bits on the wire and round at every combining
// step (as NCCL does), which is exact for these small integers; the
// Inexact16Test cases use random inputs in [-1, 1] and check the result
// against the exact sum of the same 16-bit inputs within one 16-bit rounding
// per hop, and that every rank holds the same bits after an allreduce.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../mp_skips.h"
#include "comm/communicator.h"
#include "comm/env.h"
#include "comm/mesh.h"
#include "comm/mpi/check.h"
#include "comm/mpi/communicator.h"
#include "core/bf16.h"
#include "core/error.h"
#include "core/f16.h"

namespace po::comm {
namespace {

using tensor::DType;

constexpr size_t kBigBytes = size_t{64} << 20;
constexpr int kModulus = 13;

mpi::MpiCommunicator* g_world = nullptr;

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  // Remembers the name here: UnitTest::current_test_info() would deadlock
  // inside OnTestPartResult (gtest holds its mutex there).
  void OnTestStart(const ::testing::TestInfo& info) override {
    test_ = core::str_cat(info.test_suite_name(), ".", info.name());
  }
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s: %s:%d: Failure\n%s\n", rank_, test_.c_str(),
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.message());
  }

 private:
  int rank_;
  std::string test_;
};

class MpiEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    session_ = std::make_unique<mpi::Session>();
    mpi::MpiOptions options;
    options.timeout = std::chrono::seconds(60);
    world_ = mpi::MpiCommunicator::create_world(options);
    g_world = world_.get();
    if (world_->rank() != 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new RankFailurePrinter(world_->rank()));
    }
  }
  void TearDown() override {
    g_world = nullptr;
    world_.reset();
    session_.reset();
  }

 private:
  std::unique_ptr<mpi::Session> session_;
  std::unique_ptr<mpi::MpiCommunicator> world_;
};

[[maybe_unused]] ::testing::Environment* const kEnv =
    ::testing::AddGlobalTestEnvironment(new MpiEnvironment);

float value(int rank, size_t i) {
  return static_cast<float>(static_cast<int>((i * 7 + static_cast<size_t>(rank) * 3) % kModulus) - 6);
}

float round_to(DType d, float x) {
  if (d == DType::kBF16) return core::bf16_to_f32(core::f32_to_bf16(x));
  if (d == DType::kF16) return core::f16_to_f32(core::f16{core::f32_to_f16(x).bits});
  return x;
}

// A typed buffer accessed as floats.
class Buf {
 public:
  Buf(DType d, size_t n) : dtype_(d), n_(n), bytes_(n * tensor::dtype_size(d) + 1) {}
  void* data() { return bytes_.data(); }
  size_t size() const { return n_; }
  void set(size_t i, float v) {
    if (dtype_ == DType::kF32) {
      std::memcpy(&bytes_[i * 4], &v, 4);
    } else {
      const uint16_t b = dtype_ == DType::kBF16 ? core::f32_to_bf16(v).bits : core::f32_to_f16(v).bits;
      std::memcpy(&bytes_[i * 2], &b, 2);
    }
  }
  float get(size_t i) const {
    if (dtype_ == DType::kF32) {
      float v;
      std::memcpy(&v, &bytes_[i * 4], 4);
      return v;
    }
    uint16_t b;
    std::memcpy(&b, &bytes_[i * 2], 2);
    return dtype_ == DType::kBF16 ? core::bf16_to_f32(core::bf16{b}) : core::f16_to_f32(core::f16{b});
  }
  template <typename F>
  void fill(F f) {
    for (size_t i = 0; i < n_; ++i) set(i, f(i));
  }

 private:
  DType dtype_;
  size_t n_;
  std::vector<uint8_t> bytes_;
};

// Compares buf[i] with expected(i) exactly; reports the count and the first
// mismatches.
template <typename F>
::testing::AssertionResult matches(const Buf& buf, F expected) {
  size_t bad = 0;
  std::string first;
  for (size_t i = 0; i < buf.size(); ++i) {
    const float want = expected(i);
    const float got = buf.get(i);
    if (got != want) {
      if (++bad <= 3) first += core::str_cat(" [", i, "] got ", got, " want ", want, ";");
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "rank " << g_world->rank() << ": " << bad << " of "
                                       << buf.size() << " elements differ:" << first;
}

// Reduction of value(r, i) over all ranks depends only on i % kModulus.
struct Reference {
  float sum[kModulus];
  float max[kModulus];
  explicit Reference(int size) {
    for (int m = 0; m < kModulus; ++m) {
      sum[m] = 0;
      max[m] = -1e30f;
      for (int r = 0; r < size; ++r) {
        sum[m] += value(r, m);
        max[m] = std::max(max[m], value(r, m));
      }
    }
  }
  float at(size_t i, ReduceOp op, DType d, int size) const {
    const size_t m = i % kModulus;
    switch (op) {
      case ReduceOp::kSum: return round_to(d, sum[m]);
      case ReduceOp::kAvg: return round_to(d, sum[m] / static_cast<float>(size));
      case ReduceOp::kMax: return max[m];
    }
    return 0;
  }
};

struct Case {
  DType dtype;
  size_t count;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return core::str_cat(tensor::dtype_name(info.param.dtype), "_", info.param.count);
}

class CollectivesTest : public ::testing::TestWithParam<Case> {
 protected:
  Communicator& world() { return *g_world; }
  DType dtype() const { return GetParam().dtype; }
  size_t count() const { return GetParam().count; }
  // Per-rank block for collectives whose total is size() blocks: for the
  // 64 MiB cases the total, not each block, is 64 MiB (8 ranks x 512 MiB
  // would not fit next to each other here).
  size_t block() {
    const bool big = count() * tensor::dtype_size(dtype()) >= kBigBytes;
    return big ? count() / static_cast<size_t>(world().size()) : count();
  }
};

const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax};

TEST_P(CollectivesTest, Allreduce) {
  const int rank = world().rank(), size = world().size();
  const Reference ref(size);
  for (ReduceOp op : kOps) {
    SCOPED_TRACE(reduce_op_name(op));
    Buf buf(dtype(), count());
    buf.fill([&](size_t i) { return value(rank, i); });
    world().allreduce(buf.data(), count(), dtype(), op);
    EXPECT_TRUE(matches(buf, [&](size_t i) { return ref.at(i, op, dtype(), size); }));
  }
}

TEST_P(CollectivesTest, ReduceScatter) {
  const int rank = world().rank(), size = world().size();
  const size_t n = block();
  const Reference ref(size);
  for (ReduceOp op : kOps) {
    SCOPED_TRACE(reduce_op_name(op));
    Buf send(dtype(), n * size), recv(dtype(), n);
    send.fill([&](size_t i) { return value(rank, i); });
    world().reduce_scatter(send.data(), recv.data(), n, dtype(), op);
    EXPECT_TRUE(matches(recv, [&](size_t i) { return ref.at(rank * n + i, op, dtype(), size); }));
  }
}

TEST_P(CollectivesTest, AllGather) {
  const int rank = world().rank();
  const size_t n = block();
  Buf send(dtype(), n), recv(dtype(), n * world().size());
  send.fill([&](size_t i) { return value(rank, i); });
  world().all_gather(send.data(), recv.data(), n, dtype());
  EXPECT_TRUE(matches(recv, [&](size_t i) { return value(static_cast<int>(i / n), i % n); }));
}

TEST_P(CollectivesTest, BroadcastFromLastRank) {
  const int root = world().size() - 1;
  Buf buf(dtype(), count());
  buf.fill([&](size_t i) { return world().rank() == root ? value(root, i) : -100.0f; });
  world().broadcast(buf.data(), count(), dtype(), root);
  EXPECT_TRUE(matches(buf, [&](size_t i) { return value(root, i); }));
}

TEST_P(CollectivesTest, AllToAll) {
  const int rank = world().rank(), size = world().size();
  const size_t n = block();
  Buf send(dtype(), n * size), recv(dtype(), n * size);
  send.fill([&](size_t i) { return value(rank, i); });  // block j, elt k: value(rank, j*n+k)
  world().all_to_all(send.data(), recv.data(), n, dtype());
  EXPECT_TRUE(matches(recv, [&](size_t i) { return value(static_cast<int>(i / n), rank * n + i % n); }));
}

// Three operations in flight at once, completed in a different order than
// started.
TEST_P(CollectivesTest, NonBlockingOverlap) {
  const int rank = world().rank(), size = world().size();
  const size_t n = block();
  const Reference ref(size);
  Buf a(dtype(), count()), rs_send(dtype(), n * size), rs_recv(dtype(), n), ag_send(dtype(), n),
      ag_recv(dtype(), n * size);
  a.fill([&](size_t i) { return value(rank, i); });
  rs_send.fill([&](size_t i) { return value(rank, i); });
  ag_send.fill([&](size_t i) { return value(rank, i); });
  Work wa = world().iallreduce(a.data(), count(), dtype(), ReduceOp::kSum);
  Work wb = world().ireduce_scatter(rs_send.data(), rs_recv.data(), n, dtype(), ReduceOp::kAvg);
  Work wc = world().iall_gather(ag_send.data(), ag_recv.data(), n, dtype());
  EXPECT_FALSE(wa.what().empty());
  (void)wb.test();
  wc.wait();
  wa.wait();
  wb.wait();
  EXPECT_TRUE(wa.done() && wb.done() && wc.done());
  EXPECT_TRUE(wa.test());
  EXPECT_TRUE(matches(a, [&](size_t i) { return ref.at(i, ReduceOp::kSum, dtype(), size); }));
  EXPECT_TRUE(matches(rs_recv, [&](size_t i) { return ref.at(rank * n + i, ReduceOp::kAvg, dtype(), size); }));
  EXPECT_TRUE(matches(ag_recv, [&](size_t i) { return value(static_cast<int>(i / n), i % n); }));
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1000003}}) cases.push_back({d, n});
    cases.push_back({d, kBigBytes / tensor::dtype_size(d)});  // 64 MiB of elements
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Sweep, CollectivesTest, ::testing::ValuesIn(all_cases()), case_name);

// ---- 16-bit reductions with rounding ----------------------------------------

// Rank k's input for inexact sums: uniform in [-1, 1) (24 random bits), rounded
// to the dtype by Buf::set / round_to.
float random_value(int rank, size_t i) {
  uint64_t x = (static_cast<uint64_t>(rank) << 48) + i + 0x9e3779b97f4a7c15ull;  // splitmix64
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return static_cast<float>(x >> 40) * 0x1p-23f - 1.0f;
}

// Exact reference over all ranks of the 16-bit inputs at global index i (in
// double: sums of at most 8 such values are exact).
struct Exact {
  double sum = 0, abs_sum = 0, max = -1e30;
};
Exact exact_at(DType d, int size, size_t i) {
  Exact e;
  for (int r = 0; r < size; ++r) {
    const double x = round_to(d, random_value(r, i));
    e.sum += x;
    e.abs_sum += std::fabs(x);
    e.max = std::max(e.max, x);
  }
  return e;
}

// The largest |result - exact| allowed: a sum over n ranks is rounded to 16
// bits once per hop (n-1 times), each time off by at most u = 2^-8 (bf16) or
// 2^-11 (f16) of a partial sum, whose magnitude is at most sum|x| (grown by
// the earlier roundings), plus half the smallest subnormal per rounding. avg
// divides that sum by n in f32 and rounds once more; max is exact.
double allowed_error(DType d, ReduceOp op, int n, const Exact& e) {
  if (op == ReduceOp::kMax) return 0;
  const double u = d == DType::kBF16 ? 0x1p-8 : 0x1p-11;
  const double tiny = d == DType::kBF16 ? 0x1p-134 : 0x1p-25;
  const int hops = n - 1;
  const double sum_err = hops * (u * e.abs_sum * std::pow(1 + u, hops) + tiny);
  if (op == ReduceOp::kSum) return sum_err;
  const double avg = (std::fabs(e.sum) + sum_err) / n;
  return sum_err / n + (u + 0x1p-23) * avg + tiny;
}

double expected(ReduceOp op, int n, const Exact& e) {
  switch (op) {
    case ReduceOp::kSum: return e.sum;
    case ReduceOp::kAvg: return e.sum / n;
    case ReduceOp::kMax: return e.max;
  }
  return 0;
}

// buf[i] against the exact reduction of global index first + i, within
// allowed_error(); reports the count and the first mismatches with the rank,
// index, values and bound.
::testing::AssertionResult within_rounding(const Buf& buf, DType d, ReduceOp op, size_t first) {
  const int rank = g_world->rank(), size = g_world->size();
  size_t bad = 0;
  std::string detail;
  for (size_t i = 0; i < buf.size(); ++i) {
    const Exact e = exact_at(d, size, first + i);
    const double want = expected(op, size, e), got = buf.get(i);
    const double bound = allowed_error(d, op, size, e);
    if (!(std::fabs(got - want) <= bound)) {
      if (++bad <= 3) {
        detail += core::str_cat(" [", first + i, "] got ", got, " want ", want, " (off by ",
                                std::fabs(got - want), ", allowed ", bound, ", sum|x| ",
                                e.abs_sum, ");");
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "rank " << rank << ": " << bad << " of " << buf.size()
                                       << " elements beyond one rounding per hop:" << detail;
}

// Whether every rank holds rank 0's bits (which are broadcast for the check).
::testing::AssertionResult same_bits_everywhere(Buf& buf, DType d) {
  const size_t n = buf.size();
  Buf root(d, n);
  std::memcpy(root.data(), buf.data(), n * tensor::dtype_size(d));
  g_world->broadcast(root.data(), n, DType::kU16, 0);
  const uint16_t* mine = static_cast<const uint16_t*>(buf.data());
  const uint16_t* theirs = static_cast<const uint16_t*>(root.data());
  size_t bad = 0;
  std::string detail;
  for (size_t i = 0; i < n; ++i) {
    if (mine[i] != theirs[i] && ++bad <= 3) {
      detail += core::str_cat(" [", i, "] here ", buf.get(i), " (bits ", mine[i], "), rank 0 ",
                              root.get(i), " (bits ", theirs[i], ");");
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "rank " << g_world->rank() << ": " << bad << " of " << n
                                       << " elements differ from rank 0's after allreduce:"
                                       << detail;
}

class Inexact16Test : public ::testing::TestWithParam<Case> {
 protected:
  DType dtype() const { return GetParam().dtype; }
  size_t count() const { return GetParam().count; }
};

TEST_P(Inexact16Test, Allreduce) {
  const int rank = g_world->rank();
  for (ReduceOp op : kOps) {
    SCOPED_TRACE(reduce_op_name(op));
    Buf buf(dtype(), count());
    buf.fill([&](size_t i) { return random_value(rank, i); });
    g_world->allreduce(buf.data(), count(), dtype(), op);
    EXPECT_TRUE(within_rounding(buf, dtype(), op, 0));
    EXPECT_TRUE(same_bits_everywhere(buf, dtype()));
  }
}

TEST_P(Inexact16Test, ReduceScatter) {
  const int rank = g_world->rank(), size = g_world->size();
  const size_t n = count() / static_cast<size_t>(size);  // the total is count()
  for (ReduceOp op : kOps) {
    SCOPED_TRACE(reduce_op_name(op));
    Buf send(dtype(), n * size), recv(dtype(), n);
    send.fill([&](size_t i) { return random_value(rank, i); });
    g_world->reduce_scatter(send.data(), recv.data(), n, dtype(), op);
    EXPECT_TRUE(within_rounding(recv, dtype(), op, static_cast<size_t>(rank) * n));
  }
}

// 2M elements (4 MiB) take the ring; 1000 stay with MPI and our user op.
std::vector<Case> inexact_cases() {
  std::vector<Case> cases;
  for (DType d : {DType::kBF16, DType::kF16}) {
    for (size_t n : {size_t{1000}, size_t{2} << 20}) cases.push_back({d, n});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Rounded, Inexact16Test, ::testing::ValuesIn(inexact_cases()), case_name);

TEST(CommTest, WorldMatchesLaunchEnvironment) {
  const LaunchEnv env = detect_launch_env();
  EXPECT_EQ(env.rank, g_world->rank());
  EXPECT_EQ(env.world_size, g_world->size());
  EXPECT_EQ(g_world->name(), "world");
}

// Every factorisation dp x tp x pp (x cp) of the world: the real groups made
// by split(group_color, rank_in_group) have the mesh's members, in its order.
// At 8 ranks this covers e.g. 2x2x2, 4x2x1, 1x2x4 and 2x1x2x2.
TEST(CommTest, MeshGroupsOnRealCommunicators) {
  const int n = g_world->size(), me = g_world->rank();
  int layouts = 0;
  for (int dp = 1; dp <= n; ++dp)
    for (int tp = 1; dp * tp <= n; ++tp)
      for (int pp = 1; dp * tp * pp <= n; ++pp) {
        if (n % (dp * tp * pp) != 0) continue;
        const int cp = n / (dp * tp * pp);
        const DeviceMesh mesh(n, {.dp = dp, .tp = tp, .pp = pp, .cp = cp});
        ++layouts;
        for (Axis axis : kAllAxes) {
          const std::string what = "dp" + std::to_string(dp) + " tp" + std::to_string(tp) +
                                   " pp" + std::to_string(pp) + " cp" + std::to_string(cp) +
                                   " axis " + axis_name(axis);
          auto group = g_world->split(mesh.group_color(me, axis), mesh.rank_in_group(me, axis));
          ASSERT_NE(group, nullptr) << what;
          const std::vector<int> members = mesh.group(me, axis);
          ASSERT_EQ(group->size(), static_cast<int>(members.size())) << what;
          EXPECT_EQ(group->rank(), mesh.rank_in_group(me, axis)) << what;
          std::vector<int32_t> got(members.size());
          const int32_t mine = me;
          group->all_gather(&mine, got.data(), 1, tensor::DType::kI32);
          EXPECT_EQ(std::vector<int>(got.begin(), got.end()), members)
              << what << ": world ranks gathered over the group differ from the mesh's";
        }
      }
  EXPECT_GT(layouts, 0);
}

TEST(CommTest, ThreadLevelRecorded) {
  int provided = 0;
  MPI_Query_thread(&provided);
  EXPECT_EQ(mpi::thread_level(),
            provided >= MPI_THREAD_MULTIPLE ? mpi::ThreadLevel::kMultiple : mpi::ThreadLevel::kFunneled);
}

TEST(CommTest, SplitByParityReversedOrder) {
  const int rank = g_world->rank(), size = g_world->size();
  auto sub = g_world->split(rank % 2, -rank);
  ASSERT_NE(sub, nullptr);
  int expected_size = 0, expected_rank = 0;
  for (int r = 0; r < size; ++r) {
    if (r % 2 != rank % 2) continue;
    ++expected_size;
    if (r > rank) ++expected_rank;  // key -rank: higher world ranks come first
  }
  EXPECT_EQ(sub->size(), expected_size);
  EXPECT_EQ(sub->rank(), expected_rank);
  EXPECT_EQ(sub->name(), core::str_cat("world/", rank % 2));
  float x = static_cast<float>(rank);
  sub->allreduce(&x, 1, DType::kF32, ReduceOp::kSum);
  float want = 0;
  for (int r = rank % 2; r < size; r += 2) want += static_cast<float>(r);
  EXPECT_EQ(x, want);
  // Sub-groups split again (mesh groups of mesh groups).
  auto single = sub->split(sub->rank(), 0, "single");
  ASSERT_NE(single, nullptr);
  EXPECT_EQ(single->size(), 1);
  EXPECT_EQ(single->name(), "single");
  single->barrier();
}

TEST(CommTest, SplitWithoutColorGivesNull) {
  const int rank = g_world->rank();
  auto sub = g_world->split(rank == 0 ? Communicator::kNoColor : 7, rank);
  if (rank == 0) {
    EXPECT_EQ(sub, nullptr);
  } else {
    ASSERT_NE(sub, nullptr);
    EXPECT_EQ(sub->size(), g_world->size() - 1);
    EXPECT_EQ(sub->rank(), rank - 1);
  }
}

TEST(CommTest, SendRecvRing) {
  const int rank = g_world->rank(), size = g_world->size();
  const int right = (rank + 1) % size, left = (rank + size - 1) % size;
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(tensor::dtype_name(d));
    Buf out(d, 1000), in(d, 1000);
    out.fill([&](size_t i) { return value(rank, i); });
    Work r = g_world->irecv(in.data(), 1000, d, left, 5);
    Work s = g_world->isend(out.data(), 1000, d, right, 5);
    s.wait();
    r.wait();
    EXPECT_TRUE(matches(in, [&](size_t i) { return value(left, i); }));
  }
  // Blocking pairs: even ranks send first, their right neighbour receives.
  if (size >= 2) {
    std::vector<int32_t> msg(3, rank), got(3, -1);
    const bool sender = rank % 2 == 0 && rank + 1 < size;
    const bool receiver = rank % 2 == 1;
    if (sender) g_world->send(msg.data(), 3, DType::kI32, rank + 1, 9);
    if (receiver) {
      g_world->recv(got.data(), 3, DType::kI32, rank - 1, 9);
      EXPECT_EQ(got, std::vector<int32_t>(3, rank - 1));
    }
  }
  g_world->barrier();
}

TEST(CommTest, BroadcastFromEveryRoot) {
  for (int root = 0; root < g_world->size(); ++root) {
    std::vector<uint16_t> buf(5, g_world->rank() == root ? static_cast<uint16_t>(100 + root) : 0);
    g_world->broadcast(buf.data(), buf.size(), DType::kU16, root);
    EXPECT_EQ(buf, std::vector<uint16_t>(5, static_cast<uint16_t>(100 + root))) << "root " << root;
  }
}

// Rank 0 starts an allreduce that the others join only after a barrier: its
// short wait times out naming the operation, and a later wait completes it.
TEST(CommTest, WaitTimesOutNamingTheOperation) {
  PO_MP_RUNS_ONLY_IF(g_world->size() >= 2, "needs two ranks");
  auto group = g_world->split(0, 0, "late");
  float x = 1;
  if (g_world->rank() == 0) {
    Work w = group->iallreduce(&x, 1, DType::kF32, ReduceOp::kSum);
    try {
      w.wait(std::chrono::milliseconds(50));
      ADD_FAILURE() << "wait returned before the other ranks joined";
    } catch (const core::Timeout& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("allreduce(sum, F32, 1 elements) on group 'late' (rank 0 of"), std::string::npos)
          << msg;
      EXPECT_NE(msg.find("did not complete within 50 ms"), std::string::npos) << msg;
    }
    EXPECT_FALSE(w.done());
    g_world->barrier();
    w.wait();
  } else {
    g_world->barrier();
    group->allreduce(&x, 1, DType::kF32, ReduceOp::kSum);
  }
  EXPECT_EQ(x, static_cast<float>(g_world->size()));
}

TEST(CommTest, MpiErrorBecomesCommError) {
  try {
    PO_MPI_CHECK(MPI_Send(nullptr, -1, MPI_FLOAT, 0, 0, g_world->handle()));
    ADD_FAILURE() << "negative count accepted";
  } catch (const core::CommError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("MPI_Send(nullptr, -1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("collectives_mp_test.cc:"), std::string::npos) << msg;
    EXPECT_NE(msg.find(core::str_cat("on rank ", g_world->rank())), std::string::npos) << msg;
  }
}

// Argument errors are caught before MPI is called, so they are local.
TEST(CommTest, InvalidArguments) {
  int32_t i = 0;
  float f = 0;
  EXPECT_THROW(g_world->allreduce(&i, 1, DType::kI32, ReduceOp::kSum), core::InvalidArgument);
  EXPECT_THROW(g_world->send(&f, 1, DType::kF32, g_world->size(), 0), core::InvalidArgument);
  EXPECT_THROW(g_world->recv(&f, 1, DType::kF32, -1, 0), core::InvalidArgument);
  EXPECT_THROW(g_world->send(&f, 1, DType::kF32, 0, -3), core::InvalidArgument);
  EXPECT_THROW(g_world->broadcast(&f, 1, DType::kF32, g_world->size()), core::InvalidArgument);
  EXPECT_THROW(g_world->split(-5, 0), core::InvalidArgument);
}

}  // namespace
}  // namespace po::comm
