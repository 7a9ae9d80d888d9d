#!/usr/bin/env bash
# Simulated hosts on this machine: Linux network namespaces on a private bridge.
#
#   tests/cluster/netns_hosts.sh up N      # as root: N hosts + a head node (idempotent)
#   tests/cluster/netns_hosts.sh status    # one line per host; exit 3 when not up
#   tests/cluster/netns_hosts.sh exec HOST CMD [ARG...]   # run CMD on HOST
#   tests/cluster/netns_hosts.sh partition HOST | heal HOST
#   tests/cluster/netns_hosts.sh down      # kill everything in them, delete all (idempotent)
#
# Environment (the defaults make one cluster; change CLUSTER_NAME, CLUSTER_SUBNET and
# CLUSTER_DIR together to run a second one side by side):
#   CLUSTER_NAME    prefix of every namespace and interface (default tfsim, <= 8 chars)
#   CLUSTER_SUBNET  first three octets of the private /24 (default 10.213.7)
#   CLUSTER_DIR     the hosts' disks (default /tmp/tfsim-cluster)
#
# What `up N` makes:
#   * namespaces NAME-head (address SUBNET.2) and NAME-h0 .. NAME-h<N-1> (SUBNET.10+i);
#     each has loopback up and one interface eth0 with its /24 address, and NO default
#     route: the /24 is the only network a host can reach, and no address outside the
#     namespaces is used. The hostname of every command run through `exec` is the host's
#     name (its own UTS namespace).
#   * a bridge NAME-br in the root namespace with no address and no uplink (no NAT, no
#     forwarding to the outside): each host's eth0 is a veth whose other end NAME-v<i>
#     (NAME-vhd for the head) is a port of the bridge. `partition HOST` takes that port
#     down (a pulled cable: the host keeps its address, its packets are lost), `heal
#     HOST` brings it back up.
#   * /etc/netns/<host>/hosts: every host's name and address, mounted over /etc/hosts for
#     commands run through `exec` (as `ip netns exec` does), so hosts resolve each other
#     by name. The Google storage names (GCS_NAMES below) resolve to the head node, where
#     the tests' GCS emulator serves them (tests/cluster/gcs.py); with no route out, no
#     client in a namespace can reach the real ones.
#   * disks: CLUSTER_DIR/hosts/<host>/{home,tfds,scratch} (node-local: HOME,
#     TFDS_DATA_DIR, TMPDIR of commands run through `exec`) and CLUSTER_DIR/shared (the
#     one directory every host sees, what NFS is on a real cluster). A cluster set up
#     from nothing starts with empty disks; `up` on a running cluster keeps them.
#   * CLUSTER_DIR/hosts.tsv, the manifest: one line per host "name address home tfds
#     scratch", head first (what tests/cluster/hosts.py reads).
# `up` repairs whatever is missing (re-running it after a crash works), heals every
# partitioned host and removes hosts beyond N. `down` kills every process in the
# namespaces (SIGKILL), deletes namespaces, veths, bridge and /etc/netns entries, and
# keeps CLUSTER_DIR for post-mortem reading. Exit status non-zero with the reason when
# something cannot be done.
set -euo pipefail

NAME=${CLUSTER_NAME:-tfsim}
SUBNET=${CLUSTER_SUBNET:-10.213.7}
DIR=${CLUSTER_DIR:-/tmp/tfsim-cluster}
BRIDGE=$NAME-br
HEAD=$NAME-head
MANIFEST=$DIR/hosts.tsv
GCS_NAMES="www.googleapis.com storage.googleapis.com oauth2.googleapis.com"
say() { echo "[netns_hosts] $*"; }
die() { echo "[netns_hosts] error: $*" >&2; exit 1; }

usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

