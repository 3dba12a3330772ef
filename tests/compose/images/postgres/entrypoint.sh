#!/bin/sh
set -eu
mkdir -p "$PGDATA" /run/postgresql
chown -R postgres:postgres "$PGDATA" /run/postgresql
chmod 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp); echo "$POSTGRES_PASSWORD" >"$pwfile"; chown postgres "$pwfile"
  su postgres -c "initdb -D '$PGDATA' -E UTF8 --locale=C.UTF-8 -U '$POSTGRES_USER' --pwfile='$pwfile' --auth-local=trust --auth-host=scram-sha-256" >/dev/null
  rm -f "$pwfile"
  echo "host all all 0.0.0.0/0 scram-sha-256" >>"$PGDATA/pg_hba.conf"
  su postgres -c "pg_ctl -D '$PGDATA' -o '-c listen_addresses=' -w start" >/dev/null
  if [ "$POSTGRES_DB" != "postgres" ]; then
    su postgres -c "createdb -U '$POSTGRES_USER' -O '$POSTGRES_USER' '$POSTGRES_DB'"
  fi
  su postgres -c "pg_ctl -D '$PGDATA' -m fast -w stop" >/dev/null
fi
exec su postgres -c "exec postgres -D '$PGDATA' -c listen_addresses='*'"
