#!/usr/bin/env bash
# multihost-down.sh — take the multi-host test bed down: every process still in a host (by
# PID, found through its network namespace), the holders, namespaces, veths, bridge, state.
# Idempotent; exits 1 if anything was left behind.  Stop SLURM on the bed first
# (tests/infra/slurm-multihost-down.sh does both).
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec timeout 120 python3 "$HERE/multihost.py" down "$@"
