#!/usr/bin/env bash
# seaweedfs-build.sh — the `weed` binary (SeaweedFS, Apache-2.0) for the store's S3 tests (marker s3),
# from the Go module proxy only, pinned to $SEAWEEDFS_VERSION; cached as the Kubernetes binaries are.
#
# `go install ...@version` refuses the module (its go.mod has `replace` directives), so the module's
# source is copied out of the module cache and built as the main module.
#
# Idempotent: a binary already in $BIN for the pinned version is kept.  Cold (empty Go caches, 2 cores):
# ~4 min on an idle machine, 10:22 on a busy one; one 157 MB binary (stripped); nothing to do: < 1 s.
#
#   tests/infra/seaweedfs-build.sh           # build it if missing; prints nothing on stdout
#   tests/infra/seaweedfs-build.sh --check   # exit 0 if it is there, else say so (exit 1); no Go needed
#   tests/infra/seaweedfs-build.sh --path    # print the binary's path (whether or not it exists)
#
# Env: SEAWEEDFS_BIN_DIR   (default ${XDG_CACHE_HOME:-$HOME/.cache}/phalanx-infra/bin — keep it cached in CI)
#      SEAWEEDFS_BUILD_DIR (scratch copy of the source; default ${XDG_CACHE_HOME:-$HOME/.cache}/phalanx-infra/build)
#      SEAWEEDFS_VERSION   (the module version; default below)
set -euo pipefail
SEAWEEDFS_VERSION=${SEAWEEDFS_VERSION:-v0.0.0-20261109003541-7506e5f91cd6}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/phalanx-infra
BIN=${SEAWEEDFS_BIN_DIR:-$CACHE/bin}
W=${SEAWEEDFS_BUILD_DIR:-$CACHE/build}
WEED=$BIN/weed-$SEAWEEDFS_VERSION   # the version is in the name: a new pin builds a new binary
log() { echo "[seaweedfs-build] $(date +%T) $*" >&2; }

case ${1:-} in
  --path) echo "$WEED"; exit 0 ;;
  --check) [[ -x $WEED ]] && { echo "present: $WEED"; exit 0; }; echo "missing: $WEED"; exit 1 ;;
  "") ;;
  *) echo "usage: $0 [--check|--path]" >&2; exit 2 ;;
esac
[[ -x $WEED ]] && { log "present: $WEED (nothing to do)"; exit 0; }
command -v go >/dev/null || {
  log "ERROR: the Go toolchain ('go') is not installed, and $WEED is missing"
  log "install Go >= 1.26 (https://go.dev/dl/) or copy a prebuilt weed binary to $WEED"; exit 2; }
t0=$(date +%s)
log "building SeaweedFS $SEAWEEDFS_VERSION with $(go version | cut -d' ' -f3) into $WEED"
mkdir -p "$BIN" "$W"
src=$(mktemp -d "$W/seaweedfs-src.XXXXXX")
trap 'chmod -R u+w "$src" 2>/dev/null; rm -rf "$src"' EXIT
dir=$(go mod download -json "github.com/seaweedfs/seaweedfs@$SEAWEEDFS_VERSION" |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
log "module downloaded at $(( $(date +%s)-t0 )) s: $dir"
cp -r "$dir/." "$src/" && chmod -R u+w "$src"
cd "$src"
GOFLAGS=-buildvcs=false go build -trimpath -ldflags "-s -w" -o "$WEED.tmp" ./weed
mv -f "$WEED.tmp" "$WEED"
log "built in $(( $(date +%s)-t0 )) s: $WEED ($(du -h "$WEED" | cut -f1))"
