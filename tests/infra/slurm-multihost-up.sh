#!/usr/bin/env bash
# slurm-multihost-up.sh — the test SLURM cluster across the multi-host test bed: one slurmd in
# each host px-h1..px-hN (node name = host name, NodeAddr = the host's address), slurmctld in
# the bed's head host px-head (10.231.0.10), munged in the root namespace (its socket is a file
# on the shared filesystem, outside /tmp).  A job's tasks run inside the hosts, so `srun -N3`
# lands on three hosts that share no /dev/shm.
# Brings the bed up first (tests/infra/multihost-up.sh) and then runs slurm-up.sh with its
# across-hosts settings; idempotent like both.
#
#   tests/infra/slurm-multihost-up.sh
#   export SLURM_CONF=/var/tmp/phalanx-slurm-multihost/slurm.conf
#   tests/infra/multihost-exec px-head srun -N3 hostname    # srun inside a host (see below)
#   tests/infra/slurm-multihost-down.sh [--purge] [--keep-bed]
#
# srun (and salloc's steps) must run inside a host, and slurmctld too: with NoInAddrAny /
# NoCtldInAddrAny (nothing binds 0.0.0.0) they listen on the address their hostname resolves
# to, and in the root namespace that is 127.0.0.1 ("vm" in /etc/hosts), which the hosts cannot
# reach.  sbatch, squeue, scancel, sinfo and scontrol work from the root namespace too.
# Settings: PHALANX_MULTIHOST_HOSTS (3), PHALANX_SLURM_MH_DIR (/var/tmp/phalanx-slurm-multihost:
# not under /tmp, which is private to each host; it holds munge's socket, the spool, the logs),
# PHALANX_SLURM_MH_PORT (6937; every slurmd on port+1 of its own address), and
# PHALANX_SLURM_NODE_CPUS / _NODE_MEM / _TIMEOUT as for slurm-up.sh.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
N=${PHALANX_MULTIHOST_HOSTS:-3}
timeout 120 python3 "$HERE/multihost.py" up -n "$N" >/dev/null
STATE_DIR=${PHALANX_MULTIHOST_DIR:-/run/phalanx-multihost}
read -r head hosts < <(python3 -c 'import json,sys; h=json.load(open(sys.argv[1]))["hosts"]
print(" ".join(x["name"]+"("+x["addr"]+")" if i == 0 else x["name"]+"="+x["addr"] for i, x in enumerate(h)))' "$STATE_DIR/state.json")
export PHALANX_SLURM_DIR=${PHALANX_SLURM_MH_DIR:-/var/tmp/phalanx-slurm-multihost}
export PHALANX_SLURM_PORT=${PHALANX_SLURM_MH_PORT:-6937}
export PHALANX_SLURM_NODE_HOSTS=$hosts
export PHALANX_SLURM_CTLD_HOST=$head  # px-head(10.231.0.10)
export PHALANX_SLURM_CTLD_ON=${head%%(*}
export PHALANX_SLURM_EXEC=$HERE/multihost-exec
export PHALANX_SLURM_SRUN="$HERE/multihost-exec ${head%%(*} srun"  # for slurm-up.sh's banner
export PHALANX_SLURM_DOWN=$HERE/slurm-multihost-down.sh
exec "$HERE/slurm-up.sh"