check_names() {
  [ "${#NAME}" -le 8 ] || die "CLUSTER_NAME '$NAME' is longer than 8 characters (interface names are limited to 15); choose a shorter one."
  [[ "$NAME" =~ ^[a-z][a-z0-9]*$ ]] || die "CLUSTER_NAME '$NAME' must be lower-case letters and digits, starting with a letter."
  [[ "$SUBNET" =~ ^10\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || die "CLUSTER_SUBNET '$SUBNET' must be the first three octets of a private 10.x.y.0/24, e.g. 10.213.7."
  if ip -4 -o addr show 2>/dev/null | grep -q " inet $SUBNET\."; then
    die "$SUBNET.0/24 is already used by an interface of this machine (ip -4 addr); set CLUSTER_SUBNET to an unused 10.x.y."
  fi
}

need_root_and_ip() {
  [ "$(id -u)" = 0 ] || die "run this as root (network namespaces need CAP_NET_ADMIN and CAP_SYS_ADMIN): sudo $0 $*"
  command -v unshare >/dev/null && command -v nsenter >/dev/null \
    || die "'unshare' or 'nsenter' (util-linux) is missing; install util-linux."
  if ! command -v ip >/dev/null; then
    command -v apt-get >/dev/null || die "'ip' (iproute2) is missing and there is no apt-get; install iproute2 by hand."
    say "installing iproute2 (apt-get)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends iproute2 >/dev/null 2>&1 || {
      apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends iproute2 >/dev/null
    } || die "apt-get could not install iproute2; see the output of: apt-get install iproute2"
  fi
}

# Namespaces of this cluster that exist now (head first, then hosts by index).
cluster_namespaces() {
  ip netns list 2>/dev/null | awk -v p="$NAME-" '
    index($1, p) == 1 { s = substr($1, length(p) + 1)
      if (s == "head") print -1, $1; else if (s ~ /^h[0-9]+$/) print substr(s, 2) + 0, $1 }' \
    | sort -n | cut -d' ' -f2
}
ns_exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$1"; }
veth_of() { if [ "$1" = "$HEAD" ]; then echo "$NAME-vhd"; else echo "$NAME-v${1##*-h}"; fi; }
address_of() { if [ "$1" = "$HEAD" ]; then echo "$SUBNET.2"; else echo "$SUBNET.$((10 + ${1##*-h}))"; fi; }
host_dir() { echo "$DIR/hosts/$1"; }

ensure_bridge() {
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge || die "could not create bridge $BRIDGE: this needs root in the machine's own network namespace (not in a container or user namespace without CAP_NET_ADMIN) and the bridge module (modprobe bridge)"
  fi
  ip addr flush dev "$BRIDGE"  # no address: the root namespace is not a host of the cluster
  ip link set "$BRIDGE" up
}

ensure_host() {  # ns: namespace, veth and address, all up
  local ns=$1 veth addr
  veth=$(veth_of "$ns"); addr=$(address_of "$ns")
  ns_exists "$ns" || ip netns add "$ns" || die "could not create network namespace $ns (ip netns add); is this a container without CAP_SYS_ADMIN?"
  if ! ip link show "$veth" >/dev/null 2>&1; then
    ip -n "$ns" link del eth0 2>/dev/null || true
    ip link add "$veth" type veth peer name eth0 netns "$ns" || die "could not create veth pair $veth/eth0 for $ns"
  fi
  ip link set "$veth" master "$BRIDGE"
  ip link set "$veth" up
  ip -n "$ns" link set lo up
  ip -n "$ns" addr replace "$addr/24" dev eth0
  ip -n "$ns" link set eth0 up
  if ip -n "$ns" route show default | grep -q .; then
    die "$ns has a default route; traffic must not leave the simulated hosts. Run '$0 down' and '$0 up' again."
  fi
  mkdir -p "$(host_dir "$ns")"/{home,tfds,scratch}
}

write_hosts_files() {  # /etc/netns/<ns>/hosts for every host, and the manifest
  local names ns dir
  names=$(for ns in $(cluster_namespaces); do printf '%s %s\n' "$(address_of "$ns")" "$ns"; done)
  names=$(printf '%s\n%s %s' "$names" "$(address_of "$HEAD")" "$GCS_NAMES")
  for ns in $(cluster_namespaces); do
    mkdir -p "/etc/netns/$ns"
    printf '127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n%s\n' "$names" > "/etc/netns/$ns/hosts"
  done
  : > "$MANIFEST.new"
  for ns in $(cluster_namespaces); do
    dir=$(host_dir "$ns")
    printf '%s\t%s\t%s\t%s\t%s\n' "$ns" "$(address_of "$ns")" "$dir/home" "$dir/tfds" "$dir/scratch" >> "$MANIFEST.new"
  done
  mv "$MANIFEST.new" "$MANIFEST"
}

remove_host() {  # kill its processes, delete veth, namespace and /etc/netns entry
  local ns=$1 pids
  for _ in $(seq 50); do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -z "$pids" ] && break
    kill -KILL $pids 2>/dev/null || true
    sleep 0.1
  done
  [ -z "$(ip netns pids "$ns" 2>/dev/null || true)" ] \
    || die "processes $(ip netns pids "$ns" | tr '\n' ' ')in $ns survived SIGKILL for 5 s (uninterruptible sleep?); see ps -o pid,stat,cmd -p <pid>"
  # Deleting the veth first makes its removal synchronous (a deleted namespace frees
  # its interfaces later, and a quick `up` would find the old name still taken).
  ip link del "$(veth_of "$ns")" 2>/dev/null || true
  ip netns del "$ns" 2>/dev/null || true
  rm -rf "/etc/netns/$ns"
}

