#!/usr/bin/env bash
# slurm-multihost-down.sh [--purge] [--keep-bed] — stop the SLURM cluster that
# slurm-multihost-up.sh started (its jobs, slurmds, slurmctld, munged: by pid file, as
# slurm-down.sh does), then take the multi-host test bed down unless --keep-bed.
# --purge also deletes the cluster's directory.  Idempotent.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
purge=(); keep=0
for a in "$@"; do case $a in --purge) purge=(--purge);; --keep-bed) keep=1;; *) echo "unknown: $a" >&2; exit 2;; esac; done
PHALANX_SLURM_DIR=${PHALANX_SLURM_MH_DIR:-/var/tmp/phalanx-slurm-multihost} "$HERE/slurm-down.sh" "${purge[@]}"
[[ $keep == 1 ]] || exec timeout 120 python3 "$HERE/multihost.py" down
