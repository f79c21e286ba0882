#!/usr/bin/env bash
# Start a throw-away PostgreSQL server on 127.0.0.1 for the tuner's shared-study test (issue 6).
# Installs the server with apt-get when missing, initialises a cluster in $TANGRAM_PG_DATA (default
# /tmp/tangram-pg) owned by the postgres user (or the current user when not root), starts it on
# 127.0.0.1:$TANGRAM_PG_PORT (default 54329), creates role/database "tangram", and prints ONE line on
# stdout:  export TANGRAM_PG_URL=postgresql://tangram:tangram@127.0.0.1:PORT/tangram
# Idempotent: a second call reuses the cluster and the running server. Use from .ci/run:
#   eval "$(bash .ci/postgres.sh)"
set -euo pipefail
PORT=${TANGRAM_PG_PORT:-54329}
DATA=${TANGRAM_PG_DATA:-/tmp/tangram-pg}
log() { echo "postgres.sh: $*" >&2; }

find_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1; }
BIN=$(find_bin || true)
if [[ -z "$BIN" || ! -x "$BIN/initdb" ]]; then
  [[ $(id -u) -eq 0 ]] || { log "PostgreSQL is not installed and we are not root: cannot apt-get install it"; exit 1; }
  log "installing postgresql with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update >&2
  apt-get install -y --no-install-recommends postgresql >&2
  BIN=$(find_bin)
fi

if [[ $(id -u) -eq 0 ]]; then
  id postgres >/dev/null 2>&1 || useradd --system --home-dir /var/lib/postgresql --shell /bin/bash postgres
  as_pg() { su postgres -s /bin/sh -c "$*"; }
  OWNER=postgres
else
  as_pg() { sh -c "$*"; }
  OWNER=$(id -un)
fi

if [[ ! -s "$DATA/PG_VERSION" ]]; then
  log "initialising a cluster in $DATA"
  mkdir -p "$DATA"
  chown "$OWNER" "$DATA"
  chmod 700 "$DATA"
  as_pg "'$BIN/initdb' -D '$DATA' -U postgres --auth-local=trust --auth-host=scram-sha-256 -E UTF8 >/dev/null"
fi

PGCTL_OPTS="-c listen_addresses=127.0.0.1 -p $PORT -c unix_socket_directories='$DATA' -c max_connections=100"
if ! as_pg "'$BIN/pg_ctl' -D '$DATA' status" >/dev/null 2>&1; then
  log "starting the server on 127.0.0.1:$PORT"
  as_pg "'$BIN/pg_ctl' -D '$DATA' -l '$DATA/server.log' -w -t 60 -o \"$PGCTL_OPTS\" start" >&2
fi

psql_pg() { as_pg "'$BIN/psql' -h '$DATA' -p $PORT -U postgres -d postgres -v ON_ERROR_STOP=1 -tAc \"$1\""; }
if [[ -z "$(psql_pg "SELECT 1 FROM pg_roles WHERE rolname='tangram'")" ]]; then
  psql_pg "CREATE ROLE tangram LOGIN PASSWORD 'tangram'" >&2
fi
if [[ -z "$(psql_pg "SELECT 1 FROM pg_database WHERE datname='tangram'")" ]]; then
  psql_pg "CREATE DATABASE tangram OWNER tangram" >&2
fi
echo "export TANGRAM_PG_URL=postgresql://tangram:tangram@127.0.0.1:$PORT/tangram"
