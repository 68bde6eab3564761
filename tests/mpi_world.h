// The MPI world of an *_mp_test binary (run whole under mpirun, once per
// world size: tests/CMakeLists.txt): a gtest environment that starts the MPI
// session and the world communicator (60 s timeout) before the tests and
// ends them after. Include it in exactly one file of the binary.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <memory>

#include "comm/mpi/communicator.h"
#include "mp_skips.h"

namespace po::test {

class MpiWorld : public ::testing::Environment {
 public:
  static comm::Communicator& world() { return *world_; }
  void SetUp() override {
    session_ = std::make_unique<comm::mpi::Session>();
    comm::mpi::MpiOptions options;
    options.timeout = std::chrono::seconds(60);
    world_ = comm::mpi::MpiCommunicator::create_world(options);
  }
  void TearDown() override {
    world_.reset();
    session_.reset();
  }

 private:
  static inline std::unique_ptr<comm::mpi::Session> session_;
  static inline std::unique_ptr<comm::mpi::MpiCommunicator> world_;
};

[[maybe_unused]] inline ::testing::Environment* const kMpiWorld =
    ::testing::AddGlobalTestEnvironment(new MpiWorld);

}  // namespace po::test
