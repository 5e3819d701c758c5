#!/usr/bin/env bash
# Installs everything phalanx and its tests need, from scratch, into ./.venv:
#   system: redis-server (Redis rendezvous tests), Open MPI (MPI communicator), Slurm + munge,
#           chromium + its driver (the dashboard's browser tests),
#           containerd + runc and Kubernetes built from the Go module proxy (scripts/setup-k8s.sh)
#   python: phalanx with every extra its tests use, torch included (large: ~3 GB download,
#           reused from pip's cache on later runs)
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v mpirun >/dev/null || need+=(openmpi-bin libopenmpi-dev)
command -v java >/dev/null || need+=(openjdk-17-jre-headless)   # pyspark, a peer in bench/
command -v gcc >/dev/null || need+=(gcc)   # radical.pilot's dependencies build C extensions from sdists
command -v chromedriver >/dev/null || need+=(chromium chromium-driver)   # the dashboard's browser tests (ui lane)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
  else
    echo "setup: please install ${need[*]} (tests that need them are skipped)" >&2
  fi
fi

bash scripts/setup-slurm.sh   # Debian's Slurm + munge for the SLURM executor's tests
bash scripts/setup-k8s.sh     # a Kubernetes control plane + real nodes for the kubernetes executor's tests

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[torch,test,dev,bench,ray,kubernetes,jupyter,parsl,ucx,radical,ui,otel]"
bash scripts/setup-airflow.sh  # Airflow 3 beside it (the airflow extra) and the provider entry point
.venv/bin/python -c "import phalanx, torch, pyarrow, polars, duckdb; print('phalanx', phalanx.__version__, 'ready')"
