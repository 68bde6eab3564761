// Federation across separately launched jobs (docs/diloco.md;
// ../shared/research/federated.md): `pagedoptim federate serve` runs a
// Coordinator, `pagedoptim federate join HOST:PORT` a FederatedClient.
//
// The coordinator holds the global model θ (whole named tensors, the
// resharding checkpoint's form), the server optimizer, and the round. Clients
// dial out to it over TLS 1.3 (comm/tls_stream.h) and prove their key
// (comm/federation_protocol.h) over the coordinator's challenge bound to the
// TLS session (RFC 9266's exporter): a man in the middle, or a replayed
// Hello, fails the proof. Without a CA the certificate is an ephemeral
// self-signed one and that binding is the authentication; with
// federated.tls_ca the client verifies the chain as well.
//
// A round: once federated.min_clients clients are connected it opens; the
// clients connected then are its participants and are sent θ. It closes when
// every participant has answered or dropped (its connection closed), or at
// federated.round_timeout: those still training are stragglers, dropped from
// the round and counted, their late updates refused as stale. A client that
// joins mid-round waits for the next round and gets the θ current then. A
// round with no update opens again on the same θ. The updates are summed in
// client-id order (train/fed_round.h), never arrival order, and the server
// step is the algorithm's outer optimizer. After every round the coordinator
// writes its state (θ, the server optimizer's fields, the round, the counters)
// to RUN/federation/state.bin atomically and a line to
// RUN/federation/metrics.jsonl; a coordinator killed and started again
// resumes from its last round, and its clients reconnect.
//
// A client trains each round as a resumed run of `pagedoptim train`: it
// writes RUN/checkpoints/step_<r·H> holding θ and its own optimizer state
// (the newest it has at or before step r·H, so a round trained twice starts
// from the same state both times), runs train to step (r+1)·H with the
// learning-rate schedule spanning rounds × H (train.stop_at), any layout and
// --nproc, and sends Δ = θ − θ_k. The inner step count, the data position and
// the schedule are functions of the round, so a client that missed rounds, or
// retrains one after a coordinator restart, computes what it would have.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config.h"
#include "optim/outer.h"

namespace po::train {

// The server optimizer of federated.algorithm: fedavg SGD at
// federated.server_lr (default 1, no momentum), fedadam and fedyogi Adam and
// Yogi at federated.server_lr (default 0.01) with outer.momentum, beta2 and
// eps, diloco outer.optimizer at outer.lr; fedprox is refused (not built).
// InvalidArgument naming the key.
optim::OuterConfig federated_server(const core::Config& cfg);

// The job's secret from federated.secret_file (its bytes, a trailing newline
// dropped) or the environment variable PAGEDOPTIM_FEDERATE_SECRET; empty when
// neither is set.
std::string federation_secret(const core::Config& cfg);

// Runs a coordinator with `cfg` (the run's config: the model, run.dir,
// federated.*, train.local_steps) until federated.rounds rounds have closed;
// prints "federation: listening on HOST:PORT" once it accepts connections.
// Returns the process's exit status.
int serve_federation(const core::Config& cfg);

// Runs client federated.client_id of the coordinator at `address` with
// `cfg` (its own model copy's config, its data) until the coordinator says
// Done. `config_path` and `sets` are how the round's `pagedoptim train` is
// started (with --nproc `nproc` when above 1). Returns the exit status.
int join_federation(const std::string& address, const core::Config& cfg, const std::string& config_path,
                    const std::vector<std::string>& sets, int nproc);

}  // namespace po::train
