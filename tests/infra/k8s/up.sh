#!/usr/bin/env bash
# up.sh — phalanx's Kubernetes test cluster on this machine's loopback, in one command:
#
#   control plane   etcd 3.6.5                     127.0.0.1:2379 (peer :2380, metrics :2381)
#                   kube-apiserver v1.36.1         127.0.0.1:6443  (TLS, token auth, Node+RBAC, gang-scheduling gates)
#                   kube-controller-manager        127.0.0.1:10257
#                   kube-scheduler                 127.0.0.1:10259 (backoff 1-2 s)
#                   kwok v0.8.0 (fake nodes)       127.0.0.1:10247 (manages only nodes annotated kwok.x-k8s.io/node=fake)
#   real nodes      node i = "127.0.0.i": its own containerd (unix socket) + runc + kubelet on 127.0.0.i:(10240+10i),
#                   healthz 127.0.0.1:(10241+10i); labels kubernetes.io/hostname=127.0.0.i, phalanx.dev/node=real.
#                   Pods really run (cgroup v1 or v2, cgroupfs driver); images are built locally (no registry):
#                   docker.io/local/pause:3.10 (sandbox) and docker.io/local/base:1 (busybox + empty usr-merged skeleton;
#                   pods bind /usr, /etc ... from the host with read-only hostPath volumes and usually hostNetwork).
#   fake nodes      kwok-node-1..K8S_KWOK_NODES, labels type=kwok, phalanx.dev/node=kwok (pods there are simulated).
#
# Idempotent: starts only what is not running (a daemon whose settings changed is restarted), re-run with the cluster
# up takes ~1 s. Needs root (containerd, cgroups, mounts), the binaries from build.sh (built here when missing and
# `go` is installed), openssl, curl, python3; apt-installs containerd runc containernetworking-plugins busybox-static
# gcc when missing. Prints the admin kubeconfig path as its LAST stdout line (logs go to stderr).
#
#   tests/infra/k8s/up.sh                      # control plane + 2 real nodes
#   K8S_REAL_NODES=1 K8S_KWOK_NODES=4 tests/infra/k8s/up.sh
#   export KUBECONFIG=$(tests/infra/k8s/up.sh)
#   tests/infra/k8s/down.sh [--purge]          # kubelets first, then the control plane
#
# Env: K8S_STATE_DIR    state (etcd data, PKI, node dirs, logs)   default ${TMPDIR:-/tmp}/phalanx-k8s
#      K8S_BIN_DIR      binaries                                  default ${XDG_CACHE_HOME:-$HOME/.cache}/phalanx-infra/bin
#      K8S_REAL_NODES   real kubelet nodes (extra running ones are stopped)                       default 2
#      K8S_KWOK_NODES   kwok fake nodes kwok-node-1..N (extra kwok-node-* are deleted)            default 0
#      K8S_KWOK_NODE_CPU / K8S_KWOK_NODE_MEM / K8S_KWOK_NODE_PODS  capacity of each fake node     default 4 / 8Gi / 110
#      K8S_UP_TIMEOUT   seconds to wait for each component                                        default 120
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BIN=${K8S_BIN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/phalanx-infra/bin}
S=${K8S_STATE_DIR:-${TMPDIR:-/tmp}/phalanx-k8s}
REAL=${K8S_REAL_NODES:-2}
KWOK_NODES=${K8S_KWOK_NODES:-0}
KWOK_CPU=${K8S_KWOK_NODE_CPU:-4}; KWOK_MEM=${K8S_KWOK_NODE_MEM:-8Gi}; KWOK_PODS=${K8S_KWOK_NODE_PODS:-110}
UP_TIMEOUT=${K8S_UP_TIMEOUT:-120}
KWOK_VERSION=${KWOK_VERSION:-0.8.0}
GATES=GenericWorkload=true,GangScheduling=true   # native scheduling.k8s.io/v1alpha2 Workload/PodGroup + gang scheduling
API=https://127.0.0.1:6443
P=$S/pki
t_start=$(date +%s.%N)
log() { echo "[k8s-up] $(date +%T) $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
el()  { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}'; }
[[ $REAL =~ ^[0-9]+$ && $REAL -le 250 ]] || die "K8S_REAL_NODES must be 0..250"
[[ $KWOK_NODES =~ ^[0-9]+$ ]] || die "K8S_KWOK_NODES must be a number"
[[ $(uname -s) == Linux ]] || die "Linux only"
[[ $(id -u) == 0 ]] || die "must run as root (containerd, cgroups, mounts)"
for c in openssl curl python3; do command -v $c >/dev/null || die "'$c' is required"; done

# alive unless gone or a zombie; and still the program we started (pid files can outlive a reboot)
pid_alive() { local s; s=$(sed -E 's/.*\) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1; [[ -n $s && $s != Z ]]; }
argv0() { local a; IFS= read -r -d '' a <"/proc/$1/cmdline" 2>/dev/null; printf %s "$a"; }
alive() {  # dir name
  local pf=$1/run/$2.pid pid; [[ -s $pf ]] || return 1; pid=$(cat "$pf")
  pid_alive "$pid" && [[ ! -s $1/run/$2.cmd || $(argv0 "$pid") == "$(cat "$1/run/$2.cmd")" ]]; }
stop() {  # dir name: by pid file only
  local pf=$1/run/$2.pid pid
  if alive "$1" "$2"; then pid=$(cat "$pf"); log "stopping $2 ($pid)"; kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do pid_alive "$pid" || break; sleep 0.1; done
    pid_alive "$pid" && kill -9 "$pid" 2>/dev/null || true; fi
  rm -f "$pf"; }
start() {  # dir name fingerprint command... — (re)start unless running with the same command line + fingerprint
  local d=$1 n=$2 fp=$3; shift 3
  local want where=; want="$fp $*"; [[ $d != "$S" ]] && where=" (${d##*/})"
  if alive "$d" "$n"; then
    [[ $(cat "$d/run/$n.args" 2>/dev/null) == "$want" ]] && return 0
    log "$n$where: settings changed, restarting"; stop "$d" "$n"
  fi
  log "starting $n$where"
  date -u +%Y-%m-%dT%H:%M:%SZ > "$d/run/$n.started"
  setsid nohup "$@" >>"$d/logs/$n.log" 2>&1 </dev/null 9>&- &
  echo $! > "$d/run/$n.pid"; printf %s "$1" > "$d/run/$n.cmd"; printf %s "$want" > "$d/run/$n.args"
}
wait_for() {  # description logfile command...
  local d=$1 lf=$2; shift 2; local dl=$(( $(date +%s) + UP_TIMEOUT ))
  until "$@" >/dev/null 2>&1; do
    if (( $(date +%s) > dl )); then
      log "timeout (${UP_TIMEOUT}s) waiting for $d"; [[ -f $lf ]] && { log "last lines of $lf:"; tail -15 "$lf" >&2; }
      exit 1
    fi
    sleep 0.1
  done
}
put() {  # write stdin to file only when it differs (keeps fingerprints stable)
  local tmp; tmp=$(mktemp "$1.XXXX"); cat >"$tmp"
  if cmp -s "$tmp" "$1"; then rm -f "$tmp"; else mv -f "$tmp" "$1"; fi; }
fp() { cat "$@" 2>/dev/null | md5sum | cut -c1-12; }
kubeconfig() {  # file, user name, user's credentials (YAML flow mapping), [namespace]: a kubeconfig for this cluster
  put "$1" <<EOT
apiVersion: v1
kind: Config
clusters:
- name: phalanx-test
  cluster: {server: "$API", certificate-authority: "$P/ca.crt"}
users:
- name: $2
  user: $3
contexts:
- name: phalanx-test
  context: {cluster: phalanx-test, user: $2${4:+, namespace: $4}}
current-context: phalanx-test
EOT
}

mkdir -p "$S"/{run,logs,pki,images}
# one up.sh/down.sh at a time per state dir (pytest workers may call it together); the daemons do not inherit fd 9
if [[ -z ${K8S_LOCK_HELD:-} ]]; then
  exec 9>"$S/.lock"; flock -w "$UP_TIMEOUT" 9 || die "another up.sh/down.sh holds $S/.lock"; export K8S_LOCK_HELD=1
fi

# ---------------------------------------------------------------- 1. binaries and packages
if ! chk=$("$HERE/build.sh" --check 2>&1); then
  command -v go >/dev/null || die "$chk; and 'go' is not installed to build them (tests/infra/k8s/build.sh)"
  log "$chk: building them (tests/infra/k8s/build.sh; ~15 min cold)"
  "$HERE/build.sh" >&2
fi
if (( REAL > 0 )); then
  need=()
  for b in containerd:containerd runc:runc /usr/lib/cni/loopback:containernetworking-plugins /bin/busybox:busybox-static gcc:gcc; do
    [[ -e ${b%%:*} ]] || command -v "${b%%:*}" >/dev/null || need+=("${b#*:}")
  done
  if (( ${#need[@]} )); then
    t=$(date +%s.%N); log "apt-get install ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=600 install -y --no-install-recommends "${need[@]}" >"$S/logs/apt.log" 2>&1 \
      || { apt-get -o DPkg::Lock::Timeout=600 update -q >>"$S/logs/apt.log" 2>&1
           apt-get -o DPkg::Lock::Timeout=600 install -y --no-install-recommends "${need[@]}" >>"$S/logs/apt.log" 2>&1; } \
      || die "apt-get install ${need[*]} failed, see $S/logs/apt.log"
    log "packages installed in $(el "$t") s"
  fi
fi

# ---------------------------------------------------------------- 2. PKI (EC P-256: fast to make), token, kubeconfig
newkey() { [[ -s $1 ]] || openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
mkcert() {  # name subject extendedKeyUsage [SAN]
  [[ -s $P/$1.crt ]] && return 0
  printf '[req]\ndistinguished_name=dn\n[dn]\n[ext]\nextendedKeyUsage=%s\nkeyUsage=critical,digitalSignature\n%s\n' \
    "$3" "${4:+subjectAltName=$4}" > "$P/$1.cnf"
  newkey "$P/$1.key"
  openssl req -new -key "$P/$1.key" -out "$P/$1.csr" -subj "$2" 2>/dev/null
  openssl x509 -req -in "$P/$1.csr" -CA "$P/ca.crt" -CAkey "$P/ca.key" -CAcreateserial -out "$P/$1.crt" -days 3650 \
    -extfile "$P/$1.cnf" -extensions ext 2>/dev/null
}
if [[ ! -s $P/ca.crt ]]; then
  log "generating PKI"
  newkey "$P/ca.key"
  openssl req -x509 -new -key "$P/ca.key" -out "$P/ca.crt" -days 3650 -subj "/CN=phalanx-test-k8s-ca" 2>/dev/null
fi
mkcert apiserver "/CN=kube-apiserver" serverAuth \
  "IP:127.0.0.1,IP:127.0.96.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"
mkcert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" clientAuth   # logs/exec on kubelets
newkey "$P/sa.key"; [[ -s $P/sa.pub ]] || openssl pkey -in "$P/sa.key" -pubout -out "$P/sa.pub" 2>/dev/null
[[ -s $P/tokens.csv ]] || echo "$(openssl rand -hex 24),admin,admin,system:masters" > "$P/tokens.csv"
NODES=(); for i in $(seq 1 "$REAL"); do NODES+=("127.0.0.$i"); done
for N in "${NODES[@]}"; do   # node identity (Node authorizer + NodeRestriction) and kubelet serving certificate
  mkcert "node-$N" "/O=system:nodes/CN=system:node:$N" clientAuth
  mkcert "kubelet-serving-$N" "/CN=$N" serverAuth "IP:$N,IP:127.0.0.1,DNS:localhost"
done
TOKEN=$(cut -d, -f1 "$P/tokens.csv")
KC=$S/kubeconfig
kubeconfig "$KC" admin "{token: \"$TOKEN\"}" default
api() { curl -sS -m 10 --cacert "$P/ca.crt" -H "Authorization: Bearer $TOKEN" "$@"; }

# ---------------------------------------------------------------- 3. etcd + kube-apiserver (they start while the nodes are prepared)
start "$S" etcd "" "$BIN/etcd" --name phalanx-test --data-dir "$S/etcd-data" \
  --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
  --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
  --initial-cluster phalanx-test=http://127.0.0.1:2380 --listen-metrics-urls http://127.0.0.1:2381 \
  --unsafe-no-fsync --quota-backend-bytes=2147483648
APISERVER=("$BIN/kube-apiserver"
  --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port=6443 --etcd-servers=http://127.0.0.1:2379
  --tls-cert-file="$P/apiserver.crt" --tls-private-key-file="$P/apiserver.key" --client-ca-file="$P/ca.crt"
  --token-auth-file="$P/tokens.csv" --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction
  --kubelet-client-certificate="$P/apiserver-kubelet-client.crt" --kubelet-client-key="$P/apiserver-kubelet-client.key"
  --kubelet-certificate-authority="$P/ca.crt" --kubelet-preferred-address-types=InternalIP,Hostname
  --service-account-issuer=https://kubernetes.default.svc --service-account-key-file="$P/sa.pub"
  --service-account-signing-key-file="$P/sa.key"
  --service-cluster-ip-range=127.0.96.0/24 --endpoint-reconciler-type=none
  --allow-privileged=true --runtime-config=scheduling.k8s.io/v1alpha2=true --feature-gates=$GATES)
etcd_ok() { curl -sf -m 2 http://127.0.0.1:2379/health | grep -q '"health":"true"'; }
# the apiserver retries etcd itself, but starting it against a dead etcd only logs noise
wait_for etcd "$S/logs/etcd.log" etcd_ok
start "$S" kube-apiserver "$(fp "$P/tokens.csv")" "${APISERVER[@]}"

# ---------------------------------------------------------------- 4. real nodes: containerd, CNI, images (per node)
if (( REAL > 0 )); then
  I=$S/images
  if [[ ! -s $I/pause.tar || ! -s $I/base.tar ]]; then
    t=$(date +%s.%N)
    cat > "$I/pause.c" <<'EOT'
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
static void down(int s) { (void)s; _exit(0); }
static void reap(int s) { (void)s; while (waitpid(-1, NULL, WNOHANG) > 0) {} }
int main(void) {
  struct sigaction a; memset(&a, 0, sizeof a);
  a.sa_handler = down; sigaction(SIGINT, &a, NULL); sigaction(SIGTERM, &a, NULL);
  a.sa_handler = reap; a.sa_flags = SA_NOCLDSTOP; sigaction(SIGCHLD, &a, NULL);
  for (;;) pause();
}
EOT
    rm -rf "$I/rootfs-pause" "$I/rootfs-base"; mkdir -p "$I/rootfs-pause" "$I/rootfs-base"
    gcc -Os -static -o "$I/rootfs-pause/pause" "$I/pause.c"; strip "$I/rootfs-pause/pause"
    R=$I/rootfs-base; mkdir -p "$R"/{usr/bin,etc,tmp,proc,sys,dev,root,opt,work,var/tmp}; chmod 1777 "$R/tmp" "$R/var/tmp"
    ln -s usr/bin "$R/bin"; ln -s usr/lib "$R/lib"; ln -s usr/lib64 "$R/lib64"; ln -s usr/sbin "$R/sbin"
    cp /bin/busybox "$R/usr/bin/busybox"; ln -s busybox "$R/usr/bin/sh"
    python3 "$HERE/mkimage.py" "$I/rootfs-pause" docker.io/local/pause:3.10 "$I/pause.tar" /pause >/dev/null
    python3 "$HERE/mkimage.py" "$I/rootfs-base" docker.io/local/base:1 "$I/base.tar" /usr/bin/sh >/dev/null
    log "local images built in $(el "$t") s"
  fi
  RUNC=$(command -v runc)
  # cgroup layout: cgroup v1 (this VM: hybrid) -> the node's root in every hierarchy; v2 -> one directory
  if [[ $(stat -fc %T /sys/fs/cgroup) == cgroup2fs ]]; then CGV2=1; else CGV2=0; fi
  # the kubelet changes these sysctls (vm.overcommit_memory=1, kernel.panic=10, kernel.panic_on_oops=1 ...):
  # remember the values before our first kubelet, down.sh restores them when the last one stops
  any_kubelet=0; for d in "$S"/node-*; do [[ -d $d ]] && alive "$d" kubelet && any_kubelet=1; done
  if [[ $any_kubelet == 0 && ! -s $S/sysctl-orig ]]; then
    for s in vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops kernel/keys/root_maxkeys kernel/keys/root_maxbytes; do
      [[ -f /proc/sys/$s ]] && echo "$s $(cat /proc/sys/$s)"; done > "$S/sysctl-orig"
  fi
  [[ -d /var/log/containers || -f $S/created-var-log-containers ]] || touch "$S/created-var-log-containers"
fi
for i in $(seq 1 "$REAL"); do
  N=127.0.0.$i; K=$S/node-$N; SOCK=$K/run/containerd.sock
  mkdir -p "$K"/{run,logs,containerd/root,containerd/state,cni,cni-bin,kubelet,pod-logs}
  put "$K/containerd/config.toml" <<EOT
version = 2
root = "$K/containerd/root"
state = "$K/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs"]
[grpc]
  address = "$SOCK"
  tcp_address = ""
[ttrpc]
  address = ""
[debug]
  address = ""
[metrics]
  address = ""
[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "docker.io/local/pause:3.10"
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
    disable_tcp_service = true
    disable_apparmor = true
    # no CAP_SYS_RESOURCE in such VMs: a negative oom_score_adj (sandbox -998) is EPERM and runc fails with
    # "can't get final child's PID from pipe: EOF"; clamp to containerd's own (0)
    restrict_oom_score_adj = true
    netns_mounts_under_state_dir = true
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "overlayfs"
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = false
          BinaryName = "$RUNC"
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "$K/cni-bin"
      conf_dir = "$K/cni"
      max_conf_num = 1
  [plugins."io.containerd.internal.v1.opt"]
    path = "$K/containerd/opt"
EOT
  # CNI: a non-hostNetwork pod gets its own netns with lo + an "eth0" that is one end of a veth pair living entirely
  # INSIDE that netns (no host interface, bridge or route). containerd's CRI insists on an IP on eth0.
  # Such pods are isolated (not even pod-to-pod); use hostNetwork for communication.
  cp -u /usr/lib/cni/loopback "$K/cni-bin/loopback"   # containerd always adds its own 'lo' network with this plugin
  put "$K/cni-bin/netns-veth" <<'EOT'
#!/bin/sh
set -e
case "$CNI_COMMAND" in
VERSION) echo '{"cniVersion":"0.4.0","supportedVersions":["0.3.0","0.3.1","0.4.0"]}'; exit 0;;
ADD)
  cat >/dev/null
  h=$(printf %s "$CNI_CONTAINERID" | cut -c1-4); ip="127.2.$((0x$(echo $h | cut -c1-2))).$((0x$(echo $h | cut -c3-4) % 254 + 1))"
  nsenter --net="$CNI_NETNS" sh -c "ip link add $CNI_IFNAME type veth peer name ${CNI_IFNAME}p && ip addr add $ip/32 dev $CNI_IFNAME && ip link set ${CNI_IFNAME}p up && ip link set $CNI_IFNAME up" >&2
  mac=$(nsenter --net="$CNI_NETNS" ip -o link show "$CNI_IFNAME" | sed -n "s/.*link\/ether \([0-9a-f:]*\).*/\1/p")
  printf '{"cniVersion":"0.4.0","interfaces":[{"name":"%s","mac":"%s","sandbox":"%s"}],"ips":[{"version":"4","address":"%s/32","interface":0}]}\n' "$CNI_IFNAME" "$mac" "$CNI_NETNS" "$ip";;
DEL) cat >/dev/null; [ -n "$CNI_NETNS" ] && [ -e "$CNI_NETNS" ] && nsenter --net="$CNI_NETNS" ip link del "$CNI_IFNAME" 2>/dev/null; exit 0;;
CHECK) cat >/dev/null; exit 0;;
*) echo '{"code":4,"msg":"unknown CNI_COMMAND"}'; exit 1;;
esac
EOT
  chmod +x "$K/cni-bin/netns-veth"
  put "$K/cni/10-pod-netns.conflist" <<<'{"cniVersion":"0.4.0","name":"pod-netns","plugins":[{"type":"netns-veth"}]}'
  start "$K" containerd "$(fp "$K/containerd/config.toml")" "$(command -v containerd)" --config "$K/containerd/config.toml"
  # own cgroup root per node, else each kubelet's orphan-cgroup cleanup kills the other nodes' pods
  CGROOT=/kubelet-$N
  if [[ $CGV2 == 1 ]]; then mkdir -p "/sys/fs/cgroup$CGROOT"
  else
    for h in /sys/fs/cgroup/*/; do
      [[ -f $h/cgroup.procs ]] || continue
      [[ -d $h${CGROOT#/} ]] && continue
      mkdir -p "$h${CGROOT#/}"
      if [[ -f $h/cpuset.cpus ]]; then cat "$h/cpuset.cpus" > "$h${CGROOT#/}/cpuset.cpus"; cat "$h/cpuset.mems" > "$h${CGROOT#/}/cpuset.mems"; fi
    done
  fi
  kubeconfig "$K/kubelet.kubeconfig" node "{client-certificate: \"$P/node-$N.crt\", client-key: \"$P/node-$N.key\"}"
  put "$K/kubelet.yaml" <<EOT
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $N
port: $((10240 + 10 * i))
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $((10241 + 10 * i))
cgroupRoot: $CGROOT
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: "$P/ca.crt"}
authorization: {mode: Webhook}
tlsCertFile: "$P/kubelet-serving-$N.crt"
tlsPrivateKeyFile: "$P/kubelet-serving-$N.key"
containerRuntimeEndpoint: "unix://$SOCK"
cgroupDriver: cgroupfs
failCgroupV1: false          # 1.35+ refuses cgroup v1 hosts by default
failSwapOn: false
podLogsDir: "$K/pod-logs"
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
imageGCHighThresholdPercent: 100   # never GC the locally imported images
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
serializeImagePulls: false
maxPods: 110
oomScoreAdj: 0               # no CAP_SYS_RESOURCE: the default -999 cannot be set
EOT
done
C() { ctr -a "$S/node-$1/run/containerd.sock" -n k8s.io "${@:2}"; }
for N in "${NODES[@]}"; do
  wait_for "containerd of node $N" "$S/node-$N/logs/containerd.log" C "$N" version
  have=$(C "$N" images ls -q)
  for img in pause:3.10 base:1; do
    grep -qx "docker.io/local/$img" <<<"$have" || C "$N" images import "$S/images/${img%%:*}.tar" >/dev/null
  done
done
# nodes beyond K8S_REAL_NODES that still run: stop them (their Node objects are deleted)
for d in "$S"/node-127.0.0.*; do
  [[ -d $d ]] || continue; n=${d##*/node-}
  (( ${n##*.} > REAL )) && { alive "$d" kubelet || alive "$d" containerd; } && "$HERE/down.sh" --node "$n" >&2
done

# ---------------------------------------------------------------- 5. rest of the control plane, kubelets, kwok
wait_for kube-apiserver "$S/logs/kube-apiserver.log" api -f "$API/readyz"
start "$S" kube-controller-manager "$(fp "$P/tokens.csv")" "$BIN/kube-controller-manager" --kubeconfig="$KC" \
  --leader-elect=false --bind-address=127.0.0.1 --secure-port=10257 --service-account-private-key-file="$P/sa.key" \
  --root-ca-file="$P/ca.crt" --use-service-account-credentials=false --feature-gates=$GATES
# short backoff: an unschedulable pod/gang is retried within ~1-2 s of capacity freeing up
put "$S/scheduler.yaml" <<EOF
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection: {kubeconfig: "$KC"}
leaderElection: {leaderElect: false}
podInitialBackoffSeconds: 1
podMaxBackoffSeconds: 2
EOF
start "$S" kube-scheduler "$(fp "$S/scheduler.yaml" "$KC")" "$BIN/kube-scheduler" --config="$S/scheduler.yaml" \
  --bind-address=127.0.0.1 --secure-port=10259 --feature-gates=$GATES
for N in "${NODES[@]}"; do
  K=$S/node-$N
  start "$K" kubelet "$(fp "$K/kubelet.yaml" "$K/kubelet.kubeconfig")" "$BIN/kubelet" --config="$K/kubelet.yaml" \
    --kubeconfig="$K/kubelet.kubeconfig" --root-dir="$K/kubelet" --hostname-override="$N" \
    --node-labels=phalanx.dev/node=real --v=2
done
# kwok runs always (cheap): tests add fake nodes at any time (tests/infra/k8s_cluster.py add_kwok_nodes).
# Fake pod IPs stay in loopback space (127.1/16), fake nodes' InternalIP is 127.0.0.1.
STAGES=$BIN/kwok-stages-v$KWOK_VERSION.yaml
start "$S" kwok "$(fp "$STAGES" "$KC")" "$BIN/kwok" --kubeconfig="$KC" --config="$STAGES" --manage-all-nodes=false \
  --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
  --cidr=127.1.0.0/16 --node-ip=127.0.0.1 --server-address=127.0.0.1:10247

# ---------------------------------------------------------------- 6. nodes: fake ones reconciled, all Ready
# A Node left in etcd by an earlier run still says Ready=True for ~40 s: a real node counts only with a heartbeat
# no older than its kubelet's start. Its phalanx.dev/node=real label is set here too should the Node predate it.
nodes_ok() {
  STARTED=$(for N in "${NODES[@]}"; do echo "$N $(cat "$S/node-$N/run/kubelet.started")"; done) \
  KWOK_NODES=$KWOK_NODES KWOK_CPU=$KWOK_CPU KWOK_MEM=$KWOK_MEM KWOK_PODS=$KWOK_PODS CA=$P/ca.crt TOKEN=$TOKEN API=$API \
  python3 - <<'PY'
import json, os, re, ssl, sys, urllib.request
E = os.environ
ctx = ssl.create_default_context(cafile=E["CA"])
def call(method, path, body=None, ctype="application/json"):
    req = urllib.request.Request(E["API"] + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + E["TOKEN"], "Content-Type": ctype})
    with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
        return json.load(r)
nodes = {n["metadata"]["name"]: n for n in call("GET", "/api/v1/nodes")["items"]}
def ready(n, since=""):
    return any(c["type"] == "Ready" and c["status"] == "True" and c.get("lastHeartbeatTime", "") >= since
               for c in n.get("status", {}).get("conditions", []))
ok = True
for line in filter(None, E["STARTED"].splitlines()):
    name, since = line.split()
    n = nodes.get(name)
    if n is None or not ready(n, since):
        ok = False; continue
    if n["metadata"].get("labels", {}).get("phalanx.dev/node") != "real":
        call("PATCH", "/api/v1/nodes/" + name, {"metadata": {"labels": {"phalanx.dev/node": "real"}}},
             "application/merge-patch+json")
want = int(E["KWOK_NODES"])
cap = {"cpu": E["KWOK_CPU"], "memory": E["KWOK_MEM"], "pods": E["KWOK_PODS"]}
capkey = "{cpu}/{memory}/{pods}".format(**cap)
for name, n in list(nodes.items()):   # kwok-node-<i> beyond the wanted count, or made with another capacity: delete
    m = re.fullmatch(r"kwok-node-(\d+)", name)
    if m and (int(m.group(1)) > want or n["metadata"].get("annotations", {}).get("phalanx.dev/capacity") != capkey):
        call("DELETE", "/api/v1/nodes/" + name); nodes.pop(name); ok = False
for i in range(1, want + 1):
    name = f"kwok-node-{i}"
    if name not in nodes:
        call("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {
            "name": name, "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0",
                                    "phalanx.dev/capacity": capkey},
            "labels": {"type": "kwok", "phalanx.dev/node": "kwok", "kubernetes.io/hostname": name,
                       "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}},
            "status": {"allocatable": cap, "capacity": cap}})
        ok = False
    elif not ready(nodes[name]):
        ok = False
sys.exit(0 if ok else 1)
PY
}
wait_for "kube-controller-manager (default ServiceAccount)" "$S/logs/kube-controller-manager.log" \
  api -f "$API/api/v1/namespaces/default/serviceaccounts/default"
wait_for kube-scheduler "$S/logs/kube-scheduler.log" curl -skf -m 2 https://127.0.0.1:10259/healthz
wait_for kwok "$S/logs/kwok.log" curl -sf -m 2 http://127.0.0.1:10247/healthz
wait_for "nodes Ready (${NODES[*]:-no real nodes}; $KWOK_NODES kwok)" \
  "$S/node-${NODES[0]:-none}/logs/kubelet.log" nodes_ok
log "cluster ready in $(el "$t_start") s: control plane + ${REAL} real node(s) ${NODES[*]:-} + ${KWOK_NODES} kwok node(s); export KUBECONFIG=$KC"
echo "$KC"
