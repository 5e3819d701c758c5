#!/usr/bin/env bash
# build.sh — the binaries of phalanx's Kubernetes test cluster, from the Go module proxy only:
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubelet  (k8s.io/kubernetes v$K8S_VERSION)
#   etcd                                                             (go.etcd.io/etcd/server/v3 v$ETCD_VERSION)
#   kwok                                                             (sigs.k8s.io/kwok v$KWOK_VERSION)
# plus kwok's stage configuration (taken from the kwok module) as $BIN/kwok-stages-v$KWOK_VERSION.yaml, so that
# up.sh needs no Go toolchain once this has run.
#
# Idempotent: a binary already in $BIN that reports the wanted version is kept; only what is missing is built.
# Cold (empty Go caches, 2 cores): ~10 min for Kubernetes + etcd, ~2-5 min more for kwok; nothing to do: < 1 s.
#
#   tests/infra/k8s/build.sh           # build what is missing
#   tests/infra/k8s/build.sh --check   # exit 0 if everything is there, else list what is missing (exit 1); no Go needed
#
# Env: K8S_BIN_DIR   (default ${XDG_CACHE_HOME:-$HOME/.cache}/phalanx-infra/bin — keep it cached in CI)
#      K8S_BUILD_DIR (wrapper modules; default ${XDG_CACHE_HOME:-$HOME/.cache}/phalanx-infra/build)
#      K8S_VERSION (1.36.1), ETCD_VERSION (3.6.5), KWOK_VERSION (0.8.0)
set -euo pipefail
K8S_VERSION=${K8S_VERSION:-1.36.1}; ETCD_VERSION=${ETCD_VERSION:-3.6.5}; KWOK_VERSION=${KWOK_VERSION:-0.8.0}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/phalanx-infra
BIN=${K8S_BIN_DIR:-$CACHE/bin}
W=${K8S_BUILD_DIR:-$CACHE/build}
CMDS="kube-apiserver kube-controller-manager kube-scheduler kubelet"
STAGES=$BIN/kwok-stages-v$KWOK_VERSION.yaml
t0=$(date +%s)
log() { echo "[k8s-build] $(date +%T) $*" >&2; }
# `cmd --version | grep -q` under pipefail can fail with SIGPIPE (grep exits first) -> spurious rebuild: use <<<
have() { [[ -x $BIN/$1 ]] && grep -q -- "$2" <<<"$("$BIN/$1" --version 2>/dev/null)"; }
have_k8s()  { have "$1" "v$K8S_VERSION\$"; }
have_etcd() { have etcd "Version: $ETCD_VERSION\$"; }
have_kwok() { have kwok "v$KWOK_VERSION"; }
missing() {
  local m=() c
  for c in $CMDS; do have_k8s "$c" || m+=("$c"); done
  have_etcd || m+=(etcd)
  have_kwok || m+=(kwok)
  [[ -s $STAGES ]] || m+=("kwok-stages")
  echo "${m[*]}"
}

if [[ ${1:-} == --check ]]; then
  m=$(missing)
  [[ -z $m ]] && { echo "all binaries present in $BIN"; exit 0; }
  echo "missing in $BIN: $m"; exit 1
fi
m=$(missing)
[[ -z $m ]] && { log "all binaries present in $BIN (nothing to do)"; exit 0; }
command -v go >/dev/null || {
  log "ERROR: the Go toolchain ('go') is not installed, and these are missing in $BIN: $m"
  log "install Go >= 1.26 (https://go.dev/dl/) or copy prebuilt binaries into $BIN"; exit 2; }
log "missing: $m — building with $(go version | cut -d' ' -f3) into $BIN"
export GOFLAGS=-mod=mod CGO_ENABLED=0
mkdir -p "$BIN" "$W/k8s-$K8S_VERSION" "$W/etcd-$ETCD_VERSION"

