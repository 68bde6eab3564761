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

# Whether process $1 runs: a zombie counts as gone (where PID 1 does not reap,
# as in some containers, a daemon that exited stays a zombie and kill -0
# still succeeds on it).
alive() {
  local state
  state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1) && [ -n "$state" ] && [ "$state" != Z ]
}

# This cluster's daemons: those started with its slurm.conf (a daemon that has
# not written its pid file yet, as slurmd before it registers, is among them).
daemons() {
  local p
  for p in $(pgrep -f -- "-f $dir/slurm.conf\$" || true); do
    alive "$p" && echo "$p"
  done
}

stop() {
  local pids
  pids=$(daemons)
  [ -n "$pids" ] || return 0
  kill $pids 2>/dev/null || true
  for _ in $(seq 50); do
    pids=$(daemons)
    [ -n "$pids" ] || return 0
    sleep 0.1
  done
  kill -9 $pids 2>/dev/null || true
}

if [ "$cmd" = stop ]; then stop; exit 0; fi
[ "$cmd" = start ] || { echo "local_cluster.sh: unknown command '$cmd'" >&2; exit 2; }

for tool in slurmctld slurmd sinfo; do
  command -v "$tool" >/dev/null || PATH=$PATH:/usr/sbin
  command -v "$tool" >/dev/null || { echo "local_cluster.sh: $tool not installed (apt install slurmctld slurmd slurm-client)" >&2; exit 3; }
done

mkdir -p "$dir/state" "$dir/spool" "$dir/log"
user=$(id -un)

# Ports: a block of 201 (slurmctld, slurmd, srun's range) that no socket on
# this machine uses now, below the kernel's ephemeral range, where every
# outgoing connection (MPI's among them) takes its local port: a block inside
# that range can be taken between the check and the daemons' bind.
pick_ports() {
  local low high lo hi used
  read -r low high < /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || { low=32768; high=60999; }
  if [ "$low" -gt 10400 ]; then lo=10000; hi=$((low - 201)); else lo=$((high + 1)); hi=65334; fi
  used=" $(ss -Htan 2>/dev/null | awk '{n = split($4, a, ":"); print a[n]}' | sort -un | tr '\n' ' ') "
  for _ in $(seq 100); do
    base=$((lo + (RANDOM * 32768 + RANDOM) % (hi - lo)))
    local p free=1
    for p in $(seq "$base" $((base + 200))); do
      case "$used" in *" $p "*) free=0; break ;; esac
    done
    [ $free = 1 ] && return 0
  done
  echo "local_cluster.sh: no free block of 201 ports in $lo-$hi" >&2
  return 1
}

# One try: fresh ports, the configuration, both daemons, and a wait of at most
# 30 s (by the clock: a client call against a controller that is not there
# takes ~10 s by itself) for the node to come up idle. A daemon that exits, or
# a node left 'unk*', fails the try, and start() is retried with new ports.
start() {
pick_ports || return 1
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
local deadline=$((SECONDS + 30)) d
state=
while [ $SECONDS -lt $deadline ]; do
  for d in slurmctld slurmd; do
    if [ -f "$dir/$d.pid" ] && ! alive "$(cat "$dir/$d.pid")"; then
      state="$d exited"
      return 1
    fi
  done
  state=$(timeout -k 1 5 sinfo -h -N -o %t 2>/dev/null | head -1 || true)
  case "$state" in idle|mix|alloc) return 0 ;; esac
  sleep 0.1
done
return 1
}

for attempt in 1 2 3; do
  if start; then exit 0; fi
  echo "local_cluster.sh: try $attempt: no idle node within 30 s (state '${state:-none}', ports from ${base:-none}); logs in $dir/log.try$attempt" >&2
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
