// Error policy (see docs/design-notes.md): exceptions end an operation, return
// values report expected outcomes, PO_ASSERT guards programmer invariants.
// Every exception carries the call site; only cli/ turns them into exit codes.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace po::core {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class InvalidArgument : public Error { using Error::Error; };
class IoError : public Error { using Error::Error; };
class OutOfMemory : public Error { using Error::Error; };
class CommError : public Error { using Error::Error; };
class Timeout : public Error { using Error::Error; };
class Internal : public Error { using Error::Error; };

namespace detail {
inline void append_all(std::ostringstream&) {}
template <typename T, typename... Rest>
void append_all(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  append_all(os, rest...);
}
}  // namespace detail

// Concatenates all arguments with operator<< into one string.
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  detail::append_all(os, args...);
  return os.str();
}

[[noreturn]] void throw_internal(const char* file, int line, const std::string& msg);

}  // namespace po::core

// Throws ErrorType with the message built from the remaining arguments.
#define PO_THROW(ErrorType, ...) throw ErrorType(::po::core::str_cat(__VA_ARGS__))

// User-facing checks: a failed condition throws InvalidArgument with the message.
#define PO_CHECK(cond, ...)                                  \
  do {                                                       \
    if (!(cond)) PO_THROW(::po::core::InvalidArgument, __VA_ARGS__); \
  } while (0)

// Invariants: a failure is a bug in PagedOptim, reported with file:line.
#define PO_ASSERT(cond, ...)                                                         \
  do {                                                                               \
    if (!(cond))                                                                     \
      ::po::core::throw_internal(__FILE__, __LINE__,                                 \
                                 ::po::core::str_cat("assertion `" #cond "` failed: ", \
                                                     ##__VA_ARGS__));                \
  } while (0)
