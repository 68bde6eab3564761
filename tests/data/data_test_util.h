// Helpers shared by the data-layer tests: a scratch directory removed at the
// end of the test, and whole-file read/write.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include "../test_util.h"

namespace po::data::testing {

// The suite's scratch directory and file helpers (tests/test_util.h).
using ScratchDir = po::test::TempDir;
using po::test::read_file;
using po::test::write_file;

inline std::string escaped(const std::string& s, size_t max_chars = 400) {
  std::string out;
  for (unsigned char c : s.substr(0, max_chars)) {
    if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '\r') out += "\\r";
    else if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else out += static_cast<char>(c);
  }
  if (s.size() > max_chars) out += "...";
  return out;
}

}  // namespace po::data::testing
