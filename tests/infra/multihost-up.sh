#!/usr/bin/env bash
# multihost-up.sh [-n N] — bring up the multi-host test bed: hosts px-h1..px-hN (default 3),
# each its own network namespace on bridge pxbr0 (10.231.0.0/24), hostname, /dev/shm and /tmp.
# Idempotent.  Run commands inside a host with tests/infra/multihost-exec HOST CMD...
# Implementation and settings: tests/infra/multihost.py; docs/multihost.md.
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec timeout 120 python3 "$HERE/multihost.py" up "$@"
