# Steps shared by the test clusters' start scripts (sourced, not run):
#   tests/slurm/start_local_slurm.sh      one node on this machine
#   tests/slurm/start_multinode_slurm.sh  one node per simulated host (tests/cluster/)
# The sourcing script defines say() and die() first.

# Installs the Debian packages slurm-wlm and munge (apt-get) unless their daemons exist.
install_slurm() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    return 0
  fi
  command -v apt-get >/dev/null || die "slurmctld/slurmd/munged are missing and there is no apt-get; install Slurm and MUNGE by hand."
  say "installing slurm-wlm and munge (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null 2>&1 || {
    apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null
  } || die "apt-get could not install slurm-wlm and munge; see the output of: apt-get install slurm-wlm munge"
}

# Starts munged unless credentials already work. Its socket (/run/munge) is a file, so
# daemons in other network namespaces of this machine use the same munged.
start_munge() {
  munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
  say "starting munged"
  [ -f /etc/munge/munge.key ] || { mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
      || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null; }
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  runuser -u munge -- munged || die "munged did not start; see /var/log/munge/munged.log"
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n | unmunge >/dev/null || die "munge credentials do not work; see /var/log/munge/munged.log"
}

# True when the pid file $1 names a live process.
# The slurm.conf lines both test clusters share: no accounting, no cgroups (plain
# processes), CPUs as the consumable resource, a scheduler that acts within seconds.
common_conf() {
  cat <<'CONF'
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1,batch_sched_delay=0
CONF
}

# Whether the daemon of pid file $1 runs: the pid is alive AND is that daemon (the file's
# name up to its first '-' or '.': slurmctld, slurmd). A daemon killed with SIGKILL leaves
# its pid file behind, and pids wrap (pid_max is 32768 here): an unchecked stale pid once
# made `stop` send SIGTERM to whatever process had been given that pid since.
running() {
  local pid program
  program=$(basename "$1"); program=${program%%[-.]*}
  pid=$(cat "$1" 2>/dev/null) && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null \
    && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$program" ]
}

# Stops the daemon of pid file $1 (SIGTERM, then up to 5 s for it to exit).
stop() {
  local pid
  running "$1" && pid=$(cat "$1" 2>/dev/null) || return 0
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
}
