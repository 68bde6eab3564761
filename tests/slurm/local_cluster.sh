#!/usr/bin/env bash
# A throw-away single-node Slurm cluster in a directory, for tests:
#   local_cluster.sh start DIR   writes DIR/slurm.conf, starts slurmctld and
#                                slurmd (as the current user, no systemd,
#                                cgroups or munge), waits until the node is idle
#   local_cluster.sh stop DIR    stops both daemons
# Clients find the cluster with SLURM_CONF=DIR/slurm.conf.
# Ports (and the first job id) are picked at random so parallel runs do not
# collide.
set -euo pipefail
cmd=${1:?usage: local_cluster.sh start|stop DIR}
dir=$(realpath -m "${2:?usage: local_cluster.sh start|stop DIR}")

stop() {
  for d in slurmd slurmctld; do
    if [ -f "$dir/$d.pid" ]; then
      kill "$(cat "$dir/$d.pid")" 2>/dev/null || true
    fi
  done
  for _ in $(seq 50); do
    alive=0
    for d in slurmd slurmctld; do
      [ -f "$dir/$d.pid" ] && kill -0 "$(cat "$dir/$d.pid")" 2>/dev/null && alive=1
    done
    [ $alive = 0 ] && return 0
    sleep 0.1
  done
  for d in slurmd slurmctld; do
    [ -f "$dir/$d.pid" ] && kill -9 "$(cat "$dir/$d.pid")" 2>/dev/null || true
  done
}

if [ "$cmd" = stop ]; then stop; exit 0; fi
[ "$cmd" = start ] || { echo "local_cluster.sh: unknown command '$cmd'" >&2; exit 2; }

for tool in slurmctld slurmd sinfo; do
  command -v "$tool" >/dev/null || PATH=$PATH:/usr/sbin
  command -v "$tool" >/dev/null || { echo "local_cluster.sh: $tool not installed (apt install slurmctld slurmd slurm-client)" >&2; exit 3; }
done

mkdir -p "$dir/state" "$dir/spool" "$dir/log"
user=$(id -un)

# One try: a fresh random port base, the configuration, both daemons, and a
# wait for the node to come up idle. A port taken by another process (another
# test's cluster, whose srun port range is 200 wide) leaves the node 'unk*',
# so start() is retried with new ports before giving up.
start() {
base=$((20000 + RANDOM % 40000))
cat > "$dir/slurm.conf" <<CONF
ClusterName=po-local
SlurmctldHost=localhost
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/none
CredType=cred/none
# A requeued job may start again cred_expire seconds after it ended (default
# 120): 10 lets the requeue test run in CI; launches here take well under it.
AuthInfo=cred_expire=10
SlurmctldPort=$base
SlurmdPort=$((base + 1))
SrunPortRange=$((base + 2))-$((base + 200))
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
InactiveLimit=0
KillWait=5
MinJobAge=60
FirstJobId=$((base * 100))
NodeName=localhost CPUs=8 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
CONF
# Job ids and PMIx's per-step files differ between clusters started side by
# side (ctest -j runs two test processes, each with its own cluster, whose
# first jobs would otherwise both be job 1 and share /tmp/pmix.1.0).
mkdir -p "$dir/pmix"
cat > "$dir/mpi.conf" <<CONF
PMIxCliTmpDirBase=$dir/pmix
CONF
export SLURM_CONF=$dir/slurm.conf
slurmctld -c -f "$dir/slurm.conf" >"$dir/log/slurmctld.out" 2>&1 || return 1
slurmd -c -N localhost -f "$dir/slurm.conf" >"$dir/log/slurmd.out" 2>&1 || return 1
for _ in $(seq 300); do
  state=$(sinfo -h -N -o %t 2>/dev/null | head -1 || true)
  case "$state" in idle|mix|alloc) return 0 ;; esac
  sleep 0.1
done
return 1
}

for attempt in 1 2 3; do
  if start; then exit 0; fi
  echo "local_cluster.sh: try $attempt: node did not become idle within 30 s (state '${state:-none}', ports from $base); logs in $dir/log.try$attempt" >&2
  for f in "$dir/log/slurmctld.log" "$dir/log/slurmd.log" "$dir/log/slurmctld.out" "$dir/log/slurmd.out"; do
    [ -s "$f" ] && { echo "--- $f" >&2; tail -n 5 "$f" >&2; }
  done
  stop
  rm -f "$dir/slurmctld.pid" "$dir/slurmd.pid"
  rm -rf "$dir/state" "$dir/spool"
  mkdir -p "$dir/state" "$dir/spool"
  mv "$dir/log" "$dir/log.try$attempt" && mkdir -p "$dir/log"
done
exit 1
