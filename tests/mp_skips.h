// The one expected skip of an *_mp_test binary, and a failure for any other
// (included by mpi_world.h; a binary with its own MPI environment includes
// it directly).
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <string>

namespace po::test {

// A test of an mp binary runs at the world sizes it names and is skipped at
// the others, by PO_MP_RUNS_ONLY_IF (the one expected skip). Any other skip
// prints PO_UNEXPECTED_SKIP, which CTest's FAIL_REGULAR_EXPRESSION turns into
// a failure (tests/CMakeLists.txt): the binary's exit status alone would
// count it a success.
inline constexpr const char* kWorldSizeSkip = "world size: ";

#define PO_MP_RUNS_ONLY_IF(condition, why) \
  if (!(condition)) GTEST_SKIP() << ::po::test::kWorldSizeSkip << why

class SkipAudit : public ::testing::EmptyTestEventListener {
  // (The test's name is taken at its start: asking gtest for the current
  // test inside OnTestPartResult deadlocks on gtest's own lock.)
  void OnTestStart(const ::testing::TestInfo& t) override {
    name_ = std::string(t.test_suite_name()) + "." + t.name();
  }
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.skipped()) return;
    const std::string m = r.message() != nullptr ? r.message() : "";
    if (m.find(kWorldSizeSkip) != std::string::npos) return;
    std::printf("PO_UNEXPECTED_SKIP %s: %s\n", name_.c_str(), m.c_str());
    std::fflush(stdout);
  }
  std::string name_;
};

[[maybe_unused]] inline const bool kSkipAudit = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new SkipAudit);
  return true;
}();

}  // namespace po::test
