#!/usr/bin/env bash
# down.sh — stop what up.sh started, by its pid files only (never by process name): the real nodes first (kubelet,
# the pods' containers, containerd and its shims; then unmount, remove the node's cgroups and Node object), then
# kwok, kube-scheduler, kube-controller-manager, kube-apiserver, etcd. The sysctls the kubelet changed are restored
# once no kubelet of ours runs.
#
#   tests/infra/k8s/down.sh                # stop everything, keep state (etcd data, PKI, images): next up ~5 s
#   tests/infra/k8s/down.sh --purge        # ... and delete the state too (binaries in K8S_BIN_DIR are kept)
#   tests/infra/k8s/down.sh --node 127.0.0.2 [--purge]   # one real node only; the control plane stays
# Env: K8S_STATE_DIR (as for up.sh, default ${TMPDIR:-/tmp}/phalanx-k8s).
set -uo pipefail
S=${K8S_STATE_DIR:-${TMPDIR:-/tmp}/phalanx-k8s}
PURGE=0; ONLY=()
while (( $# )); do
  case $1 in
    --purge) PURGE=1;;
    --node) ONLY+=("$2"); shift;;
    -h|--help) sed -n '2,11p' "$0"; exit 0;;
    *) echo "usage: $0 [--purge] [--node NAME]..." >&2; exit 2;;
  esac; shift
