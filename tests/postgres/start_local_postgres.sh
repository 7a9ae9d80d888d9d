#!/usr/bin/env bash
# Starts a local PostgreSQL server for the sweep's PostgreSQL test
# (tests/sweep/test_sweep_postgres.py). Idempotent; as root; Debian/Ubuntu (apt-get).
#
#   sudo tests/postgres/start_local_postgres.sh
#
# What it does, each step only when needed:
#   1. installs the Debian package postgresql (apt-get) if pg_ctlcluster is absent;
#   2. starts the first cluster pg_lsclusters lists (Debian's install creates one);
#   3. creates the role "sweep" (password "sweep") and its database "sweep".
# Prints the URL the test uses (TEST_POSTGRES_URL; the default port is 5432).
# Exit status 0 when the server answers; non-zero with the reason otherwise.
set -euo pipefail
say() { echo "[start_local_postgres] $*"; }
apt_install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null; }
}
if ! command -v pg_ctlcluster >/dev/null; then
  say "installing postgresql (apt-get)"
  apt_install postgresql
fi
read -r version cluster port _ < <(pg_lsclusters -h | head -n 1) || true
if [ -z "${version:-}" ]; then
  say "pg_lsclusters lists no cluster; create one with pg_createcluster"
  exit 1
fi
if ! pg_ctlcluster "$version" "$cluster" status >/dev/null 2>&1; then
  say "starting cluster $version/$cluster on port $port"
  pg_ctlcluster "$version" "$cluster" start
fi
sql() { runuser -u postgres -- psql -p "$port" -v ON_ERROR_STOP=1 -tAc "$1"; }
[ "$(sql "SELECT 1 FROM pg_roles WHERE rolname = 'sweep'")" = 1 ] \
  || sql "CREATE ROLE sweep LOGIN PASSWORD 'sweep'" >/dev/null
[ "$(sql "SELECT 1 FROM pg_database WHERE datname = 'sweep'")" = 1 ] \
  || runuser -u postgres -- createdb -p "$port" -O sweep sweep
say "ready: postgresql+psycopg2://sweep:sweep@127.0.0.1:$port/sweep"
