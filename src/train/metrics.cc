#include "train/metrics.h"
#include "train/live_metrics.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace po::train {

MetricsWriter::MetricsWriter(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd_ < 0) PO_THROW(core::IoError, path, ": cannot open for appending: ", std::strerror(errno));
  // Drop a record cut short by a kill: everything after the last newline.
  const int rd = ::open(path.c_str(), O_RDONLY);
  struct stat st {};
  if (rd >= 0 && ::fstat(rd, &st) == 0 && st.st_size > 0) {
    off_t end = st.st_size;
    char c = 0;
    if (::pread(rd, &c, 1, end - 1) == 1 && c != '\n') {
      char buf[4096];
      off_t keep = 0;
      while (end > 0 && keep == 0) {
        const off_t from = end > static_cast<off_t>(sizeof buf) ? end - static_cast<off_t>(sizeof buf) : 0;
        const ssize_t n = ::pread(rd, buf, static_cast<size_t>(end - from), from);
        if (n <= 0) break;
        for (ssize_t i = n; i-- > 0;)
          if (buf[i] == '\n') {
            keep = from + i + 1;
            break;
          }
        end = from;
      }
      if (::ftruncate(fd_, keep) != 0)
        PO_THROW(core::IoError, path, ": cannot drop a cut-short last record: ", std::strerror(errno));
    }
  }
  if (rd >= 0) ::close(rd);
}

MetricsWriter::~MetricsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsWriter::write(const nlohmann::json& record) {
  if (LiveMetrics* live = LiveMetrics::active()) live->update(record);
  const std::string line = record.dump() + "\n";
  size_t done = 0;
  while (done < line.size()) {  // one write(2) but for a disk that takes less
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) PO_THROW(core::IoError, path_, ": write failed: ", std::strerror(errno));
    done += static_cast<size_t>(n);
  }
}

namespace {

// Whether the user sees our stdout on a terminal. mpirun hands its ranks a
// pseudo-terminal even when its own output goes to a file, so under mpirun
// only our launcher's hint (PAGEDOPTIM_STDOUT_TTY, set by `--nproc` from its
// own stdout) says yes; without it plain lines are the safe choice.
bool stdout_is_terminal() {
  if (const char* hint = std::getenv("PAGEDOPTIM_STDOUT_TTY")) return std::string(hint) == "1";
  if (std::getenv("OMPI_COMM_WORLD_RANK") != nullptr) return false;
  return isatty(STDOUT_FILENO) != 0;
}

}  // namespace

Progress::Progress() : tty_(stdout_is_terminal()) {}

void Progress::step(int64_t step, int64_t total, double loss, double lr, double grad_norm,
                    double tokens_per_s, double eta_s) {
  char buf[256];
  std::snprintf(buf, sizeof(buf),
                "step %lld/%lld | loss %.4f | lr %.2e | norm %.3f | %.0f tok/s | ETA %s",
                static_cast<long long>(step), static_cast<long long>(total), loss, lr, grad_norm,
                tokens_per_s, format_duration(eta_s).c_str());
  if (tty_) {
    std::printf("\r\033[K%s", buf);
    open_line_ = true;
  } else {
    std::printf("%s\n", buf);
  }
  std::fflush(stdout);
}

void Progress::line(const std::string& text) {
  if (open_line_) std::printf("\n");
  open_line_ = false;
  std::printf("%s\n", text.c_str());
  std::fflush(stdout);
}

void Progress::finish() {
  if (open_line_) std::printf("\n");
  open_line_ = false;
  std::fflush(stdout);
}

uint64_t peak_rss_bytes() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<uint64_t>(ru.ru_maxrss) * 1024;
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<long long>(seconds + 0.5);
  char buf[64];
  if (s >= 3600)
    std::snprintf(buf, sizeof(buf), "%lldh%02lldm", s / 3600, (s % 3600) / 60);
  else if (s >= 60)
    std::snprintf(buf, sizeof(buf), "%lldm%02llds", s / 60, s % 60);
  else
    std::snprintf(buf, sizeof(buf), "%llds", s);
  return buf;
}

}  // namespace po::train
