"""px.ml.Checkpoints: model and optimizer state in the store, restored by a retry or a resume.

The round trip is checked against the state dicts the ranks held when they saved (tensor by
tensor, exactly); the damaged-checkpoint fallback by corrupting the sealed bytes on disk; and
the ETL example's train stage (phalanx.examples.synthetic:train) through the real scheduler:
its first attempt dies after epoch 2, the retry (or a ``--resume``) runs epochs 2 and 3 only,
and the metrics and the final model equal those of a run that was never interrupted.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

import phalanx as px
from phalanx.errors import DatasetNotFoundError, RankError
from phalanx.examples import synthetic
from phalanx.ml import checkpoint as C
from phalanx.orchestrator.models import Site, Stage, Workflow
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import run_workflow
from phalanx.store.tiers import part_file

pytestmark = pytest.mark.torch  # the torch extra's lane

SESSION = "ml-ckpt-tests"


@pytest.fixture(scope="module")
def gang2():
    with px.Gang(ranks=2, session=SESSION, echo=False) as g:
        yield g
    px.Store(session=SESSION).delete_session()


# ---- apps (module level: ranks import them from this file) ---------------------------------
def tiny(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def train_steps(env, name: str, steps: range, seed: int, **options):
    """Restore, train ``steps`` (a save after each), then report the state and what restore saw."""
    model, opt, sched = tiny(seed)
    ddp = px.ml.ddp(env, model)
    ckpt = px.ml.Checkpoints(env, name, **options)
    start = ckpt.restore(ddp, opt, sched=sched)
    history = list(ckpt.extra.get("history", []))
    x = torch.from_numpy(np.random.default_rng([7, env.rank]).normal(size=(32, 3)).astype(np.float32))
    for step in steps:
        opt.zero_grad()
        loss = ddp(x).square().mean()
        loss.backward()
        opt.step()
        sched.step()
        history.append({"step": step, "loss": loss.item()})
        ckpt.save(step + 1, ddp, opt, sched=sched, history=history)
    return {
        "start": start,
        "restored": ckpt.restored,
        "skipped": ckpt.skipped,
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": opt.state_dict(),
        "sched": sched.state_dict(),
        "history": history,
        "rand": torch.rand(3),  # the RNG after restore (or after the last save)
        "list": ckpt.list(),
    }


def save_disagreeing(env):
    model, opt, _ = tiny()
    px.ml.Checkpoints(env, "disagree").save(env.rank + 1, model, opt)


def save_numpy_extra(env):
    model, opt, _ = tiny()
    px.ml.Checkpoints(env, "numpy").save(1, model, opt, weights=np.ones(3))


def same_state(a, b) -> bool:
    """Equal state dicts / optimizer states, tensor by tensor, exactly."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


# ---- save / restore -----------------------------------------------------------------------------
def test_restore_round_trips_model_optimizer_extras_and_rng(gang2):
    first = gang2.run(train_steps, "roundtrip", range(3), 0)
    for r in first:
        assert r["start"] == 0 and r["restored"] is None
    # DDP replicas agree; what rank 0 saved is what every rank held
    assert same_state(first[0]["model"], first[1]["model"]) and same_state(first[0]["opt"], first[1]["opt"])
    assert [s for s, _ in first[0]["list"]] == [3, 2]  # keep=2

    # a fresh model with other initial weights, restored: the state saved after step 3
    again = gang2.run(train_steps, "roundtrip", range(0), 1)
    for rank, r in enumerate(again):
        assert r["start"] == 3 and r["restored"] == f"{SESSION}/roundtrip.ckpt.3" and r["skipped"] == []
        assert same_state(r["model"], first[0]["model"])
        assert same_state(r["opt"], first[0]["opt"]) and r["opt"]["state"][0]["step"].item() == 3
        assert r["sched"] == first[0]["sched"]
        assert r["history"] == first[0]["history"]
        # each rank's RNG is where it was when the checkpoint was saved
        assert torch.equal(r["rand"], first[rank]["rand"])
    assert not same_state(tiny(1)[0].state_dict(), first[0]["model"])  # the restore did change it

    # from the driver, too
    ckpt = px.ml.load_checkpoint(px.Store(session=SESSION), "roundtrip")
    assert ckpt.step == 3 and ckpt.world_size == 2 and same_state(ckpt.model, first[0]["model"])
    assert ckpt.extra["history"] == first[0]["history"] and len(ckpt.rng) == 2


def test_every_keep_and_a_continued_run(gang2):
    results = gang2.run(train_steps, "every", range(5), 0, every=2, keep=2)
    assert [s for s, _ in results[0]["list"]] == [4, 2]  # steps 1, 3, 5 not saved (every=2)
    # continued from 4: steps 5 (not saved) and 6 (saved; then 2 is removed, keep=2)
    cont = gang2.run(train_steps, "every", range(4, 6), 0, every=2, keep=2)
    assert cont[0]["start"] == 4 and [s for s, _ in cont[0]["list"]] == [6, 4]
    assert [h["step"] for h in cont[0]["history"]] == [0, 1, 2, 3, 4, 5]


