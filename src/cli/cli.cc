#include "cli/cli.h"

#include <cstdio>

namespace po::cli {

int run(int argc, char** argv) {
  std::fprintf(stderr, "pagedoptim: not implemented yet\n");
  return 2;
}

}  // namespace po::cli
