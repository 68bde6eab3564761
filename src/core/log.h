// Minimal leveled logging to stderr. Library code logs; only cli/ decides exit codes.
#pragma once

#include <string>

#include "core/error.h"

namespace po::core {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

void set_log_level(LogLevel level);
LogLevel log_level();
// Text put before every line, e.g. "[rank 3] " in a multi-process run.
void set_log_prefix(const std::string& prefix);
void log_line(LogLevel level, const std::string& message);

}  // namespace po::core

#define PO_LOG_INFO(...) ::po::core::log_line(::po::core::LogLevel::kInfo, ::po::core::str_cat(__VA_ARGS__))
#define PO_LOG_WARN(...) ::po::core::log_line(::po::core::LogLevel::kWarn, ::po::core::str_cat(__VA_ARGS__))
#define PO_LOG_DEBUG(...) ::po::core::log_line(::po::core::LogLevel::kDebug, ::po::core::str_cat(__VA_ARGS__))
