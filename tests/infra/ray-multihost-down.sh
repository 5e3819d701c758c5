#!/usr/bin/env bash
# ray-multihost-down.sh — stop the Ray cluster ray-multihost-up.sh started (by PID: each node's
# `ray start --block` process, then what is left of its session), remove Ray's files in each
# host's /tmp.  Idempotent; exit 1 if a Ray process was left.  The bed stays up
# (tests/infra/multihost-down.sh takes it down).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PHALANX_PYTHON:-$HERE/../../.venv/bin/python}
exec timeout 120 "$PY" "$HERE/ray_multihost.py" down
