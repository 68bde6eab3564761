#include "core/log.h"

#include <cstdio>
#include <mutex>

namespace po::core {
namespace {
LogLevel g_level = LogLevel::kInfo;
std::mutex g_mutex;
std::string g_prefix;  // guarded by g_mutex
}  // namespace

void set_log_level(LogLevel level) { g_level = level; }
LogLevel log_level() { return g_level; }

void set_log_prefix(const std::string& prefix) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_prefix = prefix;
}

void log_line(LogLevel level, const std::string& message) {
  if (level < g_level) return;
  static const char* kTags[] = {"debug", "info", "warning", "error"};
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fprintf(stderr, "%s[%s] %s\n", g_prefix.c_str(), kTags[static_cast<int>(level)], message.c_str());
}

}  // namespace po::core
