#!/usr/bin/env bash
# ray-multihost-up.sh — a Ray cluster across the multi-host test bed: the head (GCS, Ray Client
# server; no CPUs) in px-head 10.231.0.10, one raylet in each of px-h1..px-hN.  Brings the bed
# up first; idempotent (a healthy cluster is left alone).  Prints `export RAY_ADDRESS=ray://...`
# (Ray Client: a driver in the root namespace cannot use the GCS address directly).
#   eval "$(tests/infra/ray-multihost-up.sh)"
#   tests/infra/ray-multihost-down.sh
# See tests/infra/ray_multihost.py for the settings and docs/multihost.md for the pitfalls.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PHALANX_PYTHON:-$HERE/../../.venv/bin/python}
exec timeout 300 "$PY" "$HERE/ray_multihost.py" up