def test_a_later_checkpoint_not_resumed_from_is_removed_by_the_next_save(gang2):
    gang2.run(train_steps, "stale", range(3), 0, keep=3)
    store = px.Store(session=SESSION)
    # another config: steps 1-3 are skipped, training starts afresh, and its first save
    # removes them (a lineage nobody continues)
    r = gang2.run(train_steps, "stale", range(1), 0, keep=3, config={"lr": 0.5})
    assert r[0]["start"] == 0
    assert [d for d, _ in r[0]["skipped"]] == [f"{SESSION}/stale.ckpt.{s}" for s in (3, 2, 1)]
    assert all("another config" in why for _, why in r[0]["skipped"])
    assert [s for s, _ in C.checkpoints(store, "stale")] == [1]


def corrupt_state_bytes(store: px.Store, dataset: str) -> None:
    """Flip one byte inside the torch.save bytes of a sealed checkpoint, on disk."""
    info = store.info(dataset)
    path = Path(info.location) / part_file(0)
    data = bytearray(path.read_bytes())
    at = data.index(b"PK\x03\x04") + 200  # inside the zip torch.save writes
    data[at] ^= 0xFF
    path.chmod(0o600)
    path.write_bytes(bytes(data))


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(gang2):
    first = gang2.run(train_steps, "damaged", range(1), 0)
    gang2.run(train_steps, "damaged", range(1, 2), 0)
    store = px.Store(session=SESSION)
    assert [s for s, _ in C.checkpoints(store, "damaged")] == [2, 1]
    corrupt_state_bytes(store, "damaged.ckpt.2")

    back = gang2.run(train_steps, "damaged", range(0), 0)
    for r in back:
        assert r["start"] == 1 and r["restored"] == f"{SESSION}/damaged.ckpt.1"
        assert [d for d, _ in r["skipped"]] == [f"{SESSION}/damaged.ckpt.2"]
        assert same_state(r["model"], first[0]["model"])  # the state after step 1
    # the driver's reader skips it as well (here the store's own checksum catches it)
    ckpt = px.ml.load_checkpoint(store, "damaged")
    assert ckpt.step == 1 and same_state(ckpt.model, first[0]["model"])
    with pytest.raises(DatasetNotFoundError, match=r"damaged.ckpt.2: ChecksumError"):
        px.ml.load_checkpoint(store, "damaged", step=2)


def test_a_checkpoint_whose_sha256_does_not_match_is_skipped(gang2):
    gang2.run(train_steps, "sha", range(2), 0)
    store = px.Store(session=SESSION)
    # the store's checksum is right (sealed like this), the checkpoint's own sha256 is not
    table = store.read("sha.ckpt.2")
    bad = table.set_column(3, "sha256", pa.array(["0" * 64]))
    store.put("sha.ckpt.2", bad, replace=True)
    with pytest.raises(DatasetNotFoundError, match="sha256 does not match"):
        px.ml.load_checkpoint(store, "sha", step=2)
    assert px.ml.load_checkpoint(store, "sha").step == 1


def test_ranks_that_disagree_on_the_step_and_bad_extras_fail_every_rank(gang2):
    with pytest.raises(RankError, match="disagree on the step"):
        gang2.run(save_disagreeing)
    with pytest.raises(RankError, match=r"extra\['weights'\] is a ndarray \(use .tolist"):
        gang2.run(save_numpy_extra)
    assert not C.checkpoints(px.Store(session=SESSION), "numpy")


def test_checkpoints_outside_a_gang_and_bad_arguments():
    with pytest.raises(RuntimeError, match="load_checkpoint"):
        px.ml.Checkpoints(object())
    with pytest.raises(ValueError, match="bad name"):
        C.dataset_prefix(".hidden")
    assert C.dataset_prefix("sweep/3") == "sweep_3.ckpt."


# ---- the ETL example's train stage, retried and resumed -------------------------------------------
EPOCHS, CRASH_AFTER, USERS = 4, 2, 1600


def make_features(env):
    """A small features table with the columns the example's train stage reads, seeded."""
    lo, hi = USERS * env.rank // env.world_size, USERS * (env.rank + 1) // env.world_size
    rng = np.random.default_rng([5, env.rank])
    x = rng.normal(size=(hi - lo, len(synthetic.FEATURES))).astype(np.float32)
    label = (x[:, 0] - 0.5 * x[:, 3] + 0.3 * rng.normal(size=hi - lo) > 0).astype(np.float32)
    cols = {f: x[:, i] for i, f in enumerate(synthetic.FEATURES)}
    return {"features": px.DataFrame.from_arrow(pa.table({**cols, synthetic.LABEL: label}), env)}


