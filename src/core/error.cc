#include "core/error.h"

namespace po::core {

void throw_internal(const char* file, int line, const std::string& msg) {
  throw Internal(str_cat(file, ":", line, ": internal error: ", msg));
}

}  // namespace po::core