cmd_up() {
  local n=${1:-}
  [[ "$n" =~ ^[1-9][0-9]?$ ]] || die "usage: $0 up N (N = number of hosts, 1..99)"
  need_root_and_ip
  check_names
  local fresh=1 ns i
  [ -n "$(cluster_namespaces)" ] && fresh=0
  if [ "$fresh" = 1 ]; then
    rm -rf "$DIR/hosts" "$DIR/shared"  # a new cluster starts with empty disks
  fi
  mkdir -p "$DIR/shared"
  ensure_bridge
  ensure_host "$HEAD"
  for ((i = 0; i < n; i++)); do ensure_host "$NAME-h$i"; done
  for ns in $(cluster_namespaces); do
    [ "$ns" = "$HEAD" ] && continue
    [ "${ns##*-h}" -ge "$n" ] && { say "removing $ns (beyond $n hosts)"; remove_host "$ns"; }
  done
  write_hosts_files
  say "up: $n hosts + head on $SUBNET.0/24 (bridge $BRIDGE), disks in $DIR"
}

cmd_down() {
  [ "$(id -u)" = 0 ] || die "run this as root: sudo $0 down"
  local ns
  for ns in $(cluster_namespaces); do remove_host "$ns"; done
  if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE"; fi
  rm -f "$MANIFEST"
  say "down: no namespace, interface or process of cluster '$NAME' is left (disks kept in $DIR)"
}

cmd_status() {
  local ns veth link pids up=1
  [ -n "$(cluster_namespaces)" ] || { say "cluster '$NAME' is not up"; exit 3; }
  for ns in $(cluster_namespaces); do
    veth=$(veth_of "$ns")
    if ! ip link show "$veth" >/dev/null 2>&1; then link=missing; up=0
    elif ! ip -o link show "$veth" | grep -Eq '[<,]UP[,>]'; then link=partitioned
    else link=connected; fi
    pids=$(ip netns pids "$ns" | wc -l)
    printf '%-14s %-15s %-11s %s processes\n' "$ns" "$(address_of "$ns")" "$link" "$pids"
  done
  [ "$up" = 1 ] || exit 3
}

host_env() {  # exports the node-local HOME, TFDS_DATA_DIR, TMPDIR of host $1
  local line
  line=$(awk -F '\t' -v h="$1" '$1 == h' "$MANIFEST" 2>/dev/null || true)
  [ -n "$line" ] || die "no host '$1' in $MANIFEST; hosts: $(cut -f1 "$MANIFEST" 2>/dev/null | tr '\n' ' ')(is the cluster up? $0 status)"
  IFS=$'\t' read -r _ _ HOME TFDS_DATA_DIR TMPDIR <<< "$line"
  export HOME TFDS_DATA_DIR TMPDIR CLUSTER_HOST=$1
}

cmd_exec() {  # replaces this shell: the command's pid is this script's pid
  [ $# -ge 2 ] || die "usage: $0 exec HOST CMD [ARG...]"
  local ns=$1; shift
  host_env "$ns"
  # The host's network namespace, plus a mount and a UTS namespace of the command's own:
  # its /etc/hosts and its hostname. (Not `ip netns exec`: it remounts /sys, which hides
  # the cgroup hierarchy that slurmd needs.)
  exec nsenter --net="/run/netns/$ns" -- unshare --mount --uts -- sh -c \
    'mount --bind "/etc/netns/$0/hosts" /etc/hosts && hostname "$0" && exec "$@"' "$ns" "$@"
}

cmd_link() {  # partition / heal: the host's bridge port down / up
  [ $# -eq 2 ] || die "usage: $0 $1 HOST"
  ns_exists "$2" || die "no host '$2' (cluster '$NAME'); see $0 status"
  ip link set "$(veth_of "$2")" "$([ "$1" = partition ] && echo down || echo up)"
}

case "${1:-}" in
  up) shift; cmd_up "$@" ;;
  down) cmd_down ;;
  status) cmd_status ;;
  exec) shift; cmd_exec "$@" ;;
  partition|heal) cmd_link "$@" ;;
  *) usage ;;
esac