def train_crashing_once(env):
    """The example's train stage, whose first attempt dies right after the checkpoint of
    epoch CRASH_AFTER is sealed (a marker file says an attempt died already)."""
    marker = Path(env.params["crash_marker"])
    crash = not marker.exists()  # read by every rank before any can write it
    save = px.ml.Checkpoints.save

    def dying(self, step, *args, **kwargs):
        wrote = save(self, step, *args, **kwargs)
        if crash and step == CRASH_AFTER:
            if env.rank == 0:
                marker.touch()
            raise RuntimeError(f"injected: this attempt dies after epoch {step}")
        return wrote

    px.ml.Checkpoints.save = dying  # this rank process only; put back below
    try:
        return synthetic.train(env)
    finally:
        px.ml.Checkpoints.save = save


def etl_workflow(app: str, retries: int, **params) -> Workflow:
    train_params = {"epochs": EPOCHS, "batch_size": 64, "lr": 0.01, "keep_checkpoints": True, **params}
    return Workflow(
        name="ckpt-etl",
        stages={
            "features": Stage(app="test_ml_checkpoint:make_features", ranks=2, outputs=["features"]),
            "train": Stage(
                kind="torch",
                app=app,
                ranks=2,
                needs=["features"],
                inputs={"data": {"dataset": "features", "shuffle": "global"}},
                params=train_params,
                outputs=["train_metrics"],
                retries=retries,
            ),
        },
    )


def epochs_logged(db: RunDB, run_id: str) -> list[list[int]]:
    """Per attempt of the train stage, the epochs rank 0 logged it trained."""
    out = []
    for a in db.attempts(run_id, "train"):
        text = (Path(a["log_dir"]) / "rank-0.log").read_text()
        out.append([int(e) for e in re.findall(r"epoch (\d+): loss", text)])
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The train stage run once without interruption: its metrics and final checkpoint."""
    db = RunDB(tmp_path_factory.mktemp("ref") / "state")
    result = run_workflow(etl_workflow("phalanx.examples.synthetic:train", 0), Site(name="ckpt", cores=2), db=db)
    assert result.ok, result.failed
    store = px.Store(session=result.session)
    assert epochs_logged(db, result.run_id) == [[0, 1, 2, 3]]
    return store.read("train_metrics"), px.ml.load_checkpoint(store, "train"), result.session


def check_like_reference(session: str, reference) -> None:
    metrics, final, _ = reference
    store = px.Store(session=session)
    got = store.read("train_metrics")
    assert got.equals(metrics), (got.to_pandas(), metrics.to_pandas())
    assert got["epoch"].to_pylist() == list(range(EPOCHS))
    ckpt = px.ml.load_checkpoint(store, "train")
    assert ckpt.step == EPOCHS and ckpt.dataset == f"{session}/train.ckpt.{EPOCHS}"
    assert same_state(ckpt.model, final.model) and same_state(ckpt.optimizer, final.optimizer)
    assert [s for s, _ in C.checkpoints(store, "train")] == [EPOCHS, EPOCHS - 1]  # keep=2


def test_a_retried_train_stage_resumes_at_the_next_epoch(reference, tmp_path):
    db = RunDB(tmp_path / "state")
    wf = etl_workflow("test_ml_checkpoint:train_crashing_once", 1, crash_marker=str(tmp_path / "crashed"))
    result = run_workflow(wf, Site(name="ckpt", cores=2), db=db)
    assert result.ok, result.failed
    attempts = db.attempts(result.run_id, "train")
    assert [a["state"] for a in attempts] == ["failed", "succeeded"]
    # attempt 1 trained epochs 0 and 1 and died; attempt 2 trained 2 and 3 only — the
    # reference run's checkpoints (another run, another session) were not picked up by attempt 1
    assert epochs_logged(db, result.run_id) == [[0, 1], [2, 3]]
    second = (Path(attempts[1]["log_dir"]) / "rank-0.log").read_text()
    assert f"resuming from checkpoint {result.session}/train.ckpt.{CRASH_AFTER}: epoch 2 of {EPOCHS}" in second
    assert "resuming" not in (Path(attempts[0]["log_dir"]) / "rank-0.log").read_text()
    assert reference[2] != result.session
    check_like_reference(result.session, reference)


def test_a_resumed_run_continues_the_train_stage(reference, tmp_path):
    db = RunDB(tmp_path / "state")
    wf = etl_workflow("test_ml_checkpoint:train_crashing_once", 0, crash_marker=str(tmp_path / "crashed"))
    failed = run_workflow(wf, Site(name="ckpt", cores=2), db=db)
    assert not failed.ok and "train" in failed.failed
    resumed = run_workflow(wf, Site(name="ckpt", cores=2), db=db, resume=failed.run_id)
    assert resumed.ok and resumed.session == failed.session, resumed.failed
    assert epochs_logged(db, failed.run_id) == [[0, 1], [2, 3]]
    check_like_reference(resumed.session, reference)


def test_the_example_removes_its_checkpoints_once_its_outputs_are_sealed(tmp_path):
    db = RunDB(tmp_path / "state")
    wf = etl_workflow("phalanx.examples.synthetic:train", 0, keep_checkpoints=False, epochs=1)
    result = run_workflow(wf, Site(name="ckpt", cores=2), db=db)
    assert result.ok, result.failed
    assert sorted(px.Store(session=result.session).list()) == ["features", "train_metrics"]
