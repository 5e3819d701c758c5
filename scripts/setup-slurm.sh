#!/usr/bin/env bash
# Installs what the SLURM executor's tests need: Debian's Slurm (controller, node daemon,
# client commands) and munge.  Nothing is started (no systemd here): tests/infra/slurm-up.sh
# starts a private cluster on loopback.  Safe to re-run; skips when everything is present.
set -euo pipefail
missing=0
for b in slurmctld slurmd srun sbatch munged; do command -v "$b" >/dev/null 2>&1 || missing=1; done
[ -x /usr/sbin/munged ] || missing=1
if [ "$missing" = 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "setup-slurm: please install slurm-wlm slurmctld slurmd slurm-client munge (SLURM tests are skipped)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
# other processes may hold the dpkg lock on this machine: wait for it instead of failing
apt-get -o DPkg::Lock::Timeout=600 update -qq
apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
    slurm-wlm slurmctld slurmd slurm-client munge >/dev/null
# the packages try to start their daemons; without systemd policy-rc.d refuses, which is fine
echo "setup-slurm: $(slurmctld -V) and munge $(munged --version 2>&1 | awk '{print $1}') installed"
