#include "core/log.h"

#include <cstdio>
#include <mutex>

namespace po::core {
namespace {
LogLevel g_level = LogLevel::kInfo;
std::mutex g_mutex;
}  // namespace

void set_log_level(LogLevel level) { g_level = level; }
LogLevel log_level() { return g_level; }

void log_line(LogLevel level, const std::string& message) {
  if (level < g_level) return;
  static const char* kTags[] = {"debug", "info", "warning", "error"};
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fprintf(stderr, "[%s] %s\n", kTags[static_cast<int>(level)], message.c_str());
}

}  // namespace po::core
