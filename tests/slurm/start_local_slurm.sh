#!/usr/bin/env bash
# Starts a single-node Slurm cluster on this machine for the real-Slurm tests
# (tests/launch/test_slurm.py). Idempotent: run it as often as you like; a cluster that is
# already up with this configuration is left alone.
#
#   sudo tests/slurm/start_local_slurm.sh        # as root; Debian/Ubuntu (apt-get)
#
# What it does, each step only when needed:
#   1. installs the Debian packages slurm-wlm and munge (apt-get) if slurmctld is absent;
#   2. writes /etc/slurm/slurm.conf: one node "localhost" (127.0.0.1) with this
#      machine's cores as CPUs, one partition "debug", no cgroups, no accounting, and
#      short intervals so a requeued job starts again within seconds (see below);
#   3. starts munged, slurmctld and slurmd, and waits until the node is idle.
# Exit status 0 when `sinfo` shows the node ready; non-zero with the reason otherwise.
# Logs: /var/log/slurm/slurmctld.log and /var/log/slurm/slurmd.log.
#
# Why the short intervals: by default Slurm delays a requeued job by the job
# credential's lifetime (AuthInfo=cred_expire, 120 s) and tests pending jobs only every
# sched_interval (60 s); on a test cluster both are cut to a few seconds. KillWait (30 s
# between SIGTERM and SIGKILL) is cut too. MinJobAge keeps finished jobs visible to
# `scontrol show job` for 10 minutes, long enough for the tests to read their state.
set -euo pipefail

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
NODE=localhost
LOG_DIR=/var/log/slurm
STATE_DIR=/var/lib/slurm/slurmctld
SPOOL_DIR=/var/lib/slurm/slurmd
say() { echo "[start_local_slurm] $*"; }
die() { echo "[start_local_slurm] error: $*" >&2; exit 1; }
. "$(dirname "$0")/slurm_common.sh"

[ "$(id -u)" = 0 ] || die "run this as root (it installs packages and starts daemons): sudo $0"

# 1. Packages.
install_slurm

# 2. Configuration (rewritten only when it changes).
CPUS=$(nproc)
mkdir -p "$CONF_DIR" "$LOG_DIR" "$STATE_DIR" "$SPOOL_DIR"
NEW_CONF=$(cat <<CONF
# Written by tests/slurm/start_local_slurm.sh: a one-node test cluster on localhost.
ClusterName=localtest
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits cred_expire seconds before it may start again (default 120, minimum 5).
AuthInfo=cred_expire=5
StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=$SPOOL_DIR
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
$(common_conf)
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=5
MessageTimeout=10
BatchStartTimeout=10
InactiveLimit=0
SlurmdTimeout=60
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
CONF
)
MARK="# Written by tests/slurm/start_local_slurm.sh"
if [ -f "$CONF" ] && [ "$(head -n1 "$CONF")" != "${MARK}: a one-node test cluster on localhost." ]; then
  die "$CONF exists and was not written by this script: this machine has its own Slurm setup, which this test helper does not overwrite. Run the tests against it, or move $CONF away first."
fi
conf_changed=0
if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$NEW_CONF" ]; then
  printf '%s\n' "$NEW_CONF" > "$CONF"
  conf_changed=1
  say "wrote $CONF ($CPUS CPUs)"
fi

# 3. Daemons.
start_munge
if [ "$conf_changed" = 1 ]; then
  stop /run/slurmd.pid
  stop /run/slurmctld.pid
fi
if ! running /run/slurmctld.pid; then
  say "starting slurmctld"
  slurmctld || die "slurmctld did not start; see $LOG_DIR/slurmctld.log"
fi
if ! running /run/slurmd.pid; then
  say "starting slurmd"
  slurmd -N "$NODE" || die "slurmd did not start; see $LOG_DIR/slurmd.log"
fi

# Wait for the node (slurmd registers within a few seconds).
for _ in $(seq 60); do
  state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null || true)
  case "$state" in
    idle*|mixed*|allocated*|completing*) say "ready: node $NODE is $state"; exit 0 ;;
    down*|drain*|fail*) scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true ;;
  esac
  sleep 0.5
done
die "node $NODE is not ready after 30 s (state: '${state:-no answer from slurmctld}'); see $LOG_DIR/slurmctld.log and $LOG_DIR/slurmd.log"
