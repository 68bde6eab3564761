// A small TCP rendezvous store for processes started without mpirun (torchrun,
// a shell loop, a test): rank 0 listens on MASTER_PORT, the other ranks connect
// to MASTER_ADDR:MASTER_PORT, and the group then exchanges small byte blobs
// (MPI port names, config hashes, later an NCCL unique id) through rank 0.
//
// Joining: every rank sends a hello (rank, world size, an opaque blob); rank 0
// waits for all world_size - 1 peers, rejects duplicate ranks and mismatched
// world sizes, and answers every peer with the hellos of all ranks or with the
// reason it gave up. Failures to form the group are core::CommError with one
// line naming the address, port and what went wrong:
//   - rank 0: MASTER_PORT already in use; ranks that never arrived within the
//     timeout (named); two processes with one RANK; a different WORLD_SIZE;
//   - other ranks: MASTER_ADDR that cannot be resolved or reached within the
//     timeout (connects are retried until then); rank 0's verdict otherwise.
// Rank 0 listens on every interface of MASTER_ADDR's address family (as
// torchrun's store does), so MASTER_ADDR may be any name of its host.
//
// After joining, all_gather / broadcast / barrier are collectives: every rank
// calls the same operations in the same order. Each waits at most timeout()
// and then throws core::Timeout; a peer that disconnects is a CommError. Every
// frame carries a magic number, the operation kind and its sequence number, so
// a stray connection or ranks calling different operations are reported, not
// misread. Blobs are at most kMaxBlobBytes each. Not thread-safe: one thread
// at a time per Rendezvous.
//
// Who may join: rank 0 listens only on the address MASTER_ADDR names, and
// answers every connection with a fresh random challenge. A peer's hello
// carries HMAC-SHA256(job secret, challenge, its own nonce, its rank, world
// size and blob); rank 0 refuses a hello that does not verify (a stranger, a
// replayed hello, a rank with another secret) with one warning naming its
// address, and goes on waiting for the real ranks. Its welcome carries an
// HMAC over the peer's nonce, so peers know rank 0 holds the secret too. The
// secret (rendezvous_secret()) is never sent. Without one, rank 0 refuses to
// listen anywhere but on a loopback address. Blobs after the hello travel
// unencrypted: they are hashes and MPI port names, not secrets.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/env.h"

namespace po::comm {

struct RendezvousOptions {
  std::string master_addr;  // host name or address of rank 0
  int master_port = 0;      // 1..65535
  int rank = 0;
  int world_size = 1;
  // Joining: how long rank 0 waits for its peers and how long the others keep
  // retrying to connect (then as long again for rank 0's answer). Afterwards:
  // the limit of each operation.
  Duration timeout = std::chrono::seconds(60);
  std::string hello;  // this rank's blob in hellos(), e.g. a config hash
  std::string secret;  // the job's secret (the same on every rank); empty: loopback only
};

// The job's rendezvous secret from the environment: PAGEDOPTIM_RDZV_SECRET
// itself, or PAGEDOPTIM_RDZV_KEY_FILE (a file only its owner may read) keyed
// with the job's id (SLURM_JOB_ID, else TORCHELASTIC_RUN_ID, else
// PAGEDOPTIM_JOB_ID), so one key file serves every job without two jobs
// sharing a secret. Empty when neither is set. Errors name the variable or file.
std::string rendezvous_secret();

// Options for the process described by a torchrun-style LaunchEnv; an
// InvalidArgument when MASTER_ADDR or MASTER_PORT is missing.
RendezvousOptions rendezvous_options(const LaunchEnv& env, Duration timeout);

class Rendezvous {
 public:
  static constexpr size_t kMaxBlobBytes = size_t{64} << 20;

  // Joins the group; returns once every rank has said hello (see above).
  explicit Rendezvous(const RendezvousOptions& options);
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  // "MASTER_ADDR:MASTER_PORT" as given, for messages.
  const std::string& endpoint() const { return endpoint_; }
  // Every rank's hello blob, indexed by rank; the same on every rank.
  const std::vector<std::string>& hellos() const { return hellos_; }

  // Every rank's `blob`, indexed by rank.
  std::vector<std::string> all_gather(const std::string& blob);
  // Rank 0's `blob` on every rank (the others' argument is ignored).
  std::string broadcast(const std::string& blob);
  void barrier() { all_gather(std::string()); }

 private:
  struct Peer;
  void join_as_root(const RendezvousOptions& options);
  void join_as_peer(const RendezvousOptions& options);
  void reject_all(const std::string& reason);
  // Rank 0: why a hello (protocol version, rank r, world size w) from
  // `address` is refused, "" when it is fine; the ranks not arrived yet.
  std::string hello_problem(int r, int w, const std::string& address) const;
  std::string missing_ranks() const;

  int rank_ = 0;
  int world_size_ = 1;
  std::string endpoint_;
  std::string secret_;
  Duration timeout_;
  uint32_t seq_ = 0;  // operations so far; frames carry it
  std::vector<std::string> hellos_;
  // Rank 0: one connection per peer, indexed by rank (slot 0 unused).
  // Others: one connection, to rank 0, in slot 0.
  std::vector<std::unique_ptr<Peer>> peers_;
};

}  // namespace po::comm
