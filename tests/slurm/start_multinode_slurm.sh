#!/usr/bin/env bash
# A Slurm cluster on the simulated hosts of tests/cluster/netns_hosts.sh: slurmctld on
# the head node, one slurmd on each of the first SLURM_NODES hosts (default 2; NodeName =
# host name, NodeAddr = its address).
#
#   sudo tests/cluster/netns_hosts.sh up 4          # first: the hosts
#   sudo tests/slurm/start_multinode_slurm.sh       # idempotent; `--stop` stops the daemons
#   sudo tests/cluster/netns_hosts.sh exec tfsim-head env SLURM_CONF=/tmp/tfsim-cluster/slurm/slurm.conf sinfo
#
# Independent of the one-node cluster of start_local_slurm.sh (its own ClusterName,
# SLURM_CONF, state, pid and log files); the same ports, but in other network
# namespaces. One munged (started here if needed) serves both: its socket is a file.
# Environment: CLUSTER_NAME, CLUSTER_SUBNET, CLUSTER_DIR as for netns_hosts.sh.
#
# Every task of a job (the batch script too) gets the node-local HOME, TFDS_DATA_DIR,
# TMPDIR and CLUSTER_HOST of its host (TaskProlog=D/slurm/task_prolog.sh).
#
# Files (D = CLUSTER_DIR): D/slurm/slurm.conf (the clients' SLURM_CONF), D/slurm/state
# (slurmctld), D/slurm/run/{slurmctld,slurmd-<host>}.pid, D/slurm/log/{slurmctld,
# slurmd-<host>}.log, D/hosts/<host>/slurmd (each slurmd's spool, node-local).
#
# Timeouts, chosen so that a test sees a lost host within seconds (defaults in brackets):
#   SlurmdTimeout=5 [300]   a node that answers no ping for 5 s is set DOWN and its jobs
#                           end with NODE_FAIL and are requeued (JobRequeue=1); pings go
#                           out every SlurmdTimeout/3 s, so a cut is seen in ~5-10 s.
#   MessageTimeout=3 [10]   one round trip; bounds how long a ping to a lost node waits.
#   TCPTimeout=2 [2]; KillWait=5 [30]; BatchStartTimeout=10 [10]
#   AuthInfo=cred_expire=5 [120], sched_interval=2 [60]: a requeued job starts again in
#                           a few seconds.
#   ReturnToService=2: a node that was DOWN is idle again as soon as its slurmd answers
#                           (after `heal`, or after its slurmd is restarted by this script).
# Exit status 0 when every host's node is idle (or busy); non-zero with the reason.
set -euo pipefail

NAME=${CLUSTER_NAME:-tfsim}
SUBNET=${CLUSTER_SUBNET:-10.213.7}
DIR=${CLUSTER_DIR:-/tmp/tfsim-cluster}
HOSTS_SH=$(cd "$(dirname "$0")/../cluster" && pwd)/netns_hosts.sh
SLURM_DIR=$DIR/slurm
CONF=$SLURM_DIR/slurm.conf
HEAD=$NAME-head
say() { echo "[start_multinode_slurm] $*"; }
die() { echo "[start_multinode_slurm] error: $*" >&2; exit 1; }
. "$(dirname "$0")/slurm_common.sh"

[ "$(id -u)" = 0 ] || die "run this as root (it installs packages and starts daemons): sudo $0"
[ -f "$DIR/hosts.tsv" ] || die "the simulated hosts are not up ($DIR/hosts.tsv is missing); run: sudo $HOSTS_SH up 4"
# The Slurm nodes: the first SLURM_NODES hosts (default 2; the other hosts stay outside
# Slurm, for tests that start their processes themselves).
HOSTS=$(awk -F '\t' -v head="$HEAD" '$1 != head {print $1}' "$DIR/hosts.tsv" | head -n "${SLURM_NODES:-2}")
address_of() { awk -F '\t' -v h="$1" '$1 == h {print $2}' "$DIR/hosts.tsv"; }
on() { local host=$1; shift; SLURM_CONF=$CONF "$HOSTS_SH" exec "$host" "$@"; }
ctld_pid=$SLURM_DIR/run/slurmctld.pid
slurmd_pid() { echo "$SLURM_DIR/run/slurmd-$1.pid"; }

