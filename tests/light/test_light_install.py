"""`pip install phalanx` without extras: what a user who only runs dataframe stages gets.

The venv under test is made by `.ci/run light` (`pip install .` into a fresh venv) and named by
PHALANX_LIGHT_VENV; these tests drive its `phalanx` command as a user would and check the data it
wrote from this (full) venv, against pandas.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from reference import expected_features

import phalanx as px
from phalanx.orchestrator.rundb import RunDB

pytestmark = pytest.mark.light

ROOT = Path(__file__).resolve().parents[2]
VENV = os.environ.get("PHALANX_LIGHT_VENV", "")
if not VENV:
    pytest.skip("PHALANX_LIGHT_VENV names no venv (the light lane of .ci/run makes one)", allow_module_level=True)


def light(args: list[str], tmp: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the light venv's ``phalanx`` (or python) from the repository, with its own state and store."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PHALANX_STATE=str(tmp / "state"), PHALANX_STORE=str(tmp / "store"), PATH=f"{VENV}/bin:/usr/bin:/bin")
    return subprocess.run(
        [f"{VENV}/bin/{args[0]}", *args[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_install_has_no_torch(tmp_path):
    out = light(["python", "-c", "import phalanx, pyarrow, polars, duckdb; import torch"], tmp_path)
    assert "No module named 'torch'" in out.stderr, out.stderr
    pip = light(["python", "-m", "pip", "list", "--format=freeze"], tmp_path)
    heavy = [line for line in pip.stdout.splitlines() if line.lower().startswith(("torch", "nvidia-", "triton"))]
    assert pip.returncode == 0 and heavy == [], heavy


def test_a_training_stage_fails_validation_naming_the_extra(tmp_path):
    out = light(["phalanx", "validate", "workflows/etl_to_training.yaml"], tmp_path)
    assert out.returncode != 0
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "stages.train.kind" in line]
    assert len(lines) == 1, out.stdout + out.stderr
    assert lines[0].startswith("workflows/etl_to_training.yaml:") or "etl_to_training.yaml:" in lines[0]
    assert "pip install 'phalanx[torch]'" in lines[0]


def test_the_gloo_communicator_fails_validation_naming_the_extra(tmp_path):
    site = tmp_path / "gloo-site.yaml"
    site.write_text("name: gloo-here\nexecutor: local\ncores: 2\ncommunicator: gloo\n")
    out = light(["phalanx", "validate", "workflows/etl.yaml", "--site", str(site)], tmp_path)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert f"{site}:4: communicator" in text and "pip install 'phalanx[torch]'" in text, text


def test_px_ml_names_the_extra(tmp_path):
    out = light(["python", "-c", "import phalanx as px; px.ml"], tmp_path)
    assert out.returncode != 0
    assert "MissingDependencyError" in out.stderr and "pip install 'phalanx[torch]'" in out.stderr, out.stderr


def test_the_etl_stages_run_and_match_pandas(tmp_path):
    small = {"stages.generate.params.rows": 40_000, "stages.generate.params.users": 2_000}
    sets = [a for k, v in small.items() for a in ("--set", f"{k}={v}")]
    out = light(["phalanx", "run", "--plain", "workflows/etl.yaml", *sets], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert " succeeded in " in last, out.stdout
    run = RunDB(tmp_path / "state").run(last.split()[1])
    assert run["state"] == "succeeded"
    store = px.Store(tmp_path / "store", run["session"])
    tx, users = store.read("transactions").to_pandas(), store.read("users").to_pandas()
    got = store.read("features").to_pandas().sort_values("user_id").reset_index(drop=True)
    want = expected_features(tx, users)
    assert len(got) == tx.user_id.nunique() > 0
    exact = ["user_id", "n_tx", "n_refund", "first_ts", "last_ts", "country", "churned"]
    pd.testing.assert_frame_equal(got[exact], want[exact], check_dtype=False)
