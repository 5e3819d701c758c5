#!/usr/bin/env bash
# Installs Apache Airflow 3 into ./.venv beside phalanx (the `airflow` extra): Airflow 3.x needs
# no constraints file here and resolves next to torch, ray, moto, kubernetes<37 and pydantic 2
# (`pip check` stays clean).  Also registers phalanx's provider entry point (an editable
# reinstall), so `airflow providers get phalanx` and `@task.phalanx` work.
#   AIRFLOW_SPEC="apache-airflow==3.1.*" bash scripts/setup-airflow.sh   # another 3.x
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q -e ".[airflow]" ${AIRFLOW_SPEC:+"$AIRFLOW_SPEC"}
.venv/bin/python -m pip check
# a throwaway AIRFLOW_HOME: importing airflow without one creates ~/airflow
home=$(mktemp -d)
trap 'rm -rf "$home"' EXIT
AIRFLOW_HOME=$home .venv/bin/python - <<'EOF'
import airflow
from airflow.providers_manager import ProvidersManager
assert "phalanx" in ProvidersManager().providers, "phalanx's provider entry point is not registered"
print("airflow", airflow.__version__, "with the phalanx provider ready")
EOF
