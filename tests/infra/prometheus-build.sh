#!/usr/bin/env bash
# prometheus-build.sh — the real Prometheus server (Apache-2.0) that scrapes `phalanx ui`'s and
# `phalanx metrics`' /metrics in the ui lane, from the Go module proxy only, pinned to
# $PROMETHEUS_VERSION (the module's version: v0.316.0 is Prometheus 3.16); cached as SeaweedFS's
# binary is (tests/infra/seaweedfs-build.sh).  Built without its web UI's assets (the
# `builtinassets` tag): the tests use its HTTP API only.
#
# Idempotent: a binary already in $BIN for the pinned version is kept.  Cold (empty Go caches):
# 17:22 here on 2 cores under load (13:18 of CPU), 11:30 by this script with the modules already
# downloaded; nothing to do: < 1 s.
#
#   tests/infra/prometheus-build.sh           # build it if missing; prints nothing on stdout
#   tests/infra/prometheus-build.sh --check   # exit 0 if it is there, else say so (exit 1); no Go needed
#   tests/infra/prometheus-build.sh --path    # print the binary's path (whether or not it exists)
#
# Env: PROMETHEUS_BIN_DIR (default ${XDG_CACHE_HOME:-$HOME/.cache}/phalanx-infra/bin — keep it cached in CI)
#      PROMETHEUS_VERSION (the module version; default below)
set -euo pipefail
PROMETHEUS_VERSION=${PROMETHEUS_VERSION:-v0.316.0}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/phalanx-infra
BIN=${PROMETHEUS_BIN_DIR:-$CACHE/bin}
PROM=$BIN/prometheus-$PROMETHEUS_VERSION   # the version is in the name: a new pin builds a new binary
log() { echo "[prometheus-build] $(date +%T) $*" >&2; }

case ${1:-} in
  --path) echo "$PROM"; exit 0 ;;
  --check) [[ -x $PROM ]] && { echo "present: $PROM"; exit 0; }; echo "missing: $PROM"; exit 1 ;;
  "") ;;
  *) echo "usage: $0 [--check|--path]" >&2; exit 2 ;;
esac
[[ -x $PROM ]] && { log "present: $PROM (nothing to do)"; exit 0; }
command -v go >/dev/null || {
  log "ERROR: the Go toolchain ('go') is not installed, and $PROM is missing"
  log "install Go >= 1.26 (https://go.dev/dl/) or copy a prebuilt prometheus binary to $PROM"; exit 2; }
t0=$(date +%s)
log "building Prometheus $PROMETHEUS_VERSION with $(go version | cut -d' ' -f3) into $PROM"
mkdir -p "$BIN"
out=$(mktemp -d "$BIN/.prometheus-build.XXXXXX")
trap 'rm -rf "$out"' EXIT
GOBIN=$out GOFLAGS=-buildvcs=false go install -trimpath -ldflags "-s -w" \
  "github.com/prometheus/prometheus/cmd/prometheus@$PROMETHEUS_VERSION"
mv -f "$out/prometheus" "$PROM"
log "built in $(( $(date +%s)-t0 )) s: $PROM ($(du -h "$PROM" | cut -f1))"
