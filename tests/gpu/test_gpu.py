"""px.ml on CUDA GPUs (marker ``gpu``, the gpu lane): skipped, with the reason, on a machine
without one.  Written for one H100 (or more: DDP then runs NCCL over 2 ranks).

- the ETL example's training stage on the GPU (workflows/etl_to_training.yaml), its ranks'
  device and peak GPU memory in the run database;
- DDP over NCCL (2 ranks on 2 GPUs, else 1 rank on 1) agrees with the same step on the CPU;
- the device loader yields the CPU loader's batches, on the device, and feeds a training loop;
- a CUDA out-of-memory fails the gang naming the rank, its device and its memory.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

torch = pytest.importorskip("torch", reason="the gpu lane needs torch (the torch extra)")

import phalanx as px  # noqa: E402
from phalanx.errors import RankError  # noqa: E402

HAVE_GPU = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if HAVE_GPU else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAVE_GPU, reason="no CUDA GPU on this machine (torch.cuda.is_available() is False)"),
]
ROOT = Path(__file__).resolve().parents[2]
SESSION = "gpu-tests"
RANKS = 2 if GPUS >= 2 else 1


def own_gpu(env) -> None:
    """Rank r on GPU r, before CUDA starts in this rank (what a site's gpus_per_rank does)."""
    if GPUS >= env.world_size and not torch.cuda.is_initialized():
        os.environ["CUDA_VISIBLE_DEVICES"] = str(env.rank)


@pytest.fixture(scope="module")
def store():
    s = px.Store(session=SESSION)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20_000, 8)).astype(np.float32)
    s.put("xy", pa.table({**{f"f{i}": x[:, i] for i in range(8)}, "y": x.sum(1).astype(np.float32)}))
    yield s
    s.delete_session()


# ---- the ETL example's training on the GPU ------------------------------------------------------
def test_etl_example_trains_on_the_gpu(tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    from test_examples import ETL, ETL_SMALL, run_example

    overrides = {**ETL_SMALL, "stages.train.ranks": 1}  # one rank: one GPU is enough
    db, run_id, _ = run_example(ETL, overrides, tmp_path)
    attempts = [a for a in db.attempts(run_id, "train") if a["state"] == "succeeded"]
    gpu = attempts[-1]["rank_info"][0]["gpu"]
    assert gpu["device"] == "cuda:0" and 0 < gpu["peak"] <= gpu["total"], gpu
    from phalanx.orchestrator.report import _gpu_text

    assert "peak GPU memory" in _gpu_text(gpu)


# ---- NCCL ------------------------------------------------------------------------------------------
def app_nccl_step(env):
    own_gpu(env)
    torch.manual_seed(0)
    model = px.ml.ddp(env, torch.nn.Linear(16, 1))
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(env.rank)).to(model.px_device)
    model(x).square().mean().backward()
    grad = model.module.weight.grad.cpu().clone()
    return model.px_backend, str(model.px_device), next(model.parameters()).device.type, grad


def test_ddp_uses_nccl_when_every_rank_has_a_gpu():
    with px.Gang(ranks=RANKS, echo=False) as g:
        results = g.run(app_nccl_step)
    torch.manual_seed(0)
    ref = torch.nn.Linear(16, 1)
    xs = [torch.randn(32, 16, generator=torch.Generator().manual_seed(r)) for r in range(RANKS)]
    grads = []
    for x in xs:
        ref.zero_grad()
        ref(x).square().mean().backward()
        grads.append(ref.weight.grad.clone())
    expected = sum(grads) / RANKS
    for backend, device, param_device, grad in results:
        assert (backend, device, param_device) == ("nccl", "cuda:0", "cuda")
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5)


# ---- the device loader -----------------------------------------------------------------------------
def app_loader(env, device):
    ld = px.ml.loader(env, "xy", [f"f{i}" for i in range(8)], label="y", batch_size=256, session=SESSION, device=device)
    ld.set_epoch(2)
    out = [(x.device.type, x.cpu().numpy(), y.cpu().numpy()) for x, y in ld]
    return out, ld.stats["rows"]


def app_train_on_device(env):
    own_gpu(env)
    torch.manual_seed(0)
    model = px.ml.ddp(env, torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ld = px.ml.loader(
        env, "xy", [f"f{i}" for i in range(8)], label="y", batch_size=512, session=SESSION, device=model.px_device
    )
    losses = []
    for epoch in range(4):
        ld.set_epoch(epoch)
        total = n = 0.0
        for x, y in ld:
            assert x.is_cuda and y.is_cuda
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
            loss.backward()
            opt.step()
            total, n = total + loss.item() * len(y), n + len(y)
        losses.append(total / n)
    return losses


def test_device_loader_yields_the_cpu_batches_on_the_gpu_and_feeds_training(store):
    with px.Gang(ranks=1, echo=False) as g:
        [(cpu, rows_cpu)] = g.run(app_loader, None)
        [(gpu, rows_gpu)] = g.run(app_loader, "cuda")
    assert rows_cpu == rows_gpu == 20_000 and len(cpu) == len(gpu)
    for (dc, xc, yc), (dg, xg, yg) in zip(cpu, gpu):
        assert (dc, dg) == ("cpu", "cuda")
        assert np.array_equal(xc, xg) and np.array_equal(yc, yg)
    with px.Gang(ranks=RANKS, echo=False) as g:
        losses = g.run(app_train_on_device)[0]
    assert losses[-1] < 0.5 * losses[0], losses


# ---- out of memory ----------------------------------------------------------------------------------
def app_oom(env):
    keep = torch.empty(1 << 28, device="cuda")  # 1 GiB held, so "allocated" is not zero  # noqa: F841
    total = torch.cuda.get_device_properties(0).total_memory
    torch.empty(2 * total, dtype=torch.uint8, device="cuda")


def test_a_cuda_oom_names_the_rank_its_device_and_memory():
    with px.Gang(ranks=1, echo=False) as g, pytest.raises(RankError) as info:
        g.run(app_oom)
    text = str(info.value)
    assert "rank 0: CUDA out of memory on cuda:0 (" in text, text
    assert "1.00 GiB allocated by torch" in text and "GiB, of " in text, text
