#include "comm/mpi/arrivals.h"

#include <xxhash.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "comm/mpi/check.h"
#include "core/error.h"

namespace po::comm::mpi::arrivals {
namespace {

constexpr int kQueryTag = 1;
constexpr int kReplyTag = 2;
constexpr size_t kWhatBytes = 112;

struct Query {
  uint64_t group = 0;
};
struct Reply {
  uint64_t group = 0;
  uint64_t issued = 0;            // collectives this rank issued on the group
  char what[kWhatBytes] = {};     // the last of them, truncated
};

struct Issued {
  uint64_t seq = 0;
  std::string what;
};

std::mutex g_mutex;                 // guards everything below
MPI_Comm g_control = MPI_COMM_NULL;
std::map<uint64_t, Issued> g_issued;
// Sends are fire-and-forget: a peer may be dead. Their buffers live here until
// the requests are freed at stop().
std::vector<MPI_Request> g_sends;
std::vector<std::unique_ptr<Reply>> g_reply_bufs;
std::vector<std::unique_ptr<Query>> g_query_bufs;

// Caller holds g_mutex.
void answer_locked() {
  if (g_control == MPI_COMM_NULL) return;
  for (;;) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kQueryTag, g_control, &flag, &st) != MPI_SUCCESS || !flag) return;
    Query q;
    if (MPI_Recv(&q, sizeof q, MPI_BYTE, st.MPI_SOURCE, kQueryTag, g_control, MPI_STATUS_IGNORE) !=
        MPI_SUCCESS)
      return;
    auto r = std::make_unique<Reply>();
    r->group = q.group;
    if (auto it = g_issued.find(q.group); it != g_issued.end()) {
      r->issued = it->second.seq;
      std::strncpy(r->what, it->second.what.c_str(), kWhatBytes - 1);
    }
    MPI_Request req = MPI_REQUEST_NULL;
    if (MPI_Isend(r.get(), sizeof *r, MPI_BYTE, st.MPI_SOURCE, kReplyTag, g_control, &req) ==
        MPI_SUCCESS) {
      g_sends.push_back(req);
      g_reply_bufs.push_back(std::move(r));
    }
  }
}

std::string join_ranks(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

}  // namespace

void start(MPI_Comm world) {
  std::lock_guard lock(g_mutex);
  if (g_control != MPI_COMM_NULL) return;
  PO_MPI_CHECK(MPI_Comm_dup(world, &g_control));
  PO_MPI_CHECK(MPI_Comm_set_errhandler(g_control, MPI_ERRORS_RETURN));
}

void stop() {
  std::lock_guard lock(g_mutex);
  if (g_control == MPI_COMM_NULL) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) {
    for (MPI_Request& r : g_sends)
      if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
    MPI_Comm_free(&g_control);
  }
  g_control = MPI_COMM_NULL;
  g_sends.clear();
  g_reply_bufs.clear();
  g_query_bufs.clear();
  g_issued.clear();
}

void service() {
  std::unique_lock lock(g_mutex, std::try_to_lock);
  if (lock.owns_lock()) answer_locked();
}

Group::Group(MPI_Comm comm, std::string name)
    : id_(XXH3_64bits(name.data(), name.size())), name_(std::move(name)) {
  std::lock_guard lock(g_mutex);
  PO_ASSERT(g_control != MPI_COMM_NULL, "arrivals::Group before arrivals::start()");
  int size = 0;
  PO_MPI_CHECK(MPI_Comm_rank(comm, &rank_));
  PO_MPI_CHECK(MPI_Comm_size(comm, &size));
  MPI_Group mine = MPI_GROUP_NULL, control = MPI_GROUP_NULL;
  PO_MPI_CHECK(MPI_Comm_group(comm, &mine));
  PO_MPI_CHECK(MPI_Comm_group(g_control, &control));
  std::vector<int> ranks(static_cast<size_t>(size));
  for (int i = 0; i < size; ++i) ranks[static_cast<size_t>(i)] = i;
  control_.resize(static_cast<size_t>(size));
  const int rc = MPI_Group_translate_ranks(mine, size, ranks.data(), control, control_.data());
  MPI_Group_free(&mine);
  MPI_Group_free(&control);
  PO_MPI_CHECK(rc);
}

uint64_t Group::issue(const std::string& what) {
  std::lock_guard lock(g_mutex);
  Issued& i = g_issued[id_];
  i.what = what;
  return ++i.seq;
}

std::string Group::diagnose(uint64_t seq, std::chrono::milliseconds grace) const {
  using Clock = std::chrono::steady_clock;
  std::lock_guard lock(g_mutex);
  if (g_control == MPI_COMM_NULL) return "";
  const int n = static_cast<int>(control_.size());
  std::vector<int> answered(static_cast<size_t>(n), 0);
  std::vector<Reply> replies(static_cast<size_t>(n));
  answered[static_cast<size_t>(rank_)] = 1;
  for (int m = 0; m < n; ++m) {
    if (m == rank_ || control_[static_cast<size_t>(m)] == MPI_UNDEFINED) continue;
    auto q = std::make_unique<Query>();
    q->group = id_;
    MPI_Request req = MPI_REQUEST_NULL;
    if (MPI_Isend(q.get(), sizeof *q, MPI_BYTE, control_[static_cast<size_t>(m)], kQueryTag,
                  g_control, &req) == MPI_SUCCESS) {
      g_sends.push_back(req);
      g_query_bufs.push_back(std::move(q));
    }
  }
  // control rank -> group rank, for the replies
  std::map<int, int> member;
  for (int m = 0; m < n; ++m) member[control_[static_cast<size_t>(m)]] = m;
  const auto deadline = Clock::now() + grace;
  while (Clock::now() < deadline &&
         std::count(answered.begin(), answered.end(), 1) < static_cast<long>(n)) {
    answer_locked();  // peers diagnosing at the same time ask us too
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kReplyTag, g_control, &flag, &st) != MPI_SUCCESS) break;
    if (!flag) {
      std::this_thread::yield();
      continue;
    }
    Reply r;
    if (MPI_Recv(&r, sizeof r, MPI_BYTE, st.MPI_SOURCE, kReplyTag, g_control,
                 MPI_STATUS_IGNORE) != MPI_SUCCESS)
      break;
    auto it = member.find(st.MPI_SOURCE);
    if (r.group != id_ || it == member.end()) continue;  // stale, or about another group
    answered[static_cast<size_t>(it->second)] = 1;
    replies[static_cast<size_t>(it->second)] = r;
  }
  std::vector<int> silent;
  std::string behind;
  for (int m = 0; m < n; ++m) {
    if (!answered[static_cast<size_t>(m)]) {
      silent.push_back(m);
      continue;
    }
    if (m == rank_) continue;
    const Reply& r = replies[static_cast<size_t>(m)];
    if (r.issued >= seq) continue;
    behind += core::str_cat(behind.empty() ? "" : "; ", "rank ", m, " is behind at collective #",
                            r.issued, r.issued ? core::str_cat(" (", r.what, ")") : std::string());
  }
  if (silent.empty() && behind.empty()) return "";
  std::string out = core::str_cat("ranks of '", name_, "' that did not arrive at collective #", seq,
                                  ": ");
  if (!silent.empty())
    out += core::str_cat(silent.size() == 1 ? "rank " : "ranks ", join_ranks(silent),
                         " (no answer within ", grace.count(),
                         " ms: stopped, dead, or busy outside communication)");
  if (!behind.empty()) out += (silent.empty() ? "" : "; ") + behind;
  return out;
}

}  // namespace po::comm::mpi::arrivals
