// A fresh scratch directory per test, removed afterwards.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "../test_util.h"

namespace po::checkpoint::testing {

// The suite's scratch directory (tests/test_util.h).
using ScratchDir = po::test::TempDir;

}  // namespace po::checkpoint::testing