# ---------------------------------------------------------------- Kubernetes components
KMINOR=$(cut -d. -f2 <<<"$K8S_VERSION"); KPATCH=$(cut -d. -f3 <<<"$K8S_VERSION"); STAGING_V=v0.$KMINOR.$KPATCH
need=(); for c in $CMDS; do have_k8s "$c" || need+=("$c"); done
if (( ${#need[@]} )); then
  cd "$W/k8s-$K8S_VERSION"
  KDIR=$(go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  # k8s.io/kubernetes' go.mod points k8s.io/* at ./staging/..., which the module zip does not contain:
  # a wrapper module re-points every staging module at its published twin v0.MINOR.PATCH.
  { echo "module local/k8sbuild"; echo; echo "go $(sed -n 's/^go //p' "$KDIR/go.mod")"; echo
    grep -q '^godebug' "$KDIR/go.mod" && grep '^godebug' "$KDIR/go.mod" && echo
    echo "require k8s.io/kubernetes v$K8S_VERSION"; echo; echo "replace ("
    grep -E '=> \./staging/' "$KDIR/go.mod" | awk -v V="$STAGING_V" '{print "\t"$1" => "$1" "V}'
    echo ")"; } > go.mod
  go get $(for c in "${need[@]}"; do echo "k8s.io/kubernetes/cmd/$c@v$K8S_VERSION"; done) 2>go-get.log \
    || { cat go-get.log >&2; exit 1; }
  log "go get done at $(( $(date +%s)-t0 )) s"
  LD="-s -w -X k8s.io/component-base/version.gitVersion=v$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1"
  LD+=" -X k8s.io/component-base/version.gitMinor=$KMINOR -X k8s.io/component-base/version.gitTreeState=clean"
  LD+=" -X k8s.io/client-go/pkg/version.gitVersion=v$K8S_VERSION -X k8s.io/client-go/pkg/version.gitMajor=1"
  LD+=" -X k8s.io/client-go/pkg/version.gitMinor=$KMINOR"
  for c in "${need[@]}"; do
    t=$(date +%s)
    go build -trimpath -ldflags "$LD" -o "$BIN/$c.tmp" "k8s.io/kubernetes/cmd/$c" && mv -f "$BIN/$c.tmp" "$BIN/$c"
    log "$c built in $(( $(date +%s)-t )) s (total $(( $(date +%s)-t0 )) s)"
  done
  cd - >/dev/null
fi

# ---------------------------------------------------------------- etcd
if ! have_etcd; then
  t=$(date +%s); cd "$W/etcd-$ETCD_VERSION"
  # `go install go.etcd.io/etcd/server/v3@v...` is refused (its go.mod has replace directives): wrapper module
  printf 'module local/etcdbuild\n\ngo 1.24\n\nrequire (\n' > go.mod
  for m in server/v3 api/v3 client/pkg/v3 client/v3 pkg/v3; do printf '\tgo.etcd.io/etcd/%s v%s\n' $m "$ETCD_VERSION" >> go.mod; done
  echo ")" >> go.mod
  go get "go.etcd.io/etcd/server/v3@v$ETCD_VERSION" 2>go-get.log || { cat go-get.log >&2; exit 1; }
  go build -trimpath -ldflags "-s -w" -o "$BIN/etcd.tmp" go.etcd.io/etcd/server/v3 && mv -f "$BIN/etcd.tmp" "$BIN/etcd"
  cd - >/dev/null
  log "etcd built in $(( $(date +%s)-t )) s (total $(( $(date +%s)-t0 )) s)"
fi

# ---------------------------------------------------------------- kwok (+ its stage configuration)
if ! have_kwok; then
  t=$(date +%s)
  GOBIN=$BIN go install "sigs.k8s.io/kwok/cmd/kwok@v$KWOK_VERSION"
  log "kwok built in $(( $(date +%s)-t )) s (total $(( $(date +%s)-t0 )) s)"
fi
if [[ ! -s $STAGES ]]; then
  KWOK_DIR=$(go mod download -json "sigs.k8s.io/kwok@v$KWOK_VERSION" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  # node: fast initialise + heartbeat; pod: the 'general' lifecycle (annotation-driven delays) with the default
  # 1-5 s random delays set to 0, and the fast delete (the general one waits for the deletion grace period)
  { for f in "$KWOK_DIR"/kustomize/stage/node/fast/node-initialize.yaml "$KWOK_DIR"/kustomize/stage/node/heartbeat/node-heartbeat.yaml \
             "$KWOK_DIR"/kustomize/stage/pod/general/pod-{create,init-container-running,init-container-completed,ready,complete}.yaml \
             "$KWOK_DIR"/kustomize/stage/pod/fast/pod-delete.yaml; do
      [[ -s $f ]] || { log "ERROR: $f not found in the kwok module"; exit 1; }
      echo "---"; sed -e 's/durationMilliseconds: 1000$/durationMilliseconds: 0/' -e '/jitterDurationMilliseconds: 5000/d' "$f"
    done; } > "$STAGES.tmp"
  mv -f "$STAGES.tmp" "$STAGES"
  log "wrote $STAGES"
fi
m=$(missing)
[[ -n $m ]] && { log "ERROR: still missing after the build: $m"; exit 1; }
log "ALL DONE in $(( $(date +%s)-t0 )) s; binaries in $BIN"
