// The torchrun-style MPI join (see join.h): rendezvous, ompi-server, singleton
// MPI_Init, then connect/accept/merge one rank at a time. Every step that can
// fail on one rank tells the others through the rendezvous, so all ranks end
// with an error naming the cause rather than waiting for a peer that gave up.
#include "comm/mpi/join.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>
#include <vector>

#include "comm/mpi/check.h"
#include "comm/rendezvous.h"
#include "core/error.h"

namespace po::comm::mpi {
namespace {

using Clock = std::chrono::steady_clock;

// A directory removed with its contents on destruction.
struct ScratchDir {
  std::filesystem::path path;
  ~ScratchDir() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove_all(path, ec);
  }
};

// A child process stopped (SIGTERM, then SIGKILL after 2 s) and reaped on
// destruction.
struct Child {
  pid_t pid = -1;
  ~Child() {
    if (pid <= 0) return;
    kill(pid, SIGTERM);
    int status = 0;
    for (int i = 0; i < 200; ++i) {
      if (waitpid(pid, &status, WNOHANG) == pid) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
};

// ompi-server from openmpi-bin, started by rank 0 for the duration of the
// join. It dies with the thread that started it (PR_SET_PDEATHSIG), so a
// crashed rank 0 leaves nothing behind; members clean up even when the
// constructor throws.
class OmpiServer {
 public:
  explicit OmpiServer(Duration timeout);
  const std::string& uri() const { return uri_; }

 private:
  void spawn(const std::string& uri_file, const std::string& log_file);
  std::string log_text() const;

  ScratchDir dir_;  // declared before child_: the server stops before its files go
  Child child_;
  std::string uri_;
};

void OmpiServer::spawn(const std::string& uri_file, const std::string& log_file) {
  // Everything the child needs is prepared before fork(): after it, only
  // async-signal-safe calls.
  const char* argv[] = {"ompi-server", "--no-daemonize", "-r", uri_file.c_str(), nullptr};
  int status_pipe[2];
  if (pipe2(status_pipe, O_CLOEXEC) != 0)
    PO_THROW(core::CommError, "cannot start ompi-server: pipe: ", std::strerror(errno));
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    const int err = errno;
    close(status_pipe[0]);
    close(status_pipe[1]);
    PO_THROW(core::CommError, "cannot start ompi-server: fork: ", std::strerror(err));
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);
    const int log = open(log_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    const int null = open("/dev/null", O_RDONLY);
    if (log >= 0) {
      dup2(log, 1);
      dup2(log, 2);
    }
    if (null >= 0) dup2(null, 0);
    execvp(argv[0], const_cast<char* const*>(argv));
    const int err = errno;
    (void)!write(status_pipe[1], &err, sizeof err);
    _exit(127);
  }
  close(status_pipe[1]);
  // The pipe closes without data when exec succeeds (O_CLOEXEC).
  int exec_errno = 0;
  ssize_t n;
  do n = read(status_pipe[0], &exec_errno, sizeof exec_errno);
  while (n < 0 && errno == EINTR);
  close(status_pipe[0]);
  if (n == static_cast<ssize_t>(sizeof exec_errno)) {
    waitpid(pid, nullptr, 0);
    PO_THROW(core::CommError, "cannot start ompi-server (openmpi-bin), which OpenMPI needs to join "
             "processes started without mpirun: ", std::strerror(exec_errno));
  }
  child_.pid = pid;
}

OmpiServer::OmpiServer(Duration timeout) {
  std::string tmpl = (std::filesystem::temp_directory_path() / "po_ompi_server_XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr)
    PO_THROW(core::CommError, "cannot create a directory for ompi-server (", tmpl, "): ",
             std::strerror(errno));
  dir_.path = tmpl;
  const std::string uri_file = (dir_.path / "uri").string();
  spawn(uri_file, (dir_.path / "log").string());
  // The URI file appears, a whole line, once the server listens.
  const Duration limit = std::min<Duration>(timeout, std::chrono::seconds(60));
  const auto deadline = Clock::now() + limit;
  for (;;) {
    std::ifstream in(uri_file);
    std::string line;
    if (in && std::getline(in, line) && !in.eof() && !line.empty()) {
      uri_ = line;
      return;
    }
    int status = 0;
    if (waitpid(child_.pid, &status, WNOHANG) == child_.pid) {
      child_.pid = -1;
      PO_THROW(core::CommError, "ompi-server exited (status ", status, ") before reporting its URI: ",
               log_text());
    }
    if (Clock::now() >= deadline)
      PO_THROW(core::CommError, "ompi-server did not report its URI within ", limit.count(), " ms: ",
               log_text());
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

std::string OmpiServer::log_text() const {
  std::ifstream in(dir_.path / "log");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s.empty() ? "(no output)" : s;
}

// ---- helpers ---------------------------------------------------------------

// Frees an MPI communicator on scope exit (a join that fails half-way).
struct CommGuard {
  MPI_Comm comm = MPI_COMM_NULL;
  ~CommGuard() {
    if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }
};

// Rank 0 runs `produce`; its value, or its error, reaches every rank. Others
// throw a CommError naming what rank 0 could not do.
std::string share_from_root(Rendezvous& rdv, const std::function<std::string()>& produce,
                            const char* what) {
  if (rdv.rank() == 0) {
    try {
      const std::string value = produce();
      rdv.broadcast("O" + value);
      return value;
    } catch (const std::exception& e) {
      rdv.broadcast(std::string("E") + e.what());
      throw;
    }
  }
  const std::string msg = rdv.broadcast("");
  if (msg.empty() || msg[0] != 'O')
    PO_THROW(core::CommError, "rank 0 could not ", what, ": ", msg.empty() ? "?" : msg.substr(1));
  return msg.substr(1);
}

// Printable fingerprints as they are, others in hex; at most 32 bytes.
std::string show(const std::string& s) {
  bool printable = true;
  for (char c : s) printable = printable && c >= 0x20 && c < 0x7f;
  std::string out;
  const size_t n = std::min<size_t>(s.size(), 32);
  if (printable) {
    out += '\'';
    out.append(s, 0, n);
    out += '\'';
  } else {
    static const char kHex[] = "0123456789abcdef";
    for (size_t i = 0; i < n; ++i) {
      out += kHex[(static_cast<unsigned char>(s[i]) >> 4) & 15];
      out += kHex[static_cast<unsigned char>(s[i]) & 15];
    }
  }
  return s.size() > n ? out + "..." : out;
}

void check_fingerprints(const std::vector<std::string>& fps) {
  std::string differ;
  int n = 0;
  for (size_t r = 1; r < fps.size(); ++r) {
    if (fps[r] == fps[0]) continue;
    if (++n <= 4) differ += core::str_cat(", rank ", r, " has ", show(fps[r]));
  }
  if (n > 4) differ += core::str_cat(" and ", n - 4, " more ranks differ");
  PO_CHECK(n == 0, "ranks disagree on the run fingerprint (config or binary hash): rank 0 has ",
           show(fps[0]), differ);
}

// Each "tcp://host:port" (or "tcp6://[host]:port") in an ORTE URI.
std::vector<std::pair<std::string, std::string>> uri_endpoints(const std::string& uri) {
  std::vector<std::pair<std::string, std::string>> out;
  std::stringstream ss(uri);
  std::string item;
  while (std::getline(ss, item, ';')) {
    const auto scheme = item.find("://");
    const auto colon = item.rfind(':');
    if (scheme == std::string::npos || colon <= scheme + 3) continue;
    std::string host = item.substr(scheme + 3, colon - scheme - 3);
    if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
    out.emplace_back(host, item.substr(colon + 1));
  }
  return out;
}

// "" when some endpoint of the server accepts a TCP connection within 5 s,
// else what failed. MPI_Init would only warn and the join would then fail
// inside MPI with a vaguer message.
std::string probe_server(const std::string& uri) {
  std::string error = "no tcp:// address in its URI";
  for (const auto& [host, port] : uri_endpoints(uri)) {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICHOST;
    addrinfo* res = nullptr;
    if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0) continue;
    const int fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int err = fd < 0 ? errno : 0;
    if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
      err = errno;
      if (err == EINPROGRESS) {
        pollfd pfd{fd, POLLOUT, 0};
        if (poll(&pfd, 1, 5000) == 1) {
          socklen_t len = sizeof err;
          getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        } else {
          err = ETIMEDOUT;
        }
      }
    }
    if (fd >= 0) close(fd);
    freeaddrinfo(res);
    if (err == 0) return "";
    error = core::str_cat(host, ":", port, ": ", std::strerror(err));
  }
  return error;
}

// Every rank learns whether all could reach the server; those that could not
// are named in the same error on every rank.
void check_server_reachable(Rendezvous& rdv, const std::string& uri) {
  const auto results = rdv.all_gather(probe_server(uri));
  std::string bad;
  for (size_t r = 0; r < results.size(); ++r) {
    if (!results[r].empty()) bad += core::str_cat(bad.empty() ? "" : "; ", "rank ", r, ": ", results[r]);
  }
  if (!bad.empty()) {
    PO_THROW(core::CommError, "ranks cannot reach the ompi-server that rank 0 started (URI ", uri,
             "), which the MPI join needs: ", bad);
  }
}

// The intracommunicator of all ranks, grown one connect/accept at a time.
MPI_Comm grow_group(Rendezvous& rdv, const std::string& port) {
  const int me = rdv.rank();
  CommGuard group;
  if (me == 0) PO_MPI_CHECK(MPI_Comm_dup(MPI_COMM_SELF, &group.comm));
  for (int k = 1; k < rdv.world_size(); ++k) {
    rdv.broadcast("");  // rank k's turn: OpenMPI needs one connect at a time per port
    if (me > k) continue;
    CommGuard inter;
    MPI_Comm merged = MPI_COMM_NULL;
    if (me < k) {
      PO_MPI_CHECK(MPI_Comm_accept(port.c_str(), MPI_INFO_NULL, 0, group.comm, &inter.comm));
      PO_MPI_CHECK(MPI_Comm_set_errhandler(inter.comm, MPI_ERRORS_RETURN));
      PO_MPI_CHECK(MPI_Intercomm_merge(inter.comm, 0, &merged));
    } else {
      PO_MPI_CHECK(MPI_Comm_connect(port.c_str(), MPI_INFO_NULL, 0, MPI_COMM_SELF, &inter.comm));
      PO_MPI_CHECK(MPI_Comm_set_errhandler(inter.comm, MPI_ERRORS_RETURN));
      PO_MPI_CHECK(MPI_Intercomm_merge(inter.comm, 1, &merged));
    }
    if (group.comm != MPI_COMM_NULL) MPI_Comm_free(&group.comm);
    group.comm = merged;
    PO_MPI_CHECK(MPI_Comm_set_errhandler(group.comm, MPI_ERRORS_RETURN));
  }
  return std::exchange(group.comm, MPI_COMM_NULL);
}

std::unique_ptr<MpiCommunicator> join_torchrun(const LaunchEnv& env, Duration timeout,
                                               const MpiOptions& options,
                                               const std::string& fingerprint) {
  int initialized = 0;
  PO_MPI_CHECK(MPI_Initialized(&initialized));
  if (initialized) {
    PO_THROW(core::Internal, "join_world_from_env: MPI is already initialized; the join of processes "
             "started without mpirun must come before anything else initializes MPI");
  }
  RendezvousOptions ro = rendezvous_options(env, timeout);
  ro.hello = fingerprint;
  Rendezvous rdv(ro);
  check_fingerprints(rdv.hellos());

  std::unique_ptr<OmpiServer> server;
  const std::string uri = share_from_root(
      rdv, [&] { server = std::make_unique<OmpiServer>(timeout); return server->uri(); },
      "start ompi-server");
  check_server_reachable(rdv, uri);
  setenv("OMPI_MCA_pmix_server_uri", uri.c_str(), 1);
  init();

  const std::string port = share_from_root(
      rdv,
      [] {
        char p[MPI_MAX_PORT_NAME] = {};
        PO_MPI_CHECK(MPI_Open_port(MPI_INFO_NULL, p));
        return std::string(p);
      },
      "open an MPI port");
  CommGuard group;
  group.comm = grow_group(rdv, port);
  if (env.rank == 0) PO_MPI_CHECK(MPI_Close_port(port.c_str()));
  CommGuard world;
  PO_MPI_CHECK(MPI_Comm_split(group.comm, 0, env.rank, &world.comm));
  auto comm = MpiCommunicator::create_from(world.comm, options);
  if (comm->rank() != env.rank || comm->size() != env.world_size) {
    PO_THROW(core::Internal, "MPI join: rank ", env.rank, " of ", env.world_size, " became rank ",
             comm->rank(), " of ", comm->size());
  }
  rdv.barrier();  // everyone is in; the name service can go
  return comm;
}

}  // namespace

std::unique_ptr<MpiCommunicator> join_world_from_env(const LaunchEnv& env, Duration timeout,
                                                     const MpiOptions& options,
                                                     const std::string& fingerprint) {
  if (env.source == LaunchSource::kTorchrun && env.world_size > 1)
    return join_torchrun(env, timeout, options, fingerprint);
  return MpiCommunicator::create_world(options);
}

}  // namespace po::comm::mpi
