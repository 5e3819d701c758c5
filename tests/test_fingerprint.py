"""Fingerprints of what produces a stage's outputs (what --resume compares)."""

from __future__ import annotations

import numpy as np

import phalanx as px
from phalanx.orchestrator.fingerprint import changes, fingerprints
from phalanx.orchestrator.models import Stage, Workflow
from phalanx.orchestrator.validate import dependencies


def prints(stages: dict, tmp_path) -> dict:
    wf = Workflow(name="fp", stages=stages)
    return fingerprints(wf, dependencies(wf), px.Store(tmp_path / "store"))


def chain(rows: int = 10, **extra) -> dict:
    return {
        "gen": Stage(app="apps:wf_generate", params={"rows": rows}, outputs=["tx"], **extra),
        "use": Stage(app="apps:wf_totals", inputs={"tx": "tx"}, outputs=["totals"]),
    }


def test_a_changed_param_changes_the_stage_and_everything_downstream(tmp_path):
    old, new = prints(chain(10), tmp_path), prints(chain(20), tmp_path)
    assert changes(old["gen"], new["gen"]) == ["params.rows: 10 → 20"]
    assert changes(old["use"], new["use"]) == ["upstream stage 'gen' changed"]


def test_how_a_stage_runs_is_not_what_it_produces(tmp_path):
    old, new = prints(chain(), tmp_path), prints(chain(retries=3, timeout=60), tmp_path)
    assert old["gen"]["hash"] == new["gen"]["hash"] and changes(old["gen"], new["gen"]) == []


def test_an_edited_app_module_and_a_replaced_external_dataset_are_changes(tmp_path, monkeypatch):
    mod = tmp_path / "fp_app_mod.py"
    mod.write_text("def app(env):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    store = px.Store(tmp_path / "store", session="other")
    import pyarrow as pa

    store.put("ext", pa.table({"x": [1]}))
    stages = lambda: {"s": Stage(app="fp_app_mod:app", inputs={"e": "other/ext"})}  # noqa: E731
    before = prints(stages(), tmp_path)["s"]
    mod.write_text("def app(env):\n    return 1\n")
    store.put("ext", pa.table({"x": [2]}), replace=True)
    after = prints(stages(), tmp_path)["s"]
    assert changes(before, after) == ["its app's code changed", "input dataset 'other/ext' was replaced"]


def test_params_json_cannot_hold_are_fingerprinted_by_value(tmp_path):
    a = prints({"s": Stage(app="apps:x", params={"v": np.arange(5000)})}, tmp_path)["s"]
    b = prints({"s": Stage(app="apps:x", params={"v": np.arange(5000)})}, tmp_path)["s"]
    c = prints({"s": Stage(app="apps:x", params={"v": np.arange(5000) * 2})}, tmp_path)["s"]
    assert a["hash"] == b["hash"] != c["hash"]


def test_a_run_without_a_recorded_fingerprint_is_not_trusted():
    assert changes({}, {"hash": "x", "stage": {}, "app": "", "upstream": {}, "external": {}}) == [
        "no fingerprint was recorded when it ran"
    ]
