#!/usr/bin/env bash
# The kubernetes executor's test cluster, installed once per machine:
#   Debian: containerd, runc, CNI plugins, busybox (the real nodes' runtime and base image), gcc
#   Go module proxy: kube-apiserver, controller-manager, scheduler, kubelet v1.36, etcd, kwok,
#            built into ~/.cache/phalanx-infra/bin (cold: ~10-15 min on 2 cores; cached: < 1 s)
# Without root, apt-get or Go it says so and the tests marked kubernetes skip with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v containerd >/dev/null || need+=(containerd)
command -v runc >/dev/null || need+=(runc)
[ -e /usr/lib/cni/loopback ] || need+=(containernetworking-plugins)
[ -x /bin/busybox ] || need+=(busybox-static)
command -v gcc >/dev/null || need+=(gcc)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}"; }
  else
    echo "setup-k8s: please install ${need[*]} (tests marked kubernetes are skipped)" >&2
    exit 0
  fi
fi
if command -v go >/dev/null; then
  bash tests/infra/k8s/build.sh
else
  echo "setup-k8s: no Go toolchain: the Kubernetes test binaries cannot be built (tests marked kubernetes are skipped)" >&2
fi
