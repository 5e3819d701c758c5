"""The sweep example (workflows/sweep.yaml) as the README runs it: 8 training instances fanned
out from one stage, the best picked by a fan-in stage — checked against the instances' own
sealed metrics, read back from the store independently of the fan-in."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import phalanx as px
from phalanx.orchestrator.rundb import RunDB

pytestmark = pytest.mark.torch
ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "workflows" / "sweep.yaml"


def test_the_sweep_trains_every_configuration_and_the_fan_in_ranks_them(tmp_path):
    env = {**os.environ, "PHALANX_STATE": str(tmp_path / "state")}
    ran = subprocess.run(
        [
            sys.executable,
            "-m",
            "phalanx.cli",
            "run",
            str(SWEEP),
            "--plain",
            "--set",
            "stages.generate.params.rows=40000",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    db = RunDB(tmp_path / "state")
    run = db.runs()[0]
    states = {s["stage"]: s["state"] for s in db.stages(run["id"])}
    assert states == {
        "generate": "succeeded",
        "features": "succeeded",
        **{f"train.{i}": "succeeded" for i in range(8)},
        "pick": "succeeded",
    }
    matrix = yaml.safe_load(SWEEP.read_text())["stages"]["train"]["foreach"]["matrix"]
    combos = list(itertools.product(matrix["lr"], matrix["hidden"]))  # instance i: the i-th combination
    store = px.Store(session=run["session"])
    expected = []
    for i, (lr, hidden) in enumerate(combos):
        metrics = store.read(f"train_metrics.{i}").to_pylist()
        assert [m["epoch"] for m in metrics] == [0, 1]  # params.epochs: 2
        last = metrics[-1]
        expected.append({"lr": lr, "hidden": float(hidden), "accuracy": last["accuracy"], "loss": last["loss"]})
    expected.sort(key=lambda r: (-r["accuracy"], r["loss"]))
    assert store.read("best").to_pylist() == expected