done
log() { echo "[k8s-down] $(date +%T) $*" >&2; }
pid_alive() { local s; s=$(sed -E 's/.*\) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1; [[ -n $s && $s != Z ]]; }
argv0() { local a; IFS= read -r -d '' a <"/proc/$1/cmdline" 2>/dev/null; printf %s "$a"; }
alive() {  # dir name: the pid file's process runs and is still the program up.sh started
  local pf=$1/run/$2.pid pid; [[ -s $pf ]] || return 1; pid=$(cat "$pf")
  pid_alive "$pid" && [[ ! -s $1/run/$2.cmd || $(argv0 "$pid") == "$(cat "$1/run/$2.cmd")" ]]; }
stop() {  # dir name [seconds before SIGKILL]
  local pf=$1/run/$2.pid pid
  if alive "$1" "$2"; then
    pid=$(cat "$pf"); log "stopping $2 ($pid)"; kill "$pid" 2>/dev/null
    for _ in $(seq $(( ${3:-10} * 10 ))); do pid_alive "$pid" || break; sleep 0.1; done
    pid_alive "$pid" && { log "SIGKILL $2 ($pid)"; kill -9 "$pid" 2>/dev/null; }
  fi
  rm -f "$pf"
}
umount_under() {  # every mount below $1 (pod volumes, overlay rootfs, sandbox shm/netns, the kubelet's root-dir bind)
  local m t
  for _ in 1 2 3; do
    m=$(findmnt -rn -o TARGET | grep -F "$1/" | sort -r) || true
    [[ -z $m ]] && return 0
    while read -r t; do umount "$t" 2>/dev/null || umount -l "$t" 2>/dev/null; done <<<"$m"
  done
  ! findmnt -rn -o TARGET | grep -qF "$1/"
}
purge() {  # rm -rf only what is not mounted, and never across a mount (--one-file-system)
  local p
  for p in "$@"; do
    [[ -e $p || -L $p ]] || continue
    if findmnt -rn -o TARGET | grep -qF "$p"; then log "NOT purging $p: something is still mounted there"; continue; fi
    rm -rf --one-file-system "$p"
  done
}
if [[ -z ${K8S_LOCK_HELD:-} && -d $S ]]; then   # not while up.sh runs (up.sh itself calls us with the lock held)
  exec 9>"$S/.lock"; flock -w 300 9 || { log "another up.sh/down.sh holds $S/.lock"; exit 1; }
fi
TOKEN=; [[ -s $S/pki/tokens.csv ]] && TOKEN=$(cut -d, -f1 "$S/pki/tokens.csv")

# ---------------------------------------------------------------- real nodes
if (( ${#ONLY[@]} )); then dirs=(); for n in "${ONLY[@]}"; do dirs+=("$S/node-$n"); done; else dirs=("$S"/node-*); fi
for K in "${dirs[@]}"; do
  [[ -d $K ]] || continue
  N=${K##*/node-}; SOCK=$K/run/containerd.sock
  stop "$K" kubelet
  # drop the Node object, so that nothing is scheduled onto a node that is gone (best effort: the apiserver may be down)
  if [[ -n $TOKEN ]] && curl -s -o /dev/null -m 5 -w '%{http_code}' --cacert "$S/pki/ca.crt" \
       -H "Authorization: Bearer $TOKEN" -X DELETE "https://127.0.0.1:6443/api/v1/nodes/$N" | grep -q '^200$'; then
    log "deleted Node $N"
  fi
  if alive "$K" containerd && [[ -S $SOCK ]]; then
    C="ctr -a $SOCK -n k8s.io"
    for t in $($C tasks ls -q 2>/dev/null); do $C tasks kill -a -s SIGKILL "$t" >/dev/null 2>&1; done
    for _ in $(seq 20); do [[ -z $($C tasks ls -q 2>/dev/null | head -1) ]] && break
      for t in $($C tasks ls -q 2>/dev/null); do $C tasks delete -f "$t" >/dev/null 2>&1; done; sleep 0.1; done
    for c in $($C containers ls -q 2>/dev/null); do $C containers delete "$c" >/dev/null 2>&1; done
  fi
  stop "$K" containerd
  # shims of this containerd: their pid files are in its state dir (and their command line names our socket)
  for f in "$K"/containerd/state/io.containerd.runtime.v2.task/*/*/shim.pid; do
    [[ -s $f ]] || continue; p=$(cat "$f")
    pid_alive "$p" && grep -qF -- "$SOCK" "/proc/$p/cmdline" 2>/dev/null && { log "killing shim $p"; kill "$p" 2>/dev/null; }
  done
  # what is left in the node's cgroups are its pods' processes (e.g. containerd died before it could kill them)
  for h in /sys/fs/cgroup/kubelet-$N /sys/fs/cgroup/*/kubelet-$N; do
    [[ -d $h ]] || continue
    for p in $(find "$h" -name cgroup.procs -exec cat {} + 2>/dev/null | sort -u); do kill -9 "$p" 2>/dev/null; done
  done
  sleep 0.2
  umount_under "$K" || log "some mounts under $K could not be removed"
  for h in /sys/fs/cgroup/kubelet-$N /sys/fs/cgroup/*/kubelet-$N; do
    [[ -d $h ]] && find "$h" -depth -type d -exec rmdir {} \; 2>/dev/null
  done
  for l in /var/log/containers/*.log; do [[ -L $l && $(readlink "$l") == "$K/"* ]] && rm -f "$l"; done
  (( PURGE )) && { log "purging $K"; purge "$K"; }
done

# sysctls the kubelet changed: restore once no kubelet of ours runs any more
others=0; for K in "$S"/node-*; do [[ -d $K ]] && alive "$K" kubelet && others=1; done
if [[ $others == 0 && -s $S/sysctl-orig ]]; then
  while read -r k v; do
    [[ -f /proc/sys/$k && $(cat "/proc/sys/$k") != "$v" ]] && { log "restoring $k=$v"; echo "$v" > "/proc/sys/$k"; }
  done < "$S/sysctl-orig"
  rm -f "$S/sysctl-orig"
  [[ -f $S/created-var-log-containers ]] && { rmdir /var/log/containers 2>/dev/null; rm -f "$S/created-var-log-containers"; }
fi
(( ${#ONLY[@]} )) && exit 0

# ---------------------------------------------------------------- control plane
for n in kwok kube-scheduler kube-controller-manager kube-apiserver etcd; do stop "$S" "$n" 15; done
if (( PURGE )); then
  log "purging the state in $S (binaries are kept)"
  # only what up.sh makes: the directory may hold other things (e.g. a build directory)
  purge "$S"/{etcd-data,pki,run,logs,images,kubeconfig,scheduler.yaml} "$S"/node-*
fi
exit 0
