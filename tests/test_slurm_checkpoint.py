"""px.ml.Checkpoints on the real SLURM test cluster: the ETL example's train stage, each attempt
a SLURM job of its own, dies after epoch 2 in its first job; the retried job resumes from the
checkpoint sealed in the store and trains epochs 2 and 3 only, and its metrics and final model
equal those of the same stage run once without interruption on this machine
(tests/test_ml_checkpoint.py has the apps and the reference)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]
pytest.importorskip("torch", reason="the train stage needs the torch extra")

import phalanx as px  # noqa: E402
from phalanx.orchestrator.models import Site  # noqa: E402
from phalanx.orchestrator.rundb import RunDB  # noqa: E402
from phalanx.orchestrator.scheduler import run_workflow  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
from conftest import SLURM_CONF as CONF  # noqa: E402
from test_ml_checkpoint import CRASH_AFTER, EPOCHS, epochs_logged, etl_workflow, reference, same_state  # noqa: E402, F401


def test_a_retried_train_job_on_slurm_resumes_from_its_checkpoint(reference, tmp_path):  # noqa: F811
    site = yaml.safe_load((REPO / "site-configs" / "slurm-local.yaml").read_text())
    site["slurm"].update(conf=CONF, job_name="ckpt-resume")
    site["store"] = {"root": str(tmp_path / "store")}
    db = RunDB(tmp_path / "state")
    wf = etl_workflow("test_ml_checkpoint:train_crashing_once", 1, crash_marker=str(tmp_path / "crashed"))
    result = run_workflow(wf, Site.model_validate(site), db=db)
    assert result.ok, result.failed
    attempts = db.attempts(result.run_id, "train")
    assert [a["state"] for a in attempts] == ["failed", "succeeded"]
    assert len({a["gang_id"] for a in attempts}) == 2  # two SLURM jobs
    assert epochs_logged(db, result.run_id) == [[0, 1], [2, 3]]
    second = (Path(attempts[1]["log_dir"]) / "rank-0.log").read_text()
    assert f"resuming from checkpoint {result.session}/train.ckpt.{CRASH_AFTER}: epoch 2 of {EPOCHS}" in second
    metrics, final, _ = reference
    store = px.Store(tmp_path / "store", result.session)
    got = store.read("train_metrics")
    assert got.equals(metrics), (got.to_pandas(), metrics.to_pandas())
    ckpt = px.ml.load_checkpoint(store, "train")
    assert ckpt.step == EPOCHS
    assert same_state(ckpt.model, final.model) and same_state(ckpt.optimizer, final.optimizer)