stop_all() {
  local host
  for host in $HOSTS; do stop "$(slurmd_pid "$host")"; done
  stop "$ctld_pid"
}
if [ "${1:-}" = --stop ]; then stop_all; say "stopped"; exit 0; fi

install_slurm

# Configuration (rewritten only when it changes; then every daemon restarts).
CPUS=$(nproc)
NODES=$(for host in $HOSTS; do
  echo "NodeName=$host NodeAddr=$(address_of "$host") CPUs=$CPUS State=UNKNOWN"; done)
NEW_CONF=$(cat <<CONF
# Written by tests/slurm/start_multinode_slurm.sh: one node per simulated host.
ClusterName=$NAME
SlurmctldHost=$HEAD($(address_of "$HEAD"))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=5
StateSaveLocation=$SLURM_DIR/state
SlurmdSpoolDir=$DIR/hosts/%n/slurmd
SlurmctldPidFile=$ctld_pid
SlurmdPidFile=$SLURM_DIR/run/slurmd-%n.pid
SlurmctldLogFile=$SLURM_DIR/log/slurmctld.log
SlurmdLogFile=$SLURM_DIR/log/slurmd-%n.log
$(common_conf)
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=5
SlurmdTimeout=5
MessageTimeout=3
TCPTimeout=2
BatchStartTimeout=10
InactiveLimit=0
TaskProlog=$SLURM_DIR/task_prolog.sh
$NODES
PartitionName=hosts Nodes=$(echo $HOSTS | tr ' ' ',') Default=YES MaxTime=INFINITE State=UP
CONF
)
mkdir -p "$SLURM_DIR"/{state,run,log}
# Every task (the batch script too) gets the node-local HOME, TFDS_DATA_DIR and TMPDIR of
# the host it runs on, as commands run through `netns_hosts.sh exec` do, instead of the
# submitting host's (sbatch exports its whole environment).
cat > "$SLURM_DIR/task_prolog.sh" <<PROLOG
#!/bin/sh
# Written by tests/slurm/start_multinode_slurm.sh (TaskProlog): node-local directories.
awk -F '\t' -v h="\$SLURMD_NODENAME" '\$1 == h {
  print "export HOME=" \$3; print "export TFDS_DATA_DIR=" \$4; print "export TMPDIR=" \$5
  print "export CLUSTER_HOST=" h }' "$DIR/hosts.tsv"
PROLOG
chmod +x "$SLURM_DIR/task_prolog.sh"
if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$NEW_CONF" ]; then
  stop_all
  printf '%s\n' "$NEW_CONF" > "$CONF"
  say "wrote $CONF ($(echo $HOSTS | wc -w) nodes, $CPUS CPUs each)"
fi

# Daemons: each started in its host's namespace (it daemonizes and stays there).
start_munge
if ! running "$ctld_pid"; then
  say "starting slurmctld on $HEAD (clean state)"
  on "$HEAD" slurmctld -c -f "$CONF" || die "slurmctld did not start; see $SLURM_DIR/log/slurmctld.log"
fi
for host in $HOSTS; do
  if ! running "$(slurmd_pid "$host")"; then
    say "starting slurmd on $host"
    mkdir -p "$DIR/hosts/$host/slurmd"
    on "$host" slurmd -f "$CONF" -N "$host" || die "slurmd did not start on $host; see $SLURM_DIR/log/slurmd-$host.log"
  fi
done

# Wait until every node is usable (slurmd registers within a few seconds).
for _ in $(seq 60); do
  states=$(on "$HEAD" sinfo -h -N -o '%N %T' 2>/dev/null || true)
  not_ready=$(echo "$states" | awk '$2 !~ /^(idle|mixed|allocated|completing)/' | grep . || true)
  if [ -n "$states" ] && [ -z "$not_ready" ]; then
    say "ready: $(echo "$states" | tr '\n' ' ')"
    exit 0
  fi
  sleep 0.5
done
die "nodes not ready after 30 s: ${not_ready:-no answer from slurmctld}; see $SLURM_DIR/log/"
