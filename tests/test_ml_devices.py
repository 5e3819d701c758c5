"""px.ml on devices, what is testable without a GPU: the NCCL/Gloo choice (pure, and on a real
CPU gang), the device prefetcher's ordering with a fake copy, ``device="cpu"`` giving today's
batches, and the CUDA out-of-memory message and report text.  tests/gpu/ runs the CUDA paths."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

import phalanx as px
from phalanx.errors import RankError
from phalanx.ml.ddp import RankDevice, choose_backend
from phalanx.ml.loader import prefetch
from phalanx.orchestrator.report import _gpu_text
from phalanx.runtime.gpu import gpu_stats, oom_note
from phalanx.runtime.tasks import failure_from_exception

pytestmark = pytest.mark.torch  # the torch extra's lane
SESSION = "ml-devices-tests"


def gpus(*hosts_gpus):
    return [RankDevice(r, h, "cuda:0" if g else "cpu", g or "") for r, (h, g) in enumerate(hosts_gpus)]


def test_nccl_only_when_every_rank_has_its_own_gpu():
    assert choose_backend(gpus(("a", "GPU-1"), ("a", "GPU-2"), ("b", "GPU-1")))[0] == "nccl"
    assert choose_backend(gpus(("a", "GPU-1")))[0] == "nccl"
    backend, why = choose_backend(gpus(("a", "GPU-1"), ("a", None), ("b", "GPU-3")))
    assert backend == "gloo" and "rank(s) 1 have no GPU" in why
    assert choose_backend(gpus(("a", None), ("b", None)))[0] == "gloo"
    backend, why = choose_backend(gpus(("a", "GPU-1"), ("a", "GPU-1")))  # NCCL refuses a shared GPU
    assert backend == "gloo" and "share GPU GPU-1 on a" in why
    assert choose_backend([])[0] == "gloo"


def app_ddp_backend(env):
    model = px.ml.ddp(env, torch.nn.Linear(3, 1))
    x = torch.ones(4, 3) * (env.rank + 1)
    model(x).sum().backward()
    return model.px_backend, model.px_backend_reason, str(model.px_device), model.module.weight.grad.clone()


@pytest.mark.parametrize("communicator", ["tcp", "gloo"])
def test_a_gang_without_gpus_picks_gloo_and_still_averages(communicator):
    with px.Gang(ranks=2, communicator=communicator, echo=False) as g:
        results = g.run(app_ddp_backend)
    for backend, why, device, grad in results:
        assert backend == "gloo" and device == "cpu" and "have no GPU" in why
        assert torch.equal(grad, results[0][3])


# ---- the device prefetcher, with a fake copy ---------------------------------------------------
def test_prefetch_issues_the_next_copy_before_yielding_the_current_batch():
    log: list[str] = []

    def start(b):
        log.append(f"copy {b}")
        return b, f"event {b}"

    def ready(handle):
        b, event = handle
        log.append(f"wait {event}")
        return b * 10

    out = []
    for b in prefetch(iter([1, 2, 3]), start, ready):
        log.append(f"use {b}")
        out.append(b)
    assert out == [10, 20, 30]
    assert log == [
        "copy 1",
        "copy 2",  # batch 2's copy is issued before batch 1 is used: it overlaps the step
        "wait event 1",
        "use 10",
        "copy 3",
        "wait event 2",
        "use 20",
        "wait event 3",
        "use 30",
    ]
    assert list(prefetch(iter([]), start, ready)) == []


def test_prefetch_passes_errors_of_the_source_through():
    def source():
        yield 1
        raise ValueError("broken chunk")

    with pytest.raises(ValueError, match="broken chunk"):
        list(prefetch(source(), lambda b: b, lambda h: h))


# ---- device="cpu" is today's loader -----------------------------------------------------------
def app_batches(env, device):
    ld = px.ml.loader(env, "t", ["a", "b"], label="id", batch_size=50, session=SESSION, device=device)
    ld.set_epoch(1)
    return [(x.numpy().copy(), y.numpy().copy(), str(x.device)) for x, y in ld], ld.stats["rows"]


def test_cpu_device_gives_the_same_batches_and_cuda_without_a_gpu_is_refused():
    s = px.Store(session=SESSION)
    ids = np.arange(333)
    s.put("t", pa.table({"id": ids, "a": ids.astype(np.float32), "b": (ids % 5).astype(np.float32)}))
    try:
        with px.Gang(ranks=2, echo=False) as g:
            base = g.run(app_batches, None)
            for device in ("cpu", torch.device("cpu")):
                got = g.run(app_batches, device)
                for (bb, rows0), (gb, rows1) in zip(base, got):
                    assert rows0 == rows1
                    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(bb, gb))
                    assert all(b[2] == "cpu" for b in gb)
            if not torch.cuda.is_available():
                with pytest.raises(RankError, match="CUDA is not available on this rank"):
                    g.run(app_batches, "cuda")
            with pytest.raises(RankError, match="is not supported"):
                g.run(app_batches, "meta")
    finally:
        s.delete_session()


# ---- out of memory: the rank, its device, its memory --------------------------------------------
def app_oom(env):
    if env.rank == 1:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    return "ok"


def test_a_cuda_oom_names_the_rank():
    with px.Gang(ranks=2, echo=False) as g, pytest.raises(RankError) as info:
        g.run(app_oom)
    assert info.value.ranks == [1]
    assert "rank 1: CUDA out of memory" in str(info.value)
    assert "Tried to allocate 20.00 GiB" in str(info.value)


def test_oom_note_and_report_text_name_the_device_and_memory():
    stats = {
        "device": "cuda:0",
        "name": "NVIDIA H100 80GB HBM3",
        "visible": "3",
        "allocated": 70 << 30,
        "peak": 75 << 30,
        "total": 80 << 30,
    }
    note = oom_note(2, stats)
    assert note == (
        "rank 2: CUDA out of memory on cuda:0 (NVIDIA H100 80GB HBM3, CUDA_VISIBLE_DEVICES=3): "
        "70.00 GiB allocated by torch, peak 75.00 GiB, of 80.00 GiB"
    )
    assert _gpu_text(stats) == " · cuda:0 (NVIDIA H100 80GB HBM3) peak GPU memory 75.00 of 80.00 GiB"
    assert _gpu_text(None) == ""
    failure = failure_from_exception(2, ValueError("plain"))
    assert failure.message == "plain"  # other errors are untouched
    if not torch.cuda.is_available():
        assert gpu_stats() is None  # a CPU rank reports no GPU
