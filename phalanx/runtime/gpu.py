"""A rank's GPU memory, for its errors and its report — without importing torch.

Only where the rank's app already loaded torch (``sys.modules``) and used CUDA: a dataframe rank
pays nothing, a CPU training rank reports nothing.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_GIB = float(1 << 30)


def _cuda() -> Any:
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "cuda"):
        return None
    try:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
    except Exception:
        return None
    return torch.cuda


def gpu_stats() -> dict[str, Any] | None:
    """This rank's device and its memory: ``device`` (``cuda:N``), ``name``, ``visible``
    (CUDA_VISIBLE_DEVICES), ``allocated``, ``peak`` (max_memory_allocated) and ``total`` bytes;
    None where the rank did not use CUDA."""
    cuda = _cuda()
    if cuda is None:
        return None
    try:
        index = cuda.current_device()
        props = cuda.get_device_properties(index)
        return {
            "device": f"cuda:{index}",
            "name": props.name,
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "allocated": int(cuda.memory_allocated(index)),
            "peak": int(cuda.max_memory_allocated(index)),
            "total": int(props.total_memory),
        }
    except Exception:  # a broken context (after a CUDA error): say nothing rather than fail again
        return None


def is_cuda_oom(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")
    oom = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    return oom is not None and isinstance(exc, oom)


def oom_note(rank: int, stats: dict[str, Any] | None) -> str:
    """What a CUDA out-of-memory in ``rank`` says beside torch's own message."""
    if stats is None:
        return f"rank {rank}: CUDA out of memory (its device's memory could not be read)"
    visible = f", CUDA_VISIBLE_DEVICES={stats['visible']}" if stats.get("visible") is not None else ""
    return (
        f"rank {rank}: CUDA out of memory on {stats['device']} ({stats['name']}{visible}): "
        f"{stats['allocated'] / _GIB:.2f} GiB allocated by torch, peak {stats['peak'] / _GIB:.2f} GiB, "
        f"of {stats['total'] / _GIB:.2f} GiB"
    )


def annotate_oom(rank: int, exc: BaseException) -> str | None:
    """For a CUDA out-of-memory: add a note naming the rank, its device and memory to ``exc``
    (shown in its traceback) and return it; None for any other exception."""
    if not is_cuda_oom(exc):
        return None
    note = oom_note(rank, gpu_stats())
    add_note = getattr(exc, "add_note", None)  # (Python ≥ 3.11; the message carries it anyway)
    if add_note is not None and note not in getattr(exc, "__notes__", ()):
        add_note(note)
    return note
