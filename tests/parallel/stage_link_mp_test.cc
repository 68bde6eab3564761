// Pipeline point-to-point (parallel/stage_link.h) on real processes under
// mpirun (1, 2, 3, 4 and 8 ranks; at 1 a rank sends to itself): every rank
// sends to the next in a ring and receives from the previous one. Payloads
// arrive intact, several messages in flight at once are told apart by tag
// whatever order they are received in, and a receiver expecting another
// shape — even one of the same size, [3, 2] for [2, 3] — gets an error
// naming both ranks and both shapes instead of the payload, after which the
// link still works.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "../mpi_world.h"
#include "core/error.h"
#include "parallel/stage_link.h"

namespace po::parallel {
namespace {

comm::Communicator& world() { return po::test::MpiWorld::world(); }

int next_rank() { return (world().rank() + 1) % world().size(); }
int prev_rank() { return (world().rank() + world().size() - 1) % world().size(); }

std::vector<float> payload(int rank, int tag, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(rank * 1000 + tag * 10) + static_cast<float>(i);
  return v;
}

TEST(StageLink, MessagesArriveByTagInAnyOrder) {
  StageLink link(world());
  const tensor::Shape shape = {4, 8};
  std::vector<std::vector<float>> out;
  for (int tag : {5, 6, 7}) out.push_back(payload(world().rank(), tag, 32));
  for (size_t k = 0; k < out.size(); ++k) link.send(out[k].data(), shape, next_rank(), 5 + static_cast<int>(k));
  for (int tag : {7, 5, 6}) {  // received out of order
    std::vector<float> got(32);
    link.recv(got.data(), shape, prev_rank(), tag);
    EXPECT_EQ(got, payload(prev_rank(), tag, 32)) << "rank " << world().rank() << " tag " << tag;
  }
  link.wait_sends();
}

TEST(StageLink, ShapeMismatchNamesBothRanksAndShapes) {
  StageLink link(world());
  const std::vector<float> x = payload(world().rank(), 1, 6);
  link.send(x.data(), {2, 3}, next_rank(), 1);
  std::vector<float> got(6);
  try {
    link.recv(got.data(), {3, 2}, prev_rank(), 1);
    ADD_FAILURE() << "a [2, 3] message was taken for [3, 2]";
  } catch (const core::CommError& e) {
    const std::string msg = e.what();
    const std::string want = core::str_cat("rank ", world().rank(), " expected [3, 2] from rank ",
                                           prev_rank(), ", which sent [2, 3]");
    EXPECT_NE(msg.find(want), std::string::npos) << msg << "\nwanted: " << want;
  }
  // The link still works after the error.
  link.send(x.data(), {6}, next_rank(), 2);
  link.recv(got.data(), {6}, prev_rank(), 2);
  EXPECT_EQ(got, payload(prev_rank(), 1, 6));
  link.wait_sends();
}

}  // namespace
}  // namespace po::parallel
